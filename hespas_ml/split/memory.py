"""Per-device memory of a split program: what its arguments hold, and the most that its regions' results
keep alive at once.

The regions run in program order. A region's result lives in device memory when another region reads it
or the program returns it (a value used only inside its region stays on chip, as in a fused kernel); it
is allocated when its region runs and freed after the last region that reads it, or kept to the end when
it is returned. The arguments (parameters, optimizer state, the batch) live through the whole step. A loop
body's values count once (one iteration's worth). This is the program's own footprint; the allocator's
padding, fragmentation and workspace are not in it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .regions import RegionGraph


@dataclass(frozen=True, slots=True)
class Memory:
    """Bytes per device: ``arguments`` (live all step), and at the peak, the live ``intermediates``
    (results of compute regions other regions still need), ``collective_buffers`` (results of
    collectives) and ``outputs`` (results the program returns, computed so far). ``argument_parts``: the
    arguments by what they hold (parameters, optimizer_state, batch) when the program says (zoo steps do)."""

    arguments: int
    intermediates: int
    collective_buffers: int
    outputs: int
    argument_parts: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return self.arguments + self.intermediates + self.collective_buffers + self.outputs

    def to_dict(self) -> dict[str, int]:
        parts = asdict(self)
        return {**{k: v for k, v in parts.items() if k != "argument_parts"}, **parts["argument_parts"],
                "peak": self.peak}

    def shortfall(self, capacity: float, device: str) -> str | None:
        """What to say when the peak does not fit in ``capacity`` bytes of ``device``; None when it fits."""
        if self.peak <= capacity:
            return None
        return f"{self.peak / 2**30:.2f} GiB per device at the peak, the {device} has {capacity / 2**30:.2f} GiB"


def memory(rg: RegionGraph) -> Memory:
    """The per-device :class:`Memory` of ``rg`` at its peak."""
    graph = rg.graph
    region_of: dict[int, int] = {}
    copies: dict[int, list[int]] = {}          # recomputed op -> every region that computes it
    for position, region in enumerate(rg.regions):
        for op in region.op_ids:
            if op in region.recomputed:
                copies.setdefault(op, []).append(position)
            else:
                region_of[op] = position
    users = graph.users()
    returned = set(graph.outputs)
    end = len(rg.regions)
    # per position: bytes allocated there, by part; bytes freed after it, by part
    alloc = [[0, 0, 0] for _ in range(end)]
    freed = [[0, 0, 0] for _ in range(end + 1)]
    for position, region in enumerate(rg.regions):
        for op in region.op_ids:
            if op in region.recomputed:
                continue                  # computed again wherever it is read: never in memory
            readers = [r for u in users[op] for r in copies.get(u, [region_of.get(u, position)]) if r != position]
            if op in returned:
                part, last = 2, end
            elif readers:
                part, last = (1 if region.kind == "collective" else 0), max(readers)
            else:
                continue
            size = sum(t.nbytes for t in graph.ops[op].result_types)
            alloc[position][part] += size
            freed[last][part] += size
    live, best = [0, 0, 0], (-1, [0, 0, 0])
    for position in range(end):
        live = [a + b for a, b in zip(live, alloc[position])]
        if sum(live) > best[0]:
            best = (sum(live), list(live))
        live = [a - b for a, b in zip(live, freed[position])]
    intermediates, buffers, outputs = best[1]
    parts: dict[str, int] = {}
    for role, t in zip(graph.input_roles or (), graph.inputs):
        parts[role] = parts.get(role, 0) + t.nbytes
    return Memory(sum(t.nbytes for t in graph.inputs), intermediates, buffers, outputs, parts)


__all__ = ["Memory", "memory"]
