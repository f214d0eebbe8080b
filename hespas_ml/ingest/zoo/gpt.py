"""Zoo family ``gpt``: a GPT-style decoder-only language model (GPT-2 / Megatron-LM), as an inference or
training step.

Token embedding plus a learned position embedding, ``layers`` pre-norm blocks (LayerNorm; causal multi-head
attention with biases; a GELU MLP of ``ffn`` hidden units, 4·d_model by default), a final LayerNorm and the LM
head: the embedding transposed (``tied=true``, the default, as GPT-2 and Megatron) or its own matrix. The
vocabulary is padded as Megatron-LM pads it: up to a multiple of 128 × the tensor-parallel size (GPT-2's
50,257 tokens become 50,304 on one device, 51,200 with tp 8). The loss is next-token cross-entropy.
``scan=true`` runs the layers as one ``lax.scan``. Its LayerNorms and GELU are Megatron-LM's fused kernels:
their backward keeps their inputs (and a norm's row statistics) and recomputes the rest.

``devices=N`` with ``parallel`` = ``dp`` | ``fsdp`` | ``tp`` (explicit collectives) or the same with
``-partitioned``; ``mesh=pp:S,dp:D,fsdp:F,tp:T`` uses several at once, ``pp`` as a GPipe (or with
``schedule=interleaved:V`` an interleaved) pipeline of ``microbatch``-sized microbatches (a tied embedding's
gradient summed over the stages), ``sp=true`` Megatron's sequence parallelism inside tp, a ``cp`` axis the
sequence split (context parallelism), and ``remat``
recomputes activations backward (see :mod:`.llama`). Under tp the heads and the MLP hidden units are split
(Megatron), and so are the token embedding (by vocabulary rows) and the head (by columns), with Megatron's
vocabulary-parallel cross-entropy; the position embedding is replicated, and a split layer's output bias is
added once, after its all-reduce.

Example sizes: GPT-2 small is the default (124M parameters); Megatron-LM's 1.7B GPT is
``layers=24&d_model=2304&heads=24&seq=2048``, its 8.3B ``layers=72&d_model=3072&heads=32&seq=2048``.
"""
from __future__ import annotations

import math
from typing import Any

from .base import MAX_DEVICES, ZooEntry, ZooParam
from .checks import ATTENTION_PARAM, MESH_PARAMS, check_heads, check_layout, parse_mesh

PARALLEL = ("dp", "fsdp", "tp", "dp-partitioned", "fsdp-partitioned", "tp-partitioned")
VOCAB_MULTIPLE = 128          # Megatron-LM's make-vocab-size-divisible-by

PARAMS = (
    ZooParam("layers", int, 12, "decoder blocks", minimum=1, maximum=512),
    ZooParam("d_model", int, 768, "model (residual stream) width", minimum=2, maximum=65536),
    ZooParam("heads", int, 12, "attention heads (head size d_model/heads)", minimum=1, maximum=1024),
    ZooParam("ffn", int, 0, "MLP hidden units (0: 4·d_model)", minimum=0, maximum=1 << 20),
    ZooParam("vocab", int, 50257, "vocabulary size before Megatron's padding", minimum=2, maximum=1 << 22),
    ZooParam("seq", int, 1024, "sequence length (and position embeddings)", minimum=1, maximum=1 << 20),
    ZooParam("batch", int, 8, "global batch size (sequences)", minimum=1, maximum=1 << 20),
    ZooParam("tied", bool, True, "LM head is the embedding table transposed"),
    ZooParam("dtype", str, "f32", "element type of parameters and activations", choices=("f32", "bf16")),
    ZooParam("step", str, "train", "infer: forward only; train: forward, backward and update",
             choices=("infer", "train")),
    ZooParam("optimizer", str, "sgd", "update rule of a training step", choices=("sgd", "adam")),
    ZooParam("scan", bool, False, "layers as one lax.scan over stacked parameters (a while loop)"),
    ZooParam("devices", int, 1, "devices the step runs on", minimum=1, maximum=MAX_DEVICES),
    ZooParam("parallel", str, "dp", "how several devices share the step: dp, fsdp, tp (shard_map, explicit "
             "collectives) or the same with -partitioned (XLA's SPMD partitioner)", choices=PARALLEL),
    *MESH_PARAMS,
    ATTENTION_PARAM,
)


def tensor_parallel(p: dict[str, Any]) -> int:
    """The tensor-parallel size the step runs with (1 without tp)."""
    if p["mesh"]:
        try:
            return parse_mesh(p["mesh"]).get("tp", 1)
        except ValueError:
            return 1
    return p["devices"] if p["parallel"].removesuffix("-partitioned") == "tp" else 1


def sizes(p: dict[str, Any]) -> dict[str, int]:
    """Derived sizes: ``ffn`` with its default filled in, ``head_dim`` and ``padded_vocab``."""
    multiple = VOCAB_MULTIPLE * tensor_parallel(p)
    return {"ffn": p["ffn"] or 4 * p["d_model"], "head_dim": p["d_model"] // p["heads"],
            "padded_vocab": math.ceil(p["vocab"] / multiple) * multiple}


