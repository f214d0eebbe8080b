"""Zoo family ``vit``: a Vision Transformer classifier, as an inference or training step.

Patch embedding of ``image``×``image``×3 images into (image/patch)² tokens — a convolution with kernel
and stride ``patch`` (``embed=conv``) or a reshape and a dense layer (``embed=dense``) — learned position
embeddings, a class token (``pool=cls``) or mean pooling (``pool=mean``), ``layers`` pre-LayerNorm encoder
blocks (multi-head self-attention with biases; GELU MLP of ``mlp`` hidden units), a final LayerNorm and
the classifier head. The loss is softmax cross-entropy against integer labels. ``scan=true`` runs the
blocks as one ``lax.scan`` (a while loop with trip count ``layers``).

``devices=N`` with ``parallel`` = ``dp`` | ``fsdp`` | ``tp`` (explicit collectives) or
``dp-partitioned`` | ``fsdp-partitioned`` | ``tp-partitioned`` (XLA's SPMD partitioner); see
:mod:`.parallel`. Under ``tp`` the heads and MLP hidden units are split; embeddings and head are
replicated.

Example sizes: the defaults (ViT-S-like width on 32×32 images) have ~11M parameters; ViT-B/16 is
``image=224&patch=16&layers=12&d_model=768&heads=12``.
"""
from __future__ import annotations

from typing import Any

from .base import MAX_DEVICES, ZooEntry, ZooParam
from .checks import check_heads, check_parallel

PARALLEL = ("dp", "fsdp", "tp", "dp-partitioned", "fsdp-partitioned", "tp-partitioned")
CHANNELS = 3

PARAMS = (
    ZooParam("image", int, 32, "image height and width (pixels, 3 channels)", minimum=1, maximum=8192),
    ZooParam("patch", int, 4, "patch height and width (dividing image)", minimum=1, maximum=8192),
    ZooParam("layers", int, 6, "encoder blocks", minimum=1, maximum=512),
    ZooParam("d_model", int, 384, "token width", minimum=1, maximum=65536),
    ZooParam("heads", int, 8, "attention heads (dividing d_model)", minimum=1, maximum=1024),
    ZooParam("mlp", int, 0, "MLP hidden units (0: 4·d_model)", minimum=0, maximum=1 << 20),
    ZooParam("classes", int, 10, "classifier outputs", minimum=1, maximum=1 << 20),
    ZooParam("batch", int, 32, "global batch size (images)", minimum=1, maximum=1 << 20),
    ZooParam("pool", str, "cls", "cls: class token; mean: mean of the patch tokens", choices=("cls", "mean")),
    ZooParam("embed", str, "conv", "patch embedding: conv (stride = patch) or dense (reshape + matmul)",
             choices=("conv", "dense")),
    ZooParam("dtype", str, "f32", "element type of parameters and activations", choices=("f32", "bf16")),
    ZooParam("step", str, "train", "infer: forward only; train: forward, backward and update",
             choices=("infer", "train")),
    ZooParam("optimizer", str, "sgd", "update rule of a training step", choices=("sgd", "adam")),
    ZooParam("scan", bool, False, "blocks as one lax.scan over stacked parameters (a while loop)"),
    ZooParam("devices", int, 1, "devices the step runs on", minimum=1, maximum=MAX_DEVICES),
    ZooParam("parallel", str, "dp", "how several devices share the step: dp, fsdp, tp (shard_map, explicit "
             "collectives) or the same with -partitioned (XLA's SPMD partitioner)", choices=PARALLEL),
)


