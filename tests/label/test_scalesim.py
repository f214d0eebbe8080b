"""The SCALE-Sim fidelity (hespas_ml.label.scalesim, .scalesim_worker) on the real scalesim package.

References are SCALE-Sim itself: its public file route (config + topology CSV + ``run_scale``, reading
COMPUTE_REPORT.csv) for GEMMs and convolutions, its compute-only demand matrices for the fold formula, and
``op_cost`` for the FLOPs of the op → GEMM mapping. Simulations are kept tiny (8×8 arrays, a few hundred
cycles) except where a budget must be overrun, which is done with sub-second budgets.
"""
from __future__ import annotations

import csv
import math
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import shared_path
from hespas_ml.ingest.stablehlo import parse_file, parse_module
from hespas_ml.costs import op_cost
from hespas_ml.label.fidelity import FidelityError
from hespas_ml.label.roofline import RooflineFidelity
from hespas_ml.label.scalesim import (GemmWork, LayerCache, ScaleSimFidelity, array_config, layer_key, matrix_work,
                                      passes, split_work, work_flops)
from hespas_ml.label.scalesim_worker import (ArrayConfig, Budget, Gemm, analytical_cycles, choose_mode,
                                             predict_cost, run_isolated, simulate)
from hespas_ml.label.targets import load_target, target_from_mapping
from hespas_ml.split.regions import split_program

RESNET = "resnet_50_inference_step_4_devices_1024_batch.mlir"


# -- helpers ---------------------------------------------------------------------------------------------

def array_target(rows: int = 8, cols: int = 8, count: int = 1, dataflow: str = "ws", sram_kb: int = 64,
                 clock_hz: float = 1e9, mem_bw: float = 64e9):
    """A made-up accelerator with ``count`` arrays whose bf16 matrix rate is exactly the arrays' rate."""
    nominal = 2.0 * rows * cols * count * clock_hz
    return target_from_mapping({
        "name": f"sa{rows}x{cols}x{count}-{dataflow}", "matrix_flops": {"bf16": nominal, "f32": nominal / 6},
        "vector_flops": {"f32": nominal / 16}, "mem_bw": mem_bw, "mem_capacity": 2**34, "onchip_mem": 2**20,
        "clock_hz": clock_hz, "sources": ["test"],
        "systolic": {"rows": rows, "cols": cols, "count": count, "dataflow": dataflow,
                     "ifmap_sram_kb": sram_kb, "filter_sram_kb": sram_kb, "ofmap_sram_kb": sram_kb},
    }, "test")


def program(body: str, args: str, result: str) -> str:
    return f"func.func @main({args}) -> {result} {{\n{body}\n}}\n"


def dot_program(m: int, n: int, k: int, dtype: str = "f32", batch: int = 0) -> str:
    b = f"{batch}x" if batch else ""
    dims = ("batching_dims = [0] x [0], contracting_dims = [2] x [1]" if batch
            else "contracting_dims = [1] x [0]")
    return program(f"  %0 = stablehlo.dot_general %a, %b, {dims} : (tensor<{b}{m}x{k}x{dtype}>, "
                   f"tensor<{b}{k}x{n}x{dtype}>) -> tensor<{b}{m}x{n}x{dtype}>\n"
                   f"  return %0 : tensor<{b}{m}x{n}x{dtype}>",
                   f"%a: tensor<{b}{m}x{k}x{dtype}>, %b: tensor<{b}{k}x{n}x{dtype}>", f"tensor<{b}{m}x{n}x{dtype}>")


def conv_program(h: int, w: int, c: int, kh: int, kw: int, f: int, stride: int, pad: int) -> str:
    oh, ow = (h + 2 * pad - kh) // stride + 1, (w + 2 * pad - kw) // stride + 1
    x, k, y = f"tensor<1x{h}x{w}x{c}xf32>", f"tensor<{kh}x{kw}x{c}x{f}xf32>", f"tensor<1x{oh}x{ow}x{f}xf32>"
    body = (f"  %0 = stablehlo.convolution(%x, %k) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], "
            f"window = {{stride = [{stride}, {stride}], pad = [[{pad}, {pad}], [{pad}, {pad}]]}} "
            f"{{batch_group_count = 1 : i64, feature_group_count = 1 : i64}} : ({x}, {k}) -> {y}\n"
            f"  return %0 : {y}")
    return program(body, f"%x: {x}, %k: {k}", y)


