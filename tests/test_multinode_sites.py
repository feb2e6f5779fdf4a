"""Sites on several nodes: ``[parallel] nnodes``, ``node_rank`` and ``rdzv_endpoint``.

On localhost, two "nodes" are two ``fedra site`` processes (two elastic agents, each
with its own workers) that meet at one c10d rendezvous. Multi-process: a site on two
nodes trains the very bits the same site trains on one node with as many processes; a
node killed mid-round fails that round's task only, the world forms again with the node
that remains (an elastic ``nnodes = "1:2"``), and again with both once it is back.
Unit: the configuration's rules and the ranks in ``node_rank`` order.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import HashStore  # type: ignore[attr-defined]

from fedra.client.config import ParallelConfig
from fedra.client.world import node_ordered_rank
from fedra.config import ConfigError
from fedra.local import LocalCluster
from fedra.runspec import RunSpec
from fedra.storage import Store
from tests.test_parallel_sites import CHARLM, FAST, finished_status, spec

TINY = {"d_model": "32", "seq_len": "32", "n_layers": "2", "n_heads": "4"}
DATA = {"part": 0, "num_parts": 4, "max_bytes": 200_000}


def _free_port() -> int:
    """A port for the rendezvous, which every node must know before any starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_nodes(
    cluster: LocalCluster,
    site_id: str,
    nnodes: str,
    plan: dict[str, Any] | None = None,
    nproc: int = 1,
) -> dict[str, Any]:
    parallel = {
        "nproc": nproc,
        **(plan or {"plan": "dp"}),
        "nnodes": nnodes,
        "rdzv_endpoint": f"127.0.0.1:{_free_port()}",
        "rdzv_last_call_s": 2.0,  # an elastic world forms 2 s after its first node is in
        "max_restarts": 20,
    }
    for node in (0, 1):
        cluster.start_site(site_id, [CHARLM], DATA, parallel=parallel, node_rank=node)
    return parallel


def _tiny_spec(
    rounds: int, sites: int, quorum: int, params: dict[str, str] | None = None
) -> RunSpec:
    s = spec(rounds, sites, quorum)
    return replace(s, train=replace(s.train, params=params or TINY)).validate()


# Plans whose ranks talk across the nodes differently: DDP's all-reduce and a pipeline's
# point-to-point sends between stages; then DTensor collectives of tensor parallelism,
# FSDP2's all-gathers and reduce-scatters, and expert parallelism's all-to-all (its
# block 1 a mixture of 2 experts, one a rank).
PLANS = {"dp": {"plan": "dp"}, "pp": {"plan": "pp", "pp_schedule": "1f1b", "microbatches": 2}}
SHARDED = {"tp": {"plan": "tp"}, "fsdp": {"plan": "fsdp"}, "ep": {"plan": "ep"}}
TINY_MOE = TINY | {"n_experts": "2", "top_k": "2"}
# The 2-D plans on two nodes of two processes: fsdp+tp's tensor-parallel pairs within a
# node and its FSDP groups across the nodes; pp+dp's stages and replicas across them.
TWO_D = {
    "fsdp-tp": {"plan": "fsdp+tp", "tp_size": 2},
    "pp-dp": {"plan": "pp+dp", "pp_size": 2, "pp_schedule": "1f1b", "microbatches": 2},
}


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("plans", "params", "nproc"),
    [(PLANS, TINY, 1), (SHARDED, TINY_MOE, 1), (TWO_D, TINY, 2)],
    ids=["dp-pp", "tp-fsdp-ep", "fsdp+tp-pp+dp"],
)
def test_sites_on_two_nodes_train_the_bits_of_one_node(
    cluster: LocalCluster, plans: dict[str, dict[str, Any]], params: dict[str, str], nproc: int
) -> None:
    """The same sites (a site's id seeds its shuffling), spec and data: a run with each
    site on two nodes of ``nproc`` processes each, then a run with each on one node of
    twice as many."""
    cluster.start_coordinator(flags=FAST)
    for site_id, plan in plans.items():
        _two_nodes(cluster, site_id, "2", plan, nproc)
    cluster.wait_for_sites(list(plans), timeout_s=240)
    two_nodes = _accepted_updates(cluster, len(plans), params)
    for name in [*plans, *(f"{s}.node1" for s in plans)]:
        cluster.sites.pop(name).stop()
    for site_id, plan in plans.items():
        cluster.start_site(site_id, [CHARLM], DATA, parallel={"nproc": 2 * nproc, **plan})
    one_node = _accepted_updates(cluster, len(plans), params)
    expected = {(s, n) for s in plans for n in (1, 2)}
    assert set(two_nodes) == set(one_node) == expected, (two_nodes, one_node)
    assert two_nodes == one_node  # the same updates, bit for bit, each round
    ranks = 2 * nproc
    for site_id, plan in plans.items():
        node0 = (cluster.state_dir / "logs" / f"{site_id}.log").read_text()
        assert f"local world of {ranks} ranks on 2 nodes, plan {plan['plan']}" in node0
        assert f"local world of {ranks} ranks on 1 node, plan {plan['plan']}" in node0
        node1 = (cluster.state_dir / "logs" / f"{site_id}.node1.log").read_text()
        assert "local world of" not in node1  # node 1 never talks to the coordinator


