"""Zoo families ``unet`` and ``dlrm``: specs, FLOPs against the analytical counts, the kernel kinds they add
(lhs-dilated convolutions, gathers, scatter-adds), the collectives of each parallel form, determinism, the CLI."""
from __future__ import annotations

from collections import Counter

import pytest

from hespas_ml.ingest import IngestError, TensorType
from hespas_ml.ingest.zoo import ZOO, canonical_spec, parse_zoo_spec, zoo_program
from hespas_ml.ingest.zoo import dlrm as dlrm_family
from hespas_ml.ingest.zoo import unet as unet_family
from hespas_ml.ingest.zoo.cache import export_in_subprocess
from hespas_ml.costs import graph_cost
from tests.ingest.zoo_checks import kinds, load, matrix_flops

pytestmark = pytest.mark.slow   # exports programs, starts workers, builds datasets or trains

# depth 3 (16, 8, 4 pixels), 8-16-32 channels, group norm of 4 groups
UNET = "zoo:unet?depth=3&base=8&image=16&in_channels=3&classes=4&batch=4&groups=4"
# 4 tables of 1000 x 16, 3 ids each, 13 dense features, MLPs 13-64-32-16 and 26-64-32-1
DLRM = "zoo:dlrm?tables=4&rows=1000&dim=16&lookups=3&dense=13&bottom=64,32&top=64,32&batch=32"
ALL_DEVICES = [[0, 1, 2, 3]]


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HESPAS_ML_CACHE", str(tmp_path_factory.mktemp("hespas-cache")))
        yield


def t(*shape_and_dtype) -> TensorType:
    *shape, dtype = shape_and_dtype
    return TensorType(tuple(shape), dtype)


def params_of(spec: str) -> dict:
    return parse_zoo_spec(spec)[1]


# -- specs ----------------------------------------------------------------------------------------

def test_families_are_registered_with_documented_parameters():
    assert {"depth", "base", "image", "in_channels", "classes", "batch", "dtype", "step", "optimizer",
            "devices", "parallel"} <= {p.name for p in ZOO["unet"].params}
    assert {"tables", "rows", "dim", "lookups", "pooling", "dense", "bottom", "top", "batch", "dtype", "step",
            "optimizer", "devices", "parallel"} <= {p.name for p in ZOO["dlrm"].params}
    for name in ("unet", "dlrm"):
        assert all(p.help for p in ZOO[name].params)
        assert parse_zoo_spec(f"zoo:{name}")[1] == ZOO[name].defaults()
    assert set(ZOO["unet"].param("parallel").choices) == {"dp", "fsdp", "dp-partitioned", "fsdp-partitioned"}
    assert set(ZOO["dlrm"].param("parallel").choices) == {"dp", "mp", "dp-partitioned", "mp-partitioned"}


def test_mlp_widths_have_one_spelling():
    a = params_of("zoo:dlrm?bottom=0512, 256&top=64")
    b = params_of("zoo:dlrm?bottom=512,256&top=64")
    assert a["bottom"] == "512,256" and a == b
    assert canonical_spec("dlrm", a) == canonical_spec("dlrm", b)
    assert dlrm_family.mlp_dims(a) == ([13, 512, 256, 64], [64 + 36, 64, 1])     # 8 tables: 8·9/2 pairs


@pytest.mark.parametrize("spec, message", [
    ("zoo:unet?depth=4&image=36", "image=36 is not divisible by 2^(depth-1)=8"),
    ("zoo:unet?base=12&groups=8", "groups=8 does not divide base=12"),
    ("zoo:unet?batch=6&devices=4", "batch=6 is not divisible by devices=4"),
    ("zoo:unet?batch=65536&image=4096&base=64", "the largest activation would hold"),
    ("zoo:unet?parallel=tp", "parallel=tp is not one of dp, fsdp, dp-partitioned, fsdp-partitioned"),
    ("zoo:unet?classes=1", "classes=1 is below the minimum 2"),
    ("zoo:unet?upsample=pixelshuffle", "upsample=pixelshuffle is not one of transpose, nearest, bilinear"),
    ("zoo:dlrm?tables=6&devices=4&parallel=mp", "tables=6 is not divisible by devices=4 (parallel=mp splits"),
    ("zoo:dlrm?tables=6&devices=4&parallel=mp-partitioned", "tables=6 is not divisible by devices=4"),
    ("zoo:dlrm?batch=30&devices=4&parallel=mp", "batch=30 is not divisible by devices=4 (parallel=mp splits it)"),
    ("zoo:dlrm?rows=100000000&dim=64", "a table of rows=100000000 x dim=64 would hold 6400000000 elements"),
    ("zoo:dlrm?tables=4096&rows=20000000&dim=64", "the 4096 tables would hold"),
    ("zoo:dlrm?bottom=512,x", "bottom=512,x is not a list of layer widths"),
    ("zoo:dlrm?top=0", "top=0 has a width outside 1..1048576"),
    ("zoo:dlrm?optimizer=lamb", "optimizer=lamb is not one of sgd, adagrad, adam"),
])
def test_impossible_combinations_are_rejected_in_one_line(spec, message):
    with pytest.raises(IngestError) as info:
        parse_zoo_spec(spec)
    assert message in str(info.value) and "\n" not in str(info.value)