def regions_of(text: str):
    rg = split_program(parse_module(text))
    return rg, rg.compute_regions()


def matrix_op(graph):
    return next(op for op in graph.ops if op.kind in ("dot_general", "convolution"))


def scalesim_file_route(tmp: Path, array: ArrayConfig, topology_row: str, gemm: bool,
                        offsets: tuple[int, int, int]) -> dict[str, float]:
    """One layer through SCALE-Sim's own file-based entry point; its COMPUTE_REPORT row."""
    from scalesim.scale_sim import scalesim

    bw = array.dram_words_per_cycle
    config = tmp / "arch.cfg"
    config.write_text(f"""[general]
run_name = ref
[architecture_presets]
ArrayHeight = {array.rows}
ArrayWidth = {array.cols}
ifmapsramszkB = {array.ifmap_kwords}
filtersramszkB = {array.filter_kwords}
ofmapsramszkB = {array.ofmap_kwords}
IfmapOffset = {offsets[0]}
FilterOffset = {offsets[1]}
OfmapOffset = {offsets[2]}
Bandwidth = {bw}
Dataflow = {array.dataflow}
ReadRequestBuffer = 32
WriteRequestBuffer = 32
[layout]
IfmapCustomLayout = False
IfmapSRAMBankBandwidth = {bw}
IfmapSRAMBankNum = 1
IfmapSRAMBankPort = 2
FilterCustomLayout = False
FilterSRAMBankBandwidth = {bw}
FilterSRAMBankNum = 1
FilterSRAMBankPort = 2
[sparsity]
SparsitySupport = false
[run_presets]
InterfaceBandwidth = USER
UseRamulatorTrace = False
""")
    header = ("Layer,M,N,K," if gemm else
              "Layer name,IFMAP height,IFMAP width,Filter height,Filter width,Channels,Num filter,Stride,")
    (tmp / "topo.csv").write_text(f"{header}\n{topology_row},\n")
    (tmp / "layout.csv").write_text("Layer name,\n")
    sim = scalesim(save_disk_space=True, verbose=False, config=str(config), topology=str(tmp / "topo.csv"),
                   layout=str(tmp / "layout.csv"), input_type_gemm=gemm)
    sim.run_scale(top_path=str(tmp / "out"))
    with open(tmp / "out" / "ref" / "COMPUTE_REPORT.csv") as handle:
        row = next(csv.DictReader(handle, skipinitialspace=True))
    return {"total": float(row["Total Cycles"]), "stalls": float(row["Stall Cycles"]),
            "overall": float(row["Total Cycles (incl. prefetch)"])}


@pytest.fixture
def cache(tmp_path):
    return LayerCache(disk=tmp_path / "scalesim")


@pytest.fixture(scope="module")
def resnet():
    return split_program(parse_file(shared_path("mlir", RESNET)))


# -- the fold formula and SCALE-Sim ------------------------------------------------------------------------

@pytest.mark.parametrize("dataflow", ["ws", "os", "is"])
def test_formula_equals_scalesim_compute_only(dataflow):
    # non-square arrays so that a rows/cols mix-up in the formula shows
    for rows, cols in [(8, 4), (4, 8)]:
        array = ArrayConfig(rows, cols, dataflow, 64, 64, 64, 4)
        for m, n, k in [(1, 1, 1), (5, 3, 7), (16, 8, 4), (20, 12, 10), (9, 17, 33), (33, 2, 5)]:
            gemm = Gemm(m, n, k)
            assert simulate(gemm, array, "compute-only")["cycles"] == analytical_cycles(gemm, rows, cols, dataflow)