def parameter_count(p: dict[str, Any]) -> int:
    """Number of trainable parameters (the padded vocabulary's rows included, as Megatron counts them)."""
    s = sizes(p)
    d, ffn = p["d_model"], s["ffn"]
    per_layer = 4 * d * d + 4 * d + 2 * d * ffn + ffn + d + 4 * d
    embeddings = s["padded_vocab"] * d * (1 if p["tied"] else 2) + p["seq"] * d
    return p["layers"] * per_layer + embeddings + 2 * d


def check(p: dict[str, Any]) -> str | None:
    """A message when the combination of parameters is impossible, else None."""
    problem = check_heads(p["d_model"], p["heads"])
    if problem:
        return problem
    tp = {"heads": p["heads"], "ffn": sizes(p)["ffn"]}
    return check_layout(p, tp_dims=tp)


def generate(p: dict[str, Any]) -> str | bytes:
    """The GPT step's StableHLO (text; bytecode for a ``-partitioned`` strategy on several devices)."""
    import jax
    import jax.numpy as jnp

    from . import transformer as tf
    from .steps import LayeredModel, export_family_step

    s = sizes(p)
    dtype = jnp.bfloat16 if p["dtype"] == "bf16" else jnp.float32
    d, hd, ffn, vocab, tied = p["d_model"], s["head_dim"], s["ffn"], s["padded_vocab"], p["tied"]

    def sd(*shape):
        return jax.ShapeDtypeStruct(shape, dtype)

    layer = {"ln1_g": sd(d), "ln1_b": sd(d), "wq": sd(d, d), "bq": sd(d), "wk": sd(d, d), "bk": sd(d),
             "wv": sd(d, d), "bv": sd(d), "wo": sd(d, d), "bo": sd(d), "ln2_g": sd(d), "ln2_b": sd(d),
             "w1": sd(d, ffn), "b1": sd(ffn), "w2": sd(ffn, d), "b2": sd(d)}
    top = {"embed": sd(vocab, d), "pos": sd(p["seq"], d), "lnf_g": sd(d), "lnf_b": sd(d)}
    if not tied:
        top["head"] = sd(d, vocab)

    def embed(t, inputs, col):
        (tokens,) = inputs
        x = tf.vocab_embed(t["embed"], tokens, col)
        # the whole table under context parallelism (the tokens are this device's part of the sequence)
        positions = t["pos"][None] if "cp" in col.mesh_axes else t["pos"][None, :tokens.shape[1]]
        return x + col.seq_shard(positions), None

    def block(lp, x, ctx, col):
        h = col.enter_tp(tf.fused_layer_norm(x, lp["ln1_g"], lp["ln1_b"]))
        b, n, _ = h.shape              # the whole sequence (under sequence parallelism x holds a part)
        q, k, v = ((h @ lp[w] + lp[bias]).reshape(b, n, -1, hd)
                   for w, bias in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
        o = tf.causal_attention(q, k, v, col, fused=p["attention"] == "fused").reshape(b, n, -1)
        x = x + col.exit_tp(o @ lp["wo"]) + lp["bo"]
        h = col.enter_tp(tf.fused_layer_norm(x, lp["ln2_g"], lp["ln2_b"]))
        h = tf.fused_gelu(h @ lp["w1"] + lp["b1"])
        return x + col.exit_tp(h @ lp["w2"]) + lp["b2"]

    def head(t, x, ctx, col):
        x = tf.fused_layer_norm(x, t["lnf_g"], t["lnf_b"])
        return tf.vocab_head(x, t["embed"].T if tied else t["head"], col)

    tokens = jax.ShapeDtypeStruct((p["batch"], p["seq"]), jnp.int32)
    model = LayeredModel(
        top=top, layer=layer, layers=p["layers"], inputs=(tokens,), targets=tokens,
        embed=embed, block=block, head=head, loss=tf.vocab_loss, tp_top=tf.VOCAB_PARALLEL_TP,
        tp_layer={"wq": 1, "bq": 0, "wk": 1, "bk": 0, "wv": 1, "bv": 0, "wo": 0, "w1": 1, "b1": 0, "w2": 0},
        pp_shared=("embed",) if tied else (),
    )
    return export_family_step(model, p, "gpt")


def forward_flops(p: dict[str, Any]) -> int:
    """Analytical matmul FLOPs of one forward pass (multiply-add = 2), global batch: the four attention
    projections, the two MLP matrices, the LM head over the padded vocabulary, and the two attention
    products over the full (masked) ``seq × seq`` score matrix. A training step does three times this."""
    s = sizes(p)
    d, tokens = p["d_model"], p["batch"] * p["seq"]
    per_layer = 4 * d * d + 2 * d * s["ffn"] + 2 * p["seq"] * d
    return 2 * tokens * (p["layers"] * per_layer + d * s["padded_vocab"])


ENTRY = ZooEntry(
    name="gpt",
    description="GPT-style decoder (LayerNorm, learned positions, GELU MLP, tied head, Megatron vocabulary "
                "padding); inference or training step; dp/fsdp/tp explicit or compiler-partitioned, or a mesh",
    params=PARAMS,
    generate=generate,
    check=check,
    version=4,  # under FSDP each layer's parameters are gathered again in the backward
)
