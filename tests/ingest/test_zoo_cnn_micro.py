"""Zoo families ``resnet`` and the micro-benchmarks (gemm, bgemm, conv, eltwise, reduce, softmax,
layernorm, attention): they export, ingest cleanly, cost what the analytical formulas say, and reject
bad specs in one line."""
from __future__ import annotations

from collections import Counter

import pytest

from hespas_ml.ingest import IngestError
from hespas_ml.ingest.zoo import ZOO, canonical_spec, parse_zoo_spec, zoo_program
from hespas_ml.ingest.zoo.cache import cache_key, export_in_subprocess
from hespas_ml.costs import graph_cost
from tests.ingest.zoo_checks import kinds, load

pytestmark = pytest.mark.slow   # exports programs, starts workers, builds datasets or trains

MICRO = ("gemm", "bgemm", "conv", "eltwise", "reduce", "softmax", "layernorm", "attention")
SMALL_RESNET = "depth=18&width=0.125&image=32&batch=8"


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HESPAS_ML_CACHE", str(tmp_path_factory.mktemp("hespas-cache")))
        yield


def types(ops, which: str = "operand_types") -> list[str]:
    return [str(t) for op in ops for t in getattr(op, which)]


# -- specs ----------------------------------------------------------------------------------------

def test_families_are_registered_with_exportable_defaults():
    for name in ("resnet",) + MICRO:
        family, params = parse_zoo_spec(f"zoo:{name}")
        assert family == name and params == ZOO[name].defaults()


def test_shapes_and_lists_have_one_spelling():
    a = parse_zoo_spec("zoo:eltwise?shape=64X0128&ops=add, exp")[1]
    b = parse_zoo_spec("zoo:eltwise?shape=64x128&ops=add,exp")[1]
    assert a["shape"] == "64x128" and a["ops"] == "add,exp"
    assert canonical_spec("eltwise", a) == canonical_spec("eltwise", b)
    assert cache_key("eltwise", a) == cache_key("eltwise", b)


@pytest.mark.parametrize("spec, message", [
    ("zoo:resnet?depth=20", "depth=20 is not one of 18, 34, 50, 101, 152"),
    ("zoo:resnet?batch=10&devices=4", "batch=10 is not divisible by devices=4"),
    ("zoo:resnet?batch=65536&image=2048", "the largest activation would hold"),
    ("zoo:resnet?optimizer=lamb", "optimizer=lamb is not one of sgd, momentum, adam"),
    ("zoo:conv?h=4&w=8&kernel=5&padding=VALID", "kernel=5 (extent 5 with dilation=1) is larger than the input h=4"),
    ("zoo:conv?h=9&w=9&kernel=3&dilation=5&padding=VALID", "(extent 11 with dilation=5) is larger than the input h=9"),
    ("zoo:conv?cin=64&cout=48&groups=32", "groups=32 must divide cin=64 and cout=48"),
    ("zoo:conv?kernel=64", "kernel=64 is above the maximum 31"),
    ("zoo:gemm?m=1048576&n=1048576", "the C tensor 1048576x1048576 would hold 1099511627776 elements"),
    ("zoo:bgemm?b=65536&m=4096&k=4096", "the A tensor 65536x4096x4096 would hold"),
    ("zoo:eltwise?shape=64xq", "shape=64xq is not a shape (write sizes joined by x"),
    ("zoo:eltwise?shape=64x0", "shape=64x0 has a dimension below 1"),
    ("zoo:eltwise?shape=2x2x2x2x2x2x2", "has 7 dimensions (at most 6)"),
    ("zoo:eltwise?shape=100000x100000", "the input tensor 100000x100000 would hold"),
    ("zoo:eltwise?ops=add,foo", "ops=add,foo: 'foo' is not one of"),
    ("zoo:reduce?shape=4x4&axes=2", "axes=2: axis 2 is out of range for a tensor of rank 2"),
    ("zoo:reduce?axes=0,0", "axes=0,0 names an axis twice"),
    ("zoo:reduce?axes=x", "axes=x is not a list of integers"),
    ("zoo:softmax?shape=4x4&axis=2", "axis=2 is out of range for shape=4x4 (rank 2)"),
    ("zoo:attention?seq=128&kv_seq=64&causal=true", "causal attention needs kv_seq >= seq"),
    ("zoo:layernorm?norm=batch", "norm=batch is not one of layer, rms"),
])
def test_bad_specs_are_rejected_in_one_line(spec, message):
    with pytest.raises(IngestError) as info:
        parse_zoo_spec(spec)
    assert message in str(info.value)
    assert "\n" not in str(info.value) and info.value.source == spec