@pytest.mark.slow      # starts SCALE-Sim workers
def test_full_gemm_equals_scalesim_file_route(tmp_path):
    gemm = Gemm(20, 12, 10)
    roomy = ArrayConfig(8, 4, "ws", 1, 1, 1, 4)          # everything fits: no stalls
    tight = ArrayConfig(8, 8, "ws", 1, 1, 1, 1)          # 1 kword buffers at 1 word/cycle: stalls
    for array, gemm in [(roomy, gemm), (tight, Gemm(64, 48, 40))]:
        offsets = (0, gemm.m * gemm.k, gemm.m * gemm.k + gemm.k * gemm.n)
        folder = tmp_path / f"{array.rows}x{array.cols}"
        folder.mkdir()
        ref = scalesim_file_route(folder, array, f"g,{gemm.m},{gemm.n},{gemm.k}", True, offsets)
        ours = run_isolated([(gemm, array, "full")], Budget(30))[0]
        assert ours["cycles"] == ref["total"]
        assert ours["stall_cycles"] == ref["stalls"]
        assert ours["overall_cycles"] == ref["overall"]
    # stall-free: the three modes agree; with stalls full is slower than the compute demand alone
    assert simulate(Gemm(20, 12, 10), roomy, "compute-only")["cycles"] == 227 == analytical_cycles(
        Gemm(20, 12, 10), 8, 4, "ws")
    assert ours["stall_cycles"] > 0
    assert ours["cycles"] == analytical_cycles(Gemm(64, 48, 40), 8, 8, "ws") + ours["stall_cycles"]


@pytest.mark.parametrize("dataflow", ["ws", "os", "is"])
def test_conv_mapping_matches_scalesim_conv_layer(tmp_path, dataflow, cache):
    # 11x11x3 input, 3x3 kernel, 5 filters, stride 2, no padding (SCALE-Sim's conv layers have none):
    # SCALE-Sim's own conv layer and our im2col GEMM must take the same cycles
    target = array_target(8, 8, 1, dataflow)
    rg, regions = regions_of(conv_program(11, 11, 3, 3, 3, 5, stride=2, pad=0))
    label = ScaleSimFidelity(Budget(30), mode="compute-only", cache=cache).label(regions[0], target)
    ref = scalesim_file_route(tmp_path, array_config(target, "f32"), "c,11,11,3,3,3,5,2", False,
                              (0, 10_000_000, 20_000_000))
    assert label.status == "ok" and label.meta["mode"] == "compute-only"
    assert [g["gemm"] for g in label.meta["gemms"]] == [[25, 5, 27]]
    assert label.meta["gemms"][0]["layer_cycles"] == ref["total"]


def test_padded_conv_skips_the_padding():
    # 9x9x3 input padded by 1, 3x3 kernel, stride 2 -> 5x5 outputs. Along each dim the first and last
    # output read 2 of the 3 taps, the middle 3 outputs all 3: 3x3 interior outputs x 27 inputs, four
    # edges of 3 outputs x 18, four corners of 1 output x 12.
    graph = parse_module(conv_program(9, 9, 3, 3, 3, 5, stride=2, pad=1))
    works = matrix_work(matrix_op(graph))
    assert sorted((w.count, w.gemm.m, w.gemm.k) for w in works) == [(1, 9, 27), (4, 1, 12), (4, 3, 18)]
    assert work_flops(works) == op_cost(matrix_op(graph)).flops


# -- mapping ops to GEMMs ------------------------------------------------------------------------------------

def test_mapping_flops_match_op_cost_on_resnet(resnet):
    ratios = []
    for op in resnet.graph.ops:
        if op.kind in ("convolution", "dot_general"):
            works = matrix_work(op)
            ratios.append(work_flops(works) / op_cost(op).flops)
    assert len(ratios) == 54
    assert ratios == pytest.approx([1.0] * 54, rel=1e-12)


