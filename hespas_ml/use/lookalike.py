"""A stand-in for a program one cannot share: a synthetic module with the same per-device FLOPs, kernel
bytes, collective volume and step time on a target and system, and nothing else of the original.

The original's kernels (its fusion split, each counted as often as it runs) fall in two groups on the
target: compute-bound (compute time at least its memory time) and memory-bound. The stand-in carries each
group in a kernel: a matrix product ``[M, K] x [K, M]`` with element-wise multiplies fused after it (the
compute-bound group's product is near a cube, the memory-bound group's skinny), or, for a group without
matrix FLOPs, an element-wise chain over one input.

A program with collectives also has its traffic carried: for each kind, element type and set of device
groups (or send/recv pairs), as many collectives as the original ran (each pays the network's latency; at
most :data:`MAX_PIECES`), together moving what the original's moved per device (ASTRA-sim's ``comm_size``
meaning, summed over executions). How much of that communication the step
hides matters as much as its volume, so the compute is cut in two: the first part runs, the collectives
start on its result, and the second part runs beside them. The second part's share is solved from one
simulation of the stand-in with nothing beside its collectives (what they take exposed) against the
original's exposed communication, so the stand-in hides as much as the original does.

Sizes are solved in closed form and rounded to whole dimensions; :func:`make_lookalike` simulates both
programs and reports how far apart they come. What the stand-in does not keep: the op graph, the number of
kernels and their sizes, each collective's own size (it keeps how many of each kind ran, and on which
device groups), the element types but the dominant one, and anything a real run would add to the roofline
(launches). It matches on the target and system it was made for; another's
peaks and bandwidths give other times.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from ..ingest.errors import HespasError
from ..label.roofline import kernel_seconds
from ..label.targets import Target, load_target

__all__ = ["Group", "Traffic", "Budget", "program_budget", "lookalike_text", "make_lookalike", "LookalikeError"]

ELEM_BYTES = {"f32": 4, "bf16": 2, "f16": 2}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")
MAX_PIECES = 1000     # collectives per kind and groups in a stand-in; more are merged into this many


class LookalikeError(HespasError):
    """A program the stand-in cannot be made for (one line naming it and why)."""


@dataclass
class Group:
    """Kernels of one kind (compute-bound or memory-bound on the target), summed over their executions."""

    matrix_flops: float = 0.0
    vector_flops: float = 0.0
    bytes: float = 0.0
    matrix_dtypes: dict[str, float] = field(default_factory=dict)

    def add(self, k, n: int) -> None:
        """Kernel ``k``, run ``n`` times."""
        self.matrix_flops += n * k.matrix_flops
        self.vector_flops += n * k.vector_flops
        self.bytes += n * k.bytes
        if k.matrix_flops:
            d = k.matrix_dtype or k.dtype
            self.matrix_dtypes[d] = self.matrix_dtypes.get(d, 0.0) + n * k.matrix_flops

    @property
    def dtype(self) -> str:
        """The element type most of its matrix FLOPs are in (``f32`` where that is not a float type)."""
        if not self.matrix_dtypes:
            return "f32"
        top = max(self.matrix_dtypes, key=self.matrix_dtypes.get)
        return top if top in ELEM_BYTES else "f32"


@dataclass
class Traffic:
    """Collectives of one kind and element type on one set of device groups (``()``: every device) or
    send/recv ``pairs``: the bytes per device they move, summed over their executions."""

    kind: str
    dtype: str
    groups: tuple[tuple[int, ...], ...]
    pairs: tuple[tuple[int, int], ...]
    bytes: float = 0.0
    count: int = 0

    @property
    def pieces(self) -> int:
        """How many collectives carry it: as many as the original ran (each pays the network's latency),
        at most :data:`MAX_PIECES`."""
        return max(1, min(self.count, MAX_PIECES))


@dataclass
class Budget:
    """What the stand-in must carry: the compute-bound and the memory-bound group, the traffic of its
    collectives, on ``devices`` devices."""

    compute: Group
    memory: Group
    traffic: list[Traffic] = field(default_factory=list)
    devices: int = 1

    @property
    def comm_bytes(self) -> float:
        return sum(t.bytes for t in self.traffic)


def program_budget(graph, target: Target, source: str | None = None) -> Budget:
    """:class:`Budget` of an ingested program on ``target`` (its fusion split's kernels and collectives);
    ``source`` names it in errors."""
    from ..split.regions import split_program

    rg = split_program(graph)
    b = Budget(Group(), Group(), devices=graph.n_devices)
    for region in rg.compute_regions():
        for k in region.kernels:
            c, m = kernel_seconds(k, target)
            (b.compute if c >= m and c > 0 else b.memory).add(k, region.count)
    traffic: dict[tuple, Traffic] = {}
    for region in rg.collectives():
        c = region.collective
        if c.kind not in COLLECTIVES:
            raise LookalikeError(f"{source or graph.name}: a stand-in carries {', '.join(COLLECTIVES)}, not {c.kind}")
        dtype = c.dtype if c.dtype in ELEM_BYTES else "f32"
        key = (c.kind, dtype, tuple(tuple(g) for g in c.groups), tuple(c.pairs))
        t = traffic.setdefault(key, Traffic(*key))
        t.bytes += c.comm_bytes * region.count
        t.count += region.count
    b.traffic = [t for t in traffic.values() if t.bytes > 0]
    return b


def _scaled(g: Group, share: float) -> Group:
    return Group(g.matrix_flops * share, g.vector_flops * share, g.bytes * share,
                 {d: f * share for d, f in g.matrix_dtypes.items()})


def _dense_i64(rows) -> str:
    body = ", ".join("[" + ", ".join(str(v) for v in row) + "]" for row in rows)
    width = len(rows[0]) if rows else 0
    return f"dense<[{body}]> : tensor<{len(rows)}x{width}xi64>"


def _collective(t: Traffic, devices: int, tag: str, operand: str, channel: int, body: list[str]) -> tuple[str, str]:
    """One piece of ``t`` on ``operand`` (a buffer of :func:`_traffic_type`). Returns the result and its type."""
    groups = [list(g) for g in t.groups] or [list(range(devices))]
    size, ty, n = len(groups[0]), _traffic_type(t, devices), _elements(t, devices)
    attrs = f"channel_handle = #stablehlo.channel_handle<handle = {channel}, type = 1>"
    if t.kind == "collective_permute":
        body.append(f'    %{tag} = "stablehlo.collective_permute"({operand}) <{{{attrs}, source_target_pairs = '
                    f'{_dense_i64([list(p) for p in t.pairs])}}}> : ({ty}) -> {ty}')
        return f"%{tag}", ty
    attrs += f", replica_groups = {_dense_i64(groups)}, use_global_device_ids"
    scalar = f"tensor<{t.dtype}>"
    adds = [f"      ^bb0(%{tag}x: {scalar}, %{tag}y: {scalar}):",
            f'        %{tag}s = "stablehlo.add"(%{tag}x, %{tag}y) : ({scalar}, {scalar}) -> {scalar}',
            f'        "stablehlo.return"(%{tag}s) : ({scalar}) -> ()', "    })"]
    if t.kind == "all_gather":
        out = f"tensor<{n * size}x{t.dtype}>"
        body.append(f'    %{tag} = "stablehlo.all_gather"({operand}) <{{all_gather_dim = 0 : i64, {attrs}}}> : '
                    f'({ty}) -> {out}')
    elif t.kind == "all_to_all":
        out = ty
        body.append(f'    %{tag} = "stablehlo.all_to_all"({operand}) <{{split_dimension = 0 : i64, '
                    f'concat_dimension = 0 : i64, split_count = {size} : i64, {attrs}}}> : ({ty}) -> {out}')
    else:                                                # all_reduce, reduce_scatter: a sum
        out = ty if t.kind == "all_reduce" else f"tensor<{n // size}x{t.dtype}>"
        extra = "" if t.kind == "all_reduce" else ", scatter_dimension = 0 : i64"
        body.append(f'    %{tag} = "stablehlo.{t.kind}"({operand}) <{{{attrs}{extra}}}> ({{')
        body.extend(adds)
        body[-1] += f" : ({ty}) -> {out}"
    return f"%{tag}", out


def _elements(t: Traffic, devices: int) -> int:
    """Elements of the buffer each piece of ``t`` carries: its share of the bytes, a multiple of the group size
    (reduce_scatter and all_to_all split it evenly)."""
    size = len(t.groups[0]) if t.groups else devices
    n = max(size, round(t.bytes / t.pieces / ELEM_BYTES[t.dtype]))
    return n + (-n) % size


def _traffic_type(t: Traffic, devices: int) -> str:
    return f"tensor<{_elements(t, devices)}x{t.dtype}>"


def _gemm_side(flops: float, nbytes: float, elem: int) -> tuple[int, int]:
    """``(M, K)`` of ``[M, K] x [K, M]`` with ``2 M² K`` = ``flops`` and ``elem (2 M K + M²)`` closest to
    ``nbytes`` (the larger root: the fewest bytes one product of those FLOPs can move is at ``M³ = flops / 2``)."""
    target = nbytes / elem

    def moved(m: float) -> float:
        return m * m + flops / m

    low = max(1.0, (flops / 2) ** (1 / 3))
    high = max(low, math.sqrt(max(target, 1.0)))
    if moved(low) >= target:
        m = low
    else:
        for _ in range(100):
            mid = (low + high) / 2
            low, high = (mid, high) if moved(mid) < target else (low, mid)
        m = (low + high) / 2
    m_int = max(1, round(m))
    return m_int, max(1, round(flops / (2 * m_int * m_int)))


def _kernel(g: Group, tag: str, params: list[str], body: list[str]) -> tuple[str, str, Group] | None:
    """One kernel carrying group ``g``: a matrix product (its matrix FLOPs and bytes) with element-wise
    multiplies by a constant fused after it (its vector FLOPs), or, without matrix FLOPs, a chain of them
    over one input (bytes: the input and the result). Returns the result, its type and what the kernel
    carries at its whole dimensions."""
    if g.matrix_flops <= 0 and g.bytes <= 0:
        return None
    dt = g.dtype
    e = ELEM_BYTES[dt]
    if g.matrix_flops > 0:
        m, k = _gemm_side(g.matrix_flops, max(g.bytes, 1.0), e)
        t = f"tensor<{m}x{m}x{dt}>"
        params += [f"%{tag}a: tensor<{m}x{k}x{dt}>", f"%{tag}b: tensor<{k}x{m}x{dt}>"]
        body.append(f'    %{tag}0 = "stablehlo.dot_general"(%{tag}a, %{tag}b) {{dot_dimension_numbers = '
                    f'#stablehlo.dot<lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [0]>}} : '
                    f'(tensor<{m}x{k}x{dt}>, tensor<{k}x{m}x{dt}>) -> {t}')
        ops = round(g.vector_flops / (m * m))
        carried = Group(2.0 * m * m * k, float(ops * m * m), float(e * (2 * m * k + m * m)), {dt: 2.0 * m * m * k})
    else:
        elements = max(1, round(g.bytes / (2 * e)))
        t = f"tensor<{elements}x{dt}>"
        params.append(f"%{tag}x: {t}")
        body.append(f'    %{tag}0 = "stablehlo.negate"(%{tag}x) : ({t}) -> {t}')
        ops = max(0, round(g.vector_flops / elements) - 1)
        carried = Group(0.0, float((ops + 1) * elements), float(2 * e * elements))
    if ops:
        body.append(f'    %{tag}s = "stablehlo.constant"() {{value = dense<1.000000e+00> : tensor<{dt}>}} : '
                    f'() -> tensor<{dt}>')
        body.append(f'    %{tag}c = "stablehlo.broadcast_in_dim"(%{tag}s) {{broadcast_dimensions = array<i64>}} : '
                    f'(tensor<{dt}>) -> {t}')
    for i in range(ops):
        body.append(f'    %{tag}{i + 1} = "stablehlo.multiply"(%{tag}{i}, %{tag}c) : ({t}, {t}) -> {t}')
    return f"%{tag}{ops}", t, carried


def _rest(g: Group, part: tuple[str, str, Group] | None) -> Group:
    """What of ``g`` is left once ``part`` carries its share."""
    if part is None:
        return g
    c = part[2]
    return Group(max(0.0, g.matrix_flops - c.matrix_flops), max(0.0, g.vector_flops - c.vector_flops),
                 max(0.0, g.bytes - c.bytes), {d: max(0.0, f - c.matrix_dtypes.get(d, 0.0))
                                               for d, f in g.matrix_dtypes.items()})


def lookalike_text(b: Budget, name: str = "lookalike", beside: float = 0.0) -> str:
    """The stand-in module for budget ``b`` (see the module docstring): the compute's first part, the
    collectives on its result, and the share ``beside`` of the compute running beside them."""
    params: list[str] = []
    body: list[str] = []
    later_params: list[str] = []
    later: list[str] = []             # the part beside the collectives, sized first: the rest is the first part's
    second = [_kernel(_scaled(g, beside), tag, later_params, later) for g, tag in ((b.compute, "h"), (b.memory, "f"))]
    compute, memory = _rest(b.compute, second[0]), _rest(b.memory, second[1])
    pieces = [t for t in b.traffic for _ in range(t.pieces)]
    if pieces:
        # the first part's last kernel takes the barrier that joins its result to the collectives' buffers,
        # and with it their reading and writing: that kernel's own bytes are that much fewer
        joined = 2.0 * sum(_elements(t, b.devices) * ELEM_BYTES[t.dtype] for t in pieces)
        if memory.bytes > 0 or memory.matrix_flops > 0:
            memory = replace(memory, bytes=max(0.0, memory.bytes - joined))
        else:
            compute = replace(compute, bytes=max(0.0, compute.bytes - joined))
    first = [r[:2] for r in (_kernel(compute, "g", params, body), _kernel(memory, "e", params, body)) if r]
    results = list(first)
    if pieces:
        buffers = [(f"%c{i}buf", _traffic_type(t, b.devices)) for i, t in enumerate(pieces)]
        params += [f"{v}: {ty}" for v, ty in buffers]
        operands = [v for v, _ in buffers]
        if first:                   # the collectives wait for the first part: its result joins their buffers
            src, src_type = first[-1]
            types = ", ".join([src_type] + [ty for _, ty in buffers])
            body.append(f'    %dep:{len(buffers) + 1} = "stablehlo.optimization_barrier"'
                        f'({", ".join([src] + operands)}) : ({types}) -> ({types})')
            operands = [f"%dep#{i + 1}" for i in range(len(buffers))]
            results[-1] = ("%dep#0", src_type)             # what the program returns, through the barrier
        for i, (t, operand) in enumerate(zip(pieces, operands)):
            results.append(_collective(t, b.devices, f"c{i}", operand, i + 1, body))
    params += later_params
    body += later
    results += [r[:2] for r in second if r]
    if not results:
        raise LookalikeError(f"{name}: the program has no compute or communication to stand in for")
    types = ", ".join(t for _, t in results)
    attributes = (f" attributes {{mhlo.num_partitions = {b.devices} : i32, mhlo.num_replicas = 1 : i32}}"
                  if b.devices > 1 else "")
    return "\n".join([f"module @{name}{attributes} {{",
                      f"  func.func public @main({', '.join(params)}) -> ({types}) {{",
                      *body, f'    "func.return"({", ".join(v for v, _ in results)}) : ({types}) -> ()',
                      "  }", "}"]) + "\n"


def make_lookalike(program, target: Target | str = "H100", system=None,
                   devices: int | None = None) -> tuple[str, dict[str, Any]]:
    """``(module text, report)``: the stand-in for ``program`` (one device's share of it) on ``target`` and
    ``system`` (a spec, folder or SystemConfig; default ``ring:Nx100`` for a program of N > 1 devices) and,
    for both programs simulated there (roofline), per-device FLOPs, kernel bytes, collective bytes and step
    time with the stand-in's relative error on each, and the share of the compute it runs beside its
    collectives."""
    from ..ingest import load_program
    from ..ingest.stablehlo import parse_module
    from ..pipeline import simulate

    target = load_target(target) if isinstance(target, str) else target
    graph = load_program(program, devices)
    budget = program_budget(graph, target, str(program))
    n = graph.n_devices
    if system is None and n > 1:
        system = f"ring:{n}x100"
    real = simulate(graph, target, system)
    beside = 0.0
    if budget.traffic:                 # the collectives alone after all the compute: what they take exposed
        alone = simulate(parse_module(lookalike_text(budget), "<lookalike>"), target, system)
        if alone.compute_time_s > 0:
            hide = alone.exposed_comm_s - real.exposed_comm_s
            beside = min(1.0, max(0.0, hide / alone.compute_time_s))
    text = lookalike_text(budget, beside=beside)
    stand_in = parse_module(text, "<lookalike>")
    fake = simulate(stand_in, target, system)
    carried = program_budget(stand_in, target, "<lookalike>").comm_bytes
    rows = {}
    for key, a, b in (("flops", real.flops, fake.flops), ("kernel_bytes", real.kernel_bytes, fake.kernel_bytes),
                      ("comm_bytes", budget.comm_bytes, carried), ("step_time_s", real.step_time_s, fake.step_time_s)):
        rows[key] = {"program": a, "lookalike": b, "error": (b - a) / a if a else float(b != a)}
    return text, {"program": str(program), "target": target.name, "system": real.system, "devices": n,
                  "beside": beside, "exposed_comm_s": {"program": real.exposed_comm_s, "lookalike": fake.exposed_comm_s},
                  **rows}