def sizes(p: dict[str, Any]) -> dict[str, int]:
    """Derived sizes: ``mlp`` filled in, ``patches`` per image, ``tokens`` per image, ``patch_dim``."""
    patches = (p["image"] // p["patch"]) ** 2
    return {"mlp": p["mlp"] or 4 * p["d_model"], "patches": patches,
            "tokens": patches + (1 if p["pool"] == "cls" else 0), "patch_dim": p["patch"] ** 2 * CHANNELS}


def parameter_count(p: dict[str, Any]) -> int:
    """Number of trainable parameters of the model ``p`` describes."""
    s = sizes(p)
    d, m = p["d_model"], s["mlp"]
    per_layer = 4 * d * d + 4 * d + 2 * d * m + m + d + 4 * d
    top = (s["patch_dim"] + 1) * d + s["tokens"] * d + (d if p["pool"] == "cls" else 0) + 2 * d \
        + (d + 1) * p["classes"]
    return p["layers"] * per_layer + top


def check(p: dict[str, Any]) -> str | None:
    """A message when the combination of parameters is impossible, else None."""
    if p["image"] % p["patch"]:
        return f"patch={p['patch']} does not divide image={p['image']}"
    problem = check_heads(p["d_model"], p["heads"])
    if problem:
        return problem
    return check_parallel(p, tp_dims={"heads": p["heads"], "mlp": sizes(p)["mlp"]})


def forward_flops(p: dict[str, Any]) -> dict[str, int]:
    """Analytical matmul/convolution FLOPs of one forward pass (multiply-add = 2), global batch:
    ``patch`` (the patch embedding), ``total`` (with every projection, both attention products and the
    head). A training step does ``3 · total − patch`` (the images need no gradient)."""
    s = sizes(p)
    b, d, t = p["batch"], p["d_model"], s["tokens"]
    patch = 2 * b * s["patches"] * s["patch_dim"] * d
    layer = 2 * b * t * (4 * d * d + 2 * d * s["mlp"]) + 4 * b * t * t * d
    return {"patch": patch, "total": patch + p["layers"] * layer + 2 * b * d * p["classes"]}


def generate(p: dict[str, Any]) -> str | bytes:
    """The ViT step's StableHLO (text; bytecode for a ``-partitioned`` strategy on several devices)."""
    import jax
    import jax.numpy as jnp

    from . import transformer as tf
    from .steps import LayeredModel, export_family_step

    s = sizes(p)
    dtype = jnp.bfloat16 if p["dtype"] == "bf16" else jnp.float32
    d, m, patch, heads = p["d_model"], s["mlp"], p["patch"], p["heads"]
    hd = d // heads
    side = p["image"] // patch

    def sd(*shape):
        return jax.ShapeDtypeStruct(shape, dtype)

    layer = {"ln1_g": sd(d), "ln1_b": sd(d), "wq": sd(d, d), "bq": sd(d), "wk": sd(d, d), "bk": sd(d),
             "wv": sd(d, d), "bv": sd(d), "wo": sd(d, d), "bo": sd(d), "ln2_g": sd(d), "ln2_b": sd(d),
             "w1": sd(d, m), "b1": sd(m), "w2": sd(m, d), "b2": sd(d)}
    kernel = sd(patch, patch, CHANNELS, d) if p["embed"] == "conv" else sd(s["patch_dim"], d)
    top = {"patch_w": kernel, "patch_b": sd(d), "pos": sd(s["tokens"], d), "ln_g": sd(d), "ln_b": sd(d),
           "head_w": sd(d, p["classes"]), "head_b": sd(p["classes"])}
    if p["pool"] == "cls":
        top["cls"] = sd(1, 1, d)

    def embed(t, inputs, col):
        (images,) = inputs
        b = images.shape[0]
        if p["embed"] == "conv":
            x = jax.lax.conv_general_dilated(images, t["patch_w"], (patch, patch), "VALID",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
            x = x.reshape(b, side * side, d)
        else:
            x = images.reshape(b, side, patch, side, patch, CHANNELS).transpose(0, 1, 3, 2, 4, 5)
            x = x.reshape(b, side * side, s["patch_dim"]) @ t["patch_w"]
        x = x + t["patch_b"]
        if p["pool"] == "cls":
            x = jnp.concatenate([jnp.broadcast_to(t["cls"], (b, 1, d)), x], axis=1)
        return x + t["pos"], None

    def block(lp, x, ctx, col):
        b, n, _ = x.shape
        h = col.enter_tp(tf.layer_norm(x, lp["ln1_g"], lp["ln1_b"]))
        q = (h @ lp["wq"] + lp["bq"]).reshape(b, n, -1, hd)
        k = (h @ lp["wk"] + lp["bk"]).reshape(b, n, -1, hd)
        v = (h @ lp["wv"] + lp["bv"]).reshape(b, n, -1, hd)
        o = tf.attention(q, k, v, causal=False).reshape(b, n, -1)
        x = x + col.exit_tp(o @ lp["wo"]) + lp["bo"]
        h = col.enter_tp(tf.layer_norm(x, lp["ln2_g"], lp["ln2_b"]))
        h = jax.nn.gelu(h @ lp["w1"] + lp["b1"], approximate=True)
        return x + col.exit_tp(h @ lp["w2"]) + lp["b2"]

    def head(t, x, ctx, col):
        x = tf.layer_norm(x, t["ln_g"], t["ln_b"])
        pooled = x[:, 0] if p["pool"] == "cls" else jnp.mean(x, axis=1)
        return pooled @ t["head_w"] + t["head_b"]

    images = sd(p["batch"], p["image"], p["image"], CHANNELS)
    labels = jax.ShapeDtypeStruct((p["batch"],), jnp.int32)
    model = LayeredModel(
        top=top, layer=layer, layers=p["layers"], inputs=(images,), targets=labels,
        embed=embed, block=block, head=head, loss=lambda out, targets, col: tf.cross_entropy(out, targets),
        tp_layer={"wq": 1, "bq": 0, "wk": 1, "bk": 0, "wv": 1, "bv": 0, "wo": 0, "w1": 1, "b1": 0, "w2": 0},
    )
    return export_family_step(model, p, "vit")


ENTRY = ZooEntry(
    name="vit",
    description="Vision Transformer (patch embedding, pre-LN encoder, GELU MLP, class token or mean pool); "
                "inference or training step; dp/fsdp/tp explicit or compiler-partitioned",
    params=PARAMS,
    generate=generate,
    check=check,
    version=4,  # under FSDP each layer's parameters are gathered again in the backward
)