def test_mapping_flops_of_training_convolutions():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from jax import lax

    def grads(x_shape, w_shape, stride, padding, groups):
        def loss(x, w):
            y = lax.conv_general_dilated(x, w, stride, padding, dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                         feature_group_count=groups)
            return jnp.sum(y * y)
        args = (jnp.zeros(x_shape, jnp.float32), jnp.zeros(w_shape, jnp.float32))
        graph = parse_module(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).as_text())
        return [op for op in graph.ops if op.kind == "convolution"]

    seen = set()
    # forward, backward-data (lhs-dilated) and backward-filter convs; strided, grouped and depthwise
    for x_shape, w_shape, stride, padding, groups in [((4, 32, 32, 16), (3, 3, 16, 32), (2, 2), "VALID", 1),
                                                       ((2, 28, 28, 8), (3, 3, 1, 8), (1, 1), "VALID", 8),
                                                       ((2, 30, 30, 8), (5, 5, 4, 6), (3, 3), "VALID", 2),
                                                       ((2, 56, 56, 32), (3, 3, 32, 32), (2, 2), "SAME", 1)]:
        for op in grads(x_shape, w_shape, stride, padding, groups):
            works, cost = matrix_work(op), op_cost(op).flops
            assert work_flops(works) == pytest.approx(cost, rel=1e-12)
            a = op.attrs
            lhs_dilated = any(d > 1 for d in a.get("lhs_dilation") or [1])
            grouped = (a.get("feature_group_count") or 1) > 1 or (a.get("batch_group_count") or 1) > 1
            seen.add(("lhs_dilated" if lhs_dilated else "") + ("grouped" if grouped else ""))
            if lhs_dilated:
                # plain im2col over the dilated input would compute ~stride^2 times the real work
                dn = a["dimension_numbers"]
                lhs, rhs, out = op.operand_types[0].shape, op.operand_types[1].shape, op.result_types[0].shape
                naive = 2.0 * out[dn["output_feature"]] * lhs[dn["input_batch"]] * math.prod(
                    out[d] for d in dn["output_spatial"]) * math.prod(rhs[d] for d in dn["kernel_spatial"]) * \
                    lhs[dn["input_feature"]] / (a.get("feature_group_count") or 1)
                assert naive / cost > 3.5
                assert len(works) > 1
    assert {"", "lhs_dilated", "grouped", "lhs_dilatedgrouped"} <= seen


def test_mapping_of_the_shared_dilated_convolution():
    graph = parse_file(shared_path("mlir", "convolution.mlir"))
    op = matrix_op(graph)
    works = matrix_work(op)
    # 4x4 input dilated by 2, 3x3 kernel, stride 4: each output meets 2 real taps per dim
    assert works == [GemmWork(1, Gemm(4, 1, 4))]
    assert work_flops(works) == op_cost(op).flops


def test_dot_batch_dims_become_a_batch_of_gemms(cache):
    rg, regions = regions_of(dot_program(24, 16, 40, "bf16", batch=6))
    op = matrix_op(rg.graph)
    assert matrix_work(op) == [GemmWork(6, Gemm(24, 16, 40))]
    one = array_target(8, 8, 1)
    label = ScaleSimFidelity(Budget(30), mode="compute-only", cache=cache).label(regions[0], one)
    assert label.meta["cycles"] == 6 * analytical_cycles(Gemm(24, 16, 40), 8, 8, "ws")


# -- several arrays ---------------------------------------------------------------------------------------

def test_split_across_arrays():
    four = array_target(8, 8, 4).systolic
    batch = split_work(GemmWork(8, Gemm(64, 8, 8)), four)
    assert batch.ways == (4, 1, 1) and batch.per_array == 2 and batch.gemm == Gemm(64, 8, 8)
    wide = split_work(GemmWork(1, Gemm(16, 64, 8)), four)          # many columns: split N
    assert wide.ways == (1, 4, 1) and wide.gemm == Gemm(16, 16, 8)
    narrow = split_work(GemmWork(1, Gemm(400, 8, 8)), four)        # one column fold: split M
    assert narrow.ways == (1, 1, 4) and narrow.gemm == Gemm(100, 8, 8)
    for split, work in [(batch, GemmWork(8, Gemm(64, 8, 8))), (wide, GemmWork(1, Gemm(16, 64, 8))),
                        (narrow, GemmWork(1, Gemm(400, 8, 8)))]:
        whole = work.count * analytical_cycles(work.gemm, 8, 8, "ws")
        assert split.per_array * analytical_cycles(split.gemm, 8, 8, "ws") < whole / 2
        assert split.arrays_used == 4
    # a GEMM too small to share leaves arrays idle
    tiny = split_work(GemmWork(1, Gemm(1, 1, 8)), four)
    assert tiny.ways == (1, 1, 1) and tiny.arrays_used == 1 and tiny.gemm == Gemm(1, 1, 8)


