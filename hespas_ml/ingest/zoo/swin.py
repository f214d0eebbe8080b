"""Zoo family ``swin``: a Swin Transformer classifier (Liu et al., 2021), as an inference or training step.

NHWC token maps. Patch embedding (a ``patch``×``patch`` convolution with stride ``patch``, then a
LayerNorm) to ``d_model`` channels; stages of Swin blocks, with patch merging between stages (the 2×2
neighbours concatenated to 4× the channels, a LayerNorm and a dense layer to 2×, halving the map);
a final LayerNorm, global average pooling and the classifier. A block is pre-LayerNorm windowed
multi-head self-attention, then a GELU MLP of 4× the width, each with a residual:

* the map is cut into non-overlapping ``window``×``window`` windows (reshape and transpose) and every
  window attends within itself: a dense q/k/v projection with biases, scaled scores plus a relative
  position bias — a learned ``[(2·window−1)², heads]`` table gathered by a constant index — softmax in
  f32, the output projection;
* every second block shifts the windows by ``window/2``: the map is rolled by −window/2 before the
  partition and back after, and the scores of token pairs that come from different regions of the
  unrolled map get −100 (a mask compared from constant region ids in the program).

A stage whose map is no larger than ``window`` uses one window of the whole map and no shift (as the
reference implementation does). ``variant`` picks ``d_model``, ``depths`` and ``heads``: ``tiny`` (96;
2,2,6,2; 3,6,12,24), ``small`` (96; 2,2,18,2; 3,6,12,24), ``base`` (128; 2,2,18,2; 4,8,16,32); each can be
given instead (one integer per stage). ``step``, ``optimizer``, ``devices`` and ``parallel`` as in
``resnet`` (:func:`.cnn.export_cnn_step`). Weights are never allocated: the step is exported from
``jax.ShapeDtypeStruct`` s.
"""
from __future__ import annotations

from typing import Any

from .base import ZooEntry, ZooParam
from .vision_common import IntsParam, check_step, ints_or, step_params

# variant -> (d_model, blocks per stage, heads per stage)
VARIANTS = {
    "tiny": (96, (2, 2, 6, 2), (3, 6, 12, 24)),
    "small": (96, (2, 2, 18, 2), (3, 6, 12, 24)),
    "base": (128, (2, 2, 18, 2), (4, 8, 16, 32)),
}
MLP_RATIO = 4
MASKED = -100.0

PARAMS = (
    ZooParam("variant", str, "tiny", "d_model, blocks and heads per stage: tiny, small, base",
             choices=tuple(VARIANTS)),
    ZooParam("d_model", int, 0, "channels of the first stage, doubling per stage (0: the variant's)", minimum=0,
             maximum=65536),
    IntsParam("depths", str, "variant", "Swin blocks per stage, e.g. 2,2,6,2 (variant: the variant's)"),
    IntsParam("heads", str, "variant", "attention heads per stage, e.g. 3,6,12,24 (variant: the variant's)"),
    ZooParam("window", int, 7, "attention window side (tokens)", minimum=1, maximum=256),
    ZooParam("patch", int, 4, "patch side of the embedding (pixels)", minimum=1, maximum=256),
    ZooParam("image", int, 224, "input resolution (square images, 3 channels)", minimum=1, maximum=8192),
    *step_params(),
)


def config(p: dict[str, Any]) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """``(d_model, depths, heads)`` after the variant's defaults are filled in."""
    d, depths, heads = VARIANTS[p["variant"]]
    return p["d_model"] or d, ints_or(p["depths"], depths), ints_or(p["heads"], heads)


def stage_shapes(p: dict[str, Any]) -> list[dict[str, int]]:
    """Per stage: ``side`` (of the token map), ``dim``, ``heads``, ``blocks``, ``window`` and ``shift``
    (of the odd blocks; 0 when the map fits one window)."""
    d, depths, heads = config(p)
    out = []
    for i, (n, h) in enumerate(zip(depths, heads)):
        side = p["image"] // p["patch"] >> i
        window = min(p["window"], side)
        shift = window // 2 if side > p["window"] else 0
        out.append({"side": side, "dim": d << i, "heads": h, "blocks": n, "window": window, "shift": shift})
    return out


