"""Parameter checks and derived sizes shared by the transformer families (no jax: specs are checked
when they are parsed, long before anything is exported)."""
from __future__ import annotations

import math
from typing import Any


def swiglu_hidden(d_model: int, multiple: int = 128) -> int:
    """Llama's SwiGLU hidden size: 8/3 · d_model rounded up to a multiple of ``multiple``."""
    return multiple * math.ceil(8 * d_model / 3 / multiple)


def check_heads(d_model: int, heads: int, kv_heads: int | None = None, rope: bool = False) -> str | None:
    """A message when the attention head layout is impossible, else None."""
    if d_model % heads:
        return f"d_model={d_model} is not divisible by heads={heads}"
    if rope and (d_model // heads) % 2:
        return f"head size d_model/heads={d_model // heads} is odd (rotary embeddings need an even size)"
    if kv_heads is not None and heads % kv_heads:
        return f"kv_heads={kv_heads} does not divide heads={heads}"
    return None


def check_parallel(p: dict[str, Any], tp_dims: dict[str, int], ep_dims: dict[str, int] | None = None,
                   batch_key: str = "batch") -> str | None:
    """A message when ``p["devices"]`` cannot share the step the way ``p["parallel"]`` says:
    the batch for dp/fsdp/ep, each of ``tp_dims`` for tp, each of ``ep_dims`` for ep."""
    n, parallel = p["devices"], p["parallel"]
    if n == 1:
        return None
    strategy = parallel.removesuffix("-partitioned")
    need: dict[str, int] = {}
    if strategy in ("dp", "fsdp", "ep"):
        need[batch_key] = p[batch_key]
    if strategy == "tp":
        need.update(tp_dims)
    if strategy == "ep":
        need.update(ep_dims or {})
    for name, size in need.items():
        if size % n:
            return f"{name}={size} is not divisible by devices={n} (parallel={parallel} splits it)"
    return None


MESH_AXES = ("dp", "fsdp", "tp")
"""The axes of a several-axis mesh, outermost first: ``tp`` innermost (within a node), ``dp`` outermost."""


def format_mesh(mesh: dict[str, int]) -> str:
    """``dp:2,tp:4`` of ``{"dp": 2, "fsdp": 1, "tp": 4}`` (the axes of size one left out; ``dp:1`` for none)."""
    return ",".join(f"{a}:{mesh[a]}" for a in MESH_AXES if mesh.get(a, 1) > 1) or "dp:1"


def parse_mesh(text: str) -> dict[str, int]:
    """``{"dp": 2, "tp": 4}`` of ``dp:2,tp:4`` (axes of :data:`MESH_AXES`, each once, sizes ≥ 1); ``{}`` of
    ``""``. Raises ValueError with a one-line message."""
    out: dict[str, int] = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        axis, _, size = item.partition(":")
        axis = axis.strip()
        if axis not in MESH_AXES:
            raise ValueError(f"mesh axis '{axis}' is not one of {', '.join(MESH_AXES)} (write e.g. mesh=dp:2,tp:4)")
        if axis in out:
            raise ValueError(f"mesh axis '{axis}' is given twice")
        if not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"mesh axis '{axis}' needs a size of at least 1 (write {axis}:N)")
        out[axis] = int(size)
    return out


def check_mesh(p: dict[str, Any], tp_dims: dict[str, int], batch_key: str = "batch") -> str | None:
    """A message when ``p["mesh"]`` cannot lay out the step: its product is not ``devices``, it is given
    with another ``parallel``, tp does not divide each of ``tp_dims``, dp × fsdp does not divide the batch."""
    try:
        mesh = parse_mesh(p["mesh"])
    except ValueError as exc:
        return str(exc)
    if not mesh:
        return None
    if p["parallel"] != "dp":
        return f"mesh={p['mesh']} lays out the devices itself: leave parallel={p['parallel']} out"
    n = math.prod(mesh.values())
    if n != p["devices"]:
        return f"mesh={p['mesh']} spans {n} devices, not devices={p['devices']}"
    for name, size in tp_dims.items():
        if size % mesh.get("tp", 1):
            return f"tp {mesh['tp']} does not divide {name} {size}"
    shards = mesh.get("dp", 1) * mesh.get("fsdp", 1)
    if p[batch_key] % shards:
        return f"dp × fsdp = {shards} does not divide {batch_key} {p[batch_key]}"
    return None
