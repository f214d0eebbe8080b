"""Group ops into kernels the way XLA fuses them, so memory traffic is counted only at kernel boundaries.

If the program was already fused by XLA (``mhlo.fusion`` regions, as in compiler-partitioned or MaxText
exports), those fusions are the kernels. Otherwise the grouping follows XLA's main rules:

* **loop fusion** — elementwise ops and cheap data movement (convert, broadcast, reshape, transpose,
  slice, pad, concatenate, select, compare, iota, gather …) fuse into their consumer when every consumer
  is in the same kernel and in the same loop body;
* **free ops** (constants, reshapes, broadcasts, tuples) are copied into each consumer's kernel rather
  than materialised;
* **input fusion** — a reduction (reduce, reduce_window) takes in the elementwise ops that produce its
  operands;
* **output fusion** — a dot or convolution takes in its elementwise epilogue (bias, activation, scaling,
  convert) when the epilogue is its only consumer;
* **operand layouts** — a transpose or reverse (the flipped kernel of a backward-data convolution) whose
  only consumer is a dot or convolution is folded into it, as the backends do;
* **in-place accumulation** — a ``dynamic_update_slice`` into zeros, or a ``pad`` with zeros, whose only
  consumer is an ``add`` (the gradient of a sliced operand, summed over a loop's iterations) joins that add:
  XLA updates the window of the sum in place (:func:`accumulated_window`);
* collectives, custom calls, sort, scatter, select_and_scatter, other in-place updates, copies and RNG are
  kernels of their own.

:func:`merge_producers` goes one step further, as XLA's fusion merger does on GPUs: an elementwise kernel
whose results only loop or reduction kernels read is recomputed inside each of them instead of being
written once and read by each, where that moves fewer bytes.
"""
from __future__ import annotations

from ..ingest.graph import OpGraph

# No kernel of their own: metadata or views that fusion duplicates into consumers.
FREE_KINDS = frozenset({
    "constant", "reshape", "bitcast", "broadcast_in_dim", "broadcast", "get_tuple_element", "tuple",
    "optimization_barrier", "partition_id", "replica_id", "iota", "sharding_constraint", "reshard",
    "propagation_barrier", "after_all", "create_token", "custom_call_noop",
})
# Fuse into their consumers (loop fusion).
FUSIBLE_KINDS = frozenset({
    "abs", "add", "and", "atan2", "cbrt", "ceil", "clamp", "compare", "complex", "convert", "cosine",
    "count_leading_zeros", "divide", "exponential", "exponential_minus_one", "floor", "imag", "is_finite",
    "log", "log_plus_one", "logistic", "maximum", "minimum", "multiply", "negate", "not", "or",
    "popcnt", "power", "real", "reduce_precision", "remainder", "round_nearest_afz", "round_nearest_even",
    "rsqrt", "select", "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "sine",
    "sqrt", "subtract", "tan", "tanh", "xor", "transpose", "slice", "pad", "concatenate", "reverse",
    "dynamic_slice", "gather", "erf", "erf_inv", "bitcast_convert", "map",
}) | FREE_KINDS
# Roots that take in their producers (input fusion).
REDUCTION_KINDS = frozenset({"reduce", "reduce_window"})
# Roots that take in a single elementwise consumer (output fusion).
MATRIX_KINDS = frozenset({"dot_general", "dot", "convolution"})
# Operand layout changes that a dot or convolution absorbs (dimension numbers, a flipped kernel).
LAYOUT_KINDS = frozenset({"transpose", "reverse"})


# Elementwise ops cheap enough to compute again in every kernel that reads them. XLA:GPU counts exp, sqrt,
# rsqrt and divide as cheap in f32 and f16 and the other transcendentals as expensive; bf16 is taken as f16.
_CHEAP_TRANSCENDENTAL = frozenset({"exponential", "sqrt", "rsqrt"})
_CHEAP_DTYPES = frozenset({"f32", "f16", "bf16"})
_MERGEABLE_KINDS = frozenset({
    "abs", "add", "and", "clamp", "compare", "convert", "divide", "maximum", "minimum", "multiply", "negate",
    "not", "or", "select", "subtract", "xor", "sign", "floor", "ceil", "round_nearest_afz",
    "round_nearest_even", "is_finite", "reduce_precision", "bitcast_convert", "transpose",
}) | _CHEAP_TRANSCENDENTAL | FREE_KINDS


def _is_zeros(graph: OpGraph, i: int) -> bool:
    """Whether op ``i`` is a zero constant, or a broadcast or reshape of one."""
    ops = graph.ops
    while i >= 0 and ops[i].kind in ("broadcast_in_dim", "broadcast", "reshape"):
        i = ops[i].operands[0] if ops[i].operands else -1
    return i >= 0 and ops[i].kind == "constant" and ops[i].attrs.get("value") == 0


