"""Splitting programs into compute regions and collectives (real programs, real cost model)."""
from __future__ import annotations

import pytest

from conftest import shared_path
from hespas_ml.ingest.stablehlo import parse_file, parse_module
from hespas_ml.split.regions import SplitError, split_program

SHARED_PROGRAMS = ["convolution.mlir", "custom_call_topk.mlir", "jax_example.mlir",
                   "resnet_50_inference_step_4_devices_1024_batch.mlir", "test_dependency_graph.mlir",
                   "test_no_comm_graph.mlir", "test_split_replica_groups.mlir", "maxtext/llama3-100m-4dev.mlir"]


def _check_dag(rg):
    """Every op in exactly one region; dependencies point to earlier regions; collectives stand alone."""
    covered = sorted(i for r in rg.regions for i in r.op_ids)
    assert covered == list(range(len(rg.graph.ops)))
    for r in rg.regions:
        assert all(d < r.id for d in r.deps), (r.id, r.deps)
        if r.kind == "collective":
            assert len(r.op_ids) == 1 and rg.graph.ops[r.op_ids[0]].is_collective
        else:
            assert not any(rg.graph.ops[i].is_collective for i in r.op_ids)


@pytest.mark.parametrize("name", SHARED_PROGRAMS)
@pytest.mark.parametrize("split", ["fusion", "linear", "individual"])
def test_every_shared_program_splits_into_a_valid_dag(name, split):
    graph = parse_file(shared_path("mlir", name))
    rg = split_program(graph, split)
    _check_dag(rg)
    n_coll = sum(1 for op in graph.ops if op.is_collective)
    assert len(rg.collectives()) == n_coll


def test_dependency_graph_orders_collective_between_its_producer_and_consumers():
    rg = split_program(parse_file(shared_path("mlir", "test_dependency_graph.mlir")), "individual")
    ops = rg.graph.ops
    (coll,) = rg.collectives()
    dot_region = next(r for r in rg.regions if ops[r.op_ids[0]].kind == "dot_general")
    tanh_region = next(r for r in rg.regions if ops[r.op_ids[0]].kind == "tanh")
    assert coll.deps == [dot_region.id]
    assert coll.id in tanh_region.deps
    assert coll.collective.kind == "all_reduce"
    assert coll.collective.comm_bytes == 128 * 512 * 4


def test_split_replica_groups_keep_their_groups():
    rg = split_program(parse_file(shared_path("mlir", "test_split_replica_groups.mlir")))
    first, second = rg.collectives()
    assert first.collective.groups == [[0, 1], [2, 3]]
    assert second.collective.groups == []          # one group of all 4 devices = the global communicator


def test_fusion_split_counts_far_less_memory_traffic_than_op_by_op():
    graph = parse_file(shared_path("mlir", "resnet_50_inference_step_4_devices_1024_batch.mlir"))
    fused = split_program(graph, "fusion")
    unfused = split_program(graph, "linear")
    fused_bytes = sum(r.bytes * r.count for r in fused.compute_regions())
    unfused_bytes = sum(r.bytes * r.count for r in unfused.compute_regions())
    assert unfused_bytes > 4 * fused_bytes
    # FLOPs do not depend on the split
    assert sum(r.flops for r in fused.compute_regions()) == pytest.approx(
        sum(r.flops for r in unfused.compute_regions()), rel=1e-9)
    # one kernel per fusion region, ~one per conv
    assert 53 <= len(fused.compute_regions()) < 400


def test_linear_split_makes_runs_between_collectives():
    rg = split_program(parse_file(shared_path("mlir", "test_split_replica_groups.mlir")), "linear")
    kinds = [r.kind for r in rg.regions]
    assert kinds == ["compute", "collective", "compute", "collective", "compute"]
    assert all(r.deps == [r.id - 1] for r in rg.regions[1:])


