"""Writing `fedra bench compare`'s report: report.md, report.json and two PNG plots."""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedra.config import ConfigError

DEFINITIONS = """\
- **time to target**: wall-clock seconds until the global model's eval loss is at or below
  the target, counted from the first training round's opening (centralised: from the
  first step, evaluations included); "—" if it never gets there.
- **final eval loss**: the last global model, exported from the coordinator and scored
  in this process with the task's `evaluate` on the pooled held-out data of all sites
  (the centralised model on the same data, the same windows).
- **down / up per site**: payload bytes the coordinator counted for each site's
  participations over the training rounds (round 0 only builds the initial model),
  averaged over the sites. Downloads are the fp32 global model, or with int8 the
  coordinator's int8 outer step (`[codec] download`); uploads are the update in the run's
  codec. A site rebuilds the initial model from the run's seed (checked by SHA-256)
  instead of downloading it.
- **bytes per inner step**: (down + up) per site / inner steps per site.
- **utilisation**: the share of the run's wall time a site spent computing: the sum of
  the site's `compute_s` over its accepted rounds (from its download finishing to its
  update being ready: evaluating the incoming model, the H inner steps, the delta)
  divided by the time from the first training round's opening to the last commit;
  mean over sites. The rest is the link, the coordinator and waiting for the other site.
- **round time**: each committed training round's `stages["round_s"]` (opening to
  commit), percentiles with linear interpolation.
- **failures**: failed or expired participations / all participations.
- **ddp**: PyTorch DDP across the same sites, one process each on its own site's data,
  gloo's all-reduce of the gradients after every step, one AdamW per rank. gloo's ranks
  connect to each other directly, so the same link (bandwidth, one-way latency) is
  applied to each gradient bucket by DDP's communication hook: the bucket is reduced by
  gloo for real and handed back no earlier than a ring all-reduce of it would have
  arrived over the link (2 (n - 1) / n of its bytes sent and received by each rank, in
  2 (n - 1) latencies, buckets queued at the link's bandwidth), overlapping the rest of
  the backward pass as DDP does. Its bytes per site are what each rank sends (up) and
  receives (down); its round time is a step's; its utilisation is each step's time less
  the backward pass's wait for the last bucket, over the run's wall time; its model is
  evaluated from copies kept every `eval_every` steps (no evaluation in its clock).
"""


def require_matplotlib() -> None:
    """Fail before a long run, not after it, when the plots cannot be drawn."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(
            "matplotlib is needed for the plots: pip install -c constraints.txt 'fedra[examples]'"
        )


def write(report: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """Write the four files; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "report.md", out_dir / "report.json"]
    paths[0].write_text(markdown(report))
    paths[1].write_text(json.dumps(_finite(report), indent=1, allow_nan=False) + "\n")
    configs = report["configurations"]
    colours = {c["name"]: f"C{i % 10}" for i, c in enumerate(configs)}  # the same in both plots
    time_png, bytes_png = out_dir / "loss_vs_time.png", out_dir / "loss_vs_bytes.png"
    paths.append(plot(configs, colours, time_png, "seconds", "wall-clock seconds"))
    federated = [c for c in configs if c["strategy"] != "centralised"]
    xlabel = "bytes moved per site (down + up), symlog"
    paths.append(plot(federated, colours, bytes_png, "bytes_per_site", xlabel))
    return paths


