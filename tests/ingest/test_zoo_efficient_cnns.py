"""Zoo families ``mobilenet``, ``efficientnet``, ``convnext`` and ``swin`` (and depthwise ``conv``): specs,
parameter counts against the published models, FLOPs against counts written from the papers' layer
tables, the depthwise convolutions and their backward passes, shifted windows, one clear line per bad
spec."""
from __future__ import annotations

from collections import Counter
from math import prod

import pytest

from hespas_ml.ingest import IngestError
from hespas_ml.ingest.zoo import ZOO, canonical_spec, load_zoo, parse_zoo_spec
from hespas_ml.ingest.zoo import convnext as convnext_family
from hespas_ml.ingest.zoo import efficientnet as efficientnet_family
from hespas_ml.ingest.zoo import mbconv
from hespas_ml.ingest.zoo import mobilenet as mobilenet_family
from hespas_ml.ingest.zoo import swin as swin_family
from hespas_ml.costs import graph_cost
from tests.ingest.zoo_checks import kinds, load, matrix_flops

pytestmark = pytest.mark.slow   # exports programs, starts workers, builds datasets or trains

FAMILIES = ("mobilenet", "efficientnet", "convnext", "swin")
SMALL = "image=32&batch=2&classes=10"
MOBILENET_V2 = f"zoo:mobilenet?version=2&{SMALL}"
MOBILENET_V3 = f"zoo:mobilenet?version=3&{SMALL}"
EFFICIENTNET = f"zoo:efficientnet?variant=b0&{SMALL}"
CONVNEXT = f"zoo:convnext?variant=atto&{SMALL}"
# 16×16 patches of 2×2 pixels; stages of 16, 8, 4 tokens a side: windows of 4 (shifted by 2), 4 (shifted),
# and one 4×4 window (no shift); heads of 12 channels
SWIN = "zoo:swin?image=32&patch=2&window=4&d_model=24&depths=2,2,2&heads=2,4,8&batch=2&classes=10"


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HESPAS_ML_CACHE", str(tmp_path_factory.mktemp("hespas-cache")))
        yield


def params_of(spec: str) -> dict:
    return parse_zoo_spec(spec)[1]


def leaves(tree) -> list[tuple[int, ...]]:
    if isinstance(tree, dict):
        return [s for v in tree.values() for s in leaves(v)]
    if isinstance(tree, list):
        return [s for v in tree for s in leaves(v)]
    return [tree]


def n_params(shapes) -> int:
    return sum(prod(s) for s in leaves(shapes))


def grouped(ops) -> list:
    return [op for op in ops if (op.attrs.get("feature_group_count") or 1) > 1]


def batch_grouped(ops) -> list:
    return [op for op in ops if (op.attrs.get("batch_group_count") or 1) > 1]


# -- an independent count of the work, from the layer tables ------------------------------------------

class Work:
    """Forward multiply-adds × 2 of a square NHWC network, layer by layer: convolutions padded by
    (k-1)/2 (only kernel taps that read real input count, as XLA counts them) and dense layers."""

    def __init__(self, batch: int, image: int):
        self.batch, self.size, self.flops, self.first = batch, image, 0, 0

    def conv(self, k: int, stride: int, cin: int, cout: int, groups: int = 1, pad: int | None = None):
        pad = (k - 1) // 2 if pad is None else pad
        out = (self.size + 2 * pad - k) // stride + 1
        taps = sum(0 <= o * stride - pad + t < self.size for o in range(out) for t in range(k))
        flops = 2 * self.batch * taps * taps * (cin // groups) * cout
        self.first = self.first or flops
        self.flops += flops
        self.size = out

    def dense(self, rows: int, cin: int, cout: int):
        self.flops += 2 * rows * cin * cout


def mobilenet_v2_work(batch: int, image: int, classes: int) -> Work:
    """Table 2 of the MobileNet-V2 paper (width 1.0): (expansion t, channels c, repeats n, stride s)."""
    w = Work(batch, image)
    w.conv(3, 2, 3, 32)
    cin = 32
    for t, c, n, s in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                       (6, 320, 1, 1)]:
        for i in range(n):
            e = cin * t
            if t != 1:
                w.conv(1, 1, cin, e)
            w.conv(3, s if i == 0 else 1, e, e, groups=e)
            w.conv(1, 1, e, c)
            cin = c
    w.conv(1, 1, 320, 1280)
    w.dense(batch, 1280, classes)
    return w


