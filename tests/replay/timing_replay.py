"""Timing script for the replay stage (not a test): python tests/replay/timing_replay.py

Builds synthetic training-step-like traces (a chain of COMP nodes with collectives hanging off it and
consumed a few nodes later) and times ET encoding/decoding and the embedded replay engines.
"""
from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hespas_ml.replay import chakra as et  # noqa: E402
from hespas_ml.replay.embedded import replay_embedded  # noqa: E402
from hespas_ml.replay.system import load_system  # noqa: E402

MIB = 1 << 20


def step_trace(n_nodes: int, n_colls: int, seed: int = 0,
               kinds: tuple[int, ...] = (et.ALL_REDUCE,)) -> list[et.EtNode]:
    """A chain of COMPs; collective k depends on one COMP and feeds a COMP ~8 nodes later."""
    rng = random.Random(seed)
    sizes = [1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 3 * MIB + 17]
    nodes: list[et.EtNode] = []
    every = max(1, (n_nodes - n_colls) // max(n_colls, 1))
    pending: list[tuple[int, int]] = []  # (consumer position, collective id)
    next_id, last_comp, colls = 1, None, 0
    comp_index = 0
    while len(nodes) < n_nodes:
        deps = [last_comp] if last_comp else []
        deps += [cid for pos, cid in pending if pos == comp_index]
        pending = [(pos, cid) for pos, cid in pending if pos != comp_index]
        duration = rng.randint(5, 400)
        nodes.append(et.EtNode(next_id, f"comp{next_id}", et.COMP_NODE, deps, [], duration))
        last_comp = next_id
        next_id += 1
        comp_index += 1
        if colls < n_colls and comp_index % every == 0 and len(nodes) < n_nodes:
            kind = kinds[colls % len(kinds)]
            nodes.append(et.EtNode(next_id, f"coll{next_id}", et.COMM_COLL_NODE, [last_comp], [], 0,
                                   {"comm_type": kind, "comm_size": rng.choice(sizes)}))
            pending.append((comp_index + 8, next_id))
            next_id += 1
            colls += 1
    tail = [cid for _pos, cid in pending]
    if tail:
        nodes.append(et.EtNode(next_id, "final", et.COMP_NODE, [last_comp] + tail, [], 1))
    return nodes


def timed(label: str, fn):
    start = time.perf_counter()
    value = fn()
    print(f"{label:62s} {time.perf_counter() - start:8.3f} s")
    return value


def main() -> None:
    cases = [
        ("4 ranks x 3000 nodes, 400 AR, ring:4x150", "ring:4x150", 4, 3000, 400, (et.ALL_REDUCE,)),
        ("8 ranks x 3000 nodes, 400 mixed, switch:8x400", "switch:8x400", 8, 3000, 400,
         (et.ALL_REDUCE, et.ALL_GATHER, et.REDUCE_SCATTER, et.ALL_TO_ALL)),
        ("64 ranks x 2000 nodes, 300 mixed, [Switch 8, Ring 8]", "switch:8x400,ring:8x50", 64, 2000, 300,
         (et.ALL_REDUCE, et.ALL_GATHER, et.REDUCE_SCATTER)),
    ]
    for label, spec, ranks, n_nodes, n_colls, kinds in cases:
        system = load_system(spec)
        trace = step_trace(n_nodes, n_colls, kinds=kinds)
        traces = [trace] * ranks
        with tempfile.TemporaryDirectory() as tmp:
            prefix = Path(tmp) / "et" / "rank"
            timed(f"{label}: write_traces", lambda: et.write_traces(prefix, traces))
            timed(f"{label}: read_traces", lambda: et.read_traces(prefix, ranks))
        result = timed(f"{label}: replay auto", lambda: replay_embedded(traces, system))
        print(f"{'':62s} step {result.step_time_s * 1e3:.3f} ms, engine {result.details['engine']}")
        if ranks <= 8:
            full = timed(f"{label}: replay full engine", lambda: replay_embedded(traces, system, engine="full"))
            print(f"{'':62s} same result: {full.ranks == result.ranks}")
    # tensor-parallel style: every other collective runs in the rank's 8-NPU switch group
    system = load_system("switch:8x400,ring:8x50")
    groups = {g + 1: list(range(8 * g, 8 * g + 8)) for g in range(8)}
    for n_nodes, n_colls, engines in ((2000, 300, ("auto",)), (400, 60, ("auto", "full"))):
        traces = []
        for rank in range(64):
            trace = step_trace(n_nodes, n_colls, kinds=(et.ALL_REDUCE, et.ALL_GATHER, et.REDUCE_SCATTER))
            colls = [n for n in trace if n.type == et.COMM_COLL_NODE]
            for node in colls[::2]:
                node.attrs["pg_name"] = str(rank // 8 + 1)
            traces.append(trace)
        for engine in engines:
            label = f"64 ranks x {n_nodes} nodes, {n_colls} colls, half in 8-rank groups: {engine}"
            result = timed(label, lambda: replay_embedded(traces, system, groups, engine=engine))
            print(f"{'':62s} step {result.step_time_s * 1e3:.3f} ms, engine {result.details['engine']}")
    system = load_system("ring:4x150")
    base = step_trace(3000, 400)
    skewed = []
    for rank in range(4):  # same collectives on every rank, compute times differ per rank
        rng = random.Random(rank)
        skewed.append([et.EtNode(n.id, n.name, n.type, n.data_deps, n.ctrl_deps,
                                 n.duration_micros + (rng.randint(0, 20) if n.type == et.COMP_NODE else 0),
                                 n.attrs) for n in base])
    result = timed("4 ranks x 3000 nodes, 400 AR, per-rank jitter: full engine",
                   lambda: replay_embedded(skewed, system))
    print(f"{'':62s} step {result.step_time_s * 1e3:.3f} ms, engine {result.details['engine']}")


if __name__ == "__main__":
    main()
