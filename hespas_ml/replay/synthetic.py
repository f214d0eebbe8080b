"""Synthetic Chakra traces that follow the statistics of given ones: a workload's shape without the workload.

:class:`TraceModel` is fitted on one rank's trace (rank 0; SPMD ranks run alike) and holds what the
generator draws from, each as the source's own values (empirical distributions):

* the order of COMP and collective nodes, as a two-state Markov chain (how often a COMP follows a COMP, a
  collective follows a COMP, ...), and the first node's kind;
* a COMP node's duration and its ``num_ops`` / ``tensor_size`` (drawn together);
* a collective's type, size and the size of its communicator group (drawn together);
* how many nodes a node depends on, and how far back (in node positions) each of them is.

:func:`generate_traces` draws ``nodes`` nodes from it with a seeded generator and gives every one of
``ranks`` ranks the same trace (collectives over groups of the source's sizes, contiguous ranks, where
they divide ``ranks``; else over all ranks), so the embedded replay and ASTRA-sim accept it. SEND/RECV
nodes of the source are counted in ``unmodelled`` and not reproduced.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from . import chakra as et
from .errors import TraceError

KINDS = ("comp", "coll")


@dataclass
class TraceModel:
    """What :func:`generate_traces` draws from (see the module docstring)."""

    n_nodes: int
    first: str
    transitions: dict[str, dict[str, int]]
    comp: list[tuple[int, int, int]]               # (duration µs, num_ops, tensor_size)
    coll: list[tuple[int, int, int | None]]        # (comm_type, comm_size, group size or None: all ranks)
    n_deps: list[int]
    distances: list[int]
    source_ranks: int
    unmodelled: dict[str, int] = field(default_factory=dict)

    @classmethod
    def fit(cls, traces: Sequence[Sequence[et.EtNode]], comm_groups: dict[int, list[int]] | None = None,
            source: str = "traces") -> "TraceModel":
        """The model of ``traces`` (rank 0's nodes; ``comm_groups``: the groups their ``pg_name`` name)."""
        if not traces or not traces[0]:
            raise TraceError(f"{source}: no nodes to learn from")
        nodes = sorted(traces[0], key=lambda n: n.id)
        position = {n.id: i for i, n in enumerate(nodes)}
        groups = comm_groups or {}
        kinds: list[str] = []
        comp: list[tuple[int, int, int]] = []
        coll: list[tuple[int, int, int | None]] = []
        n_deps: list[int] = []
        distances: list[int] = []
        unmodelled: Counter = Counter()
        for i, node in enumerate(nodes):
            if node.type == et.COMP_NODE:
                kinds.append("comp")
                comp.append((int(node.duration_micros), int(node.attrs.get("num_ops", 1)),
                             int(node.attrs.get("tensor_size", 1))))
            elif node.type == et.COMM_COLL_NODE:
                kinds.append("coll")
                pg = str(node.attrs.get("pg_name", "") or "")
                members = groups.get(int(pg)) if pg not in ("", "0") and pg.isdigit() else None
                size = len(members) if members and len(members) < len(traces) else None
                coll.append((int(node.attrs.get("comm_type", et.ALL_REDUCE)), int(node.attrs.get("comm_size", 1)),
                             size))
            else:
                unmodelled[et.NODE_TYPE_NAMES.get(node.type, str(node.type))] += 1
                continue
            deps = [position[d] for d in node.data_deps if d in position]
            n_deps.append(len(deps))
            distances.extend(i - p for p in deps if i > p)
        transitions = {a: {b: 0 for b in KINDS} for a in KINDS}
        for a, b in zip(kinds, kinds[1:]):
            transitions[a][b] += 1
        if not kinds:
            raise TraceError(f"{source}: no COMP or collective node to learn from")
        return cls(len(kinds), kinds[0], transitions, comp, coll, n_deps, distances or [1], len(traces),
                   dict(unmodelled))

    def summary(self) -> dict[str, Any]:
        """Counts and totals of the fitted trace (what a generated one is compared with)."""
        return {"nodes": self.n_nodes, "comp_nodes": len(self.comp), "coll_nodes": len(self.coll),
                "comp_us": sum(c[0] for c in self.comp), "comm_bytes": sum(c[1] for c in self.coll),
                "unmodelled": self.unmodelled}


def generate_traces(model: TraceModel, ranks: int, *, seed: int = 0, nodes: int | None = None
                    ) -> tuple[list[list[et.EtNode]], dict[int, list[int]]]:
    """Every rank's trace (``nodes`` nodes, the source's count by default) and the communicator groups
    their collectives name, drawn from ``model`` with ``random.Random(seed)``."""
    if ranks < 1:
        raise TraceError(f"ranks must be at least 1, got {ranks}")
    count = model.n_nodes if nodes is None else nodes
    if count < 1:
        raise TraceError(f"nodes must be at least 1, got {count}")
    rng = random.Random(seed)
    kind = model.first if model.comp and model.coll else ("comp" if model.comp else "coll")
    group_ids: dict[int, list[int]] = {}          # group size -> first group id of its blocks
    groups: dict[int, list[int]] = {}
    shared: list[et.EtNode] = []
    variants: list[tuple[int, list[et.EtNode]]] = []
    for i in range(count):
        if i:
            row = model.transitions[kind]
            total = sum(row.values())
            if total and model.comp and model.coll:
                kind = "comp" if rng.random() < row["comp"] / total else "coll"
        want = rng.choice(model.n_deps) if i else 0
        deps = sorted({i - d for d in (rng.choice(model.distances) for _ in range(want)) if i - d >= 0})
        if kind == "comp" or not model.coll:
            micros, ops, size = rng.choice(model.comp)
            shared.append(et.EtNode(i, f"comp_{i}", et.COMP_NODE, deps, [], micros,
                                    {"num_ops": max(1, ops), "tensor_size": max(1, size)}))
            continue
        comm_type, size, group = rng.choice(model.coll)
        attrs = {"comm_type": comm_type, "comm_size": max(1, size)}
        if group is None or group >= ranks or ranks % group:
            shared.append(et.EtNode(i, f"coll_{i}", et.COMM_COLL_NODE, deps, [], 0, attrs))
            continue
        if group not in group_ids:                 # contiguous blocks of that size, one id each
            group_ids[group] = [len(groups) + 1 + b for b in range(ranks // group)]
            for b, gid in enumerate(group_ids[group]):
                groups[gid] = list(range(b * group, (b + 1) * group))
        per_rank = [et.EtNode(i, f"coll_{i}", et.COMM_COLL_NODE, deps, [], 0,
                              {**attrs, "pg_name": str(group_ids[group][r // group])}) for r in range(ranks)]
        shared.append(per_rank[0])
        variants.append((len(shared) - 1, per_rank))
    traces = et.RankTraces(shared, variants, ranks)
    return [traces[r] for r in range(ranks)], groups


def summary(traces: Sequence[Sequence[et.EtNode]]) -> dict[str, Any]:
    """The counts and totals :meth:`TraceModel.summary` gives, of ``traces`` (rank 0)."""
    return TraceModel.fit(traces).summary()


__all__ = ["TraceModel", "generate_traces", "summary"]