CONV_BIAS_RELU = """
func.func @main(%x: tensor<8x32x32x16xf32>, %w: tensor<3x3x16x32xf32>, %b: tensor<32xf32>) -> tensor<8x32x32x32xf32> {
  %0 = stablehlo.convolution(%x, %w) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f],
       window = {stride = [1, 1], pad = [[1, 1], [1, 1]]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64}
       : (tensor<8x32x32x16xf32>, tensor<3x3x16x32xf32>) -> tensor<8x32x32x32xf32>
  %1 = stablehlo.broadcast_in_dim %b, dims = [3] : (tensor<32xf32>) -> tensor<8x32x32x32xf32>
  %2 = stablehlo.add %0, %1 : tensor<8x32x32x32xf32>
  %z = stablehlo.constant dense<0.0> : tensor<8x32x32x32xf32>
  %3 = stablehlo.maximum %2, %z : tensor<8x32x32x32xf32>
  return %3 : tensor<8x32x32x32xf32>
}
"""


def test_conv_epilogue_fuses_into_one_kernel_with_boundary_bytes_only():
    graph = parse_module(CONV_BIAS_RELU, "conv_bias_relu")
    rg = split_program(graph, "fusion")
    (region,) = rg.compute_regions()
    (kernel,) = region.kernels
    x, w, b, out = 8 * 32 * 32 * 16 * 4, 3 * 3 * 16 * 32 * 4, 32 * 4, 8 * 32 * 32 * 32 * 4
    assert kernel.bytes == x + w + b + out          # intermediates never touch memory
    # XLA counts only the kernel taps that land inside the (unpadded) input: per spatial dim,
    # 30 outputs see all 3 taps and the 2 border outputs see 2
    taps = (30 * 3 + 2 * 2) ** 2
    assert kernel.matrix_flops == 2 * 8 * 32 * 16 * taps
    assert kernel.vector_flops > 0
    unfused = split_program(graph, "individual")
    assert sum(r.bytes for r in unfused.compute_regions()) > 2.5 * kernel.bytes


LOOP = """
func.func @main(%x: tensor<64x64xf32>) -> tensor<64x64xf32> {
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %r:2 = stablehlo.while(%i = %c0, %a = %x) : tensor<i32>, tensor<64x64xf32>
   cond {
    %lim = stablehlo.constant dense<12> : tensor<i32>
    %p = stablehlo.compare LT, %i, %lim, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
    stablehlo.return %p : tensor<i1>
   } do {
    %one = stablehlo.constant dense<1> : tensor<i32>
    %n = stablehlo.add %i, %one : tensor<i32>
    %d = stablehlo.dot_general %a, %a, contracting_dims = [1] x [0] : (tensor<64x64xf32>, tensor<64x64xf32>) -> tensor<64x64xf32>
    %t = stablehlo.tanh %d : tensor<64x64xf32>
    stablehlo.return %n, %t : tensor<i32>, tensor<64x64xf32>
   }
  return %r#1 : tensor<64x64xf32>
}
"""


def test_loop_body_regions_run_trip_count_times():
    rg = split_program(parse_module(LOOP, "loop"), "fusion")
    dots = [r for r in rg.compute_regions() if any(rg.graph.ops[i].kind == "dot_general" for i in r.op_ids)]
    assert len(dots) == 1 and dots[0].count == 12
    assert dots[0].flops == 2 * 64 ** 3        # per execution


def test_unknown_split_is_a_clean_error():
    graph = parse_module(CONV_BIAS_RELU, "x")
    with pytest.raises(SplitError, match="unknown split"):
        split_program(graph, "greedy")


FLIPPED_KERNEL_CONV = """
func.func @main(%dy: tensor<4x16x16x32xf32>, %w: tensor<3x3x16x32xf32>) -> tensor<4x16x16x16xf32> {
  %r = stablehlo.reverse %w, dims = [0, 1] : tensor<3x3x16x32xf32>
  %0 = stablehlo.convolution(%dy, %r) dim_numbers = [b, 0, 1, f]x[0, 1, o, i]->[b, 0, 1, f],
       window = {stride = [1, 1], pad = [[1, 1], [1, 1]]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64}
       : (tensor<4x16x16x32xf32>, tensor<3x3x16x32xf32>) -> tensor<4x16x16x16xf32>
  return %0 : tensor<4x16x16x16xf32>
}
"""


