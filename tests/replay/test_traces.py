"""Chakra traces built from split programs: durations, collectives, comm groups, send/recv."""
from __future__ import annotations

import random

import pytest

from conftest import shared_path
from hespas_ml.ingest.stablehlo import parse_file, parse_module
from hespas_ml.replay import chakra
from hespas_ml.replay.traces import build_traces
from hespas_ml.split.regions import split_program


def test_rounding_carries_the_remainder_so_tiny_regions_are_not_lost():
    graph = parse_file(shared_path("mlir", "resnet_50_inference_step_4_devices_1024_batch.mlir"))
    rg = split_program(graph, "individual")
    rng = random.Random(0)
    # mostly sub-microsecond regions: integer rounding per node would drop almost all of them
    seconds = [rng.uniform(0.05e-6, 1.4e-6) if r.kind == "compute" else 0.0 for r in rg.regions]
    ts = build_traces(rg, seconds)
    total_us = sum(n.duration_micros for n in ts.traces[0] if n.type == chakra.COMP_NODE)
    exact_us = sum(s * r.count for s, r in zip(seconds, rg.regions)) * 1e6
    assert abs(total_us - exact_us) <= 0.5
    assert ts.compute_time_s == pytest.approx(exact_us * 1e-6)
    assert ts.encoded_compute_s == pytest.approx(total_us * 1e-6)
    # per node the error never exceeds one microsecond
    node_exact = {}
    for nid, rid in ts.region_of_node.items():
        node_exact[nid] = seconds[rid] * rg.regions[rid].count * 1e6
    assert all(abs(n.duration_micros - node_exact[n.id]) < 1.0
               for n in ts.traces[0] if n.type == chakra.COMP_NODE)


def test_all_devices_get_the_same_nodes_and_collectives_carry_comm_size():
    graph = parse_file(shared_path("mlir", "test_dependency_graph.mlir"))
    rg = split_program(graph, "fusion")
    ts = build_traces(rg, [1e-5] * len(rg.regions), n_ranks=4)
    assert ts.n_ranks == 4
    ids = [[n.id for n in t] for t in ts.traces]
    assert all(i == ids[0] for i in ids)
    coll = [n for n in ts.traces[0] if n.type == chakra.COMM_COLL_NODE]
    assert len(coll) == 1
    assert coll[0].attrs["comm_type"] == chakra.ALL_REDUCE
    assert coll[0].attrs["comm_size"] == 128 * 512 * 4
    assert "pg_name" not in coll[0].attrs               # the group of every device is the global one
    # every dependency names a node of the same trace, and ids are unique
    for t in ts.traces:
        known = {n.id for n in t}
        assert len(known) == len(t)
        assert all(d in known for n in t for d in n.data_deps)


def test_split_replica_groups_become_comm_groups_with_pg_names():
    rg = split_program(parse_file(shared_path("mlir", "test_split_replica_groups.mlir")))
    ts = build_traces(rg, [2e-6] * len(rg.regions))
    assert ts.comm_groups == {1: [0, 1], 2: [2, 3]}
    pg = [[n.attrs.get("pg_name") for n in t if n.type == chakra.COMM_COLL_NODE] for t in ts.traces]
    assert pg == [["1", None], ["1", None], ["2", None], ["2", None]]


PERMUTE = """
module @perm attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 4 : i32} {
  func.func @main(%x: tensor<256x256xf32>) -> tensor<256x256xf32> {
    %0 = stablehlo.tanh %x : tensor<256x256xf32>
    %1 = "stablehlo.collective_permute"(%0) <{source_target_pairs = dense<[[0, 1], [1, 2], [2, 3], [3, 0]]> : tensor<4x2xi64>}> : (tensor<256x256xf32>) -> tensor<256x256xf32>
    %2 = stablehlo.exponential %1 : tensor<256x256xf32>
    return %2 : tensor<256x256xf32>
  }
}
"""


def test_collective_permute_becomes_matched_send_recv_pairs():
    rg = split_program(parse_module(PERMUTE, "perm"))
    ts = build_traces(rg, [3e-6] * len(rg.regions))
    sends = {r: [n for n in t if n.type == chakra.COMM_SEND_NODE] for r, t in enumerate(ts.traces)}
    recvs = {r: [n for n in t if n.type == chakra.COMM_RECV_NODE] for r, t in enumerate(ts.traces)}
    for rank in range(4):
        (s,), (rv,) = sends[rank], recvs[rank]
        assert s.attrs["comm_src"] == rank and s.attrs["comm_dst"] == (rank + 1) % 4
        assert rv.attrs["comm_dst"] == rank and rv.attrs["comm_src"] == (rank - 1) % 4
        assert s.attrs["comm_tag"] == rv.attrs["comm_tag"]
        assert s.attrs["comm_size"] == 256 * 256 * 4
        # the exponential waits for the data received
        exp_node = [n for n in ts.traces[rank] if n.type == chakra.COMP_NODE][-1]
        assert rv.id in exp_node.data_deps


