"""Embedded replay against the real ASTRA-sim congestion-unaware results.

Every scenario of ../shared/astra-vectors is a test (discovered at collection time), for each engine;
measured calibration points of shared/reference/astra-sim.md are checked on hand-built traces.
"""
from __future__ import annotations

import json
import random

import pytest
from vector_cases import load_vector, vector_names

from hespas_ml.replay import chakra as et
from hespas_ml.replay.embedded import ReplayResult, replay_embedded
from hespas_ml.replay.errors import ReplayError
from hespas_ml.replay.system import SystemConfig, load_system

MIB = 1 << 20
TOLERANCE = 0.01  # acceptance: within 1 % of the binary (the engines are exact on the public vectors)


def close(got: int, want: int) -> bool:
    return abs(got - want) <= TOLERANCE * max(abs(want), 1)


def check_against_binary(result: ReplayResult, expected: dict) -> None:
    for rank in result.ranks:
        want = expected["ranks"][str(rank.rank)]
        stats = want["stats"]
        assert close(rank.finish_ns, want["finished_cycles"]), (rank, want)
        assert close(rank.exposed_comm_ns, want["exposed_comm_cycles"]), (rank, want)
        assert close(rank.gpu_ns, stats.get("GPU time", 0)), (rank, stats)
        assert close(rank.comm_ns, stats.get("Comm time", 0)), (rank, stats)
        if "Total compute-communication overlap" in stats:
            assert close(rank.overlap_ns, stats["Total compute-communication overlap"]), (rank, stats)
        else:
            assert rank.overlap_ns <= TOLERANCE * rank.finish_ns


@pytest.mark.parametrize("name", vector_names())
def test_vector_auto_engine(name: str) -> None:
    vector = load_vector(name)
    check_against_binary(replay_embedded(vector.traces, vector.system, vector.groups), vector.unaware)


@pytest.mark.parametrize("name", vector_names())
def test_vector_replay_as_the_pipeline_calls_it(name: str) -> None:
    """replay(): the fast path where ranks run alike, the embedded replay elsewhere."""
    from hespas_ml.replay import replay

    vector = load_vector(name)
    check_against_binary(replay(vector.traces, vector.system, vector.groups, backend="embedded"), vector.unaware)


@pytest.mark.parametrize("name", vector_names())
def test_vector_full_engine_including_per_node_ticks(name: str) -> None:
    vector = load_vector(name)
    result = replay_embedded(vector.traces, vector.system, vector.groups, engine="full", record_nodes=True)
    check_against_binary(result, vector.unaware)
    for rank, nodes in vector.unaware.get("nodes", {}).items():
        span = vector.unaware["ranks"][rank]["finished_cycles"]
        for node_id, ticks in nodes.items():
            issue, finish = result.details["nodes"][int(rank)][int(node_id)]
            assert abs(issue - ticks["issue"]) <= TOLERANCE * span, (rank, node_id)
            assert abs(finish - ticks["finish"]) <= TOLERANCE * span, (rank, node_id)


@pytest.mark.parametrize("name", vector_names())
def test_vector_symmetric_engine_where_it_applies(name: str) -> None:
    vector = load_vector(name)
    try:
        result = replay_embedded(vector.traces, vector.system, vector.groups, engine="symmetric")
    except ReplayError as exc:
        assert "the symmetric engine does not apply" in str(exc)
        pytest.skip(str(exc))
    check_against_binary(result, vector.unaware)


# --- hand-built traces, checked against measured numbers of astra-sim.md ----------------------------------
def comp(node_id: int, micros: int, deps=(), ctrl=()) -> et.EtNode:
    return et.EtNode(node_id, f"comp{node_id}", et.COMP_NODE, list(deps), list(ctrl), micros)


def coll(node_id: int, kind: int, size: int, deps=(), micros: int = 0, **attrs) -> et.EtNode:
    return et.EtNode(node_id, f"coll{node_id}", et.COMM_COLL_NODE, list(deps), [], micros,
                     {"comm_type": kind, "comm_size": size, **attrs})


