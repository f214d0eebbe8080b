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


def test_traces_round_trip_through_et_files(tmp_path):
    rg = split_program(parse_file(shared_path("mlir", "jax_example.mlir")))
    ts = build_traces(rg, [1.5e-6] * len(rg.regions), n_ranks=2)
    chakra.write_traces(tmp_path / "et" / "prog", ts.traces)
    back = chakra.read_traces(tmp_path / "et" / "prog")
    assert len(back) == 2
    for orig, dec in zip(ts.traces, back):
        assert [(n.id, n.type, n.data_deps, n.duration_micros, n.attrs) for n in orig] == \
               [(n.id, n.type, n.data_deps, n.duration_micros, n.attrs) for n in dec]