def _accepted_updates(
    cluster: LocalCluster, sites: int, params: dict[str, str]
) -> dict[tuple[str, int], str | None]:
    """Run two rounds with every site; (site, round) -> the digest of its accepted update."""
    with cluster.admin() as admin:
        run_id = admin.submit(_tiny_spec(rounds=2, sites=sites, quorum=sites, params=params))
    status = finished_status(cluster, run_id)
    assert status.state == "completed", status.reason
    store = Store(f"sqlite:///{cluster.state_dir / 'fedra.db'}", migrate=False)
    try:
        return {
            (p.site_id, p.round_number): p.update_sha256
            for p in store.list_participations(run_id)
            if p.state == "accepted" and p.round_number > 0
        }
    finally:
        store.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_a_node_killed_mid_round_fails_that_round_and_the_world_forms_again(
    cluster: LocalCluster,
) -> None:
    cluster.start_coordinator(flags=FAST)
    parallel = _two_nodes(cluster, "elastic", "1:2")
    cluster.start_site("single", [CHARLM], {**DATA, "part": 1})
    cluster.wait_for_sites(["elastic", "single"], timeout_s=240)
    node0 = cluster.sites["elastic"]
    _wait_for_log(node0.log_path, BOTH, 1)
    spec = _tiny_spec(rounds=10_000, sites=2, quorum=1)
    # Seconds of training a round, so that the kill below lands while the site trains.
    spec = replace(spec, train=replace(spec.train, local_steps=160)).validate()
    with cluster.admin() as admin:
        run_id = admin.submit(spec)
        _wait_for(lambda: _accepted_after(admin, run_id, 1, "elastic"), 300)
        # Node 1 dies as a machine does, its agent and its worker at once, while the site
        # trains a round: the next collective finds it gone and the task fails.
        killed_after = _wait_for(lambda: _training(admin, run_id, "elastic"), 300)
        alone_before, both_before = _count(node0.log_path, ALONE), _count(node0.log_path, BOTH)
        _kill_node(cluster.sites["elastic.node1"].pid)
        cluster.sites["elastic.node1"].popen.wait(30)
        # The world forms again with node 0 alone, and the site takes part again.
        _wait_for_log(node0.log_path, ALONE, alone_before + 1, timeout_s=300)
        alone = _wait_for(lambda: _accepted_after(admin, run_id, killed_after + 1, "elastic"), 300)
        # Node 1 comes back: the world forms again with both nodes.
        cluster.start_site("elastic", [CHARLM], DATA, parallel=parallel, node_rank=1)
        _wait_for_log(node0.log_path, BOTH, both_before + 1, timeout_s=300)
        both = _wait_for(lambda: _accepted_after(admin, run_id, alone, "elastic"), 300)
        admin.cancel(run_id)
        status = admin.status(run_id)
    by_round = {r.number: {p.site_id: p for p in r.participations} for r in status.rounds}
    killed = by_round[killed_after]  # the round the site was training when node 1 died
    assert killed["elastic"].status in ("failed", "expired"), killed["elastic"]
    assert killed["single"].status == "accepted"  # the round went on without it
    assert both > alone > killed_after


def _kill_node(agent_pid: int) -> None:
    """SIGKILL an agent and every process under it at once, as when a machine dies."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" (", 1)
            ppid = int(rest.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    doomed, todo = [], [agent_pid]
    while todo:
        pid = todo.pop()
        doomed.append(pid)
        todo += children.get(pid, [])
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _training(admin: Any, run_id: str, site_id: str) -> int:
    """The open round in which ``site_id`` has its model and trains; 0 if none now."""
    for r in admin.status(run_id).rounds:
        if r.status == "open":
            for p in r.participations:
                if p.site_id == site_id and p.status == "downloaded":
                    return int(r.number)
    return 0


def _accepted_after(admin: Any, run_id: str, after: int, site_id: str) -> int:
    """The first round after ``after`` that counted ``site_id``'s update; 0 if none yet."""
    for r in admin.status(run_id).rounds:
        if r.number > after and any(
            p.site_id == site_id and p.status == "accepted" for p in r.participations
        ):
            return int(r.number)
    return 0


