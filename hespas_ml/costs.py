"""The per-op cost model: FLOPs, transcendentals and bytes of every op of an :class:`OpGraph`.

The FLOP and transcendental figures follow the conventions of XLA's ``HloCostAnalysis`` (the numbers
``jax.jit(f).lower(...).cost_analysis()`` reports for the un-optimised module), so they can be checked against
XLA op by op:

* ``dot_general`` / ``dot``: 2 per multiply-add (``2 × result elements × contracted size``).
* ``convolution``: 2 per multiply-add that touches a real input element. Positions that fall into padding or
  into the holes of an lhs (base) dilation are *not* counted, so backward-data (lhs-dilated) and
  backward-filter (batch/feature swapped, ``batch_group_count``) convolutions get exactly XLA's figure.
* elementwise ops (arithmetic, compare, select, clamp, convert, bitcast_convert, reduce_precision …):
  1 per result element (a ``convert`` to its own type is dropped by XLA and is free); transcendental ops
  (exp, log, tanh, logistic, sin, cos, tan, sqrt, rsqrt, cbrt, power, atan2, erf, expm1, log1p):
  1 *transcendental* per element and no FLOPs.
* ``chlo`` ops that XLA expands into polynomials (erf_inv, lgamma, sinh …): the per-element FLOPs and
  transcendentals of XLA's expansion (measured, f32; f16/bf16 add the two converts around it).
* ``reduce``: body × (input elements − output elements); ``reduce_window``: body × (window − 1) × output
  elements; ``select_and_scatter``: select body × (window − 1) × source elements + scatter body × source
  elements; ``scatter``: body × update elements; ``map``: body × elements; ``all_reduce``: body × result
  elements (``reduce_scatter`` and the other collectives: 0). "body" is the body's FLOPs and
  transcendentals when ingest lists its op kinds (``attrs["body_op_kinds"]``), else ``attrs["body_ops"]``
  FLOPs (exact for the usual add/max/compare/select bodies; a constant or an exp in a body is overcounted).
* ``sort``: ``n × ceil(log2 n)`` with ``n`` the elements of the first operand (the comparator is not counted).
* ``rng`` / ``rng_bit_generator``: 1 transcendental per generated element (state included).
* ``fft``: ``8 × prod(floor(log2 len)) × operand elements``; ``cholesky``: ``n³/3`` per matrix;
  ``triangular_solve``: ``2 × n × elements of b``.

Deliberate departures from XLA (which costs these at 0 FLOPs): ``top_k`` is costed like a sort of its
operand, and ``batch_norm_*`` get an estimate of the elementwise work of their expansion.

Bytes are what the op reads and writes *if it runs as its own kernel* (no fusion): operands and results,
except for ops that read only part of an operand (``slice``, ``dynamic_slice``, ``gather`` read as much as
they write, plus indices) and in-place updates (``dynamic_update_slice`` and ``scatter`` read and write the
update-sized part). Ops that are free after layout assignment (``reshape`` — a bitcast in row-major layouts —
``get_tuple_element``, ``tuple``, ``optimization_barrier``, ``constant``, sharding annotations …) cost nothing.

``op_cost`` is a dictionary dispatch on :attr:`Op.kind`; it imports nothing heavy and takes a few
microseconds per op.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import gcd, prod
from typing import Any, Callable

from .ingest.graph import (COLLECTIVE_KINDS, FUSED_ATTENTION_GRAD, FUSED_ATTENTION_TARGETS, Op, OpGraph,
                           TensorType, last_program_table)

MATRIX, VECTOR, NONE = "matrix", "vector", "none"
UNITS = (MATRIX, VECTOR, NONE)


@dataclass(frozen=True, slots=True)
class OpCost:
    """Cost of one execution of one op (multiply by :attr:`Op.count` for the program total)."""

    flops: float            # arithmetic ops, XLA HloCostAnalysis convention (multiply-add = 2)
    transcendentals: float  # transcendental elements (exp, log, tanh …), XLA convention
    bytes_in: float         # bytes read when the op runs as its own kernel
    bytes_out: float        # bytes written
    unit: str               # "matrix" (dot/conv), "vector" (other computing ops), "none" (data movement)
    modelled: bool          # False for custom_call and op kinds the model does not know

    @property
    def bytes(self) -> float:
        return self.bytes_in + self.bytes_out


# -- op kind sets (Op.kind strings: the opcode without its dialect) --------------------------------------

FREE_OPS = frozenset({
    "constant", "get_tuple_element", "tuple", "optimization_barrier", "reshape", "bitcast",
    "after_all", "create_token", "partition_id", "replica_id", "get_dimension_size", "set_dimension_size",
    "dynamic_reshape", "add_dependency", "domain", "xla.rng_get_and_update_state",
    # Shardy / sharding annotations
    "sharding_constraint", "reshard", "propagation_barrier", "data_flow_edge", "sharding_group",
})
"""Ops that run no kernel: zero FLOPs and zero bytes."""

DATA_MOVEMENT_OPS = frozenset({
    "broadcast_in_dim", "broadcast", "dynamic_broadcast_in_dim", "transpose", "slice", "real_dynamic_slice",
    "pad", "dynamic_pad", "concatenate", "dynamic_slice", "dynamic_update_slice", "reverse", "copy",
    "gather", "dynamic_gather", "torch_index_select", "iota", "dynamic_iota", "all_slice",
    "send", "recv", "infeed", "outfeed",
})
"""Ops that only move or generate data: zero FLOPs, their bytes read and written."""

PARTIAL_READ_OPS = frozenset({
    "slice", "real_dynamic_slice", "dynamic_slice", "gather", "dynamic_gather", "torch_index_select", "all_slice",
})
"""Data-movement ops that read only part of operand 0: as many elements as they write."""

TRANSCENDENTAL_OPS = frozenset({
    "exponential", "exponential_minus_one", "log", "log_plus_one", "logistic", "tanh", "sine", "cosine",
    "tan", "sqrt", "rsqrt", "cbrt", "power", "atan2", "erf",
})
"""Elementwise ops XLA counts as one transcendental per element (and no FLOPs)."""

ELEMENTWISE_OPS = frozenset({
    "add", "subtract", "multiply", "divide", "remainder", "maximum", "minimum", "and", "or", "xor", "not",
    "negate", "abs", "sign", "floor", "ceil", "round_nearest_afz", "round_nearest_even", "compare", "select",
    "clamp", "convert", "reduce_precision", "is_finite", "popcnt", "count_leading_zeros", "shift_left",
    "shift_right_arithmetic", "shift_right_logical", "real", "imag", "complex", "square",
    "uniform_quantize", "uniform_dequantize", "bitcast_convert",
    # chlo's implicitly broadcasting binary ops
    "broadcast_add", "broadcast_subtract", "broadcast_multiply", "broadcast_divide", "broadcast_remainder",
    "broadcast_maximum", "broadcast_minimum", "broadcast_and", "broadcast_or", "broadcast_xor",
    "broadcast_compare", "broadcast_select", "broadcast_complex", "broadcast_shift_left",
    "broadcast_shift_right_arithmetic", "broadcast_shift_right_logical",
})
"""Elementwise ops XLA counts as one FLOP per result element."""

# Elementwise ops whose "FLOP" is a pure bit reinterpretation: counted as XLA does, but no compute unit.
_NO_UNIT_ELEMENTWISE = frozenset({"bitcast_convert"})
# chlo ops that broadcast and whose non-broadcast form is costed by _decomposed.
_BROADCAST_DECOMPOSED = {"broadcast_polygamma": "polygamma", "broadcast_zeta": "zeta",
                         "broadcast_next_after": "next_after", "broadcast_power": "power",
                         "broadcast_atan2": "atan2"}

DECOMPOSED_OPS: dict[str, tuple[float, float]] = {
    "erf_inv": (37, 2), "erfc": (62, 1), "lgamma": (53, 4), "digamma": (73, 3), "polygamma": (260, 19),
    "zeta": (121, 11), "bessel_i1e": (83, 1), "sinh": (10, 3), "cosh": (3, 2), "asin": (5, 2),
    "acos": (3, 2), "atan": (0, 1), "asinh": (11, 3), "acosh": (7, 4), "atanh": (6, 2),
    "next_after": (24, 0), "is_inf": (2, 0), "is_pos_inf": (1, 0), "is_neg_inf": (1, 0), "conj": (1, 0),
}
"""chlo ops XLA expands into elementwise code: (FLOPs, transcendentals) per element of XLA's f32 expansion."""
# f64 expansions that differ from the f32 ones.
_DECOMPOSED_F64 = {"erf_inv": (100, 2), "erfc": (90, 1), "bessel_i1e": (173, 1)}
# Types XLA computes in f32 inside such expansions (one convert in, one out).
_UPCAST_TYPES = frozenset({"bf16", "f16"})