def ring_permute(pairs: str) -> str:
    return PERMUTE.replace("[[0, 1], [1, 2], [2, 3], [3, 0]]", pairs)


@pytest.mark.parametrize("pairs, system, engine", [
    ("[[0, 1], [1, 2], [2, 3], [3, 0]]", "switch:4x100", "fast"),          # every message alike
    # 1 -> 3 and 2 -> 0 cross the second dimension, 0 -> 1 and 3 -> 2 the first: ranks are not alike
    ("[[0, 1], [1, 3], [3, 2], [2, 0]]", "switch:2x100,switch:2x25", "full"),
])
def test_a_ring_of_sends_is_one_shared_trace_replayed_exactly(pairs, system, engine):
    from hespas_ml.replay import load_system
    from hespas_ml.replay.embedded import replay_embedded
    from hespas_ml.replay.fast import replay_fast

    rg = split_program(parse_module(ring_permute(pairs), "perm"))
    ts = build_traces(rg, [3e-6] * len(rg.regions))
    assert isinstance(ts.traces, chakra.RankTraces)             # one trace: the SEND and RECV are variants
    for rank, trace in enumerate(ts.traces):
        (send,) = [n for n in trace if n.type == chakra.COMM_SEND_NODE]
        (recv,) = [n for n in trace if n.type == chakra.COMM_RECV_NODE]
        assert send.attrs["comm_src"] == rank == recv.attrs["comm_dst"]
    cfg = load_system(system)
    fast = replay_fast(ts.traces, cfg, ts.comm_groups, ts.replay_plan())
    every_rank = replay_embedded(ts.traces, cfg, ts.comm_groups)
    assert fast.details["engine"] == engine and every_rank.details["engine"] == "full"
    assert fast.ranks == every_rank.ranks


def test_traces_round_trip_through_et_files(tmp_path):
    rg = split_program(parse_file(shared_path("mlir", "jax_example.mlir")))
    ts = build_traces(rg, [1.5e-6] * len(rg.regions), n_ranks=2)
    chakra.write_traces(tmp_path / "et" / "prog", ts.traces)
    back = chakra.read_traces(tmp_path / "et" / "prog")
    assert len(back) == 2
    for orig, dec in zip(ts.traces, back):
        assert [(n.id, n.type, n.data_deps, n.duration_micros, n.attrs) for n in orig] == \
               [(n.id, n.type, n.data_deps, n.duration_micros, n.attrs) for n in dec]


LOOP_WITH_ALLREDUCE = """
module @loop_ar attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 4 : i32} {
  func.func @main(%x: tensor<256x256xf32>) -> tensor<256x256xf32> {
    %c0 = stablehlo.constant dense<0> : tensor<i32>
    %r:2 = stablehlo.while(%i = %c0, %a = %x) : tensor<i32>, tensor<256x256xf32>
     cond {
      %lim = stablehlo.constant dense<3> : tensor<i32>
      %p = stablehlo.compare LT, %i, %lim, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %p : tensor<i1>
     } do {
      %one = stablehlo.constant dense<1> : tensor<i32>
      %n = stablehlo.add %i, %one : tensor<i32>
      %d = stablehlo.dot_general %a, %a, contracting_dims = [1] x [0] : (tensor<256x256xf32>, tensor<256x256xf32>) -> tensor<256x256xf32>
      %s = "stablehlo.all_reduce"(%d) <{replica_groups = dense<[[0, 1, 2, 3]]> : tensor<1x4xi64>}> ({
      ^bb0(%p0: tensor<f32>, %p1: tensor<f32>):
        %q = stablehlo.add %p0, %p1 : tensor<f32>
        stablehlo.return %q : tensor<f32>
      }) : (tensor<256x256xf32>) -> tensor<256x256xf32>
      stablehlo.return %n, %s : tensor<i32>, tensor<256x256xf32>
     }
    return %r#1 : tensor<256x256xf32>
  }
}
"""