# -- GEMMs ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("ta, tb", [(False, False), (True, True)])
def test_gemm_is_one_dot_with_2mnk_flops(ta, tb):
    m, n, k = 96, 40, 24
    g = load(f"zoo:gemm?m={m}&n={n}&k={k}&transpose_a={str(ta).lower()}&transpose_b={str(tb).lower()}&dtype=bf16")
    assert [op.kind for op in g.ops] == ["dot_general"]       # the transposes are folded into the dot
    dot = g.ops[0]
    assert types([dot]) == [f"{k}x{m}xbf16" if ta else f"{m}x{k}xbf16", f"{n}x{k}xbf16" if tb else f"{k}x{n}xbf16"]
    assert types([dot], "result_types") == [f"{m}x{n}xbf16"]
    assert graph_cost(g)["flops"] == 2 * m * n * k


def test_batched_gemm_has_2bmnk_flops():
    b, m, n, k = 5, 32, 48, 16
    g = load(f"zoo:bgemm?b={b}&m={m}&n={n}&k={k}&transpose_b=true")
    (dot,) = g.ops
    assert types([dot]) == [f"{b}x{m}x{k}xf32", f"{b}x{n}x{k}xf32"]
    assert types([dot], "result_types") == [f"{b}x{m}x{n}xf32"]
    assert graph_cost(g)["flops"] == 2 * b * m * n * k


@pytest.mark.parametrize("causal", [False, True])
def test_attention_flops_and_mask(causal):
    b, h, s, kv, d = 2, 4, 32, 48, 16
    g = load(f"zoo:attention?batch={b}&heads={h}&seq={s}&kv_seq={kv}&head_dim={d}&causal={str(causal).lower()}")
    dots = kinds(g, "dot_general")
    assert types(dots, "result_types") == [f"{b}x{h}x{s}x{kv}xf32", f"{b}x{h}x{s}x{d}xf32"]
    cost = graph_cost(g)
    assert cost["flops_by_unit"]["matrix"] == 2 * (2 * b * h * s * kv * d)
    assert cost["transcendentals"] == b * h * s * kv                  # one exp per score
    assert bool(kinds(g, "select")) == causal and bool(kinds(g, "iota")) == causal


# -- convolutions ---------------------------------------------------------------------------------