MATRIX_OPS = frozenset({"dot_general", "dot", "convolution", "dynamic_conv", "ragged_dot", "cholesky",
                        "triangular_solve"})
"""Ops that run on tensor cores / the MXU."""

REDUCTION_OPS = frozenset({"reduce", "reduce_window", "select_and_scatter", "scatter", "map", "all_reduce"})
"""Ops whose FLOPs are their reducer body's cost times a count."""

# custom_call targets that are sharding annotations or markers, not kernels.
ANNOTATION_TARGETS = frozenset({
    "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "xla.sdy.GlobalToLocalShape",
    "xla.sdy.LocalToGlobalShape", "xla.sdy.FuncResultSharding", "xla.sdy.ShardingGroup",
    "xla.sdy.PropagationBarrier",
})
"""``custom_call`` targets that are free annotations (modelled, zero cost)."""

# The fused attention stand-ins (FUSED_ATTENTION, FUSED_ATTENTION_GRAD: :mod:`hespas_ml.ingest.graph`): the
# scores never reach memory, so the kernel reads its operands and writes its results once; of the s × t
# scores a causal mask leaves half (on average over a context-parallel group's devices too). Forward: two
# products over them, 2·b·h·s·t·d FLOPs; backward 2.5 times that (the scores recomputed, four products).


