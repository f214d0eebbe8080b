"""Zoo family ``unet``: a U-Net for per-pixel classification (segmentation), as an inference or training step.

NHWC activations, HWIO kernels. ``depth`` levels; level ``i`` has ``base·2^i`` channels and works at
``image/2^i`` pixels. Each level's block is two 3×3 convolutions (symmetric padding 1), each followed by
group norm (``norm=group``; a per-channel bias with ``norm=none``) and ReLU.

* Encoder: the block of level ``i``, then a 2×2/2 max-pool down to level ``i+1``; the last level is the
  bottleneck.
* Decoder, from level ``depth-2`` up to 0: upsample the level below ×2 to ``base·2^i`` channels —
  ``upsample=transpose``: a 2×2/2 transposed convolution (an lhs-dilated convolution);
  ``nearest`` / ``bilinear``: ``jax.image.resize`` (gathers / interpolation matrices applied with
  dot_general) then a 3×3 convolution — concatenate the encoder's output of the same level (the skip
  connection) and run the level's block on the ``2·base·2^i`` channels.
* Head: a 1×1 convolution with bias to ``classes`` logits per pixel. ``step=train``: mean per-pixel softmax
  cross-entropy against integer labels ``[batch, image, image]``, backward pass and an SGD or Adam update.

``devices=N`` with ``parallel`` = ``dp`` | ``fsdp`` (shard_map, explicit collectives) or
``dp-partitioned`` | ``fsdp-partitioned`` (XLA's SPMD partitioner); see :mod:`.parallel`. The step is run
by :func:`.steps.export_step` with every parameter in its ``top`` group (no repeated layers).

Weights are never allocated: the step is exported from ``jax.ShapeDtypeStruct`` s.
"""
from __future__ import annotations

from typing import Any

from .base import MAX_DEVICES, ZooEntry, ZooParam
from .checks import check_parallel

PARALLEL = ("dp", "fsdp", "dp-partitioned", "fsdp-partitioned")
MAX_ACTIVATION_ELEMENTS = 1 << 32      # the largest activation tensor (global batch) may hold this many
GN_EPS = 1e-5

PARAMS = (
    ZooParam("depth", int, 4, "levels of the U, the last one the bottleneck (image halves per level)",
             minimum=1, maximum=10),
    ZooParam("base", int, 32, "channels at level 0 (doubling per level)", minimum=1, maximum=4096),
    ZooParam("image", int, 64, "input height and width (divisible by 2^(depth-1))", minimum=1, maximum=8192),
    ZooParam("in_channels", int, 3, "channels of the input image", minimum=1, maximum=4096),
    ZooParam("classes", int, 2, "logits per pixel", minimum=2, maximum=65536),
    ZooParam("batch", int, 4, "global batch size (images)", minimum=1, maximum=1 << 16),
    ZooParam("norm", str, "group", "group: group norm after every 3×3 convolution; none: a bias instead",
             choices=("group", "none")),
    ZooParam("groups", int, 8, "group-norm groups (dividing base)", minimum=1, maximum=4096),
    ZooParam("upsample", str, "transpose", "transpose: 2×2/2 transposed convolution; nearest | bilinear: "
             "jax.image.resize ×2, then a 3×3 convolution", choices=("transpose", "nearest", "bilinear")),
    ZooParam("dtype", str, "f32", "element type of parameters and activations (norm statistics: f32)",
             choices=("f32", "bf16")),
    ZooParam("step", str, "train", "infer: forward only; train: forward, backward and update",
             choices=("infer", "train")),
    ZooParam("optimizer", str, "sgd", "update rule of a training step", choices=("sgd", "adam")),
    ZooParam("devices", int, 1, "devices the step runs on", minimum=1, maximum=MAX_DEVICES),
    ZooParam("parallel", str, "dp", "how several devices share the step: dp, fsdp (shard_map, explicit "
             "collectives) or the same with -partitioned (XLA's SPMD partitioner)", choices=PARALLEL),
)


def channels(p: dict[str, Any]) -> list[int]:
    """Channels of every level, ``base·2^i``."""
    return [p["base"] << i for i in range(p["depth"])]


