"""Zoo family ``moe``: a mixture-of-experts decoder (Mixtral-style), as an inference or training step.

Token embedding, ``layers`` pre-norm blocks — causal attention with RoPE (``heads`` query heads sharing
``kv_heads`` key/value heads, as in Mixtral; multi-head by default), then a
mixture-of-experts feed-forward layer — a final RMSNorm and the LM head; next-token cross-entropy.
The MoE layer: a linear router and softmax over ``experts``; each token goes to its ``top_k`` experts
with the renormalised top-k probabilities as weights. Experts are SwiGLU MLPs of ``ffn`` hidden units
held as batched weights ``[experts, …]``. Tokens are routed in groups of ``group`` (GShard; default:
one group per sequence): in each group an expert takes at most
``slots = ceil(top_k · group · capacity / experts)`` tokens (first choices before second ones, earlier
tokens first; overflow is dropped). Dispatch and combine are one-hot einsums: ``[groups, group,
experts, slots]`` masks contracted with the tokens / the expert outputs, so their cost grows with the
group size, not with the batch.

``devices=N`` with ``parallel`` = ``dp`` | ``fsdp`` | ``tp`` | ``ep`` (explicit collectives) or the same
with ``-partitioned`` (XLA's SPMD partitioner); see :mod:`.parallel`. Under ``ep`` the experts are split
over the devices, the batch too, and dispatched tokens travel to their experts and back with
``all_to_all``; under ``tp`` heads and every expert's hidden units are split. ``mesh=ep:E,dp:D,tp:T,pp:P``
(any of pp, dp, fsdp, ep, cp, tp) uses several at once, with microbatches, pipeline schedules, recomputation
and master weights as the llama family takes them.

Example sizes: the defaults have ~12M parameters (8 experts); a Mixtral-8x7B-like model is
``layers=32&d_model=4096&heads=32&kv_heads=8&ffn=14336&vocab=32000``.
"""
from __future__ import annotations

import math
from typing import Any

from .base import MAX_DEVICES, ZooEntry, ZooParam
from .checks import MESH_PARAMS, batch_shards, check_heads, check_layout, mesh_of, microbatch_count, swiglu_hidden

PARALLEL = ("dp", "fsdp", "tp", "ep", "dp-partitioned", "fsdp-partitioned", "tp-partitioned", "ep-partitioned")

PARAMS = (
    ZooParam("layers", int, 2, "decoder blocks (each with an MoE feed-forward layer)", minimum=1, maximum=512),
    ZooParam("d_model", int, 256, "model width", minimum=2, maximum=65536),
    ZooParam("heads", int, 8, "query heads (head size d_model/heads, even)", minimum=1, maximum=1024),
    ZooParam("kv_heads", int, 0, "key/value heads, dividing heads (0: as many as heads)", minimum=0,
             maximum=1024),
    ZooParam("experts", int, 8, "experts per MoE layer", minimum=1, maximum=4096),
    ZooParam("top_k", int, 2, "experts each token is sent to", minimum=1, maximum=4096),
    ZooParam("capacity", float, 1.25, "capacity factor: expert slots per token share", minimum=0.01,
             maximum=1024.0),
    ZooParam("group", int, 0, "tokens routed together (0: one sequence); divides the tokens of a device",
             minimum=0, maximum=1 << 24),
    ZooParam("ffn", int, 0, "SwiGLU hidden units per expert (0: 8/3·d_model rounded up to a multiple of 128)",
             minimum=0, maximum=1 << 20),
    ZooParam("vocab", int, 4096, "vocabulary size", minimum=2, maximum=1 << 22),
    ZooParam("seq", int, 128, "sequence length", minimum=1, maximum=1 << 20),
    ZooParam("batch", int, 8, "global batch size (sequences)", minimum=1, maximum=1 << 20),
    ZooParam("dtype", str, "f32", "element type of parameters and activations", choices=("f32", "bf16")),
    ZooParam("step", str, "train", "infer: forward only; train: forward, backward and update",
             choices=("infer", "train")),
    ZooParam("optimizer", str, "sgd", "update rule of a training step", choices=("sgd", "adam")),
    ZooParam("scan", bool, False, "blocks as one lax.scan over stacked parameters (a while loop)"),
    ZooParam("devices", int, 1, "devices the step runs on", minimum=1, maximum=MAX_DEVICES),
    ZooParam("parallel", str, "dp", "how several devices share the step: dp, fsdp, tp, ep (shard_map, "
             "explicit collectives) or the same with -partitioned (XLA's SPMD partitioner)", choices=PARALLEL),
    *MESH_PARAMS,
)