# -- unet -----------------------------------------------------------------------------------------

def test_unet_analytical_count_by_hand():
    p = params_of(UNET)
    # 3×3 convolutions on s×s pixels use 3s−2 taps per axis (the rest fall on padding)
    b, enc = 4, [(3, 8, 16), (8, 8, 16), (8, 16, 8), (16, 16, 8), (16, 32, 4), (32, 32, 4)]
    dec = [(16 * 2, 16, 8), (16, 16, 8), (8 * 2, 8, 16), (8, 8, 16)]      # after the concatenations
    convs = sum(2 * b * (3 * s - 2) ** 2 * ci * co for ci, co, s in enc + dec)
    ups = 2 * b * (4 * 4 * 32 * 16 * 4 + 8 * 8 * 16 * 8 * 4)             # 2×2/2 transposed: 4 taps per input pixel
    head = 2 * b * 16 * 16 * 8 * 4
    flops = unet_family.forward_flops(p)
    assert flops["total"] == convs + ups + head
    assert flops["first"] == 2 * b * (3 * 16 - 2) ** 2 * 3 * 8


@pytest.mark.parametrize("upsample", ["transpose", "nearest", "bilinear"])
def test_unet_inference_and_training_flops_and_kernels(upsample):
    spec = f"{UNET}&upsample={upsample}"
    p = params_of(spec)
    flops = unet_family.forward_flops(p)
    gi = load(f"{spec}&step=infer")
    assert matrix_flops(gi) == pytest.approx(flops["total"], rel=1e-9)
    assert graph_cost(gi)["flops"] == pytest.approx(flops["total"], rel=0.06)     # norms, ReLU, pooling
    assert gi.inputs[-1] == t(4, 16, 16, 3, "f32")
    assert sum(x.numel for x in gi.inputs[:-1]) == unet_family.parameter_count(p)
    convs = kinds(gi, "convolution")
    assert len(convs) == 6 + 2 * 2 + 2 + 1                   # encoder, decoder blocks, upsampling, head
    assert convs[-1].result_types[0] == t(4, 16, 16, 4, "f32")
    lhs_dilated = [op for op in convs if op.attrs.get("lhs_dilation") == [2, 2]]
    assert len(lhs_dilated) == (2 if upsample == "transpose" else 0)
    assert len(kinds(gi, "reduce_window")) == 2                # the max-pools
    assert bool(kinds(gi, "gather")) == (upsample == "nearest")
    assert bool(kinds(gi, "dot_general")) == (upsample == "bilinear")

    g = load(spec)
    # backward data and filter for every convolution but the image's; interpolation matrices are constants
    assert matrix_flops(g) == pytest.approx(3 * flops["total"] - flops["first"] - flops["resize"], rel=1e-9)
    assert graph_cost(g)["flops"] == pytest.approx(matrix_flops(g), rel=0.06)
    assert len(kinds(g, "select_and_scatter")) == 2            # max-pool gradients
    # per-pixel cross-entropy: the labels' logits gathered, their gradient scattered back
    n_resize_gathers = len(kinds(gi, "gather"))
    assert len(kinds(g, "gather")) == len(kinds(g, "scatter")) == 1 + n_resize_gathers


def test_unet_bf16_adam_without_norm():
    shallow = UNET.replace("depth=3", "depth=2") + "&norm=none"
    g = load(f"{shallow}&dtype=bf16&optimizer=adam")
    p = params_of(shallow)
    n_leaves = len(unet_family.param_shapes(p))
    assert n_leaves == 2 * 2 * 2 + 2 + 2 * 2 + 2                # 4 block convs (w, b), up (w, b), 2 convs, head
    assert len(g.inputs) == 3 * n_leaves + 1 + 2                # params, m, v, step count, images, labels
    assert {op.dtype for op in kinds(g, "convolution")} == {"bf16"}
    assert not kinds(g, "rsqrt")