def largest_activation(p: dict[str, Any]) -> int:
    """Elements of the largest activation tensor of the step (global batch): at level 0 the concatenated
    skip (``2·base`` channels) or the input / logits at full resolution; deeper levels are smaller."""
    widest = max(2 * p["base"] if p["depth"] > 1 else p["base"], p["in_channels"], p["classes"])
    return p["batch"] * p["image"] ** 2 * widest


def check(p: dict[str, Any]) -> str | None:
    """A message when the combination of parameters is impossible, else None."""
    scale = 1 << (p["depth"] - 1)
    if p["image"] % scale:
        return f"image={p['image']} is not divisible by 2^(depth-1)={scale} (depth={p['depth']} halves it " \
               f"{p['depth'] - 1} times)"
    if p["norm"] == "group" and p["base"] % p["groups"]:
        return f"groups={p['groups']} does not divide base={p['base']} (group norm splits every level's channels)"
    n = largest_activation(p)
    if n > MAX_ACTIVATION_ELEMENTS:
        return (f"the largest activation would hold {n} elements (limit {MAX_ACTIVATION_ELEMENTS}); "
                "lower batch, image or base")
    return check_parallel(p, tp_dims={})


# -- the layer plan (shapes only) -------------------------------------------------------------------

def conv_plan(p: dict[str, Any]) -> list[tuple[str, int, int, int, int]]:
    """Every convolution in program order: ``(name, kernel, cin, cout, output size)``. Names end in
    ``_c1``/``_c2`` (block convolutions), ``_up`` (upsampling; a transposed convolution with
    ``upsample=transpose``) or are ``head``."""
    ch, size = channels(p), p["image"]
    plan = []
    cin = p["in_channels"]
    for i, c in enumerate(ch):
        s = size >> i
        plan += [(f"enc{i}_c1", 3, cin, c, s), (f"enc{i}_c2", 3, c, c, s)]
        cin = c
    up_k = 2 if p["upsample"] == "transpose" else 3
    for i in reversed(range(p["depth"] - 1)):
        c, s = ch[i], size >> i
        plan += [(f"dec{i}_up", up_k, ch[i + 1], c, s), (f"dec{i}_c1", 3, 2 * c, c, s), (f"dec{i}_c2", 3, c, c, s)]
    plan.append(("head", 1, ch[0], p["classes"], size))
    return plan