# -- helpers --------------------------------------------------------------------------------------------

def _nbytes(types: list[TensorType]) -> float:
    return float(sum(t.nbytes for t in types))


def _numel(types: list[TensorType]) -> float:
    return float(sum(t.numel for t in types))


def _first_numel(types: list[TensorType]) -> float:
    return float(types[0].numel) if types else 0.0


def _io(op: Op) -> tuple[float, float]:
    return _nbytes(op.operand_types), _nbytes(op.result_types)


def _kinds_cost(kinds: list[str]) -> tuple[float, float]:
    """(FLOPs, transcendentals) of one application of a scalar body made of ops of these kinds."""
    flops = trans = 0.0
    for k in kinds:
        if k in TRANSCENDENTAL_OPS:
            trans += 1
        elif k in ELEMENTWISE_OPS:
            flops += 1
        elif k in DECOMPOSED_OPS:
            f, t = DECOMPOSED_OPS[k]
            flops += f
            trans += t
    return flops, trans


def _body(op: Op, default: float = 1.0, region: int | None = None) -> tuple[float, float]:
    """(FLOPs, transcendentals) of one application of the op's reducer / comparator body.

    Uses ``attrs["body_op_kinds"]`` (one list of op kinds per region) when ingest provides it, so constants
    in a body cost nothing and transcendental ops count as transcendentals; otherwise ``attrs["body_ops"]``
    (every body op taken as one FLOP), otherwise ``default``. ``region`` picks one region's body.
    """
    kinds = op.attrs.get("body_op_kinds")
    if isinstance(kinds, list) and kinds:
        regions = kinds if isinstance(kinds[0], list) else [kinds]
        if region is not None:
            return _kinds_cost(regions[region]) if region < len(regions) else (0.0, 0.0)
        return _kinds_cost([k for r in regions for k in r])
    n = op.attrs.get("body_ops")
    return (float(default if n is None else n), 0.0)


def _log2_ceil(n: float) -> int:
    n = int(n)
    return (n - 1).bit_length() if n > 1 else 0


def _log2_floor(n: int) -> int:
    return int(n).bit_length() - 1 if n >= 1 else 0


# -- handlers (one per family; each returns the OpCost of one execution) ---------------------------------

def _free(op: Op) -> OpCost:
    return OpCost(0.0, 0.0, 0.0, 0.0, NONE, True)


def _unknown(op: Op) -> OpCost:
    bin_, bout = _io(op)
    return OpCost(0.0, 0.0, bin_, bout, NONE, False)


def _move(op: Op) -> OpCost:
    bin_, bout = _io(op)
    return OpCost(0.0, 0.0, bin_, bout, NONE, True)


def _generate(op: Op) -> OpCost:
    """iota: writes its result, reads nothing."""
    return OpCost(0.0, 0.0, 0.0, _nbytes(op.result_types), NONE, True)


