"""Split an op graph into compute regions and collectives, with their dependency DAG in program order.

Five splits:

* ``fusion`` (default) — ops grouped the way XLA fuses them (see :mod:`hespas_ml.split.fusion`); each
  region is one kernel, and its bytes are counted only at the kernel's boundary. Inside a kernel an op
  counts only the part of its result that is read (an elementwise chain ending in a slice or gather is
  evaluated only where it is picked, as XLA does).
* ``linear`` — maximal runs of compute between collectives (what Hespas calls a linear split); each op
  is costed as its own kernel, so every intermediate tensor is written and read again.
* ``merged`` — the fusion split, then cheap elementwise kernels recomputed inside the loop and reduction
  kernels that read them rather than written once and read by each, where that moves fewer bytes (XLA's
  fusion merger on GPUs; :func:`hespas_ml.split.fusion.merge_producers`). A recomputed op belongs to every
  region that reads it (``Region.recomputed``) and is never written to memory.
* ``individual`` — every op is its own region.
* ``hespas`` — the blocks the Hespas simulator profiles (:mod:`hespas_ml.split.hespas_blocks`): top-level
  collectives alone, the other top-level ops of ``@main`` in runs of at most 1024; each block's kernels are
  the fusion groups cut at its edge, and each block follows the previous one.

Regions never mix ops from different loop bodies, so each region has one ``count`` (executions per run
of the program). Costs in :class:`Kernel` are per single execution.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ingest.graph import Op, OpGraph, program_users
from ..costs import (DECOMPOSED_OPS, ELEMENTWISE_OPS, PARTIAL_READ_OPS, TRANSCENDENTAL_OPS,
                            program_costs)
from .errors import SplitError
from .fusion import FREE_KINDS, accumulated_window, fuse, merge_producers, window_update
from .hespas_blocks import hespas_blocks

SPLITS = ("fusion", "linear", "individual", "hespas", "merged")

# ASTRA-sim's collective types that our collectives map to.
COLLECTIVE_TO_COMM = {"all_reduce": "ALL_REDUCE", "all_gather": "ALL_GATHER", "reduce_scatter": "REDUCE_SCATTER",
                      "all_to_all": "ALL_TO_ALL", "collective_broadcast": "ALL_GATHER"}


@dataclass(slots=True)
class Kernel:
    """One launched kernel (an XLA-style fusion, or a lone op) with its per-execution cost."""

    op_ids: list[int]
    matrix_flops: float = 0.0       # dot / convolution FLOPs (tensor cores, MXU)
    vector_flops: float = 0.0       # all other arithmetic
    transcendentals: float = 0.0
    bytes: float = 0.0              # off-chip traffic at the kernel boundary
    dtype: str = "f32"              # element type of the vector work
    matrix_dtype: str | None = None  # element type the matrix unit sees
    unmodelled: int = 0             # ops inside that the cost model does not know

    @property
    def flops(self) -> float:
        return self.matrix_flops + self.vector_flops


@dataclass(slots=True)
class Collective:
    """A collective as the network sees it. ``comm_bytes`` follows ASTRA-sim's ``comm_size`` meaning:
    the per-device buffer for all_reduce / reduce_scatter / all_to_all, each device's contribution
    for all_gather, the message for collective_permute."""

    kind: str
    comm_bytes: int
    groups: list[list[int]]            # device groups; [] means every device in one group
    pairs: list[tuple[int, int]] = field(default_factory=list)   # collective_permute source -> target
    dtype: str = "f32"


@dataclass(slots=True)
class Region:
    id: int
    kind: str                           # "compute" | "collective"
    op_ids: list[int]
    deps: list[int] = field(default_factory=list)
    count: int = 1                      # executions per program run
    loop: int | None = None
    kernels: list[Kernel] = field(default_factory=list)
    collective: Collective | None = None
    graph: OpGraph | None = field(default=None, repr=False, compare=False)   # the program it belongs to
    recomputed: frozenset[int] = frozenset()   # ops also computed in other regions; never written to memory

    @property
    def flops(self) -> float:
        return sum(k.flops for k in self.kernels)

    @property
    def bytes(self) -> float:
        return sum(k.bytes for k in self.kernels)

    @property
    def name(self) -> str:
        return f"{self.kind}_{self.id}"


@dataclass(slots=True)
class RegionGraph:
    graph: OpGraph
    regions: list[Region]
    split: str

    @property
    def n_devices(self) -> int:
        return self.graph.n_devices

    def compute_regions(self) -> list[Region]:
        return [r for r in self.regions if r.kind == "compute"]

    def collectives(self) -> list[Region]:
        return [r for r in self.regions if r.kind == "collective"]

    def describe(self, region: Region, limit: int = 4) -> str:
        """A short human name for a region: its heaviest op kinds."""
        ops = self.graph.ops
        if region.collective is not None:
            c = region.collective
            return f"{c.kind} {c.comm_bytes / 2**20:.2f} MiB"
        kinds: dict[str, int] = {}
        for i in region.op_ids:
            kinds[ops[i].kind] = kinds.get(ops[i].kind, 0) + 1
        if any(k not in FREE_KINDS for k in kinds):        # name a kernel by the ops that do work
            kinds = {k: v for k, v in kinds.items() if k not in FREE_KINDS}
        order = sorted(kinds, key=lambda k: (k not in ("dot_general", "dot", "convolution"), -kinds[k]))
        return "+".join(order[:limit]) + ("+…" if len(order) > limit else "")


def split_program(graph: OpGraph, split: str = "fusion") -> RegionGraph:
    """Split ``graph`` into regions; see the module docstring for the three splits."""
    if split not in SPLITS:
        raise SplitError(f"unknown split '{split}' (choose from {', '.join(SPLITS)})")
    ops = graph.ops
    costs = program_costs(graph)
    users = program_users(graph)
    if split == "hespas":
        return _hespas_regions(graph, costs, users)
    copied: set[int] = set()
    if split == "fusion":
        groups = fuse(graph, users)                       # list of op-id lists, each one kernel
    elif split == "merged":
        groups, copied = merge_producers(
            graph, users, fuse(graph, users),
            lambda group, recomputed: _kernel_of(graph, group, costs, users, recomputed).bytes)
    else:
        groups = [[op.id] for op in ops]
    # Regions: collectives alone; compute groups either alone (fusion/individual) or merged into runs.
    group_of = [0] * len(ops)
    for gi, g in enumerate(groups):
        for i in g:
            if i not in copied:
                group_of[i] = gi
    order = sorted(range(len(groups)), key=lambda gi: max(groups[gi]))   # a kernel runs when its last op can
    regions: list[Region] = []
    region_of_group: dict[int, int] = {}
    current: Region | None = None
    for gi in order:
        g = groups[gi]
        first = ops[g[0]]
        if first.is_collective:
            current = None
            region = Region(len(regions), "collective", list(g), count=first.count, loop=first.loop,
                            collective=_collective(graph, first))
            regions.append(region)
        else:
            kernels = _kernels(graph, g, costs, users, per_op=split not in ("fusion", "merged"), recomputed=copied)
            joinable = (split == "linear" and current is not None and current.loop == first.loop
                        and current.count == first.count)
            if joinable:
                region = current
                region.op_ids.extend(g)
                region.kernels.extend(kernels)
            else:
                region = Region(len(regions), "compute", list(g), count=first.count, loop=first.loop,
                                kernels=kernels, recomputed=frozenset(copied.intersection(g)))
                regions.append(region)
                if split == "linear":
                    current = region
        region_of_group[gi] = region.id
    _link(graph, regions, [region_of_group[group_of[i]] for i in range(len(ops))], chained=split == "linear",
          looked_through=copied)
    return RegionGraph(graph, regions, split)


def _link(graph: OpGraph, regions: list[Region], region_of_op: list[int], chained: bool,
          looked_through: set[int] = frozenset()) -> None:
    """Give each region its dependencies, from dataflow: free ops (reshape, broadcast, constants …) that
    fusion copies into several kernels, and the ``looked_through`` ops that a split recomputes in each
    region that reads them, are looked through, so a kernel depends on whoever produced their inputs.
    ``chained``: the split keeps program order, each region following the previous one."""
    ops = graph.ops
    sources = _dependency_sources(graph, looked_through)
    for r in regions:
        deps = {region_of_op[q] for i in r.op_ids for p in ops[i].operands for q in sources(p)}
        if chained and r.id > 0:
            deps.add(r.id - 1)
        deps.discard(r.id)
        r.deps = sorted(deps)
        r.op_ids.sort()
        r.graph = graph


def _hespas_regions(graph: OpGraph, costs, users: list[list[int]]) -> RegionGraph:
    """The ``hespas`` split: one region per Hespas block (see the module docstring)."""
    ops = graph.ops
    fused = fuse(graph, users)
    group_of = {i: gi for gi, g in enumerate(fused) for i in g}
    regions: list[Region] = []
    region_of_op = [0] * len(ops)
    for block in hespas_blocks(graph):
        if not block.op_ids:
            continue
        if block.kind == "collective":
            op = ops[block.op_ids[0]]
            region = Region(len(regions), "collective", list(block.op_ids), count=op.count, loop=op.loop,
                            collective=_collective(graph, op))
        else:
            inner = next((i for i in block.op_ids if ops[i].is_collective), None)
            if inner is not None:
                raise SplitError(f"{graph.source or graph.name}: op {inner} ({ops[inner].opcode}) is a collective "
                                 "inside a call, loop or fusion, which the hespas split times as compute")
            parts: dict[int, list[int]] = {}
            for i in block.op_ids:
                parts.setdefault(group_of[i], []).append(i)
            kernels = [_kernel_of(graph, sorted(g), costs, users) for g in sorted(parts.values(), key=max)]
            region = Region(len(regions), "compute", sorted(block.op_ids), count=1, loop=None, kernels=kernels)
        for i in region.op_ids:
            region_of_op[i] = region.id
        regions.append(region)
    _link(graph, regions, region_of_op, chained=True)       # blocks run one after another, as Hespas chains them
    return RegionGraph(graph, regions, "hespas")


def _kernels(graph: OpGraph, group: list[int], costs, users: list[list[int]], per_op: bool,
             recomputed: set[int] = frozenset()) -> list[Kernel]:
    if per_op:
        return [_kernel_of(graph, [i], costs, users) for i in group]
    return [_kernel_of(graph, group, costs, users, recomputed)]


# Ops whose result element k needs only element k of each same-sized operand.
_PER_ELEMENT = ELEMENTWISE_OPS | TRANSCENDENTAL_OPS | frozenset(DECOMPOSED_OPS) | {
    "reshape", "transpose", "copy", "reverse"}


def _demand(graph: OpGraph, group: list[int], costs, users: list[list[int]], outputs: set[int]) -> dict[int, float]:
    """The fraction of each op's result a fused kernel computes (1 unless only part of it is ever read).

    XLA computes a fused elementwise chain only at the positions its consumers read: a log-softmax over
    the vocabulary followed by a gather of one label per row evaluates one element per row, not the whole
    [batch, seq, vocab] tensor. Demand flows back from the kernel's results (which are written whole)
    through ops that work element by element, and shrinks at slices and gathers to the part they read.
    A result read by several ops adds their demands (at most 1); matrix ops and everything else whose
    access pattern is not modelled demand all of their operands.
    """
    ops = graph.ops
    members = set(group)
    demand: dict[int, float] = {}
    for i in sorted(group, reverse=True):          # op ids are in program order: users come later
        if i in outputs or not users[i] or any(u not in members for u in users[i]):
            demand[i] = 1.0
            continue
        need = 0.0
        for u in users[i]:
            du, user = demand[u], ops[u]
            if costs[u].unit == "matrix":
                need = 1.0
                break
            out = user.result_types[0].numel if user.result_types else 0
            for j, p in enumerate(user.operands):
                if p != i:
                    continue
                size = user.operand_types[j].numel
                if user.kind in PARTIAL_READ_OPS and j == 0 and size:
                    need += du * min(1.0, out / size)
                elif user.kind in _PER_ELEMENT and size == out:
                    need += du
                elif user.kind == "reduce" and j < len(user.operands) // 2:
                    need += du                     # a part of the results needs that part of the inputs
                else:
                    need += 1.0
        demand[i] = min(1.0, need)
    return demand


def _kernel_of(graph: OpGraph, group: list[int], costs, users: list[list[int]],
               recomputed: set[int] = frozenset()) -> Kernel:
    """Cost one kernel: FLOPs summed over its ops; bytes only where data crosses the kernel boundary.

    In a fused kernel each op counts only the part of its result the kernel needs (:func:`_demand`). The
    ``recomputed`` ops are computed again by every kernel that reads them, so their results are never
    written.
    """
    ops = graph.ops
    members = set(group)
    k = Kernel(op_ids=list(group))
    vector_dtype_weight: dict[str, float] = {}
    read: dict[tuple[int, int], float] = {}
    outputs = set(graph.outputs)
    demand = _demand(graph, group, costs, users, outputs) if len(group) > 1 else {}
    for i in group:
        op, c = ops[i], costs[i]
        d = demand.get(i, 1.0)
        if not c.modelled:
            k.unmodelled += 1
        if c.unit == "matrix":
            k.matrix_flops += c.flops
            k.matrix_dtype = k.matrix_dtype or op.dtype
        else:
            k.vector_flops += c.flops * d
            if c.flops:
                rt = op.result_types[0].dtype if op.result_types else op.dtype
                vector_dtype_weight[rt] = vector_dtype_weight.get(rt, 0.0) + c.flops * d
        k.transcendentals += c.transcendentals * d
        if len(group) == 1:
            k.bytes = c.bytes
            continue
        # reads of tensors produced outside the kernel (each tensor once per kernel), the needed part
        partial = c.bytes_in < sum(t.nbytes for t in op.operand_types) - 1
        for j, (p, t) in enumerate(zip(op.operands, op.operand_types)):
            if p >= 0 and p in members:
                continue
            nbytes = float(t.nbytes)
            if partial and j == 0:
                nbytes = min(nbytes, c.bytes_in)   # slice / dynamic_slice / gather read a part
            if d < 1.0 and (op.kind in _PER_ELEMENT or (op.kind in PARTIAL_READ_OPS and j == 0)):
                nbytes *= d
            key = (p, t.nbytes) if p >= 0 else (-1 - i * 64 - j, t.nbytes)
            read[key] = max(read.get(key, 0.0), nbytes)
        # writes of results used outside the kernel or returned by the program
        if i in recomputed:
            continue
        if i in outputs or any(u not in members for u in users[i]) or not users[i]:
            k.bytes += sum(t.nbytes for t in op.result_types)
    if len(group) > 1:
        k.bytes += sum(read.values())
    for window in (i for i in group if accumulated_window(graph, i, users)):
        # acc + dus(0, u, idx), updated in place: the window of acc is read and written, not all of it
        add = ops[users[window][0]]
        j, p, t = next((j, p, t) for j, (p, t) in enumerate(zip(add.operands, add.operand_types)) if p != window)
        update = float(ops[window].operand_types[window_update(graph, window)].nbytes)
        if p not in members:
            k.bytes -= read.get((p, t.nbytes) if p >= 0 else (-1 - add.id * 64 - j, t.nbytes), 0.0) - update
        if add.id in outputs or any(u not in members for u in users[add.id]) or not users[add.id]:
            k.bytes -= sum(t.nbytes for t in add.result_types) - update
        k.vector_flops -= costs[add.id].flops - ops[window].operand_types[window_update(graph, window)].numel
    if vector_dtype_weight:
        k.dtype = max(vector_dtype_weight, key=vector_dtype_weight.get)
    elif k.matrix_dtype:
        k.dtype = k.matrix_dtype
    else:
        k.dtype = ops[group[-1]].dtype
    return k


def _dependency_sources(graph: OpGraph, looked_through: set[int] = frozenset()):
    """Map a producer id to the non-free op ids it stands for (free ops, and ``looked_through`` ops, are
    looked through)."""
    ops = graph.ops
    memo: dict[int, tuple[int, ...]] = {}

    def sources(p: int) -> tuple[int, ...]:
        if p < 0:
            return ()
        hit = memo.get(p)
        if hit is not None:
            return hit
        if ops[p].kind not in FREE_KINDS and p not in looked_through:
            memo[p] = (p,)
            return memo[p]
        out: list[int] = []
        stack = [p]
        seen = set()
        while stack:
            q = stack.pop()
            if q < 0 or q in seen:
                continue
            seen.add(q)
            if ops[q].kind in FREE_KINDS or q in looked_through:
                stack.extend(ops[q].operands)
            else:
                out.append(q)
        memo[p] = tuple(sorted(set(out)))
        return memo[p]

    return sources


def _collective(graph: OpGraph, op: Op) -> Collective:
    kind = op.kind
    in_bytes = sum(t.nbytes for t in op.operand_types)
    groups = op.attrs.get("replica_groups") or []
    if isinstance(groups, str):
        graph.warnings.append(f"{kind}: replica groups '{groups[:60]}' not understood; using all devices")
        groups = []
    n = graph.n_devices
    if len(groups) == 1 and sorted(groups[0]) == list(range(n)):
        groups = []
    pairs = [tuple(p) for p in op.attrs.get("source_target_pairs") or []]
    if kind == "collective_broadcast":
        graph.warnings.append("collective_broadcast modelled as an all_gather of its buffer")
    dtype = op.operand_types[0].dtype if op.operand_types else "f32"
    return Collective(kind=kind, comm_bytes=int(in_bytes), groups=[list(g) for g in groups],
                      pairs=[(int(a), int(b)) for a, b in pairs], dtype=dtype)
