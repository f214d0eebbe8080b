"""Zoo family ``convnext``: a ConvNeXt (Liu et al., 2022), as an inference or training step.

NHWC activations, HWIO kernels. A 4×4/4 patchify stem convolution and a LayerNorm; stages of ConvNeXt
blocks, with a downsampling layer (LayerNorm, 2×2/2 convolution doubling the width) between stages;
global average pooling, a LayerNorm and the classifier. A block is

    x + γ · W₂ · GELU(W₁ · LayerNorm(dwconv₇ₓ₇(x)))

— a 7×7 depthwise convolution (``feature_group_count`` = channels, padding 3) with bias, a LayerNorm
over the channels, a dense expansion to 4× the width with GELU, a dense projection back, and a learned
per-channel layer scale γ (the 1×1 layers are dense layers on the channels-last map, as in the
reference implementation; no stochastic depth).

``variant`` picks the blocks per stage and widths: ``atto`` (2,2,6,2; 40…320), ``femto`` (48…384),
``pico`` (64…512), ``nano`` (2,2,8,2; 80…640) — the sizes of ConvNeXt-V2 — and ``tiny`` (3,3,9,3;
96…768), ``small`` (3,3,27,3; 96…768), ``base`` (3,3,27,3; 128…1024); ``depths`` and ``dims`` override
them (one integer per stage). ``step``, ``optimizer``, ``devices`` and ``parallel`` as in ``resnet``
(:func:`.cnn.export_cnn_step`); there are no running statistics. Weights are never allocated: the step is
exported from ``jax.ShapeDtypeStruct`` s.
"""
from __future__ import annotations

from typing import Any

from .base import ZooEntry, ZooParam
from .vision_common import IntsParam, check_step, ints_or, real_taps, step_params

# variant -> (blocks per stage, widths per stage)
VARIANTS = {
    "atto": ((2, 2, 6, 2), (40, 80, 160, 320)),
    "femto": ((2, 2, 6, 2), (48, 96, 192, 384)),
    "pico": ((2, 2, 6, 2), (64, 128, 256, 512)),
    "nano": ((2, 2, 8, 2), (80, 160, 320, 640)),
    "tiny": ((3, 3, 9, 3), (96, 192, 384, 768)),
    "small": ((3, 3, 27, 3), (96, 192, 384, 768)),
    "base": ((3, 3, 27, 3), (128, 256, 512, 1024)),
}
STEM, DOWN, KERNEL, EXPANSION = 4, 2, 7, 4

PARAMS = (
    ZooParam("variant", str, "tiny", "blocks per stage and widths: atto, femto, pico, nano (ConvNeXt-V2 sizes), "
             "tiny, small, base", choices=tuple(VARIANTS)),
    IntsParam("depths", str, "variant", "blocks per stage, e.g. 3,3,9,3 (variant: the variant's)"),
    IntsParam("dims", str, "variant", "width of every stage, e.g. 96,192,384,768 (variant: the variant's)"),
    ZooParam("image", int, 224, "input resolution (square images, 3 channels; divisible by 4·2^(stages-1))",
             minimum=4, maximum=4096),
    *step_params(),
)


