"""Entry point of the embedded replay: input checks, engine choice, the full engine, results."""
from __future__ import annotations

from typing import Any, Sequence

from hespas_ml.replay import chakra as et
from hespas_ml.replay.embedded.config import ReplayConfig
from hespas_ml.replay.embedded.engine import Engine
from hespas_ml.replay.embedded.network import Network
from hespas_ml.replay.embedded.nodes import group_id
from hespas_ml.replay.embedded.results import RankResult, ReplayResult
from hespas_ml.replay.embedded.symmetric import Asymmetric, run_symmetric, symmetric_plan
from hespas_ml.replay.embedded.system_layer import SystemLayer, split_into_chunks
from hespas_ml.replay.embedded.workload import Workload, raise_if_stuck
from hespas_ml.replay.errors import ReplayError
from hespas_ml.replay.system import SystemConfig, validate_dims, validate_system

ENGINES = ("auto", "full", "symmetric")
FULL_ENGINE_EVENT_BUDGET = 20_000    # "auto" uses the exact full engine below this estimate


def run_full(traces: Sequence[Sequence[et.EtNode]], cfg: ReplayConfig, network: Network,
             groups: dict[int, list[int]]) -> tuple[list[RankResult], list[Workload]]:
    """The full engine: every rank's workload and system layer, every message."""
    engine = Engine(network)
    systems = [SystemLayer(engine, cfg, rank, groups) for rank in range(cfg.total)]
    workloads = [Workload(rank, nodes, systems[rank], cfg, groups) for rank, nodes in enumerate(traces)]
    for workload in workloads:
        workload.fire()
    engine.run()
    raise_if_stuck(workloads)
    return [w.result() for w in workloads], workloads


def estimated_events(nodes: Sequence[et.EtNode], cfg: ReplayConfig, groups: dict[int, list[int]]) -> int:
    """Rough count of the events the full engine would simulate when every rank runs ``nodes``: each
    rank's nodes, and the collectives' messages."""
    total = len(nodes) * cfg.total
    for node in nodes:
        if node.type != et.COMM_COLL_NODE or node.attrs.get("comm_type") == et.BROADCAST:
            continue
        size = node.attrs.get("comm_size", 0)
        size = size if isinstance(size, int) else 0
        chunk, size = split_into_chunks(node.attrs.get("comm_type"), size, cfg.splits, cfg.total)
        chunks = -(-size // max(chunk, 1))
        try:
            members = groups.get(group_id(node.attrs.get("pg_name", "")))
        except (ValueError, TypeError):
            members = None
        if members is not None and len(members) != cfg.total:
            total += chunks * 2 * len(members) * len(members)
        else:
            total += chunks * sum(2 * n for n in cfg.npus) * cfg.total
    return total


def _checked_groups(comm_groups: dict[int, list[int]] | None, total: int) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for gid, members in (comm_groups or {}).items():
        if int(gid) <= 0:
            raise ReplayError(f"communicator group {gid}: ids must be > 0 (0 means all ranks)")
        bad = [m for m in members if not 0 <= m < total]
        if bad or not members:
            raise ReplayError(f"communicator group {gid}: ranks {bad or members} outside the {total} NPUs")
        groups[int(gid)] = list(members)
    return groups


def replay_embedded(traces: Sequence[Sequence[et.EtNode]], system: SystemConfig,
                    comm_groups: dict[int, list[int]] | None = None, *, engine: str = "auto",
                    record_nodes: bool = False) -> ReplayResult:
    """Replay per-rank Chakra traces on `system` with the embedded congestion-unaware model.

    `engine`: "full" simulates every rank and message; "symmetric" simulates one rank of identical
    traces (ReplayError when that does not apply); "auto" uses the full engine for small workloads
    (estimated below FULL_ENGINE_EVENT_BUDGET node and message events) and the symmetric one, when it
    applies, for larger ones.  With `record_nodes`, `details["nodes"][rank][node_id]` = (issue ns, finish ns).
    """
    validate_dims(system.dims, system.source)
    validate_system(system.system, len(system.dims), system.source)
    cfg = ReplayConfig(system)
    if len(traces) != cfg.total:
        raise ReplayError(f"{len(traces)} rank trace(s) given for a system of {cfg.total} NPUs ({system.source})")
    groups = _checked_groups(comm_groups, cfg.total)
    for rank, nodes in enumerate([traces.template] if isinstance(traces, et.RankTraces) else traces):
        if not nodes:
            raise ReplayError(f"rank {rank}: the trace has no node (ASTRA-sim aborts)")
    if engine not in ENGINES:
        raise ReplayError(f"unknown embedded engine {engine!r} (auto, full or symmetric)")
    network = Network(system)
    chosen = "full"
    peer_groups: dict[int, set[int]] | None = None
    if engine == "symmetric" or (engine == "auto" and
                                 estimated_events(traces[0], cfg, groups) > FULL_ENGINE_EVENT_BUDGET):
        peer_groups = symmetric_plan(traces, cfg, groups)
        if peer_groups is not None:
            chosen = "symmetric"
        elif engine == "symmetric":
            raise ReplayError("the symmetric engine does not apply: ranks run different traces, p2p or "
                              "MEM/INVALID nodes, or sub-group collectives that differ between ranks")
    if chosen == "symmetric":
        try:
            ranks, workloads = run_symmetric(traces, cfg, network, groups, peer_groups or {})
        except Asymmetric:
            if engine == "symmetric":
                raise ReplayError("the symmetric engine does not apply: a collective phase is not "
                                  "rank-symmetric (doubleBinaryTree, oneDirect on several dimensions, ...)") from None
            chosen = "full"
    if chosen == "full":
        ranks, workloads = run_full(traces, cfg, network, groups)
    details: dict[str, Any] = {"engine": chosen}
    if record_nodes:
        details["nodes"] = {rank: w.node_ticks() for rank, w in enumerate(workloads)}
    return ReplayResult(ranks, "embedded", details)