def window_update(graph: OpGraph, i: int) -> int | None:
    """Which operand of op ``i`` is the window it places into zeros: ``dynamic_update_slice(zeros, u, …)``
    (1) or ``pad(u, 0)`` without interior padding (0); None for any other op."""
    op = graph.ops[i]
    if op.kind == "dynamic_update_slice" and _is_zeros(graph, op.operands[0]):
        return 1
    if op.kind == "pad" and len(op.operands) > 1 and _is_zeros(graph, op.operands[1]) \
            and not any(op.attrs.get("interior_padding") or []):
        return 0
    return None


def accumulated_window(graph: OpGraph, i: int, users: list[list[int]]) -> bool:
    """Whether op ``i`` places a window into zeros (:func:`window_update`) for an ``add`` in the same loop,
    its only consumer: ``acc + dus(0, u, idx)`` or ``acc + pad(u, 0)``, which XLA runs as an in-place
    update of ``acc``'s window (the gradient of a sliced operand, summed over a loop's iterations). The
    window added to itself is not an update of anything."""
    ops = graph.ops
    op = ops[i]
    if len(users[i]) != 1 or window_update(graph, i) is None:
        return False
    user = ops[users[i][0]]
    return (user.kind == "add" and user.loop == op.loop and user.count == op.count
            and any(p != i for p in user.operands))


def fuse(graph: OpGraph, users: list[list[int]]) -> list[list[int]]:
    """Return kernels as lists of op ids (each sorted), covering every op exactly once."""
    ops = graph.ops
    if any(op.fusion is not None for op in ops):
        return _xla_fusions(graph, users)
    n = len(ops)
    group = [-1] * n
    members: list[list[int]] = []
    accepts_producers: list[bool] = []   # may producers still join this kernel?

    root_kind: list[str] = []

    def new_group(i: int, open_: bool) -> None:
        group[i] = len(members)
        members.append([i])
        accepts_producers.append(open_)
        root_kind.append(ops[i].kind)

    for i in range(n - 1, -1, -1):
        op = ops[i]
        kind = op.kind
        us = users[i]
        if accumulated_window(graph, i, users):
            g = group[us[0]]                  # updated in place inside the add's kernel
            group[i] = g
            members[g].append(i)
            continue
        if kind in FUSIBLE_KINDS and us:
            gs = {group[u] for u in us}
            same_ctx = all(ops[u].loop == op.loop and ops[u].count == op.count for u in us)
            if kind in LAYOUT_KINDS and same_ctx and len(gs) == 1 and root_kind[next(iter(gs))] in MATRIX_KINDS:
                g = group[us[0]]          # a flipped/transposed operand is folded into the dot/conv
                group[i] = g
                members[g].append(i)
                continue
            if same_ctx and len(gs) == 1:
                g = gs.pop()
                if accepts_producers[g]:
                    group[i] = g
                    members[g].append(i)
                    continue
            if kind in FREE_KINDS and same_ctx:
                # copied into each consumer: it belongs to the earliest consumer's kernel
                g = group[min(us)]
                if accepts_producers[g]:
                    group[i] = g
                    members[g].append(i)
                    continue
            new_group(i, True)
        elif kind in FUSIBLE_KINDS or kind in REDUCTION_KINDS:
            new_group(i, True)          # a loop fusion (or reduction) rooted here
        elif kind in MATRIX_KINDS:
            new_group(i, False)         # producers of a dot/conv stay separate kernels
        else:
            new_group(i, False)         # collectives, custom calls, sort, scatter, copies …
    _output_fusion(graph, users, group, members)
    return sorted((sorted(m) for m in members if m), key=lambda m: m[-1])


def _output_fusion(graph: OpGraph, users: list[list[int]], group: list[int], members: list[list[int]]) -> None:
    """Merge an elementwise-only consumer kernel into the dot/conv kernel that feeds it."""
    ops = graph.ops
    for g, mem in enumerate(members):
        if not mem:
            continue
        root = max(mem)
        if ops[root].kind not in MATRIX_KINDS:
            continue
        us = users[root]
        if len(us) != 1:
            continue
        cg = group[us[0]]
        if cg == g or not members[cg]:
            continue
        consumer = members[cg]
        if any(ops[j].kind not in FUSIBLE_KINDS for j in consumer):
            continue
        if any(ops[j].loop != ops[root].loop or ops[j].count != ops[root].count for j in consumer):
            continue
        first = min(mem)
        cset = set(consumer)
        # no other path from this kernel into the consumer: its other inputs all come from earlier ops
        ok = all(p < first or p in cset or group[p] == g for j in consumer for p in ops[j].operands)
        if not ok:
            continue
        for j in consumer:
            group[j] = g
        mem.extend(consumer)
        members[cg] = []