def real_macs(p: dict) -> float:
    """Multiply-adds of a forward convolution that touch real input: the sum of conv(ones, ones)."""
    import jax.numpy as jnp
    from jax import lax

    x = jnp.ones((p["batch"], p["h"], p["w"], p["cin"]), jnp.float32)
    w = jnp.ones((p["kernel"], p["kernel"], p["cin"] // p["groups"], p["cout"]), jnp.float32)
    y = lax.conv_general_dilated(x, w, (p["stride"],) * 2, p["padding"], rhs_dilation=(p["dilation"],) * 2,
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=p["groups"])
    return float(jnp.sum(y))


CONV = "batch=2&h=13&w=11&cin=8&cout=12&kernel=3&stride=2&dilation=2&groups=4"


def test_conv_passes_cost_the_same_real_multiply_adds():
    p = parse_zoo_spec(f"zoo:conv?{CONV}")[1]
    macs = real_macs(p)
    passes = {}
    for pas in ("fwd", "bwd_data", "bwd_filter"):
        g = load(f"zoo:conv?{CONV}&pass={pas}")
        (conv,) = kinds(g, "convolution")
        passes[pas] = conv
        assert graph_cost(g)["flops"] == 2 * macs, pas
    assert types([passes["fwd"]], "result_types") == ["2x7x6x12xf32"]          # ceil(13/2) x ceil(11/2)
    assert types([passes["bwd_data"]], "result_types") == ["2x13x11x8xf32"]    # dx
    assert passes["bwd_data"].attrs["lhs_dilation"] == [2, 2]                  # the strided transpose
    assert types([passes["bwd_filter"]], "result_types") == ["3x3x2x12xf32"]   # dw
    assert passes["bwd_filter"].attrs["batch_group_count"] == 4                # grouped weight gradient


def test_conv_valid_padding_flops_formula_and_layouts_agree():
    n, h, w, cin, cout, k = 2, 10, 12, 6, 5, 3
    flops = {}
    for layout in ("NHWC", "NCHW"):
        g = load(f"zoo:conv?batch={n}&h={h}&w={w}&cin={cin}&cout={cout}&kernel={k}&padding=VALID&layout={layout}")
        (conv,) = kinds(g, "convolution")
        flops[layout] = graph_cost(g)["flops"]
        out = [n, h - 2, w - 2, cout] if layout == "NHWC" else [n, cout, h - 2, w - 2]
        assert list(conv.result_types[0].shape) == out
    assert flops["NHWC"] == flops["NCHW"] == 2 * n * (h - 2) * (w - 2) * cout * cin * k * k


def test_conv_backward_filter_contracts_over_the_batch():
    g = load("zoo:conv?batch=4&h=8&w=8&cin=3&cout=5&pass=bwd_filter&layout=NCHW")
    (conv,) = kinds(g, "convolution")
    dn = conv.attrs["dimension_numbers"]
    assert dn["input_feature"] == 0 and conv.operand_types[0].shape[0] == 4     # NCHW batch is the feature
    assert types([conv], "result_types") == ["5x3x3x3xf32"]                     # OIHW


# -- vector work ----------------------------------------------------------------------------------

def test_eltwise_chain_is_one_fused_kernel_with_per_element_costs():
    from hespas_ml.split.regions import split_program

    shape, numel = "16x8x32", 16 * 8 * 32
    g = load(f"zoo:eltwise?shape={shape}&length=7&ops=add,mul,exp,tanh")     # add mul exp tanh add mul exp
    counts = g.op_counts()
    assert (counts["add"], counts["multiply"], counts["exponential"], counts["tanh"]) == (2, 2, 2, 1)
    assert [str(t) for t in g.inputs] == [f"{shape}xf32"] * 2
    cost = graph_cost(g)
    assert cost["flops"] == 4 * numel and cost["transcendentals"] == 3 * numel
    regions = split_program(g).compute_regions()
    assert len(regions) == 1 and len(regions[0].kernels) == 1
    unary = load(f"zoo:eltwise?shape={shape}&length=3&ops=relu,sqrt&dtype=f16")
    assert [str(t) for t in unary.inputs] == [f"{shape}xf16"]             # no second input without a binary op


@pytest.mark.parametrize("axes, op, out", [("0,-1", "max", "8xf32"), ("all", "mean", "f32")])
def test_reduce_over_chosen_axes(axes, op, out):
    g = load(f"zoo:reduce?shape=4x8x16&axes={axes}&op={op}")
    (red,) = kinds(g, "reduce")
    assert types([red], "result_types") == [out]
    assert graph_cost(g)["flops"] >= 4 * 8 * 16 - red.result_types[0].numel
    assert bool(kinds(g, "divide")) == (op == "mean")


def test_softmax_and_norms():
    sm = load("zoo:softmax?shape=6x10x12&axis=1&dtype=bf16")
    assert graph_cost(sm)["transcendentals"] == 6 * 10 * 12
    assert {t.shape for op in kinds(sm, "reduce") for t in op.result_types} == {(6, 12)}   # max and sum over axis 1
    ln = load("zoo:layernorm?shape=4x16x256&norm=layer&dtype=bf16")
    rms = load("zoo:layernorm?shape=4x16x256&norm=rms&dtype=bf16")
    assert [str(t) for t in ln.inputs] == ["4x16x256xbf16", "256xbf16", "256xbf16"]
    assert [str(t) for t in rms.inputs] == ["4x16x256xbf16", "256xbf16"]
    for g, n_reduce in ((ln, 2), (rms, 1)):                       # mean and variance vs mean square
        assert len(kinds(g, "reduce")) == n_reduce
        assert graph_cost(g)["transcendentals"] == 4 * 16           # one rsqrt per row
        assert {op.result_types[0].dtype for op in kinds(g, "reduce")} == {"f32"}


# -- ResNet ---------------------------------------------------------------------------------------

def test_resnet50_forward_costs_about_4_1_gmacs_per_image_and_train_about_three_times():
    infer = load("zoo:resnet?depth=50&image=224&batch=1&step=infer")
    train = load("zoo:resnet?depth=50&image=224&batch=1&step=train")
    f_infer, f_train = graph_cost(infer)["flops"], graph_cost(train)["flops"]
    # The published 4.09 GMACs count the kernel taps that fall on padding; the cost model (like XLA) does
    # not, which removes 3.4 % of the convolution work here.
    assert 0.96 < f_infer / (2 * 4.089e9) < 1.0
    assert 2.8 < f_train / f_infer < 3.2
    assert len(kinds(infer, "convolution")) == 53              # 49 in the blocks + stem + 3 projections
    convs = kinds(train, "convolution")
    # forward 53, backward-filter 53, backward-data 52 (nothing needs the image's gradient)
    assert len(convs) == 158
    # the input gradients of the strided 3×3 convolutions and projections of stages 2-4 are lhs-dilated
    assert sum(op.attrs["lhs_dilation"] == [2, 2] for op in convs) == 6
    assert len(kinds(train, "select_and_scatter")) == 1         # max-pool gradient
    assert infer.inputs[-1].shape == (1, 224, 224, 3)


def test_resnet18_forward_flops_and_layout():
    g = load("zoo:resnet?depth=18&image=224&batch=1&step=infer")
    # published: 1.819 GMACs with padding taps; on 7×7 and 14×14 maps the 3×3 kernels' padding taps
    # are ~8 % of the work
    assert 0.90 < graph_cost(g)["flops"] / (2 * 1.819e9) < 0.95
    convs = kinds(g, "convolution")
    assert len(convs) == 20
    assert types(convs[:1]) == ["1x224x224x3xf32", "7x7x3x64xf32"]
    assert types(convs[-1:], "result_types") == ["1x7x7x512xf32"]


def test_resnet_width_norm_dtype_and_optimizers():
    g = load(f"zoo:resnet?{SMALL_RESNET}&norm=none&dtype=bf16&step=infer")
    convs = kinds(g, "convolution")
    assert types(convs[:1]) == ["8x32x32x3xbf16", "7x7x3x8xbf16"]           # 64 × 0.125 channels
    assert not kinds(g, "rsqrt")
    sgd = load(f"zoo:resnet?{SMALL_RESNET}&step=train&optimizer=sgd")
    mom = load(f"zoo:resnet?{SMALL_RESNET}&step=train&optimizer=momentum")
    adam = load(f"zoo:resnet?{SMALL_RESNET}&step=train&optimizer=adam")
    n_params = 20 * 3 + 2                                       # conv kernel + BN scale/bias, fc weight/bias
    n_stats = 20 * 2
    assert len(sgd.inputs) == n_params + n_stats + 2            # + images, labels
    assert len(mom.inputs) == 2 * n_params + n_stats + 2        # + velocity
    assert len(adam.inputs) == 3 * n_params + 1 + n_stats + 2   # + first and second moments, step
    assert len(kinds(adam, "sqrt")) >= n_params


def test_resnet_data_parallel_shard_map_has_one_all_reduce_per_gradient():
    single = load(f"zoo:resnet?{SMALL_RESNET}&step=train")
    dp = load(f"zoo:resnet?{SMALL_RESNET}&step=train&devices=4&parallel=dp")
    assert dp.n_devices == 4
    params = single.inputs[:62]
    reduces = kinds(dp, "all_reduce")
    assert all(op.attrs["replica_groups"] == [[0, 1, 2, 3]] for op in reduces)
    # one per parameter gradient, one per batch-norm running statistic (mean and var of 20 norms), the loss
    assert Counter(types(reduces)) == Counter([str(t) for t in params] + ["8xf32"] * 2 * 5 + ["16xf32"] * 2 * 5
                                              + ["32xf32"] * 2 * 5 + ["64xf32"] * 2 * 5 + ["f32"])
    assert types(kinds(dp, "convolution")[:1]) == ["2x32x32x3xf32", "7x7x3x8xf32"]   # batch/devices images
    assert not any(op.is_collective for op in single.ops)


def test_resnet_compiler_partitioned_data_parallel_combines_gradients():
    g = load(f"zoo:resnet?{SMALL_RESNET}&step=train&norm=none&devices=4&parallel=dp-partitioned")
    assert g.n_devices == 4
    assert "2x32x32x3xf32" in [str(t) for t in g.inputs]        # the per-device batch shard
    reduced = sorted(t.numel for op in g.ops if op.is_collective for t in op.operand_types)
    params = load(f"zoo:resnet?{SMALL_RESNET}&step=train&norm=none").inputs[:-2]
    assert reduced == sorted([t.numel for t in params] + [1])   # every gradient and the loss, once
    assert len([op for op in g.ops if op.is_collective]) < len(params)   # XLA combined them


def test_resnet_fsdp_gathers_parameters_and_reduce_scatters_gradients():
    g = load(f"zoo:resnet?{SMALL_RESNET}&step=train&devices=4&parallel=fsdp")
    gathers, scatters = kinds(g, "all_gather"), kinds(g, "reduce_scatter")
    # every parameter's last dimension (8…64 channels, 1000 classes) divides by 4: all are sharded
    assert len(gathers) == len(scatters) == 62
    assert Counter(types(gathers, "result_types")) == Counter(types(scatters))    # full shapes in, shards out
    assert Counter(types(gathers)) == Counter(types(scatters, "result_types"))
    assert "7x7x3x2xf32" in types(gathers)                        # the stem kernel's shard, gathered
    assert len(kinds(g, "all_reduce")) == 20 * 2 + 1             # running statistics and the loss


def test_resnet_export_is_deterministic():
    spec = f"zoo:resnet?{SMALL_RESNET}&step=train&devices=4&parallel=dp"     # cached by the dp test
    first = zoo_program(spec)
    assert isinstance(first, str) and first == export_in_subprocess(*parse_zoo_spec(spec), spec)


def test_simulate_cli_runs_a_resnet(capsys):
    from hespas_ml.cli.main import main

    assert main(["simulate", "zoo:resnet?depth=18&batch=8&image=64", "--system", "ring:4x150"]) == 0
    out = capsys.readouterr().out
    assert "step time" in out and "(4 devices)" in out
    comm = next(line for line in out.splitlines() if line.startswith("nodes"))
    assert " 0 communication" not in comm                          # the data-parallel gradients are all-reduced