def test_unet_data_parallel_sums_every_gradient():
    n_leaves = len(unet_family.param_shapes(params_of(UNET)))
    dp = load(f"{UNET}&devices=4&parallel=dp")
    assert dp.n_devices == 4
    reduces = kinds(dp, "all_reduce")
    assert len(reduces) == n_leaves + 1                         # every gradient and the loss
    assert all(op.attrs["replica_groups"] == ALL_DEVICES for op in reduces)
    assert kinds(dp, "convolution")[0].operand_types[0] == t(1, 16, 16, 3, "f32")   # one image per device
    one_image = unet_family.forward_flops(params_of(UNET), batch=1)
    assert matrix_flops(dp) == pytest.approx(3 * one_image["total"] - one_image["first"], rel=1e-9)
    infer = load(f"{UNET}&devices=4&parallel=dp&step=infer")
    assert not any(op.is_collective for op in infer.ops)


def test_unet_fsdp_and_compiler_partitioned():
    n_leaves = len(unet_family.param_shapes(params_of(UNET)))
    fsdp = load(f"{UNET}&devices=4&parallel=fsdp")
    # every parameter has an axis that 4 divides (channels 8…64, 4 classes): all are sharded
    assert len(kinds(fsdp, "all_gather")) == len(kinds(fsdp, "reduce_scatter")) == n_leaves
    assert len(kinds(fsdp, "all_reduce")) == 1                  # the loss
    part = load(f"{UNET}&devices=4&parallel=dp-partitioned")
    assert part.n_devices == 4 and t(1, 16, 16, 3, "f32") in part.inputs
    reduced = sorted(x.numel for op in part.ops if op.is_collective for x in op.operand_types)
    params = load(f"{UNET}&step=train").inputs[:-2]
    assert reduced == sorted([x.numel for x in params] + [1])  # every gradient and the loss, once


# -- dlrm -----------------------------------------------------------------------------------------

def test_dlrm_analytical_count_by_hand():
    p = params_of(DLRM)
    b = 32
    bottom = 2 * b * (13 * 64 + 64 * 32 + 32 * 16)
    top = 2 * b * ((16 + 10) * 64 + 64 * 32 + 32 * 1)          # 5 vectors: 10 pairwise products
    interaction = 2 * b * 5 * 5 * 16
    assert dlrm_family.forward_flops(p) == {"first": 2 * b * 13 * 64, "interaction": interaction,
                                           "total": bottom + top + interaction}
    assert dlrm_family.parameter_count(p) == 4 * 1000 * 16 + (13 * 64 + 64 + 64 * 32 + 32 + 32 * 16 + 16) \
        + (26 * 64 + 64 + 64 * 32 + 32 + 32 + 1)


def test_dlrm_inference_step():
    p = params_of(DLRM)
    flops = dlrm_family.forward_flops(p)
    g = load(f"{DLRM}&step=infer")
    assert matrix_flops(g) == pytest.approx(flops["total"], rel=1e-9)
    assert graph_cost(g)["flops"] == pytest.approx(flops["total"], rel=0.05)    # pooling, ReLU
    assert sum(x.numel for x in g.inputs[:-2]) == dlrm_family.parameter_count(p)
    assert g.inputs[-2:] == [t(32, 13, "f32"), t(32, 4, 3, "i32")]
    gathers = kinds(g, "gather")
    # one lookup per table ([1000, 16] rows by [32, 3] ids), one for the lower triangle of the dot products
    lookups = [op for op in gathers if op.operand_types[0] == t(1000, 16, "f32")]
    assert len(lookups) == 4 and all(op.result_types[0] == t(32, 3, 16, "f32") for op in lookups)
    assert [op.result_types[0] for op in gathers if op not in lookups] == [t(32, 10, "f32")]
    assert [op.result_types[0] for op in kinds(g, "dot_general") if len(op.result_types[0].shape) == 3] == \
        [t(32, 5, 5, "f32")]
    assert not kinds(g, "scatter")


def test_dlrm_training_scatter_adds_table_gradients():
    p = params_of(DLRM)
    flops = dlrm_family.forward_flops(p)
    g = load(DLRM)
    assert matrix_flops(g) == pytest.approx(3 * flops["total"] - flops["first"], rel=1e-9)
    # SGD touches every parameter twice (scale, subtract): the dense table update dominates the vector work
    assert graph_cost(g)["flops"] == pytest.approx(3 * flops["total"] - flops["first"]
                                                   + 2 * dlrm_family.parameter_count(p), rel=0.05)
    scatters = kinds(g, "scatter")
    table_grads = [op for op in scatters if op.result_types[0] == t(1000, 16, "f32")]
    assert len(table_grads) == 4 and len(scatters) == 5        # and the interaction triangle's gradient
    assert all(op.operand_types[2] == t(32, 3, 16, "f32") for op in table_grads)
    for optimizer, states in (("adagrad", 1), ("adam", 2)):
        other = load(f"{DLRM}&optimizer={optimizer}&dtype=bf16&pooling=mean")
        n_params = len(other.inputs) - 3 - (optimizer == "adam")
        assert n_params == (1 + states) * (4 + 12)
        assert {op.dtype for op in kinds(other, "dot_general")} == {"bf16"}
        assert len(kinds(other, "sqrt")) >= 16