def test_loop_bodies_with_collectives_are_unrolled_and_interleaved():
    from hespas_ml.replay import replay

    rg = split_program(parse_module(LOOP_WITH_ALLREDUCE, "loop_ar"))
    dot = next(r for r in rg.compute_regions() if any(rg.graph.ops[i].kind == "dot_general" for i in r.op_ids))
    seconds = [0.0] * len(rg.regions)
    seconds[dot.id] = 40e-6
    ts = build_traces(rg, seconds)
    nodes = {n.id: n for n in ts.traces[0]}
    is_dot = {nid for nid, rid in ts.region_of_node.items() if rid == dot.id}
    seq = ["dot" if n.id in is_dot else "ar" for n in ts.traces[0]
           if n.id in is_dot or n.type == chakra.COMM_COLL_NODE]
    assert seq == ["dot", "ar", "dot", "ar", "dot", "ar"]
    comps = [n for n in ts.traces[0] if n.id in is_dot]
    ars = [n for n in ts.traces[0] if n.type == chakra.COMM_COLL_NODE]
    assert [c.duration_micros for c in comps] == [40, 40, 40]     # one trip each, not 3 x 40 in one node
    # trip k's matmul waits for trip k-1's all-reduce (the loop-carried value)
    for k in (1, 2):
        assert ars[k - 1].id in comps[k].data_deps or any(
            ars[k - 1].id in nodes[d].data_deps for d in comps[k].data_deps)
    res = replay(ts.traces, "ring:4x100")
    one_ar = replay([[chakra.EtNode(0, "ar", chakra.COMM_COLL_NODE, [], [], 0,
                                    {"comm_type": chakra.ALL_REDUCE, "comm_size": 256 * 256 * 4})]] * 4,
                    "ring:4x100").step_time_s
    assert res.step_time_s == pytest.approx(3 * (40e-6 + one_ar), rel=1e-3)


def test_huge_unrolls_fall_back_to_rolled_loops(monkeypatch):
    import hespas_ml.replay.traces as traces_mod

    monkeypatch.setattr(traces_mod, "MAX_UNROLLED_INSTANCES", 2)
    rg = split_program(parse_module(LOOP_WITH_ALLREDUCE, "loop_ar"))
    ts = traces_mod.build_traces(rg, [1e-5] * len(rg.regions))
    ars = [n for n in ts.traces[0] if n.type == chakra.COMM_COLL_NODE]
    assert len(ars) == 3                                   # the collective still runs once per trip
    assert any("rolled up" in w for w in rg.graph.warnings)


PERMUTE_THEN_TWO_ALLREDUCES = """
module @order attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 4 : i32} {
  func.func @main(%x: tensor<512x512xf32>, %y: tensor<64x64xf32>) -> (tensor<512x512xf32>, tensor<64x64xf32>) {
    %p = "stablehlo.collective_permute"(%x) <{source_target_pairs = dense<[[0, 1]]> : tensor<1x2xi64>}> : (tensor<512x512xf32>) -> tensor<512x512xf32>
    %a = "stablehlo.all_reduce"(%p) <{replica_groups = dense<[[0, 1, 2, 3]]> : tensor<1x4xi64>}> ({
    ^bb0(%p0: tensor<f32>, %p1: tensor<f32>):
      %q = stablehlo.add %p0, %p1 : tensor<f32>
      stablehlo.return %q : tensor<f32>
    }) : (tensor<512x512xf32>) -> tensor<512x512xf32>
    %b = "stablehlo.all_reduce"(%y) <{replica_groups = dense<[[0, 1, 2, 3]]> : tensor<1x4xi64>}> ({
    ^bb0(%p0: tensor<f32>, %p1: tensor<f32>):
      %q = stablehlo.add %p0, %p1 : tensor<f32>
      stablehlo.return %q : tensor<f32>
    }) : (tensor<64x64xf32>) -> tensor<64x64xf32>
    return %a, %b : tensor<512x512xf32>, tensor<64x64xf32>
  }
}
"""


def test_collectives_keep_program_order_so_ranks_never_disagree():
    """Rank 1 waits for a receive before its first all-reduce while its second is ready at once; the other
    ranks are ready for the first. Issued by readiness, ranks would pair different collectives and hang."""
    from hespas_ml.replay import replay

    rg = split_program(parse_module(PERMUTE_THEN_TWO_ALLREDUCES, "order"))
    ts = build_traces(rg, [1e-6] * len(rg.regions))
    for trace in ts.traces:
        colls = [n for n in trace if n.type == chakra.COMM_COLL_NODE]
        assert colls[0].id in colls[1].ctrl_deps
    res = replay(ts.traces, "ring:4x50", backend="embedded")
    assert len(res.ranks) == 4 and res.step_time_s > 0