def calibration_system(spec: str) -> SystemConfig:
    """The system file of astra-sim.md section 11: ring everywhere, local-mem-bw 50."""
    cfg = load_system(spec, local_mem_bw_gbps=50)
    for key in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        cfg.system[f"{key}-implementation"] = ["ring"] * len(cfg.dims)
    return cfg


def finish_times(traces, system, groups=None, engine="full") -> list[int]:
    return [r.finish_ns for r in replay_embedded(traces, system, groups, engine=engine).ranks]


KINDS = {"AR": et.ALL_REDUCE, "AG": et.ALL_GATHER, "RS": et.REDUCE_SCATTER, "A2A": et.ALL_TO_ALL}
CALIBRATION = [  # topology, N, collective, (1 MiB, 64 MiB) ns measured with the unaware binary
    ("ring", 4, "AR", 88720, 4907176), ("ring", 4, "AG", 64744, 3756160), ("ring", 4, "RS", 67960, 3963556),
    ("ring", 4, "A2A", 41560, 1887280), ("ring", 8, "AR", 117780, 5739284), ("ring", 8, "AG", 151016, 8764320),
    ("ring", 8, "RS", 86420, 4631268), ("ring", 8, "A2A", 125480, 4432104),
    ("switch", 4, "AR", 100720, 4919176), ("switch", 4, "AG", 70744, 3762160),
    ("switch", 4, "RS", 73960, 3969556), ("switch", 4, "A2A", 53560, 1899280),
    ("switch", 8, "AR", 145780, 5767284), ("switch", 8, "AG", 165016, 8778320),
    ("switch", 8, "RS", 100420, 4645268), ("switch", 8, "A2A", 181480, 4488104),
    ("fc", 4, "AR", 88720, 4907176), ("fc", 8, "A2A", 125480, 4432104),
]


@pytest.mark.parametrize("topology, n, kind, one_mib, sixty_four_mib", CALIBRATION)
def test_single_collective_calibration_points(topology, n, kind, one_mib, sixty_four_mib) -> None:
    system = calibration_system(f"{topology}:{n}x50@500")
    for size, want in ((MIB, one_mib), (64 * MIB, sixty_four_mib)):
        traces = [[coll(1, KINDS[kind], size)] for _ in range(n)]
        assert finish_times(traces, system) == [want] * n
        assert finish_times(traces, system, engine="symmetric") == [want] * n


def test_collective_chain_with_broadcast_is_the_sum_of_its_parts() -> None:
    system = calibration_system("ring:4x50@500")
    chain = [coll(1, et.ALL_REDUCE, MIB), coll(2, et.ALL_GATHER, MIB, [1]), coll(3, et.REDUCE_SCATTER, MIB, [2]),
             coll(4, et.ALL_TO_ALL, MIB, [3]), coll(5, et.BROADCAST, MIB, [4], micros=3)]
    assert finish_times([chain] * 4, system) == [265984] * 4


def test_two_dimensional_involved_dim_sequence() -> None:
    system = calibration_system("ring:2x200@100,switch:4x50@1000")
    trace = [coll(1, et.ALL_REDUCE, MIB), coll(2, et.ALL_REDUCE, MIB, [1], involved_dim=[True, False]),
             coll(3, et.ALL_REDUCE, MIB, [2], involved_dim=[False, True])]
    assert finish_times([trace] * 8, system) == [257795] * 8


def test_compute_and_collective_overlap_statistics() -> None:
    system = calibration_system("ring:4x50@500")
    serial = replay_embedded([[comp(1, 10), coll(2, et.ALL_REDUCE, MIB, [1]), comp(3, 5, [2])]] * 4, system)
    assert (serial.ranks[0].finish_ns, serial.ranks[0].exposed_comm_ns) == (103720, 88720)
    parallel = replay_embedded([[comp(1, 20), coll(2, et.ALL_REDUCE, MIB)]] * 4, system).ranks[0]
    assert (parallel.finish_ns, parallel.exposed_comm_ns, parallel.overlap_ns) == (88720, 68720, 20000)
    assert (parallel.gpu_ns, parallel.comm_ns) == (20000, 88720)