def _finite(value: Any) -> Any:
    """NaN and infinities become null: report.json stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def plot(
    configs: Sequence[Mapping[str, Any]],
    colours: Mapping[str, str],
    path: Path,
    x_key: str,
    xlabel: str,
) -> Path:
    """Eval loss against ``x_key`` of each configuration's curve."""
    import matplotlib  # noqa: PLC0415 - only the plots need it

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    try:
        for c in configs:
            xs = [p[x_key] for p in c["curve"]]
            ys = [p["eval_loss"] for p in c["curve"]]
            style = "--" if c["strategy"] == "centralised" else "-"
            marker = "." if len(xs) < 40 else None
            ax.plot(xs, ys, style, color=colours[c["name"]], marker=marker, label=c["name"])
        if x_key == "bytes_per_site":
            ax.set_xscale("symlog", linthresh=1e5)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("eval loss (global model)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path


def markdown(report: Mapping[str, Any]) -> str:
    setup = report["setup"]
    loads = [load for c in report["configurations"] for load in c.get("load_average", [])]
    lines = ["# fedra bench compare", "", setup_text(setup, loads), "", "## Results", ""]
    lines += results_table(report["configurations"])
    lines += ["", "## Cost", "", *cost_lines(report)]
    lines += ["", "## Headline", "", headline_text(report), "", "## Definitions", "", DEFINITIONS]
    lines += ["", "## Provenance", "", *provenance_lines(report["configurations"])]
    return "\n".join(lines)


def provenance_lines(configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """What each federated run's results came from: its spec, and each site's task
    source, data fingerprint and software."""
    lines = ["| run | site | task source | data | versions |", "|---|---|---|---|---|"]
    for c in configs:
        p = c.get("provenance")
        if not p:
            continue  # the centralised baseline runs in this process
        for site_id, s in sorted(p["sites"].items()):
            versions = ", ".join(f"{k} {v}" for k, v in sorted(s["versions"].items()))
            changed = " (changed)" if s["changed"] else ""
            lines.append(
                f"| {c['name']} (spec {p['run']['spec_sha256'][:12]}) | {site_id}{changed} | "
                f"{s['task_source_sha256'][:12]} | {s['data_fingerprint'][:19]} | {versions} |"
            )
    return lines


def setup_text(setup: Mapping[str, Any], loads: Sequence[float] = ()) -> str:
    """The set-up paragraph; ``loads`` are 1-minute load averages sampled during the run."""
    model, link, machine = setup["model"], setup["link"], setup["machine"]
    ends = (setup["load_average_start"][0], setup.get("load_average_end", [0.0])[0])
    load = max(*ends, *loads)
    cpus = machine["cpu_count"] or 1
    contention = (
        f"contended: 1-minute load average up to {load:.1f} on {cpus} CPUs (sampled before "
        "and after each configuration; other processes ran too), so wall times are noisy"
        if load > cpus
        else f"1-minute load average up to {load:.1f} on {cpus} CPUs"
    )
    diloco = setup["diloco"]
    return (
        f"**Set-up.** `{setup['task']}`: a byte-level GPT with "
        + ", ".join(f"{k} {v}" for k, v in model.items())
        + f" ({setup['parameters']:,} parameters, {setup['model_bytes_fp32'] / 1e6:.2f} MB "
        f"fp32). {setup['sites']} sites as processes on localhost (mTLS), each behind its "
        f"own emulated link of {link['bandwidth_mbit']:g} Mbit/s per direction and "
        f"{link['latency_ms']:g} ms one way; {setup['steps']} inner steps per site in every "
        f"configuration, batch {setup['batch_size']}, inner AdamW lr "
        f"{setup['learning_rate']:g}; DiLoCo outer Nesterov lr {diloco['server_lr']:g}, "
        f"momentum {diloco['momentum']:g}; {setup['max_bytes_per_site']:,} bytes of corpus "
        f"per site; centralised evaluated every {setup['centralised_eval_every']} steps. "
        f"Target eval loss {setup['target_loss']:.4f} ({setup['target_loss_rule']}). "
        f"Machine: {machine['cpu']}, {cpus} CPUs, {machine['platform']}, torch "
        f"{machine['torch']}; {contention}. Total {setup['elapsed_s']:.0f} s."
    )


def _num(value: float | None, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return format(value, fmt)


def results_table(configs: Sequence[Mapping[str, Any]]) -> list[str]:
    head = (
        "| configuration | rounds | time to target (s) | final eval loss | down / up per site "
        "(MB) | bytes per inner step | utilisation | round time p50 / p95 / p99 (s) "
        "| failures | wall (s) |"
    )
    rows = [head, "|" + "---|" * 10]
    for c in configs:
        if c["strategy"] == "centralised":
            comm = ["—", "—", "—", "—", "—"]
        else:
            b, rt, f = c["bytes_per_site"], c["round_time_s"], c["failures"]
            comm = [
                f"{b['down'] / 1e6:.2f} / {b['up'] / 1e6:.2f}",
                f"{c['bytes_per_inner_step']:,.0f}",
                _num(c["utilisation"]["mean"], ".1%"),
                " / ".join(_num(rt[k], ".2f") for k in ("p50", "p95", "p99")),
                f"{f['failed']}/{f['participations']}",
            ]
        rows.append(
            f"| {c['name']} | {c['num_rounds'] or '—'} | {_num(c.get('time_to_target_s'), '.1f')} "
            f"| {_num(c['final_eval_loss'], '.4f')} | "
            + " | ".join(comm)
            # the state only when it is not the expected one
            + f" | {_num(c['wall_s'], '.1f')}"
            + ("" if c["state"] == "completed" else f" ({c['state']})")
            + " |"
        )
    return rows


def cost_lines(report: Mapping[str, Any]) -> list[str]:
    """Compute-hours and bytes at the stated prices, for the whole run and up to the
    target (the useful result), per configuration."""
    prices = report["setup"].get("prices", {"compute_hour": 1.0, "gb": 0.09})
    lines = [
        f"At {prices['compute_hour']:g} per compute-hour (one site's process for an hour; "
        f"the centralised run is one process) and {prices['gb']:g} per GB moved over the "
        "link (`--price-compute-hour`, `--price-gb`). *To target*: the cost up to the first "
        "evaluation at or below the target loss, pro rata of the run's time; — if never.",
        "",
        "| configuration | compute-hours | GB moved (all sites) | cost | cost to target |",
        "|---|---|---|---|---|",
    ]
    for c in report["configurations"]:
        k = c.get("cost")
        if not k:
            continue
        lines.append(
            f"| {c['name']} | {_num(k['compute_hours'], '.4f')} | {_num(k['gb'], '.4f')} "
            f"| {_num(k['total'], '.4f')} | {_num(k['to_target'], '.4f')} |"
        )
    return lines


def headline_text(report: Mapping[str, Any]) -> str:
    h = report["headline"]
    every, name = h["every_step_configuration"], h["diloco_configuration"]
    met = {True: "**met**", False: "**not met**"}
    overlap = [_overlap_line(o, met) for o in h.get("overlap", [])]
    if "error" in h:
        return "\n".join([f"Headline ratios not computed: {h['error']}.", *overlap])
    b, loss, u = h["bytes_per_inner_step"], h["final_eval_loss"], h["utilisation"]
    diloco = next(c for c in report["configurations"] if c["name"] == name)
    down_share = diloco["bytes_per_site"]["down"] / max(1.0, diloco["bytes_per_site"]["total"])
    return "\n".join(
        [
            f"- Bytes per inner step, {every} ÷ {name}: {b[every]:,.0f} ÷ "
            f"{b[name]:,.0f} = **{_num(b['ratio'], '.0f')}x** (target ≥ {b['target']:.0f}x: "
            f"{met[b['met']]}). {down_share:.0%} of {name}'s bytes are downloads.",
            f"- Final eval loss: {name} {_num(loss[name], '.4f')} vs {every} "
            f"{_num(loss[every], '.4f')}, {_num(loss['relative_difference'], '+.1%')} "
            f"(target: at most {loss['target']:.0%} worse: {met[loss['met']]}). "
            f"Bytes target as a whole (ratio and loss): {met[h['bytes_target_met']]}.",
            f"- Compute utilisation under the emulated link: {name} "
            f"{_num(u[name], '.1%')} (target ≥ {u['target']:.0%}: {met[u['met']]}); "
            f"{every} {_num(u[every], '.1%')}.",
            *overlap,
        ]
    )


def _overlap_line(o: Mapping[str, Any], met: Mapping[bool, str]) -> str:
    name, without = o["configuration"], o["without"]
    u, loss = o["utilisation"], o["final_eval_loss"]
    return (
        f"- Overlapping communication with compute: {name} utilisation "
        f"{_num(u[name], '.1%')} against {without} {_num(u[without], '.1%')} (target ≥ "
        f"{u['target']:.0%}: {met[u['met']]}); final eval loss {_num(loss[name], '.4f')} "
        f"against {_num(loss[without], '.4f')}, {_num(loss['relative_difference'], '+.1%')} "
        f"(target: at most {loss['target']:.0%} worse: {met[loss['met']]})."
    )
