"""Micro-benchmark zoo families of matrix work: ``gemm``, ``bgemm`` (batched GEMM) and ``attention``.

Each is one tiny inference program (one device) whose work is what its name says:

* ``gemm``: ``C[m,n] = A·B`` as one ``dot_general`` (2·m·n·k FLOPs). ``transpose_a`` stores A as
  ``k×m`` and ``transpose_b`` stores B as ``n×k``; the transpose is folded into the dot's contracting
  dimensions, as XLA would.
* ``bgemm``: ``C[b,m,n] = A[b]·B[b]`` as one batched ``dot_general`` (2·b·m·n·k FLOPs).
* ``attention``: scaled dot-product attention of ``q [batch, heads, seq, head_dim]`` against
  ``k, v [batch, heads, kv_seq, head_dim]``: ``QKᵀ``, optional causal mask, softmax (in f32), ``·V``.

Sizes follow :mod:`.micro_common` (named integer parameters).
"""
from __future__ import annotations

from typing import Any

from .base import ZooEntry, ZooParam
from .micro_common import MAX_DIM, dtype_param, jnp_dtype, too_big

GEMM_PARAMS = (
    ZooParam("m", int, 256, "rows of A and C", minimum=1, maximum=MAX_DIM),
    ZooParam("n", int, 256, "columns of B and C", minimum=1, maximum=MAX_DIM),
    ZooParam("k", int, 256, "contracted size", minimum=1, maximum=MAX_DIM),
    dtype_param(),
    ZooParam("transpose_a", bool, False, "A is stored k×m"),
    ZooParam("transpose_b", bool, False, "B is stored n×k"),
)
BGEMM_PARAMS = (ZooParam("b", int, 8, "batch of independent GEMMs", minimum=1, maximum=MAX_DIM),) + GEMM_PARAMS
ATTENTION_PARAMS = (
    ZooParam("batch", int, 1, "sequences", minimum=1, maximum=1 << 16),
    ZooParam("heads", int, 8, "attention heads", minimum=1, maximum=1024),
    ZooParam("seq", int, 256, "query positions", minimum=1, maximum=1 << 20),
    ZooParam("kv_seq", int, 0, "key/value positions (0: the same as seq)", minimum=0, maximum=1 << 20),
    ZooParam("head_dim", int, 64, "features per head", minimum=1, maximum=4096),
    ZooParam("causal", bool, False, "mask keys after each query (aligned to the end of the keys)"),
    dtype_param(),
)


def _operand_shapes(p: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Shapes of A, B and C (leading batch dim for bgemm)."""
    m, n, k = p["m"], p["n"], p["k"]
    batch = (p["b"],) if "b" in p else ()
    a = batch + ((k, m) if p["transpose_a"] else (m, k))
    b = batch + ((n, k) if p["transpose_b"] else (k, n))
    return a, b, batch + (m, n)


def check_gemm(p: dict[str, Any]) -> str | None:
    a, b, c = _operand_shapes(p)
    return too_big(A=a, B=b, C=c)


def generate_gemm(p: dict[str, Any]) -> str:
    """One (batched) GEMM with its transposes folded into the dot dimension numbers."""
    import jax
    from jax import lax

    from ..export import export_jax

    a_shape, b_shape, _ = _operand_shapes(p)
    nb = len(a_shape) - 2                                   # 1 for bgemm, 0 for gemm
    lhs_c = nb + (0 if p["transpose_a"] else 1)
    rhs_c = nb + (1 if p["transpose_b"] else 0)
    batch = (tuple(range(nb)), tuple(range(nb)))
    dtype = jnp_dtype(p["dtype"])

    def gemm(a, b):
        return lax.dot_general(a, b, (((lhs_c,), (rhs_c,)), batch))

    name = "zoo_bgemm" if nb else "zoo_gemm"
    return export_jax(gemm, jax.ShapeDtypeStruct(a_shape, dtype), jax.ShapeDtypeStruct(b_shape, dtype), name=name)


def _kv_seq(p: dict[str, Any]) -> int:
    return p["kv_seq"] or p["seq"]


def check_attention(p: dict[str, Any]) -> str | None:
    b, h, s, d, kv = p["batch"], p["heads"], p["seq"], p["head_dim"], _kv_seq(p)
    if p["causal"] and kv < s:
        return f"causal attention needs kv_seq >= seq (kv_seq={kv}, seq={s}): early queries would see no key"
    return too_big(query=(b, h, s, d), key=(b, h, kv, d), scores=(b, h, s, kv))


def generate_attention(p: dict[str, Any]) -> str:
    """Softmax(Q·Kᵀ/√d [+ causal mask])·V; the scores are formed, normalised and applied in full."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from ..export import export_jax

    b, h, s, d, kv = p["batch"], p["heads"], p["seq"], p["head_dim"], _kv_seq(p)
    dtype = jnp_dtype(p["dtype"])
    causal = p["causal"]

    def attention(q, k, v):
        scores = lax.dot_general(q, k, (((3,), (3,)), ((0, 1), (0, 1))))          # [b, h, s, kv]
        scores = scores.astype(jnp.float32) * (1.0 / float(d) ** 0.5)
        if causal:
            qpos = lax.broadcasted_iota(jnp.int32, (s, kv), 0) + (kv - s)
            kpos = lax.broadcasted_iota(jnp.int32, (s, kv), 1)
            scores = jnp.where(kpos <= qpos, scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(dtype)
        return lax.dot_general(weights, v, (((3,), (2,)), ((0, 1), (0, 1))))     # [b, h, s, d]

    q = jax.ShapeDtypeStruct((b, h, s, d), dtype)
    k = jax.ShapeDtypeStruct((b, h, kv, d), dtype)
    return export_jax(attention, q, k, k, name="zoo_attention")


GEMM = ZooEntry("gemm", "one GEMM C=A·B (m, n, k, transposes)", GEMM_PARAMS, generate_gemm, check=check_gemm)
BGEMM = ZooEntry("bgemm", "one batched GEMM C[b]=A[b]·B[b]", BGEMM_PARAMS, generate_gemm, check=check_gemm)
ATTENTION = ZooEntry("attention", "scaled dot-product attention: QKᵀ, (causal) softmax, ·V", ATTENTION_PARAMS,
                     generate_attention, check=check_attention)
ENTRIES = (GEMM, BGEMM, ATTENTION)