def test_independent_collectives_serialise_on_the_comm_slot() -> None:
    system = calibration_system("ring:4x50@500")
    assert finish_times([[coll(1, et.ALL_REDUCE, MIB), coll(2, et.ALL_REDUCE, MIB)]] * 4, system) == [177440] * 4


def test_two_rank_groups_on_a_ring() -> None:
    system = calibration_system("ring:4x50@500")
    traces = [[coll(1, et.ALL_REDUCE, MIB, pg_name="1" if r < 2 else "2")] for r in range(4)]
    assert finish_times(traces, system, {1: [0, 1], 2: [2, 3]}) == [55100] * 4


def p2p(node_id: int, kind: int, src: int, dst: int, size: int, tag: int = 1, deps=()) -> et.EtNode:
    return et.EtNode(node_id, f"p2p{node_id}", kind, list(deps), [], 0,
                     {"comm_src": src, "comm_dst": dst, "comm_size": size, "comm_tag": tag})


def test_neighbour_exchange_costs_latency_plus_serialisation() -> None:
    system = calibration_system("ring:4x50@500")
    traces = [[p2p(1, et.COMM_SEND_NODE, r, (r + 1) % 4, MIB), p2p(2, et.COMM_RECV_NODE, (r - 1) % 4, r, MIB)]
              for r in range(4)]
    assert finish_times(traces, system) == [20031] * 4


def test_roofline_compute_time() -> None:
    system = calibration_system("ring:2x50@500")
    system.system.update({"roofline-enabled": 1, "peak-perf": 100, "local-mem-bw": 1000})
    node = et.EtNode(1, "gemm", et.COMP_NODE, [], [], 999, {"num_ops": 10**9, "tensor_size": 10**6})
    result = replay_embedded([[node]] * 2, system)
    assert (result.ranks[0].finish_ns, result.ranks[0].exposed_comm_ns) == (10000, 0)


def test_zero_duration_compute_takes_one_ns() -> None:
    system = calibration_system("ring:2x50@500")
    assert finish_times([[comp(1, 0), comp(2, 0, [1])]] * 2, system) == [2, 2]


# --- the symmetric engine agrees with the full engine on a generated workload -----------------------------
def generated_step(seed: int, n_comp: int = 60) -> list[et.EtNode]:
    rng = random.Random(seed)
    nodes, last, next_id = [], None, 1
    for i in range(n_comp):
        nodes.append(comp(next_id, rng.choice([0, 1, 7, 30, 200]), [last] if last else []))
        last, next_id = next_id, next_id + 1
        if i % 3 == 0:
            kind = rng.choice(list(KINDS.values()))
            extra = {"involved_dim": [rng.random() < 0.7, True]} if rng.random() < 0.3 else {}
            nodes.append(coll(next_id, kind, rng.choice([4096, MIB, 3 * MIB + 5, 9 * MIB]), [last], **extra))
            next_id += 1
    return nodes


@pytest.mark.parametrize("spec, impl, active, optimization", [
    ("ring:4x100@300,switch:2x50@900", "ring", 1, "localBWAware"),
    ("fc:4x150@200,ring:2x25@2000", "direct", 2, "baseline"),
    ("switch:4x200@700,fc:2x100@300", "halvingDoubling", 2, "localBWAware"),
])
def test_symmetric_engine_matches_full_engine(spec, impl, active, optimization) -> None:
    system = load_system(spec, local_mem_bw_gbps=500)
    system.system.update({"active-chunks-per-dimension": active, "collective-optimization": optimization})
    for key in ("all-reduce", "all-gather", "reduce-scatter"):
        system.system[f"{key}-implementation"] = [impl, "ring"]
    trace = generated_step(seed=len(spec))
    full = replay_embedded([trace] * system.n_npus, system, engine="full")
    symmetric = replay_embedded([trace] * system.n_npus, system, engine="symmetric")
    assert symmetric.ranks == full.ranks
    assert symmetric.details["engine"] == "symmetric"


