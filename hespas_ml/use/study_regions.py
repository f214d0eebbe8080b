"""What a study says about a compute region: its op family, op kinds and shapes, grouped by signature.

The op *family* of a region is the first of these that holds at least one of its ops (so a GEMM with a
fused bias-add and activation is ``dot``, a softmax is ``reduction``):

``conv`` (convolution), ``dot`` (dot_general, dot, ragged_dot and other matrix-unit ops),
``reduction`` (reduce, reduce_window, select_and_scatter, scatter, map, sort, top_k),
``elementwise`` (arithmetic, compare/select, converts and transcendentals),
``data movement`` (broadcast, transpose, slice, pad, concatenate, gather, copy, iota …),
``other`` (custom calls and ops the cost model does not know).
"""
from __future__ import annotations

from typing import Any, Sequence

from ..label.costs import (DATA_MOVEMENT_OPS, DECOMPOSED_OPS, ELEMENTWISE_OPS, FREE_OPS, MATRIX_OPS,
                           REDUCTION_OPS, TRANSCENDENTAL_OPS, op_cost)

FAMILIES = ("conv", "dot", "reduction", "elementwise", "data movement", "other")
_CONV = frozenset({"convolution", "dynamic_conv"})
_REDUCTION = REDUCTION_OPS | {"sort", "top_k", "topk"}
_ELEMENTWISE = ELEMENTWISE_OPS | TRANSCENDENTAL_OPS | frozenset(DECOMPOSED_OPS) | {
    "rng", "rng_bit_generator", "batch_norm_inference", "batch_norm_training", "batch_norm_grad", "fft"}


def op_family(kind: str) -> str | None:
    """The family of one op kind; None for ops that run no kernel (reshape, constant …)."""
    if kind in _CONV:
        return "conv"
    if kind in MATRIX_OPS:
        return "dot"
    if kind in _REDUCTION:
        return "reduction"
    if kind in _ELEMENTWISE or kind.startswith("broadcast_"):
        return "elementwise"
    if kind in DATA_MOVEMENT_OPS:
        return "data movement"
    if kind in FREE_OPS:
        return None
    return "other"


def region_family(kinds: Sequence[str]) -> str:
    """The family of a region made of ops of these kinds (see the module docstring)."""
    present = {op_family(k) for k in kinds}
    return next((f for f in FAMILIES if f in present), "data movement")


def _tensor(t) -> str:
    return ("x".join(str(d) for d in t.shape) + "x" if t.shape else "") + t.dtype


def main_op(graph, op_ids: Sequence[int]):
    """The op that names a region: of its family, the one with the most FLOPs, then bytes."""
    ops = [graph.ops[i] for i in op_ids]
    family = region_family([o.kind for o in ops])
    members = [o for o in ops if op_family(o.kind) == family] or ops

    def weight(o) -> tuple[float, float]:
        c = op_cost(o)
        return c.flops + c.transcendentals, c.bytes
    return max(members, key=weight)


def region_shape(graph, op_ids: Sequence[int]) -> str:
    """``kind operand shapes -> result shapes`` of the region's main op, e.g.
    ``dot_general 32x64xf32, 64x48xf32 -> 32x48xf32``."""
    op = main_op(graph, op_ids)
    ins = ", ".join(_tensor(t) for t in op.operand_types[:4]) + (", …" if len(op.operand_types) > 4 else "")
    outs = ", ".join(_tensor(t) for t in op.result_types[:2]) + (", …" if len(op.result_types) > 2 else "")
    return f"{op.kind} {ins} -> {outs}"


def region_infos(rg, compute: Sequence, signatures: Sequence[str]) -> list[dict[str, Any]]:
    """One entry per distinct signature among ``compute`` (regions of ``rg``): ``signature``, ``count``
    (executions per step, all occurrences), ``occurrences``, ``family``, ``op_kinds``, ``shape``, ``flops``
    and ``bytes`` (one execution), in first-occurrence order."""
    out: dict[str, dict[str, Any]] = {}
    for region, sig in zip(compute, signatures):
        entry = out.get(sig)
        if entry is None:
            kinds = [rg.graph.ops[i].kind for i in region.op_ids]
            entry = out[sig] = {"signature": sig, "count": 0, "occurrences": 0, "family": region_family(kinds),
                                "op_kinds": rg.describe(region), "shape": region_shape(rg.graph, region.op_ids),
                                "flops": float(region.flops), "bytes": float(region.bytes)}
        entry["count"] += int(region.count)
        entry["occurrences"] += 1
    return list(out.values())
