"""Transformer building blocks for zoo families (functions of jax arrays; shapes may be per-device).

Norms and softmax statistics are computed in f32 and cast back (mixed precision as in common bf16
training); matmuls run in the parameters' dtype. Head counts are read from the (possibly
tensor-parallel, i.e. per-device) weight shapes, so the same code serves every strategy.

This module imports jax; import it only inside a generator.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..graph import FUSED_ATTENTION, FUSED_ATTENTION_GRAD
from .parallel import Collectives

NORM_EPS = 1e-6
ROPE_THETA = 10000.0


def rms_norm(x, w):
    """RMSNorm over the last axis with gain ``w``."""
    xf = x.astype(jnp.float32)
    scale = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + NORM_EPS)
    return (xf * scale).astype(x.dtype) * w


def layer_norm(x, g, b):
    """LayerNorm over the last axis with gain ``g`` and bias ``b``."""
    return _layer_norm_parts(x, g, b)[0]


def _layer_norm_parts(x, g, b):
    """(LayerNorm's output, each row's mean, each row's reciprocal deviation), in f32 within."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    centred = xf - mean
    rstd = jax.lax.rsqrt(var + NORM_EPS)
    return (centred * rstd).astype(x.dtype) * g + b, mean, rstd


@jax.custom_vjp
def fused_layer_norm(x, g, b):
    """:func:`layer_norm` as a fused kernel computes it (Apex's, which Megatron-LM uses): its backward keeps
    the input and each row's mean and reciprocal deviation, not the f32 intermediates jax's own gradient
    would keep."""
    return layer_norm(x, g, b)


def _layer_norm_fwd(x, g, b):
    y, mean, rstd = _layer_norm_parts(x, g, b)
    return y, (x, mean, rstd, g)


def _layer_norm_bwd(res, dy):
    x, mean, rstd, g = res
    lead = tuple(range(x.ndim - 1))
    xhat = (x.astype(jnp.float32) - mean) * rstd
    dyf = dy.astype(jnp.float32)
    dxhat = dyf * g.astype(jnp.float32)
    dx = rstd * (dxhat - jnp.mean(dxhat, axis=-1, keepdims=True)
                 - xhat * jnp.mean(dxhat * xhat, axis=-1, keepdims=True))
    return dx.astype(x.dtype), jnp.sum(dyf * xhat, axis=lead).astype(g.dtype), jnp.sum(dyf, axis=lead).astype(g.dtype)


fused_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)

GELU_C = math.sqrt(2.0 / math.pi)


@jax.custom_vjp
def fused_gelu(x):
    """Tanh-approximated GELU as Megatron-LM's fused bias-GELU kernel computes it: its backward keeps the
    input alone and recomputes the rest, where jax's own gradient keeps every intermediate of the formula."""
    return jax.nn.gelu(x, approximate=True)


def _gelu_fwd(x):
    return jax.nn.gelu(x, approximate=True), x


def _gelu_bwd(x, dy):
    xf = x.astype(jnp.float32)
    t = jnp.tanh(GELU_C * (xf + 0.044715 * xf ** 3))
    grad = 0.5 * (1 + t) + 0.5 * xf * (1 - t * t) * GELU_C * (1 + 3 * 0.044715 * xf * xf)
    return ((dy.astype(jnp.float32) * grad).astype(x.dtype),)


fused_gelu.defvjp(_gelu_fwd, _gelu_bwd)