@pytest.mark.parametrize("layout", ["blocks", "strided", "shuffled"])
def test_symmetric_engine_with_per_rank_groups_matches_full_engine(layout: str) -> None:
    """Tensor-parallel style: every rank runs the same step, collectives alternate between its own
    4-rank group (pg_name differs per rank) and all 8 ranks."""
    system = load_system("ring:4x100@300,switch:2x50@900", local_mem_bw_gbps=200)
    if layout == "blocks":
        groups = {1: [0, 1, 2, 3], 2: [4, 5, 6, 7]}
    elif layout == "strided":
        groups = {1: [0, 2, 4, 6], 2: [1, 3, 5, 7]}
    else:
        groups = {1: [2, 0, 3, 1], 2: [6, 4, 7, 5]}
    group_of = {rank: gid for gid, members in groups.items() for rank in members}
    traces = []
    for rank in range(8):
        trace = generated_step(seed=3, n_comp=30)
        for i, node in enumerate(n for n in trace if n.type == et.COMM_COLL_NODE):
            node.attrs.pop("involved_dim", None)
            if i % 2 == 0:
                node.attrs["pg_name"] = str(group_of[rank])
        traces.append(trace)
    full = replay_embedded(traces, system, groups, engine="full")
    try:
        symmetric = replay_embedded(traces, system, groups, engine="symmetric")
    except ReplayError as exc:
        # A listed order that is not a ring of the network makes members' phase ticks differ: the
        # symmetric engine may refuse such groups (the full engine handles them).
        assert layout == "shuffled" and "not rank-symmetric" in str(exc)
        return
    assert symmetric.ranks == full.ranks


# --- results ----------------------------------------------------------------------------------------------
def test_result_properties_and_json() -> None:
    system = calibration_system("ring:2x50@500")
    result = replay_embedded([[comp(1, 3)], [comp(1, 7)]], system)
    assert result.step_time_s == pytest.approx(7e-6)
    assert result.exposed_comm_s == 0
    data = json.loads(json.dumps(result.to_dict()))
    assert data["backend"] == "embedded" and [r["finish_ns"] for r in data["ranks"]] == [3000, 7000]


# --- deadlocks and bad input raise ReplayError instead of hanging ------------------------------------------
def replay_error(traces, system, groups=None) -> str:
    with pytest.raises(ReplayError) as info:
        replay_embedded(traces, system, groups)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_mismatched_collective_sizes_deadlock() -> None:
    system = calibration_system("ring:4x50@500")
    traces = [[coll(1, et.ALL_REDUCE, MIB if r else 2 * MIB)] for r in range(4)]
    message = replay_error(traces, system)
    assert "deadlock" in message and "rank 0" in message and "'coll1'" in message


def test_swapped_collective_order_deadlocks() -> None:
    system = calibration_system("ring:2x50@500")
    first = [coll(1, et.ALL_REDUCE, MIB), coll(2, et.ALL_GATHER, MIB, [1])]
    second = [coll(1, et.ALL_GATHER, MIB), coll(2, et.ALL_REDUCE, MIB, [1])]
    assert "deadlock" in replay_error([first, second], system)


def test_recv_without_send_deadlocks() -> None:
    system = calibration_system("ring:2x50@500")
    traces = [[comp(1, 1)], [p2p(1, et.COMM_RECV_NODE, 0, 1, MIB, tag=4)]]
    message = replay_error(traces, system)
    assert "rank 1" in message and "p2p1" in message


def test_invalid_node_whose_only_child_is_compute_stalls_like_astrasim() -> None:
    system = calibration_system("ring:2x50@500")
    trace = [et.EtNode(1, "skip", et.INVALID_NODE, [], []), comp(2, 5, [1])]
    assert "stalled DAG" in replay_error([trace, trace], system)


