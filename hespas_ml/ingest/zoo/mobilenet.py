"""Zoo family ``mobilenet``: MobileNet-V2 or MobileNet-V3 (Large), as an inference or training step.

The networks are inverted-residual stacks (:mod:`.mbconv`) with the layer tables of the papers (and of
the torchvision models):

* ``version=2`` (Sandler et al., 2018): a 3×3/2 stem of 32 channels; 17 blocks — 1×1 expansion (×6,
  none in the first block), 3×3 depthwise, 1×1 linear projection — of widths 16-24-32-64-96-160-320; a
  1×1 head convolution to 1280 channels; ReLU6 everywhere but the projections.
* ``version=3`` (Howard et al., 2019; the Large model): a 3×3/2 stem of 16 channels; 15 blocks with 3×3
  or 5×5 depthwise kernels, expansion widths from the table, squeeze-excitation (a quarter of the
  expanded width, ReLU, hard-sigmoid gate) in 8 of them, ReLU in the early blocks and hard-swish in the
  later ones; a 1×1 head convolution to 960 channels, then after pooling a dense layer to 1280 units
  (hard-swish) before the classifier.

``width`` multiplies every channel count (rounded to a multiple of 8, as the references do; the last
1280 of V2 is scaled only by ``width`` > 1). Batch norm after every convolution: batch statistics and
updated running statistics in a training step, running statistics in inference. ``step``, ``optimizer``,
``devices`` and ``parallel`` as in ``resnet`` (:func:`.cnn.export_cnn_step`). Weights are never allocated:
the step is exported from ``jax.ShapeDtypeStruct`` s.
"""
from __future__ import annotations

from typing import Any

from . import mbconv as M
from .base import ZooEntry, ZooParam
from .vision_common import check_step, make_divisible, step_params

# MobileNet-V2: (expansion, channels, blocks, stride of the first block)
V2_BLOCKS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
             (6, 320, 1, 1))
V2_STEM, V2_LAST = 32, 1280
# MobileNet-V3 Large: (kernel, expanded, channels, squeeze-excitation, activation, stride)
V3_BLOCKS = (
    (3, 16, 16, False, "relu", 1), (3, 64, 24, False, "relu", 2), (3, 72, 24, False, "relu", 1),
    (5, 72, 40, True, "relu", 2), (5, 120, 40, True, "relu", 1), (5, 120, 40, True, "relu", 1),
    (3, 240, 80, False, "hswish", 2), (3, 200, 80, False, "hswish", 1), (3, 184, 80, False, "hswish", 1),
    (3, 184, 80, False, "hswish", 1), (3, 480, 112, True, "hswish", 1), (3, 672, 112, True, "hswish", 1),
    (5, 672, 160, True, "hswish", 2), (5, 960, 160, True, "hswish", 1), (5, 960, 160, True, "hswish", 1),
)
V3_STEM, V3_LAST = 16, 1280

PARAMS = (
    ZooParam("version", int, 2, "2: MobileNet-V2 (ReLU6); 3: MobileNet-V3 Large (squeeze-excitation, "
             "hard-swish, 5×5 depthwise kernels)", minimum=2, maximum=3),
    ZooParam("width", float, 1.0, "channel multiplier (channels rounded to multiples of 8)", minimum=0.1,
             maximum=4.0),
    ZooParam("image", int, 224, "input resolution (square images, 3 channels)", minimum=16, maximum=2048),
    *step_params(),
)


def plan(p: dict[str, Any]) -> M.Plan:
    """The layer plan of the MobileNet ``p`` describes."""
    width, classes = p["width"], p["classes"]
    if p["version"] == 2:
        cin = make_divisible(V2_STEM * width)
        stem = M.Conv(3, 2, 3, cin, "relu6")
        blocks = []
        for t, c, n, s in V2_BLOCKS:
            cout = make_divisible(c * width)
            for i in range(n):
                blocks.append(M.block(cin, cin * t, cout, 3, s if i == 0 else 1, "relu6", None))
                cin = cout
        head = M.Conv(1, 1, cin, make_divisible(V2_LAST * max(1.0, width)), "relu6")
        return M.Plan(stem, tuple(blocks), head, hidden=0, hidden_act="none", classes=classes)

    def adjust(c: int) -> int:
        return make_divisible(c * width)

    cin = adjust(V3_STEM)
    stem = M.Conv(3, 2, 3, cin, "hswish")
    blocks = []
    for k, expanded, c, se, act, s in V3_BLOCKS:
        exp = adjust(expanded)
        squeeze = (make_divisible(exp // 4), "relu", "hsigmoid") if se else None
        blocks.append(M.block(cin, exp, adjust(c), k, s, act, squeeze))
        cin = adjust(c)
    head = M.Conv(1, 1, cin, 6 * cin, "hswish")
    return M.Plan(stem, tuple(blocks), head, hidden=adjust(V3_LAST), hidden_act="hswish", classes=classes)


def forward_flops(p: dict[str, Any]) -> dict[str, int]:
    """See :func:`.mbconv.forward_flops` (global batch)."""
    return M.forward_flops(plan(p), p["image"], p["batch"])


def check(p: dict[str, Any]) -> str | None:
    return check_step(p, M.largest_activation(plan(p), p["image"], p["batch"]), "batch, image or width")


def generate(p: dict[str, Any]) -> str | bytes:
    """The MobileNet step's StableHLO (text; bytecode for the compiler-partitioned forms)."""
    from .cnn import export_cnn_step

    net = plan(p)

    def apply(w, s, x, train):
        return M.apply(net, w, s, x, train)

    return export_cnn_step(p, M.param_shapes(net), M.state_shapes(net), apply, net.classes,
                           name=f"zoo_mobilenet_v{p['version']}_{p['step']}")


ENTRY = ZooEntry(
    name="mobilenet",
    description="MobileNet-V2 / V3-Large (inverted residuals with depthwise convolutions; V3: squeeze-excitation, "
                "hard-swish); inference or training step (SGD/momentum/Adam); data parallel or FSDP",
    params=PARAMS,
    generate=generate,
    check=check,
)