def _partial_read(op: Op) -> OpCost:
    """slice / dynamic_slice / gather: reads as much of operand 0 as it writes, plus the other operands."""
    out = _nbytes(op.result_types)
    extra = _nbytes(op.operand_types[1:])
    return OpCost(0.0, 0.0, out + extra, out, NONE, True)


def _dynamic_update_slice(op: Op) -> OpCost:
    """In place: reads the update and the indices, writes the update-sized window."""
    upd = float(op.operand_types[1].nbytes) if len(op.operand_types) > 1 else _nbytes(op.result_types)
    idx = _nbytes(op.operand_types[2:])
    return OpCost(0.0, 0.0, upd + idx, upd, NONE, True)


def _elementwise(op: Op) -> OpCost:
    bin_, bout = _io(op)
    unit = NONE if op.kind in _NO_UNIT_ELEMENTWISE else VECTOR
    return OpCost(_first_numel(op.result_types), 0.0, bin_, bout, unit, True)


def _convert(op: Op) -> OpCost:
    """convert: elementwise, except a convert to the operand's own type, which XLA drops (free)."""
    if op.operand_types and op.result_types and op.operand_types[0] == op.result_types[0]:
        return _free(op)
    return _elementwise(op)


def _transcendental(op: Op) -> OpCost:
    bin_, bout = _io(op)
    return OpCost(0.0, _first_numel(op.result_types), bin_, bout, VECTOR, True)


def _decomposed(op: Op) -> OpCost:
    kind = _BROADCAST_DECOMPOSED.get(op.kind, op.kind)
    if kind in ("power", "atan2"):
        return _transcendental(op)
    dtype = op.dtype
    flops, trans = (_DECOMPOSED_F64.get(kind) if dtype == "f64" else None) or DECOMPOSED_OPS[kind]
    if dtype in _UPCAST_TYPES:
        flops += 2
    n = _first_numel(op.result_types)
    bin_, bout = _io(op)
    return OpCost(flops * n, trans * n, bin_, bout, VECTOR, True)


def _dot(op: Op) -> OpCost:
    dims = op.attrs.get("dot_dimension_numbers") or {}
    lhs = op.operand_types[0].shape if op.operand_types else ()
    contract = dims.get("lhs_contract")
    if contract is None:
        contract = [len(lhs) - 1] if lhs else []
    k = prod(lhs[d] for d in contract) if lhs else 1
    bin_, bout = _io(op)
    return OpCost(2.0 * _first_numel(op.result_types) * k, 0.0, bin_, bout, MATRIX, True)


def _ragged_dot(op: Op) -> OpCost:
    """ragged_dot (lhs [m, k], rhs [g, k, n], group sizes): each lhs row meets one group's matrix."""
    bin_, bout = _io(op)
    lhs = op.operand_types[0].shape if op.operand_types else ()
    if len(lhs) < 1 or not op.result_types:
        return OpCost(0.0, 0.0, bin_, bout, MATRIX, False)
    return OpCost(2.0 * op.result_types[0].numel * lhs[-1], 0.0, bin_, bout, MATRIX, True)