def sizes(p: dict[str, Any]) -> dict[str, int]:
    """Derived sizes: ``ffn`` and ``kv_heads`` with their automatic values filled in, ``head_dim``,
    ``tokens`` an MoE layer sees (a device's share under explicit dp, fsdp and ep; the global batch
    otherwise, which XLA's partitioner then splits), ``group`` (tokens routed together) and ``slots``
    (expert capacity per group)."""
    n = p["devices"]
    if p.get("mesh"):                                            # a microbatch of one batch shard, its part of seq
        mesh = mesh_of(p)
        shards = batch_shards(mesh) * microbatch_count(p, mesh)
        tokens = p["batch"] // shards * p["seq"] // mesh.get("cp", 1) if p["batch"] % shards == 0 else \
            p["batch"] * p["seq"]
    else:
        split = n > 1 and p["parallel"] in ("dp", "fsdp", "ep")    # explicit strategies that split the batch
        tokens = p["batch"] * p["seq"] // (n if split and p["batch"] % n == 0 else 1)
    group = p["group"] or p["seq"]
    slots = max(1, math.ceil(p["top_k"] * group * p["capacity"] / p["experts"]))
    return {"ffn": p["ffn"] or swiglu_hidden(p["d_model"]), "kv_heads": p["kv_heads"] or p["heads"],
            "head_dim": p["d_model"] // p["heads"],
            "tokens": tokens, "group": group, "slots": slots}


def parameter_count(p: dict[str, Any]) -> int:
    """Number of trainable parameters (all experts) of the model ``p`` describes."""
    s = sizes(p)
    d, e, f = p["d_model"], p["experts"], s["ffn"]
    attn = 2 * d * d + 2 * d * s["kv_heads"] * s["head_dim"]         # q and o; k and v
    per_layer = attn + d * e + 3 * e * d * f + 2 * d
    return p["layers"] * per_layer + 2 * p["vocab"] * d + d


def check(p: dict[str, Any]) -> str | None:
    """A message when the combination of parameters is impossible, else None."""
    s = sizes(p)
    problem = check_heads(p["d_model"], p["heads"], s["kv_heads"], rope=True)
    if problem:
        return problem
    if p["top_k"] > p["experts"]:
        return f"top_k={p['top_k']} is more than experts={p['experts']}"
    if s["tokens"] % s["group"]:
        where = "of a device " if s["tokens"] != p["batch"] * p["seq"] else ""
        return f"group={s['group']} does not divide the {s['tokens']} tokens {where}(batch·seq)"
    return check_layout(p, tp_dims={"heads": p["heads"], "kv_heads": s["kv_heads"], "ffn": s["ffn"]},
                        ep_dims={"experts": p["experts"]})


def forward_flops(p: dict[str, Any]) -> dict[str, int]:
    """Analytical matmul FLOPs of one forward pass on one device (multiply-add = 2), for the explicit
    strategies and one device: ``dispatch`` (the one-hot dispatch einsum) and ``total`` (attention
    projections and products, router, dispatch, expert SwiGLU, combine, LM head). Under ``tp`` the
    attention and expert terms are divided by the devices. A training step does ``3 · total −
    dispatch`` (the dispatch mask has no gradient)."""
    s = sizes(p)
    d, e, c, f, t = p["d_model"], p["experts"], s["slots"], s["ffn"], s["tokens"]
    groups = t // s["group"]
    seqs = t // p["seq"]
    tp = p["devices"] if p["devices"] > 1 and p["parallel"] == "tp" else 1
    attn = 2 * t * (2 * d * d + 2 * d * s["kv_heads"] * s["head_dim"]) + 4 * seqs * p["seq"] ** 2 * d
    dispatch = 2 * t * e * c * d
    experts = 3 * 2 * e * groups * c * d * f
    layer = (attn + experts) // tp + 2 * t * d * e + 2 * dispatch
    return {"dispatch": p["layers"] * dispatch, "total": p["layers"] * layer + 2 * t * d * p["vocab"]}


