"""A stand-in for a program one cannot share: a synthetic module with the same per-device FLOPs, kernel
bytes and roofline step time on a target, and nothing else of the original.

The original's kernels (its fusion split, each counted as often as it runs) fall in two groups on the
target: compute-bound (compute time at least its memory time) and memory-bound. The stand-in has one
kernel per group, carrying its matrix FLOPs, vector FLOPs and bytes, so its time is the group's: a matrix
product ``[M, K] x [K, M]`` with element-wise multiplies fused after it (the compute-bound group's product
is near a cube, the memory-bound group's skinny), or, for a group without matrix FLOPs, an element-wise
chain over one input.

Sizes are solved in closed form and rounded to whole dimensions; :func:`make_lookalike` simulates both
programs and reports how far apart they come. What the stand-in does not keep: the op graph, the number of
kernels and their sizes, the element types but the dominant one, and anything a real run would add to the
roofline (launches, overlap). It matches on the target it was made for; another target's peaks and
bandwidth give other times.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..ingest.errors import HespasError
from ..label.roofline import kernel_seconds
from ..label.targets import Target, load_target

__all__ = ["Group", "Budget", "program_budget", "lookalike_text", "make_lookalike", "LookalikeError"]

ELEM_BYTES = {"f32": 4, "bf16": 2, "f16": 2}


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
class Budget:
    """What the stand-in must carry: the compute-bound and the memory-bound group."""

    compute: Group
    memory: Group


def program_budget(graph, target: Target, source: str | None = None) -> Budget:
    """:class:`Budget` of an ingested program on ``target`` (its fusion split's kernels); ``source`` names
    it in errors."""
    from ..split.regions import split_program

    rg = split_program(graph)
    if rg.collectives():
        raise LookalikeError(f"{source or graph.name}: has {len(rg.collectives())} collectives; a stand-in reproduces "
                             f"single-device compute only")
    b = Budget(Group(), Group())
    for region in rg.compute_regions():
        for k in region.kernels:
            c, m = kernel_seconds(k, target)
            (b.compute if c >= m and c > 0 else b.memory).add(k, region.count)
    return b


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


def _kernel(g: Group, tag: str, params: list[str], body: list[str]) -> tuple[str, str] | None:
    """One kernel carrying group ``g``: a matrix product (its matrix FLOPs and bytes) with element-wise
    multiplies by a constant fused after it (its vector FLOPs), or, without matrix FLOPs, a chain of them
    over one input (bytes: the input and the result). Returns the result and its type."""
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
    else:
        elements = max(1, round(g.bytes / (2 * e)))
        t = f"tensor<{elements}x{dt}>"
        params.append(f"%{tag}x: {t}")
        body.append(f'    %{tag}0 = "stablehlo.negate"(%{tag}x) : ({t}) -> {t}')
        ops = max(0, round(g.vector_flops / elements) - 1)
    if ops:
        body.append(f'    %{tag}s = "stablehlo.constant"() {{value = dense<1.000000e+00> : tensor<{dt}>}} : '
                    f'() -> tensor<{dt}>')
        body.append(f'    %{tag}c = "stablehlo.broadcast_in_dim"(%{tag}s) {{broadcast_dimensions = array<i64>}} : '
                    f'(tensor<{dt}>) -> {t}')
    for i in range(ops):
        body.append(f'    %{tag}{i + 1} = "stablehlo.multiply"(%{tag}{i}, %{tag}c) : ({t}, {t}) -> {t}')
    return f"%{tag}{ops}", t


def lookalike_text(b: Budget, name: str = "lookalike") -> str:
    """The stand-in module for budget ``b`` (see the module docstring)."""
    params: list[str] = []
    body: list[str] = []
    results = [r for r in (_kernel(b.compute, "g", params, body), _kernel(b.memory, "e", params, body)) if r]
    if not results:
        raise LookalikeError(f"{name}: the program has no compute to stand in for")
    types = ", ".join(t for _, t in results)
    return "\n".join([f"module @{name} {{", f"  func.func public @main({', '.join(params)}) -> ({types}) {{",
                      *body, f'    "func.return"({", ".join(v for v, _ in results)}) : ({types}) -> ()',
                      "  }", "}"]) + "\n"


def make_lookalike(program, target: Target | str = "H100", devices: int | None = None) -> tuple[str, dict[str, Any]]:
    """``(module text, report)``: the stand-in for ``program`` (one device's share of it, for a program of
    several devices without collectives) on ``target`` and, for both programs simulated on it (roofline),
    per-device FLOPs, kernel bytes and step time with the stand-in's relative error on each."""
    from ..ingest import load_program
    from ..ingest.stablehlo import parse_module
    from ..pipeline import simulate

    target = load_target(target) if isinstance(target, str) else target
    graph = load_program(program, devices)
    budget = program_budget(graph, target, str(program))
    text = lookalike_text(budget)
    n = graph.n_devices                            # no collectives (program_budget): any system will do
    real = simulate(graph, target, None if n == 1 else f"ring:{n}x100")
    fake = simulate(parse_module(text, "<lookalike>"), target)
    rows = {}
    for key, a, b in (("flops", real.flops, fake.flops), ("kernel_bytes", real.kernel_bytes, fake.kernel_bytes),
                      ("step_time_s", real.step_time_s, fake.step_time_s)):
        rows[key] = {"program": a, "lookalike": b, "error": (b - a) / a if a else 0.0}
    return text, {"program": str(program), "target": target.name, **rows}

