"""Structural hash of a region: equal for identical computations, whatever program they come from.

:func:`region_signature` hashes (SHA-256, so it is stable across processes, runs and machines) a canonical
serialisation of a region that covers

* each op's opcode, operand and result types, and the attributes that change what it computes (dimension
  numbers, windows, strides, permutations, reducer bodies, comparison directions …);
* the internal edges (which op feeds which operand of which op) and which operands come from outside the
  region — two operands reading the *same* outside tensor are told apart from two reading different ones,
  since that changes the bytes a kernel moves;
* which ops' results leave the region (they are written to memory; not those the region computes again
  for itself, ``Region.recomputed``);
* how the ops are grouped into kernels (a linear split region holds several).

Left out: op ids, positions, the call path, fusion ids, loop membership, the region's execution count, and
attributes that do not change the computation (:data:`IGNORED_ATTRS`: channel handles, and the payload
of constants — a constant's shape and type stay in).

The canonical op order does not depend on op ids: ops are ordered by depth inside the region, then by a
Merkle hash of everything upstream of them (their own label and their operands' hashes), and only ties
between structurally identical ops fall back to program order. Repeated layers of a model therefore
collapse to one hash, and so do the same kernel in two different programs.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

from ..ingest.graph import Op, OpGraph, program_users

SIGNATURE_VERSION = 1
# Attribute keys that never enter the hash: they do not change what a kernel computes or moves.
IGNORED_ATTRS = frozenset({"channel_handle", "mhlo.frontend_attributes", "mhlo.sharding", "sdy.sharding",
                           "backend_config", "result_layout", "operand_layouts", "name", "sym_name",
                           "mhlo.backend_config", "metadata"})
# Per opcode kind, attributes whose value is data rather than structure.
IGNORED_KIND_ATTRS = {"constant": frozenset({"value"})}

def _canon(value: Any) -> Any:
    """A JSON-able form of a decoded attribute value (tuples as lists, keys sorted by json)."""
    kind = type(value)
    if kind is int or kind is str or kind is bool or value is None:      # the common leaves, first
        return value
    if isinstance(value, dict):
        return {str(k): _canon(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canon(v) for v in value]
    if isinstance(value, float) and value != value:
        return "nan"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def structural_attrs(op: Op) -> dict[str, Any]:
    """The attributes of ``op`` that change its computation (see :data:`IGNORED_ATTRS`), canonicalised."""
    if not op.attrs:
        return {}
    skip = IGNORED_KIND_ATTRS.get(op.kind, frozenset())
    return {k: _canon(v) for k, v in sorted(op.attrs.items()) if k not in IGNORED_ATTRS and k not in skip}


# one encoder for every label and form (json.dumps with options builds a new one per call)
_LABEL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=True).encode
_FORM_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=True).encode


def op_label(op: Op) -> str:
    """The local part of an op's identity: opcode, types and structural attributes."""
    return _LABEL_JSON([op.opcode, [str(t) for t in op.operand_types], [str(t) for t in op.result_types],
                        structural_attrs(op)])


def escaping_ops(region, users: list[list[int]] | None = None) -> set[int]:
    """Ops of ``region`` whose results leave it: read outside the region, returned by the program, or read
    by nobody (a kernel writes those too)."""
    graph: OpGraph = region.graph
    if users is None:
        users = program_users(graph)
    members = set(region.op_ids)
    outputs = set(graph.outputs)
    recomputed = getattr(region, "recomputed", frozenset())
    return {i for i in region.op_ids if i not in recomputed and
            (i in outputs or not users[i] or any(u not in members for u in users[i]))}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def canonical_order(region, labels: dict[int, str] | None = None) -> list[int]:
    """The region's op ids in canonical order (depth, upstream Merkle hash, then program order)."""
    ops = region.graph.ops
    members = set(region.op_ids)
    labels = labels if labels is not None else {i: op_label(ops[i]) for i in region.op_ids}
    merkle: dict[int, str] = {}
    depth: dict[int, int] = {}
    for i in sorted(region.op_ids):          # producers come before consumers in program order
        op = ops[i]
        refs = []
        d = 0
        for p, t in zip(op.operands, op.operand_types):
            if p >= 0 and p in members and p in merkle:
                refs.append("i" + merkle[p])
                d = max(d, depth[p] + 1)
            elif p >= 0 and p in members:      # a later op of the region (a loop-carried value)
                refs.append("l" + str(t))
            else:
                refs.append("e" + str(t))
        depth[i] = d
        merkle[i] = _sha(labels[i] + "|" + ",".join(refs))
    return sorted(region.op_ids, key=lambda i: (depth[i], merkle[i], i))


def canonical_form(region, users: list[list[int]] | None = None) -> list[Any]:
    """The serialisable structure :func:`region_signature` hashes (useful to see why two hashes differ)."""
    return _form_and_order(region, users)[0]


def _form_and_order(region, users: list[list[int]] | None) -> tuple[list[Any], list[int], set[int]]:
    ops = region.graph.ops
    labels = {i: op_label(ops[i]) for i in region.op_ids}
    order = canonical_order(region, labels)
    index = {i: n for n, i in enumerate(order)}
    escapes = escaping_ops(region, users)
    external: dict[Any, int] = {}
    rows: list[Any] = []
    for i in order:
        op = ops[i]
        refs = []
        for j, p in enumerate(op.operands):
            if p >= 0 and p in index:
                refs.append(["i", index[p]])
            else:
                # a program input (-1) is a distinct tensor per use: the ingest does not say which argument
                key = (p, str(op.operand_types[j])) if p >= 0 else ("arg", i, j)
                refs.append(["e", external.setdefault(key, len(external))])
        rows.append([labels[i], refs, i in escapes])
    kernels = sorted(sorted(index[i] for i in k.op_ids if i in index) for k in region.kernels)
    return [SIGNATURE_VERSION, region.kind, rows, kernels], order, escapes


def region_signature(region, users: list[list[int]] | None = None) -> str:
    """Hex SHA-256 (64 characters) of the region's canonical form. ``region.graph`` must be set; ``users``
    (``graph.users()``) may be passed to save recomputing it for each region of a program."""
    return signature_parts(region, users)[0]


def signature_parts(region, users: list[list[int]] | None = None) -> tuple[str, list[int], set[int]]:
    """:func:`region_signature`, :func:`canonical_order` and :func:`escaping_ops` of ``region``, computed
    together (a region's record needs all three)."""
    if getattr(region, "graph", None) is None:
        raise ValueError(f"region {getattr(region, 'id', '?')} carries no op graph (region.graph)")
    form, order, escapes = _form_and_order(region, users)
    return _sha(_FORM_JSON(form)), order, escapes


def signatures(regions: Sequence) -> list[str]:
    """:func:`region_signature` of several regions of one program."""
    if not regions:
        return []
    users = program_users(regions[0].graph)
    return [region_signature(r, users) for r in regions]