def test_flipped_kernel_of_a_backward_data_conv_folds_into_the_conv():
    rg = split_program(parse_module(FLIPPED_KERNEL_CONV, "bwd_data"), "fusion")
    (region,) = rg.compute_regions()
    assert sorted(rg.graph.ops[i].kind for i in region.op_ids) == ["convolution", "reverse"]
    dy, w, out = 4 * 16 * 16 * 32 * 4, 3 * 3 * 16 * 32 * 4, 4 * 16 * 16 * 16 * 4
    assert region.kernels[0].bytes == dy + w + out


ROW_PICK = """
func.func @main(%x: tensor<64x1024xf32>, %m: tensor<64xf32>) -> {RESULTS} {
  %b = stablehlo.broadcast_in_dim %m, dims = [0] : (tensor<64xf32>) -> tensor<64x1024xf32>
  %s = stablehlo.subtract %x, %b : tensor<64x1024xf32>
  %e = stablehlo.exponential %s : tensor<64x1024xf32>
  {PICK}
  %r = stablehlo.reshape %g : (tensor<64x1xf32>) -> tensor<64xf32>
  %n = stablehlo.negate %r : tensor<64xf32>
  return {RETURN}
}
"""
ONE_COLUMN = "%g = stablehlo.slice %e [0:64, 7:8] : (tensor<64x1024xf32>) -> tensor<64x1xf32>"
HALVES = """%lo = stablehlo.slice %e [0:64, 0:512] : (tensor<64x1024xf32>) -> tensor<64x512xf32>
  %hi = stablehlo.slice %e [0:64, 512:1024] : (tensor<64x1024xf32>) -> tensor<64x512xf32>
  %sum = stablehlo.add %lo, %hi : tensor<64x512xf32>
  {READ}"""
ONE_COLUMN_OF_HALVES = HALVES.replace(
    "{READ}", "%g = stablehlo.slice %sum [0:64, 0:1] : (tensor<64x512xf32>) -> tensor<64x1xf32>")


def _row_pick(pick: str, also: tuple[str, str] | None = None):
    """The one kernel of ROW_PICK with ``pick`` choosing %g; ``also`` = (value, type) returned as well."""
    results, ret = "tensor<64xf32>", "%n : tensor<64xf32>"
    if also:
        results = f"(tensor<64xf32>, {also[1]})"
        ret = f"%n, {also[0]} : tensor<64xf32>, {also[1]}"
    text = ROW_PICK.replace("{PICK}", pick).replace("{RESULTS}", results).replace("{RETURN}", ret)
    (region,) = split_program(parse_module(text, "row_pick"), "fusion").compute_regions()
    (kernel,) = region.kernels
    return kernel


def test_fused_kernel_computes_only_what_its_slices_and_gathers_read():
    # exp(x - max) then one column: XLA evaluates 64 elements, not 64 x 1024 (a log-softmax + label gather)
    kernel = _row_pick(ONE_COLUMN)
    row = 64 * 4
    assert kernel.vector_flops == 64 + 64          # subtract and negate, at the picked positions
    assert kernel.transcendentals == 64
    assert kernel.bytes == row + row + row         # the picked part of x, all of m (broadcast), the result


def test_demand_adds_up_over_readers_and_is_whole_where_a_result_leaves_the_kernel():
    # column 0 of lo + hi: columns 0 and 512 of exp(...), through two slices
    assert _row_pick(ONE_COLUMN_OF_HALVES).transcendentals == 2 * 64
    # lo + hi also leaves the kernel: every element of exp(...) is needed, once
    whole = _row_pick(ONE_COLUMN_OF_HALVES, also=("%sum", "tensor<64x512xf32>"))
    assert whole.transcendentals == 64 * 1024
    assert whole.bytes == 64 * 1024 * 4 + 64 * 4 + 64 * 512 * 4 + 64 * 4
    # the difference also leaves the kernel: it is computed and written whole, exp still only where read
    kept = _row_pick(ONE_COLUMN, also=("%s", "tensor<64x1024xf32>"))
    assert kept.transcendentals == 64
    assert kept.vector_flops == 64 * 1024 + 64
    assert kept.bytes == 2 * 64 * 1024 * 4 + 64 * 4 + 64 * 4