def generate(p: dict[str, Any]) -> str | bytes:
    """The MoE step's StableHLO (text; bytecode for a ``-partitioned`` strategy on several devices)."""
    import jax
    import jax.numpy as jnp

    from . import transformer as tf
    from .steps import LayeredModel, export_family_step

    s = sizes(p)
    dtype = jnp.bfloat16 if p["dtype"] == "bf16" else jnp.float32
    d, e, f, hd, k = p["d_model"], p["experts"], s["ffn"], s["head_dim"], p["top_k"]

    def sd(*shape):
        return jax.ShapeDtypeStruct(shape, dtype)

    layer = tf.decoder_attention_shapes(d, p["heads"], s["kv_heads"], dtype)
    layer.update(mlp_norm=sd(d), router=sd(d, e), w_gate=sd(e, d, f), w_up=sd(e, d, f), w_down=sd(e, f, d))
    top = {"embed": sd(p["vocab"], d), "final_norm": sd(d), "head": sd(d, p["vocab"])}

    def top_k_choices(probs, k):
        """The ``k`` largest probabilities along the last axis, by ``k`` rounds of argmax and masking:
        one-hot choices ``[…, k, e]`` (int32) and their probabilities ``[…, k]``. (``lax.top_k`` would
        do, but XLA's CPU compiler turns it into a ``custom_call @TopK`` in partitioned programs.)"""
        picks, values = [], []
        for _ in range(k):
            pick = jax.nn.one_hot(jnp.argmax(probs, axis=-1), e, dtype=probs.dtype)
            picks.append(pick.astype(jnp.int32))
            values.append(jnp.sum(probs * pick, axis=-1))
            probs = jnp.where(pick > 0, -1.0, probs)
        return jnp.stack(picks, axis=-2), jnp.stack(values, axis=-1)

    def moe(lp, x, col):
        """Route, dispatch, run the experts, combine: ``x`` ``[b, s, d]`` → ``[b, s, d]``."""
        b, n, _ = x.shape
        g, slots = s["group"], s["slots"]
        tokens = x.reshape(b * n // g, g, d)                          # [groups, group, d]
        probs = jax.nn.softmax((tokens @ lp["router"]).astype(jnp.float32), axis=-1)
        onehot, gates = top_k_choices(probs, k)                       # [G, g, k, e], [G, g, k]
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        # slot of each (token, choice) in its expert: first choices of the group, then second ones …
        by_choice = onehot.transpose(0, 2, 1, 3).reshape(-1, k * g, e)
        taken = (jnp.cumsum(by_choice, axis=1) * by_choice).reshape(-1, k, g, e).transpose(0, 2, 1, 3)
        slot = jnp.sum(taken, axis=-1) - 1                            # [G, g, k]
        in_slot = jax.nn.one_hot(slot, slots, dtype=dtype)            # zero beyond capacity
        routed = onehot.astype(dtype)[..., None] * in_slot[..., None, :]   # [G, g, k, e, slots]
        dispatch = jnp.sum(routed, axis=2)
        combine = jnp.sum(routed * gates.astype(dtype)[..., None, None], axis=2)
        expert_in = jnp.einsum("Gtec,Gtd->eGcd", dispatch, tokens).reshape(e, -1, d)
        expert_in = col.to_experts(expert_in)                         # [e (/devices), slots, d]
        h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", expert_in, lp["w_gate"])) \
            * jnp.einsum("ecd,edf->ecf", expert_in, lp["w_up"])
        expert_out = col.from_experts(jnp.einsum("ecf,efd->ecd", h, lp["w_down"]))
        expert_out = expert_out.reshape(e, -1, slots, d)              # [e, groups, slots, d]
        return jnp.einsum("Gtec,eGcd->Gtd", combine, expert_out).reshape(b, n, d)

    def block(lp, x, rope, col):
        x = tf.decoder_attention(lp, x, hd, rope, col)
        h = col.enter_tp(tf.rms_norm(x, lp["mlp_norm"]))
        return x + col.exit_tp(moe(lp, h, col))

    tokens = jax.ShapeDtypeStruct((p["batch"], p["seq"]), jnp.int32)
    model = LayeredModel(
        top=top, layer=layer, layers=p["layers"], inputs=(tokens,), targets=tokens,
        embed=lambda t, inputs, col: tf.token_embed(t, inputs, hd),
        block=block,
        head=lambda t, x, ctx, col: tf.lm_head(t, x, tied=False),
        loss=lambda logits, targets, col: tf.lm_loss(logits, targets),
        tp_layer={**tf.DECODER_ATTENTION_TP, "w_gate": 2, "w_up": 2, "w_down": 1},
        ep_layer={"w_gate": 0, "w_up": 0, "w_down": 0},
    )
    return export_family_step(model, p, "moe")


ENTRY = ZooEntry(
    name="moe",
    description="mixture-of-experts decoder (top-k router, capacity, SwiGLU experts, one-hot dispatch/"
                "combine); inference or training step; dp/fsdp/tp/ep explicit or compiler-partitioned",
    params=PARAMS,
    generate=generate,
    check=check,
    version=4,  # under FSDP each layer's parameters are gathered again in the backward; meshes (ep among them)
)