SOME_RANKS = """
module @some attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 4 : i32} {
  func.func @main(%x: tensor<256x256xf32>) -> tensor<256x256xf32> {
    %0 = stablehlo.tanh %x : tensor<256x256xf32>
    %1 = "stablehlo.all_reduce"(%0) ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %s = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }) {replica_groups = dense<[[0, 1], [2, 3]]> : tensor<2x2xi64>} : (tensor<256x256xf32>) -> tensor<256x256xf32>
    %2 = stablehlo.exponential %1 : tensor<256x256xf32>
    %3 = "stablehlo.all_reduce"(%2) ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %s = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }) {replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>} : (tensor<256x256xf32>) -> tensor<256x256xf32>
    %4 = stablehlo.sine %3 : tensor<256x256xf32>
    return %4 : tensor<256x256xf32>
  }
}
"""


def test_ranks_share_their_nodes_until_some_sit_a_collective_out():
    rg = split_program(parse_module(SOME_RANKS, "some"))
    ts = build_traces(rg, [2e-6] * len(rg.regions))
    t = ts.traces
    # the tanh and the first all-reduce run on every rank: one node object per node (per group for the
    # all-reduce); the second all-reduce is ranks 0 and 1's only, after which each rank has its own nodes
    assert t[0][0] is t[1][0] is t[2][0] is t[3][0]
    assert t[0][1] is t[1][1] and t[2][1] is t[3][1] and t[0][1] is not t[2][1]
    assert [[n.attrs.get("pg_name") for n in r if n.type == chakra.COMM_COLL_NODE] for r in t] == \
           [["1", "1"], ["1", "1"], ["2"], ["2"]]
    assert ts.comm_groups == {1: [0, 1], 2: [2, 3]}
    assert [len(r) for r in t] == [5, 5, 4, 4]
    assert t[0][-1] is not t[1][-1] and t[0][-1] == t[1][-1]
    # ranks 2 and 3 go on from the first all-reduce: the sine waits for what the exp waited for there
    exp2, sin2 = t[2][2], t[2][3]
    assert sin2.data_deps == [exp2.id]
    from hespas_ml.replay import replay
    res = replay(ts, "ring:4x100", backend="embedded")
    assert res.ranks[0].finish_ns > res.ranks[2].finish_ns


@pytest.mark.slow      # exports two zoo programs
def test_a_scanned_loops_edges_do_not_grow_with_its_trips():
    from hespas_ml.ingest import load_program

    spec = ("zoo:llama?layers={}&d_model=256&heads=8&vocab=1024&seq=64&batch=8&step=train&parallel=tp&devices=4"
            "&scan=true")
    widest = []
    for layers in (2, 6):
        rg = split_program(load_program(spec.format(layers)), "fusion")
        # regions of free ops only get no node: a loop trip's sinks among them stand for older trips
        ts = build_traces(rg, [1e-6 if r.flops or r.bytes else 0.0 for r in rg.regions])
        widest.append(max(len(n.data_deps) for n in ts.traces[0]))
    assert widest[0] == widest[1]


def test_ranks_that_run_alike_keep_one_trace_and_replay_as_every_rank_written_out():
    from hespas_ml.replay import load_system, replay
    from hespas_ml.replay.embedded import replay_embedded
    from hespas_ml.replay.embedded.config import ReplayConfig
    from hespas_ml.replay.embedded.symmetric import symmetric_plan

    rg = split_program(parse_file(shared_path("mlir", "test_split_replica_groups.mlir")))
    ts = build_traces(rg, [2e-6] * len(rg.regions))
    assert isinstance(ts.traces, chakra.RankTraces) and len(ts.traces) == 4
    written = [list(t) for t in ts.traces]                     # every rank's list, as plain lists
    assert [[(n.id, n.attrs.get("pg_name")) for n in t] for t in written] == \
           [[(n.id, n.attrs.get("pg_name")) for n in ts.traces[r]] for r in range(4)]
    system = load_system("ring:4x100")
    cfg = ReplayConfig(system)
    assert symmetric_plan(ts.traces, cfg, ts.comm_groups) == symmetric_plan(written, cfg, ts.comm_groups) is not None
    ours = replay(ts, system, backend="embedded")
    every = replay_embedded(written, system, ts.comm_groups, engine="full")
    assert [(r.finish_ns, r.exposed_comm_ns) for r in ours.ranks] == [(r.finish_ns, r.exposed_comm_ns) for r in every.ranks]