ACCUMULATE = """
func.func @main(%acc: tensor<8x256x256xf32>, %g: tensor<1x256x256xf32>, %i: tensor<i32>, %acc2: tensor<8x256x256xf32>,
                %acc3: tensor<8x256x256xf32>)
    -> (tensor<8x256x256xf32>, tensor<8x256x256xf32>, tensor<8x256x256xf32>) {
  %z = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %zeros = stablehlo.broadcast_in_dim %z, dims = [] : (tensor<f32>) -> tensor<8x256x256xf32>
  %c0 = stablehlo.constant dense<0> : tensor<i32>
  %u = stablehlo.dynamic_update_slice %zeros, %g, %i, %c0, %c0 : (tensor<8x256x256xf32>, tensor<1x256x256xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<8x256x256xf32>
  %sum = stablehlo.add %acc, %u : tensor<8x256x256xf32>
  %one = stablehlo.constant dense<1.000000e+00> : tensor<f32>
  %ones = stablehlo.broadcast_in_dim %one, dims = [] : (tensor<f32>) -> tensor<8x256x256xf32>
  %v = stablehlo.dynamic_update_slice %ones, %g, %i, %c0, %c0 : (tensor<8x256x256xf32>, tensor<1x256x256xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<8x256x256xf32>
  %other = stablehlo.add %acc2, %v : tensor<8x256x256xf32>
  %e = stablehlo.exponential %g : tensor<1x256x256xf32>
  %padded = stablehlo.pad %e, %z, low = [3, 0, 0], high = [4, 0, 0], interior = [0, 0, 0] : (tensor<1x256x256xf32>, tensor<f32>) -> tensor<8x256x256xf32>
  %third = stablehlo.add %acc3, %padded : tensor<8x256x256xf32>
  return %sum, %other, %third : tensor<8x256x256xf32>, tensor<8x256x256xf32>, tensor<8x256x256xf32>
}
"""


def test_a_window_added_into_zeros_is_an_in_place_update_of_the_sum():
    """``acc + dynamic_update_slice(zeros, g, i)`` or ``acc + pad(g, 0)`` (the gradient of a sliced operand
    summed over a loop) is one kernel touching only the window, as XLA runs it; into anything but zeros the
    update is a whole tensor added."""
    rg = split_program(parse_module(ACCUMULATE, "accumulate"), "fusion")
    window, whole = 256 * 256 * 4, 8 * 256 * 256 * 4
    kernels = {rg.graph.ops[max(k.op_ids)].id: k for r in rg.compute_regions() for k in r.kernels}
    by_kind = {tuple(sorted(rg.graph.ops[i].kind for i in k.op_ids if rg.graph.ops[i].kind != "constant")): k
               for k in kernels.values()}
    inplace = by_kind[("add", "broadcast_in_dim", "dynamic_update_slice")]
    assert 3 * window <= inplace.bytes <= 3 * window + 16   # the window read and written, g and an index
    assert inplace.vector_flops == 256 * 256
    added = by_kind[("add",)]
    assert added.bytes == 3 * whole                       # acc2 and the updated ones read, the sum written
    # a static window (the gradient of a slice: pad with zeros) the same way, its producer fused in
    padded = by_kind[("add", "exponential", "pad")]
    assert 3 * window <= padded.bytes <= 3 * window + 16 and padded.transcendentals == 256 * 256


def test_a_window_added_to_itself_is_an_ordinary_add():
    """``pad(g, 0) + pad(g, 0)`` (a generated region drew it) has no accumulator to update in place: it
    splits as any element-wise add of a fused pad, its bytes the input read and the sum written."""
    text = """func.func @main(%g: tensor<4x8xf32>) -> tensor<4x10xf32> {
  %z = stablehlo.constant dense<0.0> : tensor<f32>
  %p = stablehlo.pad %g, %z, low = [0, 1], high = [0, 1], interior = [0, 0] : (tensor<4x8xf32>, tensor<f32>) -> tensor<4x10xf32>
  %s = stablehlo.add %p, %p : tensor<4x10xf32>
  return %s : tensor<4x10xf32>
}"""
    rg = split_program(parse_module(text, "self_add"), "fusion")
    (kernel,) = [k for r in rg.compute_regions() for k in r.kernels]
    assert kernel.bytes == 4 * 8 * 4 + 4 * 10 * 4 and kernel.vector_flops == 4 * 10