def test_four_arrays_take_a_quarter_of_a_batch(cache):
    rg, regions = regions_of(dot_program(32, 8, 8, "bf16", batch=8))
    fid = ScaleSimFidelity(Budget(30), mode="analytical-tail", cache=cache)
    one = fid.label(regions[0], array_target(8, 8, 1, mem_bw=1e15))
    four = fid.label(regions[0], array_target(8, 8, 4, mem_bw=1e15))
    assert four.meta["matrix_s"] == pytest.approx(one.meta["matrix_s"] / 4)


def test_passes_follow_the_target_rates():
    tpu = load_target("TPUv3")
    assert passes(tpu, "bf16") == 1.0
    assert passes(tpu, "f32") == 6.0                 # precision HIGHEST: six bf16 passes


# -- monotonicity -----------------------------------------------------------------------------------------

def test_cycles_grow_with_every_dimension():
    array = ArrayConfig(8, 8, "ws", 64, 64, 64, 4)
    sizes = [1, 3, 8, 9, 16, 17, 40]
    for dataflow in ("ws", "os", "is"):
        for base in [(8, 8, 8), (17, 5, 30)]:
            for axis in range(3):
                last = 0
                for s in sizes:
                    dims = list(base)
                    dims[axis] = s
                    cycles = analytical_cycles(Gemm(*dims), 8, 8, dataflow)
                    assert cycles >= last
                    last = cycles
    # and what SCALE-Sim computes grows the same way
    seen = [simulate(Gemm(m, 12, 20), array, "compute-only")["cycles"] for m in (4, 8, 16, 32)]
    assert seen == sorted(seen) and len(set(seen)) == 4


def test_labels_grow_with_gemm_size(cache):
    target = array_target(8, 8, 2)
    fid = ScaleSimFidelity(Budget(30), mode="analytical-tail", cache=cache)
    seconds = [fid.label(regions_of(dot_program(m, 16, 16, "bf16"))[1][0], target).seconds for m in (8, 64, 512)]
    assert seconds[0] < seconds[1] < seconds[2]


# -- budget -----------------------------------------------------------------------------------------------

def test_mode_choice_from_predicted_cost():
    tpu_array = ArrayConfig(128, 128, "ws", 2048, 1024, 1024, 120)
    assert choose_mode(Gemm(256, 256, 256), tpu_array, Budget(30, 2**30)) == "full"
    assert choose_mode(Gemm(512, 512, 512), tpu_array, Budget(1, 2**30)) == "compute-only"
    assert choose_mode(Gemm(2048, 2048, 1024), tpu_array, Budget(600, 2**26)) == "analytical-tail"
    # the model grows with size in every mode
    for mode in ("full", "compute-only"):
        small = predict_cost(Gemm(256, 256, 256), tpu_array, mode)
        big = predict_cost(Gemm(512, 256, 256), tpu_array, mode)
        assert big[0] > small[0] and big[1] > small[1]


@pytest.mark.slow      # starts SCALE-Sim workers
def test_time_overrun_falls_back_to_compute_only(cache):
    # full SCALE-Sim of 512^3 on a 128x128 array takes seconds; the budget allows half a second
    target = array_target(128, 128, 1, sram_kb=4096)
    rg, regions = regions_of(dot_program(512, 512, 512, "bf16"))
    fid = ScaleSimFidelity(Budget(seconds=0.5, memory_bytes=2**30), mode="full", cache=cache)
    start = time.monotonic()
    label = fid.label(regions[0], target)
    assert time.monotonic() - start < 0.5 + 2.0 + 5.0
    assert label.status == "ok" and label.meta["mode"] == "compute-only"
    assert "time budget" in label.meta["gemms"][0]["fallbacks"][0]
    assert label.meta["gemms"][0]["layer_cycles"] == analytical_cycles(Gemm(512, 512, 512), 128, 128, "ws")
    # the overrun is remembered: the same budget does not try full again
    again = ScaleSimFidelity(Budget(seconds=0.5, memory_bytes=2**30), mode="full", cache=cache)
    start = time.monotonic()
    assert again.label(regions[0], target).meta["mode"] == "compute-only"
    assert again.stats["cached"] == 1 and time.monotonic() - start < 0.5
    # a larger budget tries full again (predicted to fit in 30 s)
    assert not cache.overran(layer_key(Gemm(512, 512, 512), array_config(target, "bf16"), "full"), Budget(30))