@pytest.mark.parametrize("trace, problem", [
    ([comp(1, 1, [9])], "depends on node 9"),
    ([comp(1, 1), comp(1, 2)], "appears twice"),
    ([], "has no node"),
    ([et.EtNode(1, "meta", et.METADATA_NODE, [], [])], "METADATA_NODE"),
    ([coll(1, et.REDUCE, MIB)], "unsupported collective type REDUCE"),
    ([et.EtNode(1, "c", et.COMM_COLL_NODE, [], [], 0, {"comm_type": 0, "comm_size": 1.5})], "must be an integer"),
    ([et.EtNode(1, "c", et.COMM_COLL_NODE, [], [], 0, {"comm_type": 0})], "comm_size is missing"),
    ([coll(1, et.ALL_REDUCE, MIB, pg_name="7")], "communicator group 7 not found"),
    ([coll(1, et.ALL_REDUCE, MIB, pg_name=3)], "pg_name must be a string"),
    ([coll(1, et.ALL_GATHER, 2)], "0-byte chunks"),
    ([coll(1, et.ALL_REDUCE, MIB, involved_dim=[False])], "involves no network dimension"),
    ([p2p(1, et.COMM_SEND_NODE, 0, 0, MIB)], "is not another rank"),
])
def test_bad_traces_are_replay_errors(trace, problem) -> None:
    system = calibration_system("ring:2x50@500")
    assert problem in replay_error([trace, trace], system)


def test_wrong_rank_count_is_an_error() -> None:
    assert "3 rank trace(s) given for a system of 4 NPUs" in replay_error([[comp(1, 1)]] * 3,
                                                                         calibration_system("ring:4x50@500"))


def test_auto_counts_every_ranks_nodes_when_it_chooses_an_engine() -> None:
    # 128 identical ranks of 200 compute nodes: no message, but 25,600 node events
    trace = [comp(i, 3 + i % 5, deps=[i - 1] if i else []) for i in range(200)]
    system = load_system("switch:8x300,switch:16x50")
    traces = [list(trace) for _ in range(system.n_npus)]
    auto = replay_embedded(traces, system)
    full = replay_embedded(traces, system, engine="full")
    assert auto.details["engine"] == "symmetric" and full.details["engine"] == "full"
    assert [(r.finish_ns, r.exposed_comm_ns) for r in auto.ranks] == [(r.finish_ns, r.exposed_comm_ns) for r in full.ranks]
    small = replay_embedded([list(trace[:10]) for _ in range(4)], load_system("ring:4x100"))
    assert small.details["engine"] == "full"


def test_a_ring_larger_than_its_fits_is_timed_from_the_line_through_smaller_ones() -> None:
    from hespas_ml.replay.embedded.config import ReplayConfig
    from hespas_ml.replay.fast_collectives import DIRECT_RING, _fit_structure, measure_phase

    cfg = ReplayConfig(load_system("ring:4x100"))
    for kind in (et.ALL_REDUCE, et.ALL_GATHER, et.REDUCE_SCATTER):
        structure = (kind, "ring", 1, 2 * DIRECT_RING, 1, True, 10)     # a ring of 64, beyond the direct fits
        fit = _fit_structure(structure, cfg)
        assert fit is not None and fit.checks_left == 0
        for d, r in ((0, 0), (7, 3), (12_345, 678)):
            assert fit.at(d, r) == measure_phase(structure, d, r, cfg)


@pytest.mark.parametrize("spec", ["ring:4x100", "switch:8x450,switch:128x50"])
def test_the_embedded_replay_takes_the_fast_path_to_the_same_nanosecond(spec: str) -> None:
    from hespas_ml.replay import replay

    trace = [comp(0, 5), coll(1, et.ALL_REDUCE, 4 << 20, deps=[0]), comp(2, 7, deps=[1]),
             coll(3, et.ALL_GATHER, 1 << 20, deps=[2]), comp(4, 3, deps=[3])]
    system = load_system(spec)
    traces = [list(trace) for _ in range(system.n_npus)]
    fast = replay(traces, system, backend="embedded")
    slow = replay_embedded(traces, system)
    assert fast.details["engine"] == "fast" and slow.details["engine"] != "fast"
    assert [(r.finish_ns, r.exposed_comm_ns) for r in fast.ranks] == [(r.finish_ns, r.exposed_comm_ns) for r in slow.ranks]
