"""The ``merged`` split: elementwise kernels recomputed inside the loop and reduction kernels that read them
(XLA's fusion merger), on real programs and the real cost model."""
from __future__ import annotations

import pytest

from conftest import shared_path
from hespas_ml.ingest.stablehlo import parse_file, parse_module
from hespas_ml.pipeline import ingest
from hespas_ml.split.memory import memory
from hespas_ml.split.regions import split_program
from hespas_ml.split.signature import escaping_ops

N = 4096
# Batch-norm statistics of a half-precision activation: the f32 copy of x feeds two reductions and a
# normalisation. Fused op by op into kernels, the convert is a kernel of its own whose f32 result all
# three read; merged, each of them converts x itself.
BN_STATS = """
func.func @main(%x: tensor<4096xf16>) -> (tensor<f32>, tensor<f32>, tensor<4096xf16>) {
  %c = stablehlo.convert %x : (tensor<4096xf16>) -> tensor<4096xf32>
  %z = stablehlo.constant dense<0.0> : tensor<f32>
  %s = stablehlo.reduce(%c init: %z) applies stablehlo.add across dimensions = [0] : (tensor<4096xf32>, tensor<f32>) -> tensor<f32>
  %q = stablehlo.multiply %c, %c : tensor<4096xf32>
  %ss = stablehlo.reduce(%q init: %z) applies stablehlo.add across dimensions = [0] : (tensor<4096xf32>, tensor<f32>) -> tensor<f32>
  %m = stablehlo.broadcast_in_dim %s, dims = [] : (tensor<f32>) -> tensor<4096xf32>
  %d = stablehlo.subtract %c, %m : tensor<4096xf32>
  %y = stablehlo.convert %d : (tensor<4096xf32>) -> tensor<4096xf16>
  return %s, %ss, %y : tensor<f32>, tensor<f32>, tensor<4096xf16>
}
"""


def _check(rg):
    """Every op in at least one region, and in more than one only when it is recomputed there; recomputed
    ops never leave their region; dependencies point to earlier regions."""
    holders: dict[int, int] = {}
    for r in rg.regions:
        for i in r.op_ids:
            holders[i] = holders.get(i, 0) + 1
        assert not (r.recomputed & escaping_ops(r))
        assert all(d < r.id for d in r.deps), (r.id, r.deps)
    assert sorted(holders) == list(range(len(rg.graph.ops)))
    for i, n in holders.items():
        copies = sum(i in r.recomputed for r in rg.regions)
        assert n == 1 or copies == n, (i, n, copies)


def test_a_shared_convert_is_recomputed_by_each_reader_and_never_written():
    graph = parse_module(BN_STATS, "bn_stats")
    fused, merged = split_program(graph, "fusion"), split_program(graph, "merged")
    _check(merged)
    f16, f32, scalar = 2 * N, 4 * N, 4
    reduce = 2 * scalar          # a reduction reads its initial value and writes its result
    # fusion: convert (read f16, write f32); sum and sum of squares (each reads f32); x - mean (reads f32 and
    # the mean, writes f16)
    assert sum(r.bytes for r in fused.compute_regions()) == (f16 + f32) + (f32 + reduce) + (f32 + reduce) \
        + (f32 + scalar + f16)
    # merged: each of the three reads x in f16 instead
    assert sum(r.bytes for r in merged.compute_regions()) == (f16 + reduce) + (f16 + reduce) + (f16 + scalar + f16)
    convert = next(op.id for op in graph.ops if op.kind == "convert")
    assert sum(convert in r.op_ids for r in merged.compute_regions()) == 3
    assert len(merged.compute_regions()) == len(fused.compute_regions()) - 1
    # the normalisation still waits for the sum: its dependency runs through the recomputed convert's input
    ops = graph.ops
    norm = next(r for r in merged.compute_regions() if any(ops[i].kind == "subtract" for i in r.op_ids))
    total = next(r for r in merged.compute_regions()
                 if any(ops[i].kind == "reduce" for i in r.op_ids) and not any(ops[i].kind == "multiply" for i in r.op_ids))
    assert total.id in norm.deps


