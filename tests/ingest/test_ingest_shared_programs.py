"""Every program in ../shared/mlir ingests, with the structure its authors describe."""
from __future__ import annotations

import pytest

from conftest import SHARED_DIR, shared_path
from hespas_ml.ingest import OpGraph, load_program, parse_file

ALL_PROGRAMS = sorted(p.relative_to(SHARED_DIR / "mlir").as_posix()
                      for p in (SHARED_DIR / "mlir").rglob("*.mlir")) if (SHARED_DIR / "mlir").is_dir() else []
_CACHE: dict[str, OpGraph] = {}


def graph(rel: str) -> OpGraph:
    if rel not in _CACHE:
        _CACHE[rel] = parse_file(shared_path("mlir", *rel.split("/")))
    return _CACHE[rel]


def collectives(g: OpGraph, kind: str):
    return [op for op in g.ops if op.kind == kind]


def test_the_shared_folder_has_the_expected_programs():
    shared_path("mlir")
    assert "maxtext/llama3-100m-4dev.mlir" in ALL_PROGRAMS
    assert len(ALL_PROGRAMS) >= 8


@pytest.mark.parametrize("rel", ALL_PROGRAMS)
def test_every_shared_program_ingests(rel):
    g = graph(rel)
    assert g.ops, rel
    assert g.source.endswith(rel.split("/")[-1])
    # A well-formed flat graph: operands point backwards (or at program inputs).
    for op in g.ops:
        assert all(-1 <= src < op.id for src in op.operands), (rel, op)
        assert op.count >= 0
        for group in op.attrs.get("replica_groups", []):
            assert group and all(0 <= d < g.n_devices for d in group), (rel, op)


def test_resnet50_inference():
    g = graph("resnet_50_inference_step_4_devices_1024_batch.mlir")
    assert g.op_counts()["convolution"] == 53
    assert g.n_devices == 4 and g.num_replicas == 4
    # The 49 func.call sites are inlined: ops come from named call paths, not just main.
    assert any(op.func != "main" for op in g.ops)
    convs = collectives(g, "convolution")
    assert all(set(op.attrs["dimension_numbers"]) >= {"input_batch", "kernel_spatial", "output_feature"}
               for op in convs)
    first = convs[0]
    assert first.result_types[0].dtype == "f16"          # per-device (pmap) shapes: 256 images
    assert first.operand_types[0].shape[0] == 256


def test_split_replica_groups():
    g = graph("test_split_replica_groups.mlir")
    groups = [op.attrs["replica_groups"] for op in collectives(g, "all_reduce")]
    assert groups == [[[0, 1], [2, 3]], [[0, 1, 2, 3]]]
    assert g.n_devices == 4


def test_custom_call_topk_is_counted_unmodelled_with_a_warning():
    g = graph("custom_call_topk.mlir")
    calls = collectives(g, "custom_call")
    assert len(calls) == 1
    assert calls[0].attrs["call_target_name"] == "TopK"
    assert [str(t) for t in calls[0].result_types] == ["2048x2xbf16", "2048x2xi32"]   # tuple flattened
    assert any("TopK" in w and "not modelled" in w for w in g.warnings)
    # The tuple's elements are taken out by get_tuple_element ops that consume the custom call.
    gtes = collectives(g, "get_tuple_element")
    assert [op.operands for op in gtes] == [[calls[0].id], [calls[0].id]]


def test_maxtext_llama_partitioned_training_step():
    g = graph("maxtext/llama3-100m-4dev.mlir")
    counts = g.op_counts()
    assert counts["all_gather"] == 100
    assert counts["all_reduce"] == 272
    assert g.n_devices == 4
    assert counts["copy"] > 0                               # mhlo.copy kept as an op
    handles = [op.attrs["channel_handle"]["handle"] for op in g.ops if op.is_collective]
    assert len(handles) == len(set(handles)) == 372        # every collective has its own channel


def test_jax_example_and_dependency_graph():
    g = graph("jax_example.mlir")
    assert g.op_counts()["all_reduce"] == 6
    assert g.op_counts()["dot_general"] == 8
    dep = graph("test_dependency_graph.mlir")
    by_kind = {op.kind: op for op in dep.ops}
    # tanh consumes the all_reduce, which consumes the matmul
    assert by_kind["tanh"].operands == [by_kind["all_reduce"].id]
    assert by_kind["all_reduce"].operands == [by_kind["dot_general"].id]
    assert by_kind["dot_general"].operands == [-1, -1]
    assert by_kind["dot_general"].attrs["dot_dimension_numbers"]["lhs_contract"] == [1]
    assert not any(op.is_collective for op in graph("test_no_comm_graph.mlir").ops)


def test_convolution_window_attributes_are_decoded():
    g = graph("convolution.mlir")
    (conv,) = g.ops
    assert conv.attrs["window_strides"] == [4, 4]
    assert conv.attrs["lhs_dilation"] == [2, 2]
    assert conv.attrs["dimension_numbers"]["kernel_input_feature"] == 2


def test_load_program_reads_a_shared_path():
    path = shared_path("mlir", "test_split_replica_groups.mlir")
    assert load_program(path).op_counts() == load_program(str(path)).op_counts()