def rope_tables(seq: int, head_dim: int, dtype):
    """Rotary embedding tables ``(cos, sin)``, each ``[seq, head_dim/2]``."""
    inv = ROPE_THETA ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv[None, :]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x, cos, sin):
    """Rotate ``x`` ``[batch, seq, heads, head_dim]`` by position (rotate-half form)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def attention(q, k, v, causal: bool, q_offset=None):
    """Scaled dot-product attention with grouped KV heads.

    ``q`` ``[b, s, h, d]``, ``k``/``v`` ``[b, t, hk, d]`` with ``hk`` dividing ``h`` (each KV head
    serves ``h/hk`` query heads); returns ``[b, s, h, d]``. ``q_offset``: the queries are positions
    ``q_offset ..`` of the keys' sequence (context parallelism: this device's part of it); None: the same
    positions as the keys.
    """
    b, s, h, d = q.shape
    hk = k.shape[2]
    qg = q.reshape(b, s, hk, h // hk, d)
    scores = jnp.einsum("bskgd,btkd->bkgst", qg, k) * jnp.asarray(1.0 / math.sqrt(d), q.dtype)
    scores = scores.astype(jnp.float32)
    if causal and q_offset is not None:
        mask = jnp.arange(k.shape[1])[None, :] <= jnp.arange(s)[:, None] + q_offset
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    elif causal:
        mask = jnp.tril(jnp.ones((s, s), dtype=bool))
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v)
    return out.reshape(b, s, h, d)


def causal_attention(q, k, v, col: Collectives, fused: bool = False):
    """Causal attention of this device's queries; under context parallelism against the keys and values
    of the whole sequence (all-gathered over cp), masked by the queries' place in it. ``fused``: one fused
    kernel (:func:`fused_attention`) instead of the scores written out, softmaxed and read back."""
    if "cp" in col.mesh_axes:
        k, v = col.cp_gather(k), col.cp_gather(v)
    if fused:
        return fused_attention(q, k, v)
    if "cp" not in col.mesh_axes:
        return attention(q, k, v, causal=True)
    return attention(q, k, v, causal=True, q_offset=col.cp_offset(q.shape[1]))


@jax.custom_vjp
def fused_attention(q, k, v):
    """Causal attention as one fused kernel and its backward as another: ``custom_call``s to
    :data:`~hespas_ml.ingest.graph.FUSED_ATTENTION` / ``FUSED_ATTENTION_GRAD`` (stand-ins the cost model
    prices as FlashAttention; XLA cannot run them, so such programs are not profiled)."""
    return _fused_forward(q, k, v)


def _fused_forward(q, k, v):
    return jax.ffi.ffi_call(FUSED_ATTENTION, jax.ShapeDtypeStruct(q.shape, q.dtype))(q, k, v)


def _fused_fwd(q, k, v):
    o = _fused_forward(q, k, v)
    return o, (q, k, v, o)


def _fused_bwd(res, do):
    q, k, v, o = res
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v))
    return tuple(jax.ffi.ffi_call(FUSED_ATTENTION_GRAD, shapes)(q, k, v, o, do))


fused_attention.defvjp(_fused_fwd, _fused_bwd)


def swiglu(x, w_gate, w_up, w_down):
    """SwiGLU MLP: ``(silu(x·w_gate) * (x·w_up)) · w_down``."""
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def gelu_mlp(x, w1, b1, w2, b2):
    """Two-layer MLP with (tanh-approximated) GELU."""
    return jax.nn.gelu(x @ w1 + b1, approximate=True) @ w2 + b2


def cross_entropy(logits, labels):
    """Mean softmax cross-entropy (in f32) of integer ``labels`` (shape = logits' minus the class axis)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)
    return -jnp.mean(picked)


# -- Llama-style decoder pieces (shared by llama and moe) ---------------------------------------

def decoder_attention_shapes(d_model: int, heads: int, kv_heads: int, dtype) -> dict[str, jax.ShapeDtypeStruct]:
    """Parameters of a pre-norm grouped-query attention sub-block (no biases)."""
    hd = d_model // heads

    def s(*shape):
        return jax.ShapeDtypeStruct(shape, dtype)

    return {"attn_norm": s(d_model), "wq": s(d_model, heads * hd), "wk": s(d_model, kv_heads * hd),
            "wv": s(d_model, kv_heads * hd), "wo": s(heads * hd, d_model)}


DECODER_ATTENTION_TP = {"wq": 1, "wk": 1, "wv": 1, "wo": 0}
"""Megatron split of the attention weights: q/k/v column-parallel (heads), output row-parallel."""


def decoder_attention(lp: dict, x, head_dim: int, rope, col: Collectives, fused: bool = False):
    """``x + attention(rms_norm(x))`` with RoPE and a causal mask; heads as the weights hold them
    (``fused``: :func:`fused_attention`)."""
    h = col.enter_tp(rms_norm(x, lp["attn_norm"]))
    b, s, _ = h.shape                  # the whole sequence (under sequence parallelism x holds a part)
    q = (h @ lp["wq"]).reshape(b, s, -1, head_dim)
    k = (h @ lp["wk"]).reshape(b, s, -1, head_dim)
    v = (h @ lp["wv"]).reshape(b, s, -1, head_dim)
    cos, sin = rope
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o = causal_attention(q, k, v, col, fused).reshape(b, s, -1)
    return x + col.exit_tp(o @ lp["wo"])


def token_embed(top: dict, inputs, head_dim: int):
    """Embed ``inputs[0]`` (int32 token ids ``[batch, seq]``); the context is the RoPE tables."""
    (tokens,) = inputs
    table = top["embed"]
    x = jnp.take(table, tokens, axis=0)
    return x, rope_tables(tokens.shape[1], head_dim, table.dtype)


def lm_head(top: dict, x, tied: bool):
    """Final RMSNorm and the vocabulary projection (the embedding table transposed when ``tied``)."""
    x = rms_norm(x, top["final_norm"])
    return x @ (top["embed"].T if tied else top["head"])


def lm_loss(logits, targets):
    """Next-token cross-entropy: ``targets`` are the token ids to predict at each position."""
    return cross_entropy(logits, targets)


# -- Megatron's vocabulary-parallel embedding, head and loss (llama and gpt under tp) ------------------

VOCAB_PARALLEL_TP = {"embed": 0, "head": 1}
"""Under tp the embedding table is split by rows (vocabulary) and the LM head by columns, as Megatron-LM
splits them: each device holds vocab / tp of the vocabulary."""


def _own_rows(ids, rows: int, col: Collectives):
    """``ids`` as rows of this device's share of the vocabulary (0 where not its own) and where they are."""
    local = ids - col.tp_rank() * rows
    inside = (local >= 0) & (local < rows)
    return jnp.where(inside, local, 0), inside


def vocab_embed(table, tokens, col: Collectives):
    """Look ``tokens`` up in ``table``, this device's rows of the vocabulary under tp (the rows others hold
    are zero here; the tensor-parallel exit sums them: an all-reduce, or under sequence parallelism a
    reduce-scatter leaving this device its part of the sequence), else the whole table."""
    if col.mesh_axes.get("tp") is None:
        return jnp.take(table, tokens, axis=0)
    local, inside = _own_rows(tokens, table.shape[0], col)
    return col.exit_tp(jnp.take(table, local, axis=0) * inside[..., None].astype(table.dtype))


def vocab_head(x, weight, col: Collectives):
    """The LM head ``x @ weight``: under tp a column-parallel matrix product (each device's logits are its
    share of the vocabulary; the input's gradient is all-reduced)."""
    return col.enter_tp(x) @ weight


def vocab_loss(logits, targets, col: Collectives):
    """Next-token cross-entropy (in f32) of logits split over the vocabulary under tp (Megatron's
    vocab-parallel cross-entropy: the maximum, the sum of exponentials and the target's logit are
    all-reduced), else :func:`lm_loss`."""
    if col.mesh_axes.get("tp") is None:
        return lm_loss(logits, targets)
    z = logits.astype(jnp.float32)
    top = col.tp_max(jnp.max(z, axis=-1))
    total = col.tp_sum(jnp.sum(jnp.exp(z - top[..., None]), axis=-1))
    local, inside = _own_rows(targets.astype(jnp.int32), z.shape[-1], col)
    picked = jnp.take_along_axis(z, local[..., None], axis=-1)[..., 0] * inside.astype(jnp.float32)
    return jnp.mean(jnp.log(total) + top - col.tp_sum(picked))