# MobileNet-V3 Large (Table 1 of the paper): kernel, expanded, out, squeeze units of SE (0: none), stride
V3_LARGE = [(3, 16, 16, 0, 1), (3, 64, 24, 0, 2), (3, 72, 24, 0, 1), (5, 72, 40, 24, 2), (5, 120, 40, 32, 1),
            (5, 120, 40, 32, 1), (3, 240, 80, 0, 2), (3, 200, 80, 0, 1), (3, 184, 80, 0, 1), (3, 184, 80, 0, 1),
            (3, 480, 112, 120, 1), (3, 672, 112, 168, 1), (5, 672, 160, 168, 2), (5, 960, 160, 240, 1),
            (5, 960, 160, 240, 1)]


def mobilenet_v3_work(batch: int, image: int, classes: int) -> Work:
    w = Work(batch, image)
    w.conv(3, 2, 3, 16)
    cin = 16
    for k, e, c, se, s in V3_LARGE:
        if e != cin:
            w.conv(1, 1, cin, e)
        w.conv(k, s, e, e, groups=e)
        if se:
            w.dense(batch, e, se)
            w.dense(batch, se, e)
        w.conv(1, 1, e, c)
        cin = c
    w.conv(1, 1, 160, 960)
    w.dense(batch, 960, 1280)
    w.dense(batch, 1280, classes)
    return w


# EfficientNet-B0 (Table 1 of the paper): expansion, kernel, stride, channels, layers
B0 = [(1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3), (6, 5, 2, 192, 4),
      (6, 3, 1, 320, 1)]