def _mergeable(graph: OpGraph, kernel: list[int]) -> bool:
    """Whether every op of ``kernel`` is elementwise (or free) and cheap to compute again."""
    ops = graph.ops
    for i in kernel:
        op = ops[i]
        if op.kind not in _MERGEABLE_KINDS:
            return False
        if op.kind in _CHEAP_TRANSCENDENTAL or op.kind == "divide":
            if any(t.dtype not in _CHEAP_DTYPES for t in op.result_types):
                return False
    return True


def merge_producers(graph: OpGraph, users: list[list[int]], kernels: list[list[int]],
                    kernel_bytes) -> tuple[list[list[int]], set[int]]:
    """Recompute elementwise kernels inside the kernels that read them (XLA's fusion merger).

    A kernel of cheap elementwise ops (:func:`_mergeable`) whose results are not returned by the program and
    are read only by loop or reduction kernels of the same loop (never by a dot, convolution, collective or
    custom call, which cannot take producers in) is copied into each of those kernels and dropped, when
    ``kernel_bytes`` (the boundary bytes of an op list, with a set of ops computed again elsewhere) says the
    copies move no more bytes than the kernel and its readers did. Chains merge in turn, readers first.
    Returns the kernels (a copied op is in every kernel that reads it, so kernels may share ops) and the ops
    that were copied: those are never written to memory. Kernels XLA chose itself (``mhlo.fusion``) stay.
    """
    ops = graph.ops
    if any(op.fusion is not None for op in ops):
        return [list(k) for k in kernels], set()          # XLA chose these kernels itself
    outputs = set(graph.outputs)
    kernels = [list(k) for k in kernels]
    holders: dict[int, set[int]] = {}
    for ki, k in enumerate(kernels):
        for i in k:
            holders.setdefault(i, set()).add(ki)
    copied: set[int] = set()
    accepts = [all(ops[i].kind in FUSIBLE_KINDS or ops[i].kind in REDUCTION_KINDS for i in k) for k in kernels]
    for ki in sorted(range(len(kernels)), key=lambda k: -max(kernels[k])):    # readers before their producers
        k = kernels[ki]
        if not k or not _mergeable(graph, k):
            continue
        members = set(k)
        if any(i in outputs or not users[i] for i in members):
            continue
        readers: set[int] = set()
        for i in k:
            for u in users[i]:
                if u not in members:
                    readers |= holders[u]
        readers.discard(ki)
        loop = (ops[k[-1]].loop, ops[k[-1]].count)
        if not readers or not all(accepts[r] and kernels[r] for r in readers):
            continue
        if any((ops[kernels[r][-1]].loop, ops[kernels[r][-1]].count) != loop for r in readers):
            continue
        before = kernel_bytes(k, copied) + sum(kernel_bytes(kernels[r], copied) for r in readers)
        merged = {r: sorted(set(kernels[r]) | members) for r in readers}
        after = sum(kernel_bytes(m, copied | members) for m in merged.values())
        if after > before:
            continue
        for r, m in merged.items():
            kernels[r] = m
            for i in k:
                holders[i].add(r)
        for i in k:
            holders[i].discard(ki)
        copied |= members
        kernels[ki] = []
    return sorted((k for k in kernels if k), key=lambda m: m[-1]), copied


def _xla_fusions(graph: OpGraph, users: list[list[int]]) -> list[list[int]]:
    """Kernels as XLA chose them: one per ``mhlo.fusion``; unfused ops alone, free ops with a consumer."""
    ops = graph.ops
    by_fusion: dict[int, list[int]] = {}
    kernels: list[list[int]] = []
    kernel_of: dict[int, int] = {}
    pending_free: list[int] = []
    for op in ops:
        if op.fusion is not None:
            k = by_fusion.get(op.fusion)
            if k is None:
                k = by_fusion[op.fusion] = len(kernels)
                kernels.append([])
            kernels[k].append(op.id)
            kernel_of[op.id] = k
        elif op.kind in FREE_KINDS:
            pending_free.append(op.id)
        else:
            kernel_of[op.id] = len(kernels)
            kernels.append([op.id])
    for i in reversed(pending_free):      # a free op joins the kernel of its earliest consumer
        us = [u for u in users[i] if u in kernel_of and not ops[u].is_collective]
        if us and ops[min(us)].loop == ops[i].loop:
            k = kernel_of[min(us)]
        else:
            k = len(kernels)
            kernels.append([])
        kernels[k].append(i)
        kernel_of[i] = k
    return sorted((sorted(k) for k in kernels if k), key=lambda m: m[-1])
