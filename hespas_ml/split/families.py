"""The op family of a compute region: what kind of kernel it is, from the kinds of its ops.

Used wherever regions are grouped for people to read (study disagreement tables, surrogate error
tables and plots). The op *family* of a region is the first of these that holds at least one of its ops (so a GEMM with a
fused bias-add and activation is ``dot``, a softmax is ``reduction``):

``conv`` (convolution), ``dot`` (dot_general, dot, ragged_dot and other matrix-unit ops),
``reduction`` (reduce, reduce_window, select_and_scatter, scatter, map, sort, top_k),
``elementwise`` (arithmetic, compare/select, converts and transcendentals),
``data movement`` (broadcast, transpose, slice, pad, concatenate, gather, copy, iota …),
``other`` (custom calls and ops the cost model does not know).
"""
from __future__ import annotations

from typing import Iterable

from ..costs import (DATA_MOVEMENT_OPS, DECOMPOSED_OPS, ELEMENTWISE_OPS, FREE_OPS, MATRIX_OPS,
                           REDUCTION_OPS, TRANSCENDENTAL_OPS)

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


def region_family(kinds: Iterable[str]) -> str:
    """The family of a region made of ops of these kinds (see the module docstring)."""
    present = {op_family(k) for k in kinds}
    return next((f for f in FAMILIES if f in present), "data movement")
