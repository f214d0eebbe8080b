"""Zoo family ``llama``: a Llama-style decoder-only language model, as an inference or training step.

Token embedding, ``layers`` pre-norm blocks (RMSNorm; grouped-query causal attention with RoPE,
``heads`` query heads sharing ``kv_heads`` key/value heads; SwiGLU MLP of ``ffn`` hidden units), a final
RMSNorm and the LM head (its own matrix, or the embedding transposed with ``tied=true``). The loss is
next-token cross-entropy. ``scan=true`` runs the layers as one ``lax.scan`` over stacked parameters
(a while loop with trip count ``layers``) instead of unrolling them.

``devices=N`` with ``parallel`` = ``dp`` | ``fsdp`` | ``tp`` (shard_map with explicit collectives) or
``dp-partitioned`` | ``fsdp-partitioned`` | ``tp-partitioned`` (XLA's SPMD partitioner); see
:mod:`.parallel`. Under ``tp`` the query/key/value heads and the MLP hidden units are split (Megatron),
and so are the embedding (by vocabulary rows) and the LM head (by vocabulary columns), with Megatron's
vocabulary-parallel cross-entropy. ``mesh=pp:S,dp:D,fsdp:F,tp:T`` (any of them; S·D·F·T = devices) uses
several at once (:func:`~.steps.export_mesh_step`): ``pp`` splits the layers into S consecutive stages run as
a GPipe pipeline of the microbatches ``microbatch`` makes (``schedule=interleaved:V``: V chunks per stage,
each microbatch round the stages V times; without pp they accumulate gradients);
``remat=selective|full`` recomputes activations backward; ``sp=true`` adds Megatron's sequence
parallelism to tp; a ``cp`` axis splits the sequence (context parallelism: keys and values all-gathered).

Example sizes: the defaults have ~20M parameters; Llama-3.2-3B is
``layers=28&d_model=3072&heads=24&kv_heads=8&ffn=8192&vocab=128256&tied=true``.
"""
from __future__ import annotations

from typing import Any

from .base import MAX_DEVICES, ZooEntry, ZooParam
from .checks import ATTENTION_PARAM, MESH_PARAMS, check_heads, check_layout, swiglu_hidden

PARALLEL = ("dp", "fsdp", "tp", "dp-partitioned", "fsdp-partitioned", "tp-partitioned")