def test_a_producer_that_a_dot_reads_or_that_is_expensive_stays_a_kernel_of_its_own():
    for text in (BN_STATS.replace("%q = stablehlo.multiply %c, %c : tensor<4096xf32>",
                                  "%q = stablehlo.tanh %c : tensor<4096xf32>").replace(
                     "%c = stablehlo.convert %x : (tensor<4096xf16>) -> tensor<4096xf32>",
                     "%c0 = stablehlo.convert %x : (tensor<4096xf16>) -> tensor<4096xf32>\n"
                     "  %c = stablehlo.tanh %c0 : tensor<4096xf32>"),):
        graph = parse_module(text, "expensive")
        merged = split_program(graph, "merged")
        _check(merged)
        tanh = [op.id for op in graph.ops if op.kind == "tanh"]
        assert not any(i in r.recomputed for r in merged.regions for i in tanh)
    dot_reader = """
func.func @main(%x: tensor<64x64xf16>, %w: tensor<64x64xf32>) -> (tensor<64x64xf32>, tensor<f32>) {
  %c = stablehlo.convert %x : (tensor<64x64xf16>) -> tensor<64x64xf32>
  %d = stablehlo.dot_general %c, %w, contracting_dims = [1] x [0] : (tensor<64x64xf32>, tensor<64x64xf32>) -> tensor<64x64xf32>
  %z = stablehlo.constant dense<0.0> : tensor<f32>
  %s = stablehlo.reduce(%c init: %z) applies stablehlo.add across dimensions = [0, 1] : (tensor<64x64xf32>, tensor<f32>) -> tensor<f32>
  return %d, %s : tensor<64x64xf32>, tensor<f32>
}
"""
    graph = parse_module(dot_reader, "dot_reader")
    merged, fused = split_program(graph, "merged"), split_program(graph, "fusion")
    assert not any(r.recomputed for r in merged.regions)
    assert [r.bytes for r in merged.compute_regions()] == [r.bytes for r in fused.compute_regions()]


XLA_FUSED = """
func.func @main(%x: tensor<4096xf16>) -> (tensor<f32>, tensor<f32>) {
  %c = "mhlo.fusion"(%x) <{fusion_kind = #mhlo<fusion_kind kLoop>}> ({
  ^bb0(%p: tensor<4096xf16>):
    %1 = stablehlo.convert %p : (tensor<4096xf16>) -> tensor<4096xf32>
    mhlo.return %1 : tensor<4096xf32>
  }) : (tensor<4096xf16>) -> tensor<4096xf32>
  %s = "mhlo.fusion"(%c) <{fusion_kind = #mhlo<fusion_kind kInput>}> ({
  ^bb0(%p: tensor<4096xf32>):
    %z = stablehlo.constant dense<0.0> : tensor<f32>
    %2 = stablehlo.reduce(%p init: %z) applies stablehlo.add across dimensions = [0] : (tensor<4096xf32>, tensor<f32>) -> tensor<f32>
    mhlo.return %2 : tensor<f32>
  }) : (tensor<4096xf32>) -> tensor<f32>
  %t = "mhlo.fusion"(%c) <{fusion_kind = #mhlo<fusion_kind kInput>}> ({
  ^bb0(%p: tensor<4096xf32>):
    %z = stablehlo.constant dense<0.0> : tensor<f32>
    %q = stablehlo.multiply %p, %p : tensor<4096xf32>
    %3 = stablehlo.reduce(%q init: %z) applies stablehlo.add across dimensions = [0] : (tensor<4096xf32>, tensor<f32>) -> tensor<f32>
    mhlo.return %3 : tensor<f32>
  }) : (tensor<4096xf32>) -> tensor<f32>
  return %s, %t : tensor<f32>, tensor<f32>
}
"""


def test_programs_xla_fused_already_keep_their_kernels():
    graph = parse_module(XLA_FUSED, "xla_fused")
    fused, merged = split_program(graph, "fusion"), split_program(graph, "merged")
    assert [r.op_ids for r in merged.regions] == [r.op_ids for r in fused.regions]
    assert len(fused.compute_regions()) == 3
    assert not any(r.recomputed for r in merged.regions)
    # the same statistics written op by op are merged
    unfused = split_program(parse_module(BN_STATS, "bn_stats"), "merged")
    assert any(r.recomputed for r in unfused.regions)


def test_resnet_training_step_moves_fewer_bytes_and_keeps_no_more_in_memory():
    graph = ingest("zoo:resnet?depth=18&width=0.25&image=32&classes=10&batch=8&step=train")
    fused, merged = split_program(graph, "fusion"), split_program(graph, "merged")
    _check(merged)
    f_bytes = sum(r.bytes * r.count for r in fused.compute_regions())
    m_bytes = sum(r.bytes * r.count for r in merged.compute_regions())
    assert m_bytes < 0.9 * f_bytes
    assert sum(r.flops for r in merged.compute_regions()) >= sum(r.flops for r in fused.compute_regions())
    assert sum(bool(r.recomputed) for r in merged.regions) > 0
    assert memory(merged).intermediates <= memory(fused).intermediates
    # the same arguments, whatever the split
    assert memory(merged).arguments == memory(fused).arguments


@pytest.mark.parametrize("name", ["convolution.mlir", "jax_example.mlir", "test_dependency_graph.mlir",
                                  "resnet_50_inference_step_4_devices_1024_batch.mlir"])
def test_shared_programs_split_merged_into_valid_regions(name):
    graph = parse_file(shared_path("mlir", name))
    rg = split_program(graph, "merged")
    _check(rg)
    assert len(rg.collectives()) == sum(op.is_collective for op in graph.ops)