def check(p: dict[str, Any]) -> str | None:
    d, depths, heads = config(p)
    if len(depths) != len(heads):
        return f"depths has {len(depths)} stages but heads has {len(heads)}"
    if p["image"] % p["patch"]:
        return f"patch={p['patch']} does not divide image={p['image']}"
    grid, merges = p["image"] // p["patch"], len(depths) - 1
    if grid % (1 << merges):
        return (f"the {grid}×{grid} patch grid is not divisible by 2^{merges}={1 << merges} (each of the {merges} "
                "patch-merging layers halves it)")
    largest = p["batch"] * p["image"] ** 2 * 3
    for i, s in enumerate(stage_shapes(p)):
        if s["dim"] % s["heads"]:
            return f"stage {i + 1}: width {s['dim']} (d_model·2^{i}) is not divisible by heads={s['heads']}"
        if s["side"] % s["window"]:
            return (f"stage {i + 1}: the {s['side']}×{s['side']} token map does not divide into "
                    f"window={p['window']} windows")
        tokens = p["batch"] * s["side"] ** 2
        largest = max(largest, tokens * MLP_RATIO * s["dim"], tokens * s["heads"] * s["window"] ** 2)
    return check_step(p, largest, "batch, image or d_model")


def param_shapes(p: dict[str, Any]) -> list[Any]:
    """Trainable shapes in layer order: ``[embed, (merge,) block, …, head]``."""
    d = config(p)[0]
    layers: list[Any] = [{"w": (p["patch"], p["patch"], 3, d), "b": (d,), "ln_g": (d,), "ln_b": (d,)}]
    for i, s in enumerate(stage_shapes(p)):
        c = s["dim"]
        if i:
            layers.append({"ln_g": (2 * c,), "ln_b": (2 * c,), "w": (2 * c, c)})
        m = MLP_RATIO * c
        for _ in range(s["blocks"]):
            layers.append({"ln1_g": (c,), "ln1_b": (c,), "wqkv": (c, 3 * c), "bqkv": (3 * c,),
                           "table": ((2 * s["window"] - 1) ** 2, s["heads"]), "wo": (c, c), "bo": (c,),
                           "ln2_g": (c,), "ln2_b": (c,), "w1": (c, m), "b1": (m,), "w2": (m, c), "b2": (c,)})
    c = stage_shapes(p)[-1]["dim"]
    layers.append({"ln_g": (c,), "ln_b": (c,), "w": (c, p["classes"]), "b": (p["classes"],)})
    return layers


def forward_flops(p: dict[str, Any]) -> dict[str, int]:
    """Analytical matmul/convolution FLOPs of one forward pass (multiply-add = 2), global batch: ``first``
    (the patch embedding, whose input gradient a training step skips) and ``total`` (with every
    projection, both attention products within the windows, the merges and the head). A training step
    does ``3 · total − first``."""
    b, d = p["batch"], config(p)[0]
    stages = stage_shapes(p)
    first = 2 * b * stages[0]["side"] ** 2 * p["patch"] ** 2 * 3 * d
    total = first
    for i, s in enumerate(stages):
        c, tokens, n = s["dim"], b * s["side"] ** 2, s["window"] ** 2
        if i:
            total += 2 * tokens * (2 * c) * c                          # 4·(c/2) channels in, c out
        total += s["blocks"] * (2 * tokens * (3 * c * c + c * c + 2 * MLP_RATIO * c * c) + 2 * 2 * tokens * n * c)
    return {"first": first, "total": total + 2 * b * stages[-1]["dim"] * p["classes"]}


def _relative_index(window: int):
    """``[N, N]`` (N = window²) row of the bias table for each pair of positions in a window."""
    import numpy as np

    coords = np.stack(np.meshgrid(np.arange(window), np.arange(window), indexing="ij")).reshape(2, -1)
    rel = coords[:, :, None] - coords[:, None, :] + (window - 1)
    return (rel[0] * (2 * window - 1) + rel[1]).astype(np.int32)