@lru_cache(maxsize=4096)
def _conv_positions(size_in: int, size_k: int, size_out: int, stride: int, pad_low: int,
                    lhs_dil: int, rhs_dil: int) -> int:
    """Number of (output, kernel) position pairs along one spatial dim that read a real input element.

    The input index of output ``o`` and kernel tap ``k`` in the (padded, lhs-dilated) input is
    ``u = o·stride − pad_low + k·rhs_dil``; the pair counts when ``u`` lands on an original element:
    ``u ≥ 0``, ``u`` a multiple of ``lhs_dil`` and ``u / lhs_dil < size_in``.
    """
    stride, lhs_dil, rhs_dil = max(stride, 1), max(lhs_dil, 1), max(rhs_dil, 1)
    u_max = (size_in - 1) * lhs_dil
    period = lhs_dil // gcd(stride, lhs_dil)
    total = 0
    for k in range(size_k):
        c = k * rhs_dil - pad_low                 # u = o·stride + c
        lo = max(0, -(c // stride))               # ceil(-c / stride)
        hi = min(size_out - 1, (u_max - c) // stride)
        if hi < lo:
            continue
        if lhs_dil == 1:
            total += hi - lo + 1
            continue
        first = next((o for o in range(lo, min(lo + period, hi + 1)) if (o * stride + c) % lhs_dil == 0), None)
        if first is not None:
            total += (hi - first) // period + 1
    return total


def _convolution(op: Op) -> OpCost:
    bin_, bout = _io(op)
    a = op.attrs
    dn = a.get("dimension_numbers")
    if not isinstance(dn, dict) or len(op.operand_types) < 2 or not op.result_types:
        return OpCost(0.0, 0.0, bin_, bout, MATRIX, False)
    lhs, rhs, out = op.operand_types[0].shape, op.operand_types[1].shape, op.result_types[0].shape
    fgc = int(a.get("feature_group_count") or 1)
    bgc = int(a.get("batch_group_count") or 1)
    spatial = dn["input_spatial"]
    n = len(spatial)
    strides = a.get("window_strides") or [1] * n
    padding = a.get("padding") or [[0, 0]] * n
    lhs_dil = a.get("lhs_dilation") or [1] * n
    rhs_dil = a.get("rhs_dilation") or [1] * n
    positions = 1
    for i in range(n):
        positions *= _conv_positions(lhs[spatial[i]], rhs[dn["kernel_spatial"][i]], out[dn["output_spatial"][i]],
                                     int(strides[i]), int(padding[i][0]), int(lhs_dil[i]), int(rhs_dil[i]))
    fma = (lhs[dn["input_feature"]] // fgc) * out[dn["output_feature"]] * (lhs[dn["input_batch"]] // bgc) \
        * positions
    return OpCost(2.0 * fma, 0.0, bin_, bout, MATRIX, True)


def _reduce(op: Op) -> OpCost:
    bin_, bout = _io(op)
    reductions = max(_first_numel(op.operand_types) - _first_numel(op.result_types), 0.0)
    flops, trans = _body(op)
    return OpCost(flops * reductions, trans * reductions, bin_, bout, VECTOR if flops or trans else NONE, True)


def _reduce_window(op: Op) -> OpCost:
    bin_, bout = _io(op)
    window = prod(op.attrs.get("window_dimensions") or [1])
    reductions = (window - 1) * _first_numel(op.result_types)
    flops, trans = _body(op)
    return OpCost(flops * reductions, trans * reductions, bin_, bout, VECTOR if flops or trans else NONE, True)


def _select_and_scatter(op: Op) -> OpCost:
    """operands: (operand, source, init). Selects run (window − 1) times per source element, scatters once.

    Without per-region body kinds the select body is taken as one compare and the rest as the scatter body.
    """
    bin_, bout = _io(op)
    window = prod(op.attrs.get("window_dimensions") or [1])
    source = float(op.operand_types[1].numel) if len(op.operand_types) > 1 else 0.0
    if isinstance(op.attrs.get("body_op_kinds"), list) and op.attrs["body_op_kinds"]:
        sel_f, sel_t = _body(op, region=0)
        sc_f, sc_t = _body(op, region=1)
    else:
        total = _body(op, default=2)[0]
        sel_f, sel_t = min(total, 1.0), 0.0
        sc_f, sc_t = total - sel_f, 0.0
    selects = source * (window - 1)
    return OpCost(sel_f * selects + sc_f * source, sel_t * selects + sc_t * source, bin_, bout, VECTOR, True)


def _scatter(op: Op) -> OpCost:
    """operands: N inputs, indices, N updates. In place: reads + writes the updated part, reads indices."""
    types = op.operand_types
    n = max((len(types) - 1) // 2, 1)
    updates = types[n + 1:] if len(types) >= 2 * n + 1 else types[-1:]
    indices = types[n:n + 1]
    upd_bytes = _nbytes(updates)
    count = _first_numel(updates)
    flops, trans = _body(op)
    return OpCost(flops * count, trans * count, 2 * upd_bytes + _nbytes(indices), upd_bytes,
                  VECTOR if flops or trans else NONE, True)


def _map(op: Op) -> OpCost:
    bin_, bout = _io(op)
    n = _first_numel(op.result_types)
    flops, trans = _body(op)
    return OpCost(flops * n, trans * n, bin_, bout, VECTOR, True)


def _sort(op: Op) -> OpCost:
    bin_, bout = _io(op)
    n = _first_numel(op.operand_types)
    return OpCost(n * _log2_ceil(n), 0.0, bin_, bout, VECTOR, True)


def _rng(op: Op) -> OpCost:
    bin_, bout = _io(op)
    return OpCost(0.0, _numel(op.result_types), bin_, bout, VECTOR, True)


def _fft(op: Op) -> OpCost:
    bin_, bout = _io(op)
    logs = prod(_log2_floor(int(n)) for n in (op.attrs.get("fft_length") or [1]))
    return OpCost(2.0 * 4 * logs * _first_numel(op.operand_types), 0.0, bin_, bout, VECTOR, True)


def _cholesky(op: Op) -> OpCost:
    bin_, bout = _io(op)
    shape = op.operand_types[0].shape if op.operand_types else ()
    if len(shape) < 2:
        return OpCost(0.0, 0.0, bin_, bout, MATRIX, False)
    n = shape[-1]
    # one triangle is read and one written
    return OpCost(n ** 3 / 3.0 * prod(shape[:-2]), 0.0, bin_ / 2.0, bout / 2.0, MATRIX, True)


def _triangular_solve(op: Op) -> OpCost:
    """Reads half of the triangular matrix a, all of b; 2 × n × elements(b) FLOPs."""
    if len(op.operand_types) < 2:
        return _unknown(op)
    a, b = op.operand_types[0], op.operand_types[1]
    flops = 2.0 * a.shape[-1] * b.numel if a.shape else 0.0
    return OpCost(flops, 0.0, a.nbytes / 2.0 + b.nbytes, _nbytes(op.result_types), MATRIX, True)


def _batch_norm(op: Op) -> OpCost:
    """batch_norm_{inference,training,grad}: an estimate of the elementwise work of XLA's expansion."""
    bin_, bout = _io(op)
    per_element = {"batch_norm_inference": 4, "batch_norm_training": 7, "batch_norm_grad": 11}[op.kind]
    n = _first_numel(op.operand_types)
    features = _numel(op.operand_types[1:2])
    return OpCost(per_element * n, features, bin_, bout, VECTOR, True)


def _all_reduce(op: Op) -> OpCost:
    """The reduction of an all-reduce: body × result elements (XLA's convention; the collective itself is
    network time, so the unit is "none")."""
    bin_, bout = _io(op)
    n = _numel(op.result_types)
    flops, trans = _body(op)
    return OpCost(flops * n, trans * n, bin_, bout, NONE, True)


def _custom_call(op: Op) -> OpCost:
    target = op.attrs.get("call_target_name")
    if target in ANNOTATION_TARGETS:
        return _free(op)
    if target in FUSED_ATTENTION_TARGETS and len(op.operand_types) >= 3:
        b, s, h, d = op.operand_types[0].shape
        t = op.operand_types[1].shape[1]
        flops = 2.0 * b * h * s * t * d * (2.5 if target == FUSED_ATTENTION_GRAD else 1.0)
        bin_, bout = _io(op)
        return OpCost(flops, b * h * s * t / 2.0, bin_, bout, MATRIX, True)
    return _unknown(op)


_HANDLERS: dict[str, Callable[[Op], OpCost]] = {}
for _k in FREE_OPS:
    _HANDLERS[_k] = _free
for _k in DATA_MOVEMENT_OPS:
    _HANDLERS[_k] = _move
for _k in PARTIAL_READ_OPS:
    _HANDLERS[_k] = _partial_read
for _k in ("iota", "dynamic_iota"):
    _HANDLERS[_k] = _generate
for _k in ELEMENTWISE_OPS:
    _HANDLERS[_k] = _elementwise
for _k in TRANSCENDENTAL_OPS:
    _HANDLERS[_k] = _transcendental
for _k in [*DECOMPOSED_OPS, *_BROADCAST_DECOMPOSED]:
    _HANDLERS[_k] = _decomposed
for _k in COLLECTIVE_KINDS:
    _HANDLERS[_k] = _move
for _k in ("batch_norm_inference", "batch_norm_training", "batch_norm_grad"):
    _HANDLERS[_k] = _batch_norm
_HANDLERS.update({
    "dynamic_update_slice": _dynamic_update_slice, "convert": _convert,
    "dot_general": _dot, "dot": _dot, "ragged_dot": _ragged_dot,
    "convolution": _convolution, "dynamic_conv": _convolution,
    "reduce": _reduce, "reduce_window": _reduce_window, "select_and_scatter": _select_and_scatter,
    "scatter": _scatter, "map": _map, "sort": _sort, "top_k": _sort, "topk": _sort,
    "rng": _rng, "rng_bit_generator": _rng, "fft": _fft, "cholesky": _cholesky,
    "triangular_solve": _triangular_solve, "all_reduce": _all_reduce, "custom_call": _custom_call,
})
del _k

KNOWN_OPS = frozenset(_HANDLERS) - {"custom_call"}
"""Every op kind the model costs (custom_call is costed only for annotation targets and the fused attention
stand-ins)."""


def op_cost(op: Op) -> OpCost:
    """Cost of one execution of ``op`` (not multiplied by ``op.count``). Never raises on odd ops."""
    handler = _HANDLERS.get(op.kind, _unknown)
    try:
        return handler(op)
    except (IndexError, KeyError, TypeError, ValueError, ZeroDivisionError):
        # malformed attributes (e.g. an attribute left undecoded as text): cost the traffic only
        bin_, bout = _io(op)
        return OpCost(0.0, 0.0, bin_, bout, NONE, False)


def program_costs(graph: OpGraph) -> list[OpCost]:
    """:func:`op_cost` of every op of ``graph``, remembered for the last program asked about (the split
    costs every op; the region records of the same program reuse those costs)."""
    return last_program_table(graph, "costs", lambda g: [op_cost(op) for op in g.ops])


# Ops kept even when nothing reads their results.
_SIDE_EFFECT_KINDS = frozenset({"send", "recv", "infeed", "outfeed", "after_all", "optimization_barrier",
                                *COLLECTIVE_KINDS})


def live_mask(graph: OpGraph) -> list[bool]:
    """For each op id, whether it contributes to the program's outputs (what XLA keeps after removing dead
    code). Ops with side effects (collectives, send/recv, infeed/outfeed, custom calls marked
    ``has_side_effect``) and every op inside a while loop (loop control is read by the loop condition, which
    the graph does not record as a use) count as live."""
    ops = graph.ops
    live = [False] * len(ops)
    stack = [i for i in graph.outputs if 0 <= i < len(ops)]
    stack += [op.id for op in ops if op.loop is not None or op.kind in _SIDE_EFFECT_KINDS
              or op.attrs.get("has_side_effect") is True]
    while stack:
        i = stack.pop()
        if live[i]:
            continue
        live[i] = True
        stack.extend(j for j in ops[i].operands if j >= 0 and not live[j])
    return live


def graph_cost(graph: OpGraph, live_only: bool = False) -> dict[str, Any]:
    """Program totals with loop trip counts (``op.count``) multiplied in.

    With ``live_only``, ops whose results nothing uses (see :func:`live_mask`) are left out, as XLA's
    dead-code elimination would.

    Keys: ``flops``, ``transcendentals``, ``bytes``, ``bytes_in``, ``bytes_out``, ``flops_by_unit``
    ({unit: flops}), ``kinds`` ({kind: executions}), ``unmodelled`` ({kind: executions} of ops the model
    does not know), ``unmodelled_targets`` ({custom_call target: executions}), ``ops`` (total executions).
    """
    flops = trans = b_in = b_out = 0.0
    by_unit = {u: 0.0 for u in UNITS}
    kinds: dict[str, int] = {}
    unmodelled: dict[str, int] = {}
    targets: dict[str, int] = {}
    executions = 0
    live = live_mask(graph) if live_only else None
    for op in graph.ops:
        if live is not None and not live[op.id]:
            continue
        c = op_cost(op)
        n = op.count
        flops += c.flops * n
        trans += c.transcendentals * n
        b_in += c.bytes_in * n
        b_out += c.bytes_out * n
        by_unit[c.unit] += c.flops * n
        kind = op.kind
        kinds[kind] = kinds.get(kind, 0) + n
        executions += n
        if not c.modelled:
            unmodelled[kind] = unmodelled.get(kind, 0) + n
            if kind == "custom_call":
                t = str(op.attrs.get("call_target_name", "?"))
                targets[t] = targets.get(t, 0) + n
    return {"flops": flops, "transcendentals": trans, "bytes": b_in + b_out, "bytes_in": b_in,
            "bytes_out": b_out, "flops_by_unit": by_unit, "kinds": kinds, "unmodelled": unmodelled,
            "unmodelled_targets": targets, "ops": executions}