def stages(p: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(depths, dims)`` after the variant's defaults are filled in."""
    depths, dims = VARIANTS[p["variant"]]
    return ints_or(p["depths"], depths), ints_or(p["dims"], dims)


def sizes(p: dict[str, Any]) -> list[int]:
    """Spatial size of every stage."""
    depths, _ = stages(p)
    return [p["image"] // STEM // DOWN ** i for i in range(len(depths))]


def check(p: dict[str, Any]) -> str | None:
    depths, dims = stages(p)
    if len(depths) != len(dims):
        return f"depths has {len(depths)} stages but dims has {len(dims)}"
    scale = STEM * DOWN ** (len(depths) - 1)
    if p["image"] % scale:
        return (f"image={p['image']} is not divisible by {scale} (the stem divides it by {STEM} and each of the "
                f"{len(depths) - 1} downsampling layers by {DOWN})")
    largest = p["batch"] * max(p["image"] ** 2 * 3, *(s * s * EXPANSION * d for s, d in zip(sizes(p), dims)))
    return check_step(p, largest, "batch, image or dims")


def param_shapes(p: dict[str, Any]) -> list[Any]:
    """Trainable shapes in layer order: ``[stem, (downsample,) block, …, head]``."""
    depths, dims = stages(p)
    layers: list[Any] = [{"w": (STEM, STEM, 3, dims[0]), "b": (dims[0],), "ln_g": (dims[0],), "ln_b": (dims[0],)}]
    for i, (n, d) in enumerate(zip(depths, dims)):
        if i:
            c = dims[i - 1]
            layers.append({"ln_g": (c,), "ln_b": (c,), "w": (DOWN, DOWN, c, d), "b": (d,)})
        for _ in range(n):
            layers.append({"dw_w": (KERNEL, KERNEL, 1, d), "dw_b": (d,), "ln_g": (d,), "ln_b": (d,),
                           "w1": (d, EXPANSION * d), "b1": (EXPANSION * d,), "w2": (EXPANSION * d, d), "b2": (d,),
                           "gamma": (d,)})
    c = dims[-1]
    layers.append({"ln_g": (c,), "ln_b": (c,), "w": (c, p["classes"]), "b": (p["classes"],)})
    return layers


def forward_flops(p: dict[str, Any]) -> dict[str, int]:
    """Analytical matmul/convolution FLOPs of one forward pass (multiply-add = 2; 7×7 taps on padding not
    counted, as XLA counts them), global batch: ``first`` (the stem, whose input gradient a training step
    skips) and ``total``. A training step does ``3 · total − first``."""
    depths, dims = stages(p)
    b = p["batch"]
    first = 2 * b * (p["image"] // STEM) ** 2 * STEM * STEM * 3 * dims[0]
    total = first
    for i, (n, d, s) in enumerate(zip(depths, dims, sizes(p))):
        if i:
            total += 2 * b * s * s * DOWN * DOWN * dims[i - 1] * d
        taps = real_taps(s, KERNEL, 1, KERNEL // 2)
        total += n * (2 * b * taps * taps * d + 2 * 2 * b * s * s * d * EXPANSION * d)
    return {"first": first, "total": total + 2 * b * dims[-1] * p["classes"]}


def generate(p: dict[str, Any]) -> str | bytes:
    """The ConvNeXt step's StableHLO (text; bytecode for the compiler-partitioned forms)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from .cnn import export_cnn_step
    from .transformer import layer_norm

    depths, dims = stages(p)
    dn = ("NHWC", "HWIO", "NHWC")

    def apply(w, s, x, train):
        t = w[0]
        x = lax.conv_general_dilated(x, t["w"], (STEM, STEM), "VALID", dimension_numbers=dn) + t["b"]
        x = layer_norm(x, t["ln_g"], t["ln_b"])
        i = 1
        for stage, (n, d) in enumerate(zip(depths, dims)):
            if stage:
                t = w[i]
                i += 1
                x = layer_norm(x, t["ln_g"], t["ln_b"])
                x = lax.conv_general_dilated(x, t["w"], (DOWN, DOWN), "VALID", dimension_numbers=dn) + t["b"]
            for _ in range(n):
                t = w[i]
                i += 1
                pad = KERNEL // 2
                h = lax.conv_general_dilated(x, t["dw_w"], (1, 1), ((pad, pad), (pad, pad)), dimension_numbers=dn,
                                             feature_group_count=d) + t["dw_b"]
                h = layer_norm(h, t["ln_g"], t["ln_b"])
                h = jax.nn.gelu(h @ t["w1"] + t["b1"], approximate=False)
                x = x + t["gamma"] * (h @ t["w2"] + t["b2"])
        t = w[-1]
        x = layer_norm(jnp.mean(x, axis=(1, 2)), t["ln_g"], t["ln_b"])
        return x @ t["w"] + t["b"], s

    return export_cnn_step(p, param_shapes(p), [], apply, p["classes"],
                           name=f"zoo_convnext_{p['variant']}_{p['step']}")


ENTRY = ZooEntry(
    name="convnext",
    description="ConvNeXt (patchify stem, 7×7 depthwise convolutions, LayerNorm, inverted-bottleneck GELU MLP, "
                "layer scale; atto … base); inference or training step (SGD/momentum/Adam); data parallel or FSDP",
    params=PARAMS,
    generate=generate,
    check=check,
)