def _region_ids(side: int, window: int, shift: int):
    """``[windows, N]`` region of every token of every window of the rolled map (tokens of different
    regions must not attend to each other)."""
    import numpy as np

    ids = np.zeros((side, side), np.int32)
    bands = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    for r, rows in enumerate(bands):
        for c, cols in enumerate(bands):
            ids[rows, cols] = 3 * r + c
    k = side // window
    return ids.reshape(k, window, k, window).transpose(0, 2, 1, 3).reshape(k * k, window * window)


def generate(p: dict[str, Any]) -> str | bytes:
    """The Swin step's StableHLO (text; bytecode for the compiler-partitioned forms)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from .cnn import export_cnn_step
    from .transformer import layer_norm

    stages = stage_shapes(p)
    patch = p["patch"]

    def windows(x, w):
        b, h, wd, c = x.shape
        x = x.reshape(b, h // w, w, wd // w, w, c).transpose(0, 1, 3, 2, 4, 5)
        return x.reshape(b * (h // w) * (wd // w), w * w, c)

    def unwindows(x, w, b, h, wd):
        c = x.shape[-1]
        x = x.reshape(b, h // w, wd // w, w, w, c).transpose(0, 1, 3, 2, 4, 5)
        return x.reshape(b, h, wd, c)

    def attention(t, x, s, shift):
        b, h, wd, c = x.shape
        w, heads = s["window"], s["heads"]
        n, hd = w * w, c // heads
        if shift:
            x = jnp.roll(x, (-shift, -shift), axis=(1, 2))
        xw = windows(x, w)
        qkv = (xw @ t["wqkv"] + t["bqkv"]).reshape(xw.shape[0], n, 3, heads, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bnhd,bmhd->bhnm", q * jnp.asarray(hd ** -0.5, q.dtype), k).astype(jnp.float32)
        bias = t["table"][_relative_index(w)]                          # [n, n, heads]
        scores = scores + bias.transpose(2, 0, 1).astype(jnp.float32)
        if shift:
            ids = jnp.asarray(_region_ids(h, w, shift))                # compared in the program
            mask = jnp.where(ids[:, :, None] != ids[:, None, :], MASKED, 0.0).astype(jnp.float32)
            nw = ids.shape[0]
            scores = (scores.reshape(b, nw, heads, n, n) + mask[None, :, None]).reshape(b * nw, heads, n, n)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        o = jnp.einsum("bhnm,bmhd->bnhd", probs, v).reshape(-1, n, c) @ t["wo"] + t["bo"]
        o = unwindows(o, w, b, h, wd)
        return jnp.roll(o, (shift, shift), axis=(1, 2)) if shift else o

    def apply(w, s, x, train):
        t = w[0]
        x = lax.conv_general_dilated(x, t["w"], (patch, patch), "VALID",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC")) + t["b"]
        x = layer_norm(x, t["ln_g"], t["ln_b"])
        i = 1
        for stage, st in enumerate(stages):
            if stage:
                t = w[i]
                i += 1
                x = jnp.concatenate([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], axis=-1)
                x = layer_norm(x, t["ln_g"], t["ln_b"]) @ t["w"]
            for j in range(st["blocks"]):
                t = w[i]
                i += 1
                x = x + attention(t, layer_norm(x, t["ln1_g"], t["ln1_b"]), st, st["shift"] if j % 2 else 0)
                h = jax.nn.gelu(layer_norm(x, t["ln2_g"], t["ln2_b"]) @ t["w1"] + t["b1"], approximate=False)
                x = x + h @ t["w2"] + t["b2"]
        t = w[-1]
        x = jnp.mean(layer_norm(x, t["ln_g"], t["ln_b"]), axis=(1, 2))
        return x @ t["w"] + t["b"], s

    return export_cnn_step(p, param_shapes(p), [], apply, p["classes"], name=f"zoo_swin_{p['variant']}_{p['step']}")


ENTRY = ZooEntry(
    name="swin",
    description="Swin Transformer (window attention with shifted windows, relative position bias, patch merging; "
                "tiny/small/base); inference or training step (SGD/momentum/Adam); data parallel or FSDP",
    params=PARAMS,
    generate=generate,
    check=check,
)
