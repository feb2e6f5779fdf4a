"""Strategies against label skew: `fedra demo` runs, scored against centralised training.

    python bench/strategy_study.py                                  # the whole grid
    python bench/strategy_study.py --strategies fedavg,fedprox --alphas 0.5 --seeds 0

For every strategy, Dirichlet alpha and partition seed it runs ``fedra demo`` (a real
coordinator and three site processes over mTLS, 20 rounds by default) and reads its
summary; every committed global model is scored on the held-out test set no site trains
on. Each federated accuracy after 10 and 20 rounds is set against the same model trained
centrally for the same number of samples on the data the sites train on, pooled (the
demo's baseline, computed here for both points; not the rows each site holds out to
evaluate on), and, for context, on the whole pooled training set, those rows included.
It prints a table by strategy and skew (the mean over seeds, and the worst seed's gap),
says which strategy comes closest on the demo's own split (alpha 0.5, seed 0) after 20
rounds, and writes the figures (``--out``, JSON) and a plot of test accuracy over rounds
on the demo's split (``--plot``, PNG).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fedra.demo import DEMO_STRATEGIES, demo_spec
from fedra.examples import digits

CHECKPOINTS = (10, 20)  # rounds at which the federated model is set against centralised


def run_one(workdir: Path, strategy: str, alpha: float, seed: int, rounds: int) -> dict[str, Any]:
    name = f"{strategy}-a{alpha:g}-s{seed}"
    out = workdir / name / "out"
    cmd = [
        sys.executable, "-m", "fedra", "demo", "--rounds", str(rounds), "--strategy", strategy,
        "--alpha", str(alpha), "--partition-seed", str(seed),
        "--state-dir", str(workdir / name / "state"), "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{name}: fedra demo failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


class Centralised:
    """The demo's baseline: the model trained centrally for a number of steps on the
    sites' training data pooled (``digits.sites_training_data``: what the three sites of
    a split train on, without the rows each holds out to evaluate on); and, for context,
    on the whole pooled training set, those rows included."""

    def __init__(self, rounds: int) -> None:
        self.train = demo_spec(rounds, 3).train
        (_, _), (self.x_test, self.y_test) = digits.pooled_split(0)
        self._by_split: dict[tuple[int, float, int], float] = {}  # (steps, alpha, seed)
        self._all_rows: dict[int, float] = {}  # by steps

    def accuracy(self, samples: float, alpha: float, seed: int) -> float:
        """On the sites' training data of the split (alpha, seed)."""
        steps = self._steps(samples)
        key = (steps, alpha, seed)
        if key not in self._by_split:
            data = digits.sites_training_data(3, alpha, seed)
            self._by_split[key] = self._score(steps, data)
        return self._by_split[key]

    def accuracy_all_rows(self, samples: float) -> float:
        """On the whole pooled training set (the same for every split)."""
        steps = self._steps(samples)
        if steps not in self._all_rows:
            self._all_rows[steps] = self._score(steps, None)
        return self._all_rows[steps]

    def _steps(self, samples: float) -> int:
        return max(1, math.ceil(samples / self.train.batch_size))

    def _score(self, steps: int, data: tuple[torch.Tensor, torch.Tensor] | None) -> float:
        train = self.train
        model = digits.train_centralised(0, steps, train.batch_size, train.learning_rate, {}, data)
        return float(digits.evaluate_on(model, self.x_test, self.y_test)["accuracy"])