PARAMS = (
    ZooParam("layers", int, 4, "decoder blocks", minimum=1, maximum=512),
    ZooParam("d_model", int, 512, "model (residual stream) width", minimum=2, maximum=65536),
    ZooParam("heads", int, 8, "query heads (head size d_model/heads, even)", minimum=1, maximum=1024),
    ZooParam("kv_heads", int, 0, "key/value heads, dividing heads (0: as many as heads)", minimum=0,
             maximum=1024),
    ZooParam("ffn", int, 0, "SwiGLU hidden units (0: 8/3·d_model rounded up to a multiple of 128)",
             minimum=0, maximum=1 << 20),
    ZooParam("vocab", int, 8192, "vocabulary size", minimum=2, maximum=1 << 22),
    ZooParam("seq", int, 256, "sequence length", minimum=1, maximum=1 << 20),
    ZooParam("batch", int, 8, "global batch size (sequences)", minimum=1, maximum=1 << 20),
    ZooParam("tied", bool, False, "LM head is the embedding table transposed"),
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


def sizes(p: dict[str, Any]) -> dict[str, int]:
    """Derived sizes: ``kv_heads`` and ``ffn`` with their automatic values filled in, ``head_dim``."""
    kv = p["kv_heads"] or p["heads"]
    ffn = p["ffn"] or swiglu_hidden(p["d_model"])
    return {"kv_heads": kv, "ffn": ffn, "head_dim": p["d_model"] // p["heads"]}


def parameter_count(p: dict[str, Any]) -> int:
    """Number of trainable parameters of the model ``p`` describes."""
    s = sizes(p)
    d, hd = p["d_model"], s["head_dim"]
    attn = d * p["heads"] * hd * 2 + d * s["kv_heads"] * hd * 2
    per_layer = attn + 3 * d * s["ffn"] + 2 * d
    return p["layers"] * per_layer + p["vocab"] * d * (1 if p["tied"] else 2) + d


def check(p: dict[str, Any]) -> str | None:
    """A message when the combination of parameters is impossible, else None."""
    s = sizes(p)
    problem = check_heads(p["d_model"], p["heads"], s["kv_heads"], rope=True)
    if problem:
        return problem
    tp = {"heads": p["heads"], "kv_heads": s["kv_heads"], "ffn": s["ffn"], "vocab": p["vocab"]}
    return check_layout(p, tp_dims=tp)


def generate(p: dict[str, Any]) -> str | bytes:
    """The Llama step's StableHLO (text; bytecode for a ``-partitioned`` strategy on several devices)."""
    import jax
    import jax.numpy as jnp

    from . import transformer as tf
    from .steps import LayeredModel, export_family_step

    s = sizes(p)
    dtype = jnp.bfloat16 if p["dtype"] == "bf16" else jnp.float32
    d, hd, ffn, vocab, tied = p["d_model"], s["head_dim"], s["ffn"], p["vocab"], p["tied"]

    def sd(*shape):
        return jax.ShapeDtypeStruct(shape, dtype)

    layer = tf.decoder_attention_shapes(d, p["heads"], s["kv_heads"], dtype)
    layer.update(mlp_norm=sd(d), w_gate=sd(d, ffn), w_up=sd(d, ffn), w_down=sd(ffn, d))
    top = {"embed": sd(vocab, d), "final_norm": sd(d)}
    if not tied:
        top["head"] = sd(d, vocab)

    def embed(t, inputs, col):
        (tokens,) = inputs
        x = tf.vocab_embed(t["embed"], tokens, col)
        if "cp" in col.mesh_axes:        # this device's part of the sequence: its positions' rotations
            return x, tuple(col.cp_shard(a, axis=0) for a in tf.rope_tables(p["seq"], hd, t["embed"].dtype))
        return x, tf.rope_tables(tokens.shape[1], hd, t["embed"].dtype)

    def head(t, x, ctx, col):
        return tf.vocab_head(tf.rms_norm(x, t["final_norm"]), t["embed"].T if tied else t["head"], col)

    def block(lp, x, rope, col):
        x = tf.decoder_attention(lp, x, hd, rope, col, fused=p["attention"] == "fused")
        h = col.enter_tp(tf.rms_norm(x, lp["mlp_norm"]))
        return x + col.exit_tp(tf.swiglu(h, lp["w_gate"], lp["w_up"], lp["w_down"]))

    tokens = jax.ShapeDtypeStruct((p["batch"], p["seq"]), jnp.int32)
    model = LayeredModel(
        top=top, layer=layer, layers=p["layers"], inputs=(tokens,), targets=tokens,
        embed=embed,
        block=block,
        head=head,
        loss=tf.vocab_loss,
        tp_top=tf.VOCAB_PARALLEL_TP,
        tp_layer={**tf.DECODER_ATTENTION_TP, "w_gate": 1, "w_up": 1, "w_down": 0},
        pp_shared=("embed",) if tied else (),
    )
    return export_family_step(model, p, "llama")


def forward_flops(p: dict[str, Any]) -> int:
    """Analytical matmul FLOPs of one forward pass (multiply-add = 2), global batch: every projection
    (q, k, v, o, gate, up, down, LM head) plus the two attention products over the full (masked)
    ``seq × seq`` score matrix. A training step does three times this many."""
    s = sizes(p)
    d, hd, tokens = p["d_model"], s["head_dim"], p["batch"] * p["seq"]
    proj = d * p["heads"] * hd * 2 + d * s["kv_heads"] * hd * 2 + 3 * d * s["ffn"]
    attn = 2 * p["seq"] * p["heads"] * hd
    return 2 * tokens * (p["layers"] * (proj + attn) + d * p["vocab"])


ENTRY = ZooEntry(
    name="llama",
    description="Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU); inference or training step; "
                "dp/fsdp/tp explicit or compiler-partitioned",
    params=PARAMS,
    generate=generate,
    check=check,
    version=5,  # under FSDP each layer's parameters are gathered again in the backward
)

