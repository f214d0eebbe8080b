"""Zoo family ``efficientnet``: EfficientNet-B0…B7 (Tan & Le, 2019), as an inference or training step.

The B0 network is a 3×3/2 stem of 32 channels, seven stages of MBConv blocks (:mod:`.mbconv`) — 1×1
expansion (×6; none in the first stage), 3×3 or 5×5 depthwise convolution, squeeze-excitation to a
quarter of the block's *input* width (SiLU, sigmoid gate), 1×1 linear projection — of widths
16-24-40-80-112-192-320 and 1-2-2-3-3-4-1 blocks, and a 1×1 head convolution to 1280 channels; SiLU
(swish) after every convolution but the projections. A variant scales it by compound coefficients:

=======  =====  =====  ==========
variant  width  depth  resolution
=======  =====  =====  ==========
b0       1.0    1.0    224
b1       1.0    1.1    240
b2       1.1    1.2    260
b3       1.2    1.4    300
b4       1.4    1.8    380
b5       1.6    2.2    456
b6       1.8    2.6    528
b7       2.0    3.1    600
=======  =====  =====  ==========

Channels are multiplied by ``width`` and rounded to multiples of 8, block counts by ``depth`` and
rounded up (as the torchvision models do); ``width``, ``depth`` and ``image`` override the variant's
(0 keeps it). Batch norm, ``step``, ``optimizer``, ``devices`` and ``parallel`` as in ``mobilenet``.
Weights are never allocated: the step is exported from ``jax.ShapeDtypeStruct`` s.
"""
from __future__ import annotations

import math
from typing import Any

from . import mbconv as M
from .base import ZooEntry, ZooParam
from .vision_common import check_step, make_divisible, step_params

# variant -> (width, depth, resolution)
VARIANTS = {
    "b0": (1.0, 1.0, 224), "b1": (1.0, 1.1, 240), "b2": (1.1, 1.2, 260), "b3": (1.2, 1.4, 300),
    "b4": (1.4, 1.8, 380), "b5": (1.6, 2.2, 456), "b6": (1.8, 2.6, 528), "b7": (2.0, 3.1, 600),
}
# B0 stages: (expansion, kernel, stride, channels, blocks)
STAGES = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
          (6, 5, 2, 192, 4), (6, 3, 1, 320, 1))
STEM = 32

PARAMS = (
    ZooParam("variant", str, "b0", "compound scaling of width, depth and resolution (b0 … b7)",
             choices=tuple(VARIANTS)),
    ZooParam("width", float, 0.0, "channel multiplier (0: the variant's)", minimum=0.0, maximum=8.0),
    ZooParam("depth", float, 0.0, "block-count multiplier (0: the variant's)", minimum=0.0, maximum=8.0),
    ZooParam("image", int, 0, "input resolution, square, 3 channels (0: the variant's)", minimum=0,
             maximum=2048),
    *step_params(),
)


def scaling(p: dict[str, Any]) -> tuple[float, float, int]:
    """``(width, depth, image)`` after the variant's defaults are filled in."""
    w, d, r = VARIANTS[p["variant"]]
    return p["width"] or w, p["depth"] or d, p["image"] or r


def plan(p: dict[str, Any]) -> M.Plan:
    """The layer plan of the EfficientNet ``p`` describes."""
    width, depth, _ = scaling(p)
    cin = make_divisible(STEM * width)
    stem = M.Conv(3, 2, 3, cin, "silu")
    blocks = []
    for t, k, s, c, n in STAGES:
        cout = make_divisible(c * width)
        for i in range(math.ceil(n * depth)):
            squeeze = (max(1, cin // 4), "silu", "sigmoid")
            blocks.append(M.block(cin, make_divisible(cin * t), cout, k, s if i == 0 else 1, "silu", squeeze))
            cin = cout
    head = M.Conv(1, 1, cin, 4 * cin, "silu")
    return M.Plan(stem, tuple(blocks), head, hidden=0, hidden_act="none", classes=p["classes"])


def forward_flops(p: dict[str, Any]) -> dict[str, int]:
    """See :func:`.mbconv.forward_flops` (global batch)."""
    return M.forward_flops(plan(p), scaling(p)[2], p["batch"])


def check(p: dict[str, Any]) -> str | None:
    image = scaling(p)[2]
    if image < 16:
        return f"image={image} is below the minimum 16"
    return check_step(p, M.largest_activation(plan(p), image, p["batch"]), "batch, image or width")


def generate(p: dict[str, Any]) -> str | bytes:
    """The EfficientNet step's StableHLO (text; bytecode for the compiler-partitioned forms)."""
    from .cnn import export_cnn_step

    net = plan(p)

    def apply(w, s, x, train):
        return M.apply(net, w, s, x, train)

    return export_cnn_step({**p, "image": scaling(p)[2]}, M.param_shapes(net), M.state_shapes(net), apply,
                           net.classes, name=f"zoo_efficientnet_{p['variant']}_{p['step']}")


ENTRY = ZooEntry(
    name="efficientnet",
    description="EfficientNet-B0…B7 (MBConv: depthwise convolutions, squeeze-excitation, SiLU; compound "
                "scaling); inference or training step (SGD/momentum/Adam); data parallel or FSDP",
    params=PARAMS,
    generate=generate,
    check=check,
)