def score(summary: dict[str, Any], central: Centralised) -> dict[str, Any]:
    rounds = summary["rounds"]
    alpha, seed = summary["alpha"], summary["partition_seed"]
    row: dict[str, Any] = {
        "strategy": summary["strategy"],
        "alpha": alpha,
        "seed": seed,
        "accuracy_by_round": [r["test_accuracy"] for r in rounds],
    }
    for n in CHECKPOINTS:
        if n < len(rounds):
            samples = sum(r["samples_seen"] for r in rounds[1 : n + 1])
            row[f"acc_{n}"] = rounds[n]["test_accuracy"]
            row[f"central_{n}"] = central.accuracy(samples, alpha, seed)
            row[f"central_all_rows_{n}"] = central.accuracy_all_rows(samples)
            row[f"gap_{n}"] = row[f"central_{n}"] - row[f"acc_{n}"]
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """By strategy and alpha: mean accuracy over seeds, mean and worst gap to centralised."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["strategy"], r["alpha"]), []).append(r)
    cols = [f"{k}_{n}" for n in CHECKPOINTS for k in ("acc", "gap")]
    head = f"| strategy | alpha | seeds | {' | '.join(cols)} | worst gap_{CHECKPOINTS[-1]} |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (strategy, alpha), group in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cells = []
        for c in cols:
            values = [g[c] for g in group if c in g]
            cells.append(f"{sum(values) / len(values):.3f}" if values else "-")
        worst = max((g.get(f"gap_{CHECKPOINTS[-1]}", -1.0) for g in group), default=-1.0)
        lines.append(
            f"| {strategy} | {alpha:g} | {len(group)} | {' | '.join(cells)} | {worst:.3f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    alphas = sorted({r["alpha"] for r in rows})[:3]
    seed = min(x["seed"] for x in rows)
    for ax, alpha in zip(axes, alphas, strict=False):
        shown = [r for r in rows if r["alpha"] == alpha and r["seed"] == seed]
        for r in shown:
            ax.plot(r["accuracy_by_round"], label=r["strategy"])
        last = max(shown, key=lambda r: len(r["accuracy_by_round"]))
        n = CHECKPOINTS[-1]
        if f"central_{n}" in last:
            ax.axhline(last[f"central_{n}"], color="black", linestyle="--", label="centralised")
        ax.set_title(f"Dirichlet alpha {alpha:g}")
        ax.set_xlabel("round")
        ax.set_ylim(0.5, 1.0)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy of the global model")
    axes[-1].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default=",".join(DEMO_STRATEGIES))
    parser.add_argument("--alphas", default="0.1,0.5,1.0")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--workdir", type=Path, default=None, help="kept, for the logs")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    parser.add_argument("--plot", type=Path, default=None, help="write the plot (PNG)")
    args = parser.parse_args(argv)
    strategies = args.strategies.split(",")
    unknown = sorted(set(strategies) - set(DEMO_STRATEGIES))
    if unknown:
        parser.error(
            f"--strategies: unknown {', '.join(unknown)} (known: {', '.join(DEMO_STRATEGIES)})"
        )
    alphas = [float(a) for a in args.alphas.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    torch.set_num_threads(1)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fedra-study-"))
    central = Centralised(args.rounds)
    rows = []
    started = time.monotonic()
    for alpha in alphas:
        for seed in seeds:
            for strategy in strategies:
                row = score(run_one(workdir, strategy, alpha, seed, args.rounds), central)
                rows.append(row)
                points = [
                    f"round {k}: {row[f'acc_{k}']:.3f} (centralised {row[f'central_{k}']:.3f}; "
                    f"on all rows {row[f'central_all_rows_{k}']:.3f})"
                    for k in CHECKPOINTS
                    if f"acc_{k}" in row
                ]
                took = time.monotonic() - started
                print(f"{strategy:<11} alpha {alpha:<4g} seed {seed}: {'  '.join(points)}"
                      f"  [{took:.0f} s]", flush=True)  # fmt: skip
    print()
    print(table(rows))
    n = CHECKPOINTS[-1]
    own = [r for r in rows if r["alpha"] == 0.5 and r["seed"] == 0 and f"gap_{n}" in r]
    if own:
        best = min(own, key=lambda r: r[f"gap_{n}"])
        print(
            f"\non the demo's own split (alpha 0.5, seed 0), after {n} rounds: best "
            f"{best['strategy']} at {best[f'acc_{n}']:.3f} against centralised "
            f"{best[f'central_{n}']:.3f} "
            f"(gap {100 * best[f'gap_{n}']:.1f} points; aim: within 1)"
        )
    if args.out:
        args.out.write_text(json.dumps({"rounds": args.rounds, "rows": rows}, indent=1) + "\n")
    if args.plot:
        plot(rows, args.plot)
    print(f"logs: {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