def _wait_for(probe: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (result := probe()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s"
        time.sleep(0.2)  # polling a condition, with a deadline
    return result


ALONE, BOTH = "local world of 1 ranks on 1 node", "local world of 2 ranks on 2 nodes"


def _count(path: Path, line: str) -> int:
    return path.read_text(errors="replace").count(line)


def _wait_for_log(path: Path, line: str, times: int, timeout_s: float = 240) -> None:
    """Until ``line`` is in the log ``times`` times (each a world that formed)."""
    _wait_for(lambda: _count(path, line) >= times, timeout_s)


# -- unit --------------------------------------------------------------------------


def _parallel(**keys: object) -> ParallelConfig:
    return ParallelConfig.from_toml(dict(keys))


def test_nodes_in_the_configuration() -> None:
    two = _parallel(nproc=2, plan="dp", nnodes=2, rdzv_endpoint="10.0.0.5:29400")
    assert (two.min_nodes, two.max_nodes, two.nnodes) == (2, 2, "2")
    assert two.launches_world and two.multi_node and list(two.world_sizes) == [4]
    elastic = _parallel(nproc=1, plan="dp", nnodes="1:3", node_rank=2, rdzv_endpoint="h:1")
    assert (elastic.min_nodes, elastic.max_nodes, list(elastic.world_sizes)) == (1, 3, [1, 2, 3])
    assert not _parallel().launches_world


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        ({"nnodes": 0}, "parallel.nnodes"),
        ({"nnodes": "2:1"}, "parallel.nnodes"),
        ({"nnodes": "two"}, "parallel.nnodes"),
        ({"nnodes": True}, "parallel.nnodes"),
        ({"nnodes": 2, "plan": "dp"}, "parallel.rdzv_endpoint"),  # required
        ({"nnodes": 2, "plan": "dp", "rdzv_endpoint": "h:0"}, "parallel.rdzv_endpoint"),
        ({"rdzv_endpoint": "h:29400"}, "parallel.rdzv_endpoint"),  # one node needs none
        ({"nnodes": 2, "plan": "dp", "rdzv_endpoint": "h:1", "node_rank": 2}, "node_rank"),
        ({"nnodes": 2, "plan": "none", "rdzv_endpoint": "h:1"}, "parallel.plan"),
        ({"nnodes": 2, "plan": "dp", "rdzv_endpoint": "h:1", "rdzv_id": "a b"}, "rdzv_id"),
        ({"nnodes": 2, "plan": "dp", "rdzv_endpoint": "h:1", "rdzv_timeout_s": 0}, "timeout"),
        ({"nnodes": "1:2", "plan": "dp", "rdzv_endpoint": "h:1", "rdzv_last_call_s": -1}, "last"),
        # tp_size must divide every world the elastic range allows: 2 x 1 and 2 x 2 -> 2 only
        (
            {"nproc": 2, "nnodes": "1:2", "plan": "fsdp+tp", "tp_size": 2, "rdzv_endpoint": "h:1"},
            "parallel.tp_size",
        ),
    ],
)
def test_bad_node_settings_are_refused_naming_the_key(keys: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        _parallel(**keys)


def test_ranks_follow_node_rank_whatever_order_the_nodes_joined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = HashStore()
    # Node 1 joined first (group rank 0), node 0 second (group rank 1): 2 processes each.
    joined = {0: 1, 1: 0}  # group rank -> configured node_rank
    for group in (0, 1):  # each node's first process publishes its node_rank
        _env(monkeypatch, group=group, local=0)
        store.set(f"fedra/node_rank/{group}", str(joined[group]))
    ranks = {}
    for group in (0, 1):
        for local in (0, 1):
            _env(monkeypatch, group=group, local=local)
            ranks[(joined[group], local)] = node_ordered_rank(store, joined[group])
    assert ranks == {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3}  # node 0 first
    store.set("fedra/node_rank/1", "1")  # both nodes say 1
    _env(monkeypatch, group=0, local=1)
    with pytest.raises(RuntimeError, match="node_rank 1"):
        node_ordered_rank(store, 1)


def _env(monkeypatch: pytest.MonkeyPatch, *, group: int, local: int) -> None:
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", str(group))
    monkeypatch.setenv("LOCAL_RANK", str(local))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(group * 2 + local))