def efficientnet_b0_work(batch: int, image: int, classes: int) -> Work:
    w = Work(batch, image)
    w.conv(3, 2, 3, 32)
    cin = 32
    for t, k, s, c, n in B0:
        for i in range(n):
            e = cin * t
            if t != 1:
                w.conv(1, 1, cin, e)
            w.conv(k, s if i == 0 else 1, e, e, groups=e)
            w.dense(batch, e, cin // 4)          # squeeze-excitation: a quarter of the block's input width
            w.dense(batch, cin // 4, e)
            w.conv(1, 1, e, c)
            cin = c
    w.conv(1, 1, 320, 1280)
    w.dense(batch, 1280, classes)
    return w


def convnext_work(batch: int, image: int, classes: int, depths, dims) -> Work:
    w = Work(batch, image)
    w.conv(4, 4, 3, dims[0], pad=0)
    for i, (n, d) in enumerate(zip(depths, dims)):
        if i:
            w.conv(2, 2, dims[i - 1], d, pad=0)
        for _ in range(n):
            size = w.size
            w.conv(7, 1, d, d, groups=d)
            w.dense(batch * size * size, d, 4 * d)
            w.dense(batch * size * size, 4 * d, d)
    w.dense(batch, dims[-1], classes)
    return w


def swin_work(batch: int, image: int, classes: int, patch: int, d: int, depths, window: int) -> Work:
    w = Work(batch, image)
    w.conv(patch, patch, 3, d, pad=0)
    side = image // patch
    for i, n in enumerate(depths):
        c = d << i
        if i:
            side //= 2
            w.dense(batch * side * side, 2 * c, c)      # the merged 2×2 neighbours: 4 · c/2 channels
        tokens, win = batch * side * side, min(window, side) ** 2
        for _ in range(n):
            w.dense(tokens, c, 3 * c)                 # q, k, v
            w.flops += 2 * 2 * tokens * win * c       # scores and weighted values, all heads, within windows
            w.dense(tokens, c, c)                     # output projection
            w.dense(tokens, c, 4 * c)
            w.dense(tokens, 4 * c, c)
    w.dense(batch, d << (len(depths) - 1), classes)
    return w


# -- specs ----------------------------------------------------------------------------------------

def test_families_are_registered_with_documented_parameters():
    common = {"image", "classes", "batch", "dtype", "step", "optimizer", "devices", "parallel"}
    assert common | {"version", "width"} <= {p.name for p in ZOO["mobilenet"].params}
    assert common | {"variant", "width", "depth"} <= {p.name for p in ZOO["efficientnet"].params}
    assert common | {"variant", "depths", "dims"} <= {p.name for p in ZOO["convnext"].params}
    assert common | {"variant", "d_model", "depths", "heads", "window", "patch"} <= {p.name for p in ZOO["swin"].params}
    for name in FAMILIES:
        entry = ZOO[name]
        assert all(p.help for p in entry.params) and entry.description
        assert parse_zoo_spec(f"zoo:{name}")[1] == entry.defaults()
        for key in ("optimizer", "parallel", "dtype", "step"):
            assert entry.param(key).choices == ZOO["resnet"].param(key).choices, (name, key)


def test_stage_lists_have_one_spelling():
    a = params_of("zoo:convnext?depths= 2, 02,6,2&dims=40,80,160,320")
    b = params_of("zoo:convnext?dims=40,80,160,320&depths=2,2,6,2&variant=tiny")
    assert a["depths"] == "2,2,6,2" and canonical_spec("convnext", a) == canonical_spec("convnext", b)
    assert convnext_family.stages(a) == convnext_family.stages(params_of("zoo:convnext?variant=atto"))
    assert params_of("zoo:swin?heads=VARIANT")["heads"] == "variant"


@pytest.mark.parametrize("spec, message", [
    ("zoo:mobilenet?version=1", "version=1 is below the minimum 2"),
    ("zoo:mobilenet?batch=10&devices=4", "batch=10 is not divisible by devices=4"),
    ("zoo:mobilenet?batch=65536&image=2048", "the largest activation would hold"),
    ("zoo:mobilenet?optimizer=lamb", "optimizer=lamb is not one of sgd, momentum, adam"),
    ("zoo:mobilenet?parallel=tp", "parallel=tp is not one of dp, dp-partitioned, fsdp, fsdp-partitioned"),
    ("zoo:efficientnet?variant=b9", "variant=b9 is not one of b0, b1, b2, b3, b4, b5, b6, b7"),
    ("zoo:efficientnet?image=8", "image=8 is below the minimum 16"),
    ("zoo:efficientnet?variant=b7&batch=8192", "the largest activation would hold"),
    ("zoo:convnext?image=100", "image=100 is not divisible by 32 (the stem divides it by 4 and each of the 3"),
    ("zoo:convnext?depths=2,2,2&dims=64,128", "depths has 3 stages but dims has 2"),
    ("zoo:convnext?depths=2,x", "depths=2,x is not a list of integers"),
    ("zoo:convnext?dims=0,8", "dims=0,8 has a value outside 1..65536"),
    ("zoo:convnext?batch=6&devices=4&parallel=fsdp", "batch=6 is not divisible by devices=4"),
    ("zoo:swin?image=226", "patch=4 does not divide image=226"),
    ("zoo:swin?image=200", "the 50×50 patch grid is not divisible by 2^3=8"),
    ("zoo:swin?window=5", "stage 1: the 56×56 token map does not divide into window=5 windows"),
    ("zoo:swin?d_model=100", "stage 1: width 100 (d_model·2^0) is not divisible by heads=3"),
    ("zoo:swin?depths=2,2&heads=3,6,12", "depths has 2 stages but heads has 3"),
])
def test_impossible_combinations_are_rejected_in_one_line(spec, message):
    with pytest.raises(IngestError) as info:
        parse_zoo_spec(spec)
    assert message in str(info.value) and "\n" not in str(info.value) and info.value.source == spec


# -- the published models -------------------------------------------------------------------------

@pytest.mark.parametrize("spec, params, gmacs", [
    # torchvision's parameter counts and GMACs (rounded; they also count kernel taps on padding)
    ("zoo:mobilenet?version=2", 3_504_872, 0.30),
    ("zoo:mobilenet?version=3", 5_483_032, 0.22),
    ("zoo:efficientnet?variant=b0", 5_288_548, 0.39),
    ("zoo:efficientnet?variant=b1", 7_794_184, 0.69),
    ("zoo:efficientnet?variant=b3", 12_233_232, 1.83),
    ("zoo:convnext?variant=tiny", 28_589_128, 4.46),
    ("zoo:convnext?variant=base", 88_591_464, 15.36),
    ("zoo:swin?variant=tiny", 28_288_354, 4.49),
    ("zoo:swin?variant=small", 49_606_258, 8.74),
])
def test_published_parameter_counts_and_work(spec, params, gmacs):
    family, p = parse_zoo_spec(f"{spec}&batch=1")
    module = {"mobilenet": mobilenet_family, "efficientnet": efficientnet_family, "convnext": convnext_family,
              "swin": swin_family}[family]
    shapes = mbconv.param_shapes(module.plan(p)) if family in ("mobilenet", "efficientnet") else module.param_shapes(p)
    assert n_params(shapes) == params
    assert 0.97 < module.forward_flops(p)["total"] / (2e9 * gmacs) < 1.01


# -- MobileNet ------------------------------------------------------------------------------------

def test_mobilenet_v2_inference_depthwise_convolutions_and_flops():
    p = params_of(f"{MOBILENET_V2}&step=infer")
    g = load_zoo(f"{MOBILENET_V2}&step=infer")
    assert g.warnings == [] and graph_cost(g)["unmodelled"] == {}
    expected = mobilenet_v2_work(2, 32, 10).flops
    assert matrix_flops(g) == expected == mobilenet_family.forward_flops(p)["total"]
    convs = kinds(g, "convolution")
    assert len(convs) == 1 + 16 * 3 + 2 + 1                       # stem, 17 blocks (the first has no expansion), head
    dw = grouped(convs)
    assert len(dw) == 17
    for op in dw:                                                 # depthwise: one group per channel
        channels = op.operand_types[0].shape[3]
        assert op.attrs["feature_group_count"] == channels == op.result_types[0].shape[3]
        assert op.operand_types[1].shape == (3, 3, 1, channels)
    assert [op.operand_types[1].shape[3] for op in dw[:3]] == [32, 96, 144]
    assert sum(op.attrs["window_strides"] == [2, 2] for op in dw) == 4
    # every trainable parameter, the running statistics (2 per convolution), the images
    n_state = 2 * len(convs)
    assert len(g.inputs) == len(leaves(mbconv.param_shapes(mobilenet_family.plan(p)))) + n_state + 1
    assert sum(t.numel for t in g.inputs[:-1 - n_state]) == 3_504_872 - 1281 * 990      # 10 classes, not 1000
    assert g.inputs[-1].shape == (2, 32, 32, 3)


def test_mobilenet_v3_inference_squeeze_excitation_5x5_kernels_and_flops():
    g = load(f"{MOBILENET_V3}&step=infer&dtype=bf16")
    assert matrix_flops(g) == mobilenet_v3_work(2, 32, 10).flops
    dw = grouped(kinds(g, "convolution"))
    assert len(dw) == 15
    assert Counter(op.operand_types[1].shape[0] for op in dw) == {3: 9, 5: 6}
    assert all(op.attrs["feature_group_count"] == op.operand_types[0].shape[3] for op in dw)
    assert {op.dtype for op in kinds(g, "convolution")} == {"bf16"}
    # squeeze-excitation (two dense layers in 8 blocks), the hidden layer, the classifier
    assert len(kinds(g, "dot_general")) == 2 * 8 + 2
    assert kinds(g, "minimum") and kinds(g, "maximum")            # hard-swish / hard-sigmoid / ReLU clamps


def test_mobilenet_training_has_backward_depthwise_convolutions_and_three_times_the_work():
    w = mobilenet_v2_work(2, 32, 10)
    g = load(f"{MOBILENET_V2}&step=train&optimizer=momentum")
    # backward-data and backward-filter for every convolution but the image's
    assert matrix_flops(g) == 3 * w.flops - w.first
    convs = kinds(g, "convolution")
    assert len(convs) == 3 * 52 - 1
    filters = batch_grouped(convs)                               # depthwise weight gradients
    assert len(filters) == 17
    assert all(op.attrs["batch_group_count"] == op.operand_types[0].shape[3] == op.result_types[0].shape[3]
               for op in filters)
    assert len(grouped(convs)) == 2 * 17                          # forward and input gradient
    assert sum(op.attrs.get("lhs_dilation") == [2, 2] for op in grouped(convs)) == 4    # the strided ones
    n_params = len(leaves(mbconv.param_shapes(mobilenet_family.plan(params_of(MOBILENET_V2)))))
    assert len(g.inputs) == 2 * n_params + 2 * 52 + 2            # params, velocity, statistics, images, labels


def test_mobilenet_data_parallel_all_reduces_every_gradient():
    spec = "zoo:mobilenet?version=3&width=0.5&image=32&batch=4&classes=10&devices=2&parallel=dp"
    g = load(spec)
    assert g.n_devices == 2
    params = leaves(mbconv.param_shapes(mobilenet_family.plan(params_of(spec))))
    reduces = kinds(g, "all_reduce")
    n_bn = len(mobilenet_family.plan(params_of(spec)).convs())
    assert len(reduces) == len(params) + 2 * n_bn + 1             # gradients, running statistics, the loss
    assert all(op.attrs["replica_groups"] == [[0, 1]] for op in reduces)
    assert kinds(g, "convolution")[0].operand_types[0].shape == (2, 32, 32, 3)     # batch / devices


# -- EfficientNet ---------------------------------------------------------------------------------

def test_efficientnet_b0_inference_and_training_flops():
    w = efficientnet_b0_work(2, 32, 10)
    gi = load(f"{EFFICIENTNET}&step=infer")
    assert matrix_flops(gi) == w.flops == efficientnet_family.forward_flops(params_of(EFFICIENTNET))["total"]
    dw = grouped(kinds(gi, "convolution"))
    assert len(dw) == 16 and all(op.attrs["feature_group_count"] == op.operand_types[0].shape[3] for op in dw)
    assert len(kinds(gi, "dot_general")) == 2 * 16 + 1            # squeeze-excitation in every block, classifier
    assert kinds(gi, "exponential")                               # SiLU and the sigmoid gates
    gt = load(f"{EFFICIENTNET}&step=train&optimizer=adam")
    assert matrix_flops(gt) == 3 * w.flops - w.first
    assert len(batch_grouped(kinds(gt, "convolution"))) == 16


def test_efficientnet_variants_scale_width_depth_and_resolution():
    b3 = efficientnet_family.plan(params_of("zoo:efficientnet?variant=b3"))
    assert len(b3.blocks) == 26 and b3.stem.cout == 40 and b3.head.cout == 1536
    assert efficientnet_family.scaling(params_of("zoo:efficientnet?variant=b3&image=64")) == (1.2, 1.4, 64)
    g = load("zoo:efficientnet?variant=b2&width=0.25&depth=0.5&image=32&batch=2&step=infer")
    assert len(grouped(kinds(g, "convolution"))) == 1 + 1 + 1 + 2 + 2 + 2 + 1      # ceil(n/2) blocks per stage


# -- ConvNeXt -------------------------------------------------------------------------------------

def test_convnext_blocks_are_7x7_depthwise_convolutions_and_dense_mlps():
    p = params_of(CONVNEXT)
    w = convnext_work(2, 32, 10, (2, 2, 6, 2), (40, 80, 160, 320))
    gi = load(f"{CONVNEXT}&step=infer")
    assert matrix_flops(gi) == w.flops == convnext_family.forward_flops(p)["total"]
    convs = kinds(gi, "convolution")
    assert len(convs) == 1 + 3 + 12
    assert convs[0].operand_types[1].shape == (4, 4, 3, 40) and convs[0].attrs["window_strides"] == [4, 4]
    dw = grouped(convs)
    assert [op.attrs["feature_group_count"] for op in dw] == [40] * 2 + [80] * 2 + [160] * 6 + [320] * 2
    assert all(op.operand_types[1].shape[:3] == (7, 7, 1) for op in dw)
    assert len(kinds(gi, "dot_general")) == 2 * 12 + 1
    assert len(kinds(gi, "rsqrt")) == 1 + 3 + 12 + 1              # LayerNorms: stem, downsampling, blocks, head
    assert kinds(gi, "erfc")                                      # exact GELU
    assert sum(t.numel for t in gi.inputs[:-1]) == n_params(convnext_family.param_shapes(p))
    gt = load(f"{CONVNEXT}&step=train")
    assert matrix_flops(gt) == 3 * w.flops - w.first
    # the depthwise weight gradients (in backward order)
    assert [op.attrs["batch_group_count"] for op in batch_grouped(kinds(gt, "convolution"))] == \
        [320] * 2 + [160] * 6 + [80] * 2 + [40] * 2


# -- Swin -----------------------------------------------------------------------------------------

def test_swin_windows_shifts_merging_and_flops():
    p = params_of(SWIN)
    w = swin_work(2, 32, 10, 2, 24, (2, 2, 2), 4)
    assert [(s["side"], s["window"], s["shift"]) for s in swin_family.stage_shapes(p)] == [(16, 4, 2), (8, 4, 2),
                                                                                             (4, 4, 0)]
    gi = load(f"{SWIN}&step=infer")
    assert matrix_flops(gi) == w.flops == swin_family.forward_flops(p)["total"]
    scores = [op for op in kinds(gi, "dot_general") if op.result_types[0].shape[-2:] == (16, 16)]
    # per block: [batch·windows, heads, 16, 16] scores of 4×4 windows (16, 4 and 1 windows per image)
    assert [op.result_types[0].shape[:2] for op in scores] == [(32, 2)] * 2 + [(8, 4)] * 2 + [(2, 8)] * 2
    assert len(kinds(gi, "gather")) == 6                          # the relative position bias of every block
    assert all(op.operand_types[0].shape == (49, h) for op, h in zip(kinds(gi, "gather"), (2, 2, 4, 4, 8, 8)))
    assert len(kinds(gi, "compare")) == 2                         # the shift masks of the 2 shifted blocks
    # the rolls (two axes, there and back) of the shifted blocks and the 2 patch mergings
    assert len(kinds(gi, "concatenate")) == 2 * 2 * 2 + 2
    gt = load(f"{SWIN}&step=train&optimizer=adam&dtype=bf16")
    assert matrix_flops(gt) == 3 * w.flops - w.first
    assert len(kinds(gt, "scatter")) == 6                         # the bias tables' gradients
    assert len(kinds(gt, "convolution")) == 2                     # patch embedding and its weight gradient


# -- the conv micro-benchmark, depthwise ----------------------------------------------------------

def test_depthwise_conv_passes_cost_the_same_and_keep_their_groups():
    spec = "zoo:conv?batch=2&h=9&w=9&cin=16&cout=32&groups=16&kernel=5&stride=2"     # channel multiplier 2
    work = Work(2, 9)
    work.conv(5, 2, 16, 32, groups=16, pad=2)                     # SAME: ceil(9/2) = 5 rows
    for pas, attr, groups in (("fwd", "feature_group_count", 16), ("bwd_data", "feature_group_count", 16),
                              ("bwd_filter", "batch_group_count", 16)):
        g = load(f"{spec}&pass={pas}")
        (conv,) = kinds(g, "convolution")
        assert conv.attrs[attr] == groups, pas
        assert graph_cost(g)["flops"] == work.flops, pas
