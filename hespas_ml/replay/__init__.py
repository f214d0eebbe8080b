"""Replay stage: Chakra ET files, ASTRA-sim system configs, the embedded replay and the real binaries.

`replay(...)` is the entry point: it takes per-rank traces (or an ET path prefix) and a system, and
returns a `ReplayResult` from the real ASTRA-sim congestion-unaware binary when one is available
(`backend="auto"`), else from the embedded re-implementation of its model.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Sequence

from hespas_ml.replay.astrasim import find_binary, parse_output, replay_astrasim
from hespas_ml.replay.chakra import (
    ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, COMM_COLL_NODE, COMM_RECV_NODE, COMM_SEND_NODE,
    COMP_NODE, REDUCE_SCATTER, EtNode, RankTraces, decode_trace, encode_trace, read_trace, read_traces, trace_prefix,
    write_trace, write_traces,
)
from hespas_ml.replay.embedded import RankResult, ReplayResult, replay_embedded
from hespas_ml.replay.fast import replay_fast, system_context
from hespas_ml.replay.errors import ReplayError, ReplayStageError, SystemConfigError, TraceError
from hespas_ml.replay.system import (
    NetworkDim, SystemConfig, load_comm_groups, load_system, write_comm_groups, write_system,
)
from hespas_ml.replay.traces import TraceSet

BACKENDS = ("auto", "embedded", "astra-sim")

__all__ = [
    "ALL_GATHER", "ALL_REDUCE", "ALL_TO_ALL", "BACKENDS", "BROADCAST", "COMM_COLL_NODE", "COMM_RECV_NODE",
    "COMM_SEND_NODE", "COMP_NODE", "REDUCE_SCATTER", "EtNode", "NetworkDim", "RankResult",
    "RankTraces", "ReplayError", "ReplayResult", "ReplayStageError", "SystemConfig", "SystemConfigError",
    "TraceError", "TraceSet",
    "decode_trace", "encode_trace", "find_binary", "load_comm_groups", "load_system", "parse_output",
    "read_trace", "read_traces", "replay", "replay_astrasim", "replay_embedded", "replay_fast", "trace_prefix",
    "write_comm_groups", "write_system", "write_trace", "write_traces",
]


def replay(traces_or_prefix: TraceSet | Sequence[Sequence[EtNode]] | str | Path,
           system: SystemConfig | str | Path,
           comm_groups: dict[int, list[int]] | str | Path | None = None,
           backend: str = "auto", binary: str | Path | None = None,
           workdir: str | Path | None = None, record_nodes: bool = False) -> ReplayResult:
    """Replay a workload on a system and return per-rank finish times.

    traces_or_prefix: a :class:`TraceSet` (its comm groups unless ``comm_groups`` are given, and its
        compiled plan for the fast path), per-rank EtNode lists, an ET path prefix (`<prefix>.<r>.et`), or a
        folder holding one set of traces (`simulate --out`'s `et/`).
    system: a SystemConfig, an ASTRA-sim folder or a short spec (see `load_system`).
    comm_groups: {group id: ranks} or a comm_group.json path.
    backend: "auto" (the real congestion-unaware binary when `find_binary` finds one, else embedded),
        "embedded" or "astra-sim". The embedded replay takes its fast path where it applies
        (:func:`replay_fast`: the same result, collective phases timed from fitted lines, memoised per system).
    binary: explicit ASTRA-sim binary; workdir: where the binary's input files and logs go (a
        temporary folder, removed afterwards, when None).
    record_nodes: the embedded replay also gives each node's issue and finish ns
        (``details["nodes"][rank][node id]``; the binary does not).
    """
    if backend not in BACKENDS:
        raise ReplayError(f"unknown replay backend {backend!r} (choose from {', '.join(BACKENDS)})")
    cfg = system if isinstance(system, SystemConfig) else load_system(system)
    trace_set = traces_or_prefix if isinstance(traces_or_prefix, TraceSet) else None
    if trace_set is not None:
        traces_or_prefix = trace_set.traces
        comm_groups = comm_groups if comm_groups is not None else (trace_set.comm_groups or None)
    if isinstance(traces_or_prefix, (str, Path)):
        traces_or_prefix = trace_prefix(traces_or_prefix)
    groups_file: Path | None = None
    groups: dict[int, list[int]] | None
    if isinstance(comm_groups, (str, Path)):
        groups_file = Path(comm_groups)
        groups = load_comm_groups(groups_file, cfg.n_npus)
    else:
        groups = comm_groups
    found = find_binary(str(binary) if binary is not None else None) if backend != "embedded" else None
    if backend == "astra-sim" and found is None:
        raise ReplayError("backend astra-sim: no AstraSim_Analytical_Congestion_Unaware on PATH and "
                          "ASTRA_SIM_BIN is not set (use backend='embedded' or pass binary=...)")
    if found is None:
        if isinstance(traces_or_prefix, (str, Path)):
            traces = read_traces(traces_or_prefix, cfg.n_npus)
        elif isinstance(traces_or_prefix, RankTraces):
            traces = traces_or_prefix
        else:
            traces = list(traces_or_prefix)
        if record_nodes:
            return replay_embedded(traces, cfg, groups, record_nodes=True)
        plan = trace_set.replay_plan() if trace_set is not None else None
        return replay_fast(traces, system_context(cfg), groups, plan=plan)   # the embedded replay's result
    with tempfile.TemporaryDirectory(prefix="hespas-astrasim-") as scratch:
        folder = Path(workdir) if workdir is not None else Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        if isinstance(traces_or_prefix, (str, Path)):
            prefix = Path(traces_or_prefix)
        else:
            traces = list(traces_or_prefix)
            if len(traces) != cfg.n_npus:
                raise ReplayError(f"{len(traces)} rank trace(s) given for a system of {cfg.n_npus} NPUs")
            prefix = folder / "et" / "rank"
            write_traces(prefix, traces)
        if groups is not None and groups_file is None:
            groups_file = write_comm_groups(groups, folder / "comm_group.json")
        return replay_astrasim(prefix, cfg, groups_file, found, folder)
