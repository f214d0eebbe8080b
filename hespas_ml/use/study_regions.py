"""What a study says about a compute region: its op family, op kinds and shapes, grouped by signature.

The op family of a region is :func:`hespas_ml.split.families.region_family`.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..costs import op_cost
from ..split.families import op_family, region_family


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