def param_shapes(p: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Trainable parameter shapes by name: ``<conv>_w`` (HWIO); block convolutions carry group-norm
    ``<conv>_scale`` and ``<conv>_bias`` (``norm=group``) or a ``<conv>_b`` bias; upsampling and head
    convolutions a ``<conv>_b`` bias."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, k, cin, cout, _ in conv_plan(p):
        shapes[f"{name}_w"] = (k, k, cin, cout)
        if p["norm"] == "group" and name.endswith(("_c1", "_c2")):
            shapes[f"{name}_scale"] = (cout,)
            shapes[f"{name}_bias"] = (cout,)
        else:
            shapes[f"{name}_b"] = (cout,)
    return shapes


def parameter_count(p: dict[str, Any]) -> int:
    """Number of trainable parameters of the model ``p`` describes."""
    total = 0
    for shape in param_shapes(p).values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def _taps(k: int, size: int) -> int:
    """(output, kernel tap) pairs along one axis of a k×k stride-1 convolution padded by (k-1)/2 on a
    ``size`` axis that read a real input element (taps on padding are not work)."""
    pad = (k - 1) // 2
    return sum(min(size - 1, size - 1 + pad - t) - max(0, pad - t) + 1 for t in range(k))


def forward_flops(p: dict[str, Any], batch: int | None = None) -> dict[str, int]:
    """Analytical matmul/convolution FLOPs of one forward pass (multiply-add = 2, taps on padding not
    counted, as XLA counts them) for ``batch`` images (default: the global batch): ``first`` (the first
    convolution, whose input gradient a training step skips), ``resize`` (the interpolation matrices of
    ``upsample=bilinear``) and ``total``. A training step does ``3 · total − first − resize`` (the image
    and the interpolation matrices need no gradient). ``resize`` is exact when the bottleneck is larger
    than 1×1 (for a 1×1 input jax's einsum multiplies the two interpolation matrices first)."""
    b = p["batch"] if batch is None else batch
    total = first = resize = 0
    for name, k, cin, cout, s in conv_plan(p):
        if name.endswith("_up") and k == 2:
            positions = s * s                    # a 2×2/2 transposed convolution: one tap per output pixel
        else:
            positions = _taps(k, s) ** 2
        flops = 2 * b * positions * cin * cout
        total += flops
        first = first or flops
        if name.endswith("_up") and p["upsample"] == "bilinear":
            h = s // 2                           # rows, then columns: [s, h] weights on [b, h, h, cin] …
            resize += 2 * b * s * h * h * cin + 2 * b * s * s * h * cin
    return {"first": first, "resize": resize, "total": total + resize}


# -- the generator ------------------------------------------------------------------------------------

def generate(p: dict[str, Any]) -> str | bytes:
    """The U-Net step's StableHLO (text; bytecode for a ``-partitioned`` strategy on several devices)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from . import transformer as tf
    from .cnn_layers import conv2d
    from .steps import LayeredModel, export_family_step

    dtype = jnp.bfloat16 if p["dtype"] == "bf16" else jnp.float32
    group_norm = p["norm"] == "group"
    depth, groups = p["depth"], p["groups"]
    top = {k: jax.ShapeDtypeStruct(s, dtype) for k, s in param_shapes(p).items()}

    def norm_relu(t, name, x):
        """Group norm (statistics in f32) or a bias, then ReLU."""
        if not group_norm:
            return jax.nn.relu(x + t[f"{name}_b"])
        b, h, w, c = x.shape
        xf = x.astype(jnp.float32).reshape(b, h, w, groups, c // groups)
        mean = jnp.mean(xf, axis=(1, 2, 4), keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=(1, 2, 4), keepdims=True)
        y = ((xf - mean) * lax.rsqrt(var + GN_EPS)).reshape(b, h, w, c)
        y = y * t[f"{name}_scale"].astype(jnp.float32) + t[f"{name}_bias"].astype(jnp.float32)
        return jax.nn.relu(y.astype(x.dtype))

    def block(t, name, x):
        x = norm_relu(t, f"{name}_c1", conv2d(x, t[f"{name}_c1_w"], 1))
        return norm_relu(t, f"{name}_c2", conv2d(x, t[f"{name}_c2_w"], 1))

    def max_pool(x):
        init = np.array(-np.inf, x.dtype)     # concrete, so jax uses its differentiable max-pool
        return lax.reduce_window(x, init, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

    def up(t, name, x):
        w = t[f"{name}_w"]
        if p["upsample"] == "transpose":
            y = lax.conv_transpose(x, w, (2, 2), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        else:
            b, h, wd, c = x.shape
            y = conv2d(jax.image.resize(x, (b, 2 * h, 2 * wd, c), method=p["upsample"]), w, 1)
        return y + t[f"{name}_b"]

    def forward(t, inputs, col):
        (x,) = inputs
        skips = []
        for i in range(depth):
            x = block(t, f"enc{i}", x)
            if i < depth - 1:
                skips.append(x)
                x = max_pool(x)
        for i in reversed(range(depth - 1)):
            x = jnp.concatenate([up(t, f"dec{i}_up", x), skips[i]], axis=-1)
            x = block(t, f"dec{i}", x)
        return conv2d(x, t["head_w"], 1) + t["head_b"], None

    images = jax.ShapeDtypeStruct((p["batch"], p["image"], p["image"], p["in_channels"]), dtype)
    labels = jax.ShapeDtypeStruct((p["batch"], p["image"], p["image"]), jnp.int32)
    model = LayeredModel(
        top=top, layer={}, layers=0, inputs=(images,), targets=labels,
        embed=forward, block=lambda lp, x, ctx, col: x, head=lambda t, x, ctx, col: x, loss=lambda out, targets, col: tf.cross_entropy(out, targets),
    )
    return export_family_step(model, p, "unet")


ENTRY = ZooEntry(
    name="unet",
    description="U-Net (conv blocks with group norm, max-pool down, transposed-conv or resize up, skip "
                "concatenation, 1×1 head); inference or per-pixel cross-entropy training step; dp/fsdp "
                "explicit or compiler-partitioned",
    params=PARAMS,
    generate=generate,
    check=check,
    version=3,  # under FSDP each layer's parameters are gathered again in the backward
)