def test_dlrm_data_parallel_all_reduces_every_gradient_tables_included():
    g = load(f"{DLRM}&devices=4&parallel=dp")
    reduces = kinds(g, "all_reduce")
    assert len(reduces) == 4 + 12 + 1                           # tables, MLP weights and biases, the loss
    assert all(op.attrs["replica_groups"] == ALL_DEVICES for op in reduces)
    assert sum(op.result_types[0] == t(1000, 16, "f32") for op in reduces) == 4
    assert not kinds(g, "all_to_all")
    quarter = dlrm_family.forward_flops(params_of(DLRM), batch=8)
    assert matrix_flops(g) == pytest.approx(3 * quarter["total"] - quarter["first"], rel=1e-9)


def test_dlrm_model_parallel_tables_trade_pooled_embeddings_with_all_to_all():
    gi = load(f"{DLRM}&devices=4&parallel=mp&step=infer")
    (a2a,) = kinds(gi, "all_to_all")
    # each device pools its one table for all 32 samples and receives every table's vector for 8 samples
    assert a2a.operand_types[0] == t(32, 1, 16, "f32") and a2a.result_types[0] == t(8, 4, 16, "f32")
    assert a2a.attrs["replica_groups"] == ALL_DEVICES
    assert t(1, 1000, 16, "f32") in gi.inputs                   # one device's table of the stacked four …
    # … split by table: one batched lookup of the device's tables, then the interaction triangle
    assert [op.operand_types[0] for op in kinds(gi, "gather")] == [t(1, 1000, 16, "f32"), t(8, 5, 5, "f32")]
    assert not kinds(gi, "all_reduce")

    g = load(f"{DLRM}&devices=4&parallel=mp")
    assert len(kinds(g, "all_to_all")) == 2                     # and back with the gradients
    reduces = kinds(g, "all_reduce")
    assert len(reduces) == 12 + 1                                # MLP gradients and the loss; tables stay local
    assert t(1, 1000, 16, "f32") in {op.result_types[0] for op in kinds(g, "scatter")}
    quarter = dlrm_family.forward_flops(params_of(DLRM), batch=8)
    assert matrix_flops(g) == pytest.approx(3 * quarter["total"] - quarter["first"], rel=1e-9)


@pytest.mark.parametrize("parallel", ["dp-partitioned", "mp-partitioned"])
def test_dlrm_compiler_partitioned(parallel):
    g = load(f"{DLRM}&devices=4&parallel={parallel}")
    assert g.n_devices == 4 and t(8, 13, "f32") in g.inputs   # the batch split
    collectives = Counter(op.kind for op in g.ops if op.is_collective)
    assert collectives["all_reduce"] >= 1
    if parallel == "mp-partitioned":
        assert t(1, 1000, 16, "f32") in g.inputs and collectives["all_to_all"] >= 2
    else:
        assert t(1000, 16, "f32") in g.inputs and not collectives["all_to_all"]
    quarter = dlrm_family.forward_flops(params_of(DLRM), batch=8)
    assert matrix_flops(g) == pytest.approx(3 * quarter["total"] - quarter["first"], rel=0.01)


# -- determinism and the command line ------------------------------------------------------------------

def test_exports_are_deterministic(monkeypatch, tmp_path):
    """Two fresh exports on this machine give the very bytes: text and partitioned bytecode."""
    monkeypatch.setenv("HESPAS_ML_CACHE", str(tmp_path))      # the first export is made here, not read
    for spec in (f"{UNET}&devices=4&parallel=dp", f"{DLRM}&devices=4&parallel=mp-partitioned"):
        first = zoo_program(spec)
        assert export_in_subprocess(*parse_zoo_spec(spec), spec) == first


@pytest.mark.parametrize("spec", ["zoo:unet?depth=3&base=8&image=32&batch=8",
                                  "zoo:dlrm?tables=8&rows=10000&dim=32&batch=64&parallel=mp"])
def test_cli_simulates_on_a_ring(spec, capsys):
    from hespas_ml.cli.main import main

    assert main(["simulate", spec, "--system", "ring:4x150"]) == 0
    out = capsys.readouterr().out
    assert "(4 devices)" in out and "step time" in out
    comm = next(line for line in out.splitlines() if line.startswith("nodes"))
    assert " 0 communication" not in comm