def test_memory_overrun_without_tail_is_a_failed_label(cache):
    target = array_target(8, 8, 1)
    rg, regions = regions_of(dot_program(2048, 64, 1024, "bf16"))     # ~2M demand rows: hundreds of MB
    fid = ScaleSimFidelity(Budget(seconds=30, memory_bytes=32 * 2**20), mode="compute-only",
                           analytical_tail=False, cache=cache)
    label = fid.label(regions[0], target)
    assert label.status == "failed" and math.isnan(label.seconds)
    assert "memory budget" in label.meta["reason"]
    assert fid.stats["failed"] == 1


def test_nothing_fits_without_tail_fails_without_running(cache):
    target = array_target(8, 8, 1)
    rg, regions = regions_of(dot_program(2048, 64, 1024, "bf16"))
    fid = ScaleSimFidelity(Budget(seconds=0.01, memory_bytes=2**20), analytical_tail=False, cache=cache)
    label = fid.label(regions[0], target)
    assert label.status == "failed" and "over budget" in label.meta["reason"]
    assert fid.stats == {"simulated": 0, "cached": 0, "analytical": 0, "failed": 1}
    # with the analytical tail the same layer is labelled from the formula
    tail = ScaleSimFidelity(Budget(seconds=0.01, memory_bytes=2**20), cache=cache).label(regions[0], target)
    assert tail.status == "ok" and tail.meta["mode"] == "analytical-tail"


# -- isolation --------------------------------------------------------------------------------------------

@pytest.mark.slow      # starts SCALE-Sim workers
def test_killed_worker_gives_a_failed_label_and_the_caller_goes_on(cache):
    target = array_target(128, 128, 1, sram_kb=4096)
    rg, regions = regions_of(dot_program(512, 512, 512, "bf16"))
    killed: list[int] = []

    def kill(pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    fid = ScaleSimFidelity(Budget(30), mode="full", cache=cache, on_worker_start=kill)
    label = fid.label(regions[0], target)
    assert killed and label.status == "failed" and "SIGKILL" in label.meta["reason"]
    small = regions_of(dot_program(16, 16, 16, "bf16"))[1][0]
    assert ScaleSimFidelity(Budget(30), cache=cache).label(small, target).status == "ok"


def test_one_dead_worker_does_not_take_its_batch_down():
    array = ArrayConfig(8, 8, "ws", 16, 16, 16, 4)
    tasks = [(Gemm(16, 16, 16), array, "full"), (Gemm(64, 64, 64), array, "full"),
             (Gemm(8, 8, 8), array, "compute-only")]
    results = run_isolated(tasks, Budget(30), workers=2,
                           on_start=lambda index, pid: os.kill(pid, signal.SIGKILL) if index == 1 else None)
    assert results[1]["failed"] and results[1]["kind"] == "crash"
    assert results[0]["cycles"] == analytical_cycles(Gemm(16, 16, 16), 8, 8, "ws")
    assert results[2]["cycles"] == analytical_cycles(Gemm(8, 8, 8), 8, 8, "ws")


@pytest.mark.slow      # starts SCALE-Sim workers
def test_a_hung_worker_is_killed_at_the_deadline():
    # a stopped worker cannot even run its own alarm: the caller kills it a grace period after the budget
    array = ArrayConfig(8, 8, "ws", 16, 16, 16, 4)
    start = time.monotonic()
    result = run_isolated([(Gemm(16, 16, 16), array, "full")], Budget(0.2),
                          on_start=lambda index, pid: os.kill(pid, signal.SIGSTOP))[0]
    assert result["failed"] and result["kind"] == "time" and "was killed" in result["reason"]
    assert time.monotonic() - start < 0.2 + 2.0 + 3.0


# -- memoisation ------------------------------------------------------------------------------------------

def test_repeated_layers_are_simulated_once(tmp_path):
    target = array_target(8, 8, 1)
    rg, regions = regions_of(dot_program(24, 16, 40, "bf16"))
    twin = regions_of(dot_program(24, 16, 40, "bf16"))[1][0]
    folder = tmp_path / "scalesim"
    fid = ScaleSimFidelity(Budget(30), mode="full", cache=LayerCache(disk=folder))
    first = fid.label_regions([regions[0], twin], target)
    assert fid.stats["simulated"] == 1 and first[0].seconds == first[1].seconds
    second = fid.label(regions[0], target)
    assert fid.stats["simulated"] == 1 and fid.stats["cached"] == 1
    assert second.seconds == first[0].seconds and second.meta["mode"] == "full"
    # a new process-level cache finds the JSON file on disk
    fresh_cache = LayerCache(disk=folder)
    fresh = ScaleSimFidelity(Budget(30), mode="full", cache=fresh_cache)
    assert fresh.label(regions[0], target).seconds == first[0].seconds
    assert fresh.stats["simulated"] == 0 and fresh_cache.disk_hits == 1
    assert len(list(folder.glob("*.json"))) == 1


def test_default_disk_cache_follows_hespas_ml_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HESPAS_ML_CACHE", str(tmp_path))
    assert LayerCache().directory() == tmp_path / "scalesim"
    assert LayerCache(disk=False).directory() is None


# -- real regions ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_resnet50_regions_on_tpuv3(resnet, cache):
    tpu = load_target("TPUv3")
    regions = resnet.compute_regions()
    describe = {r.id: resnet.describe(r) for r in regions}
    dot = next(r for r in regions if "dot_general" in describe[r.id])
    convs = [r for r in regions if describe[r.id].startswith("convolution")][:3]
    plain = next(r for r in regions
                 if r.bytes > 0 and not any(k in describe[r.id] for k in ("convolution", "dot_general")))
    picked = [dot, *convs, plain]
    fid = ScaleSimFidelity(Budget(seconds=3, memory_bytes=2**30), cache=cache)
    labels = fid.label_regions(picked, tpu)
    roof = RooflineFidelity().label_regions(picked, tpu)
    assert all(l.status == "ok" and math.isfinite(l.seconds) and l.seconds > 0 for l in labels)
    assert labels[0].meta["mode"] == "compute-only"               # 256x1000x2048 in four slices of N
    assert labels[0].meta["gemms"][0]["split"] == [1, 4, 1]
    assert all(l.meta["mode"] == "analytical-tail" for l in labels[1:4])   # 800k-row convolutions
    assert labels[4].meta["mode"] == "no-matrix" and labels[4].seconds == pytest.approx(roof[4].seconds)
    for label, ref in zip(labels[:4], roof[:4]):
        assert 0 < label.meta["utilization"] <= 1
        assert label.seconds >= 0.99 * ref.seconds                # an array never beats its peak
    # modes are chosen per GEMM: the stem conv's interior is formula-only, its padded borders are small
    # enough to simulate; the region reports its least detailed mode
    stem = labels[1].meta["gemms"]
    biggest = max(stem, key=lambda g: g["gemm"][0])
    assert biggest["mode"] == "analytical-tail" and biggest["gemm"] == [256 * 109 * 109, 64, 147]
    assert {g["mode"] for g in stem} >= {"full", "analytical-tail"}
    simulated = {tuple(g["per_array"][1:]) for label in labels for g in label.meta["gemms"]
                 if g["mode"] in ("full", "compute-only")}
    assert fid.stats["simulated"] == len(simulated)


def test_errors_for_targets_without_arrays_and_regions_without_graph(resnet, cache):
    region = resnet.compute_regions()[0]
    with pytest.raises(FidelityError, match="systolic"):
        ScaleSimFidelity(cache=cache).label(region, load_target("H100"))
    rg = split_program(parse_module(dot_program(8, 8, 8)))
    for r in rg.regions:
        r.graph = None
    with pytest.raises(FidelityError, match="graph"):
        ScaleSimFidelity(cache=cache).label(rg.compute_regions()[0], array_target())
