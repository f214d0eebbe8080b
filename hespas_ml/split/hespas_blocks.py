"""Hespas's compute blocks: the split the Hespas simulator profiles a program in, rebuilt on our op graph.

Hespas (imec) cuts a program's ``@main`` into *blocks* before timing them:

* it reads only the top-level ops of ``@main``, in program order; a ``func.call``, a ``while`` or any
  other op with regions is one op to it, whatever it holds, and the terminating ``func.return`` counts too;
* each top-level ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all`` or
  ``collective_permute`` (:data:`HESPAS_COMM_KINDS`) is a block of its own (a *collective block*), after the
  pending compute ops are flushed;
* the other ops accumulate into a *compute block*, flushed when it holds :data:`BLOCK_LIMIT` top-level ops;
  an empty run makes no block.

Each compute block is compiled and timed as a module of its own; identical blocks are timed once.

:func:`hespas_blocks` replays this on an :class:`~hespas_ml.ingest.graph.OpGraph` using
:attr:`Op.main_op <hespas_ml.ingest.graph.Op.main_op>` (the position in ``@main``'s body of the top-level op
each inlined op comes from). ``split_program(graph, "hespas")`` (:mod:`hespas_ml.split.regions`) makes
regions of the blocks, so they get the project's structural hash (:mod:`hespas_ml.split.signature`) and
region records like any other region: a block's region holds every op of its top-level ops as our ingest
inlines them (the bodies of the functions they call included), its kernels are the program's XLA-style
fusion groups cut at the block's edge (XLA compiles each block as a whole module and fuses inside it).

Where the graph cannot tell:

* the position of ``@main``'s terminator is taken to be right after the last top-level op that produced
  graph ops (so a trailing call to a function with no ops is not counted);
* a top-level op is taken for a collective when it produced exactly one graph op, a collective of
  :data:`HESPAS_COMM_KINDS` that is neither in a call, a loop nor a fusion (an ``sdy.manual_computation``
  whose body is one collective would be misread as one);
* a block's region has one execution count (1): ops of a loop inside a block are counted once;
* a block made only of ``@main``'s terminator has no op and makes no region.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ingest.graph import OpGraph
from .errors import SplitError

# The ops Hespas cuts out as collective blocks (StableHLO names without the dialect).
HESPAS_COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")
# Top-level ops of @main at which Hespas flushes a compute block.
BLOCK_LIMIT = 1024


@dataclass(slots=True)
class Block:
    """One block of Hespas's split. ``index`` is its place in the split order (collective blocks included);
    ``first`` the position in ``@main``'s body of its first top-level op and ``n_top`` how many top-level
    ops it holds; ``op_ids`` the graph ops they stand for."""

    index: int
    kind: str                                   # "compute" | "collective"
    first: int
    n_top: int
    op_ids: list[int]


def _positions(graph: OpGraph) -> tuple[dict[int, list[int]], int]:
    """Graph op ids per position in ``@main``'s body, and the number of top-level ops (terminator included)."""
    by_pos: dict[int, list[int]] = {}
    for op in graph.ops:
        if op.main_op < 0:
            raise SplitError(f"{graph.source or graph.name}: op {op.id} ({op.opcode}) does not say which top-level "
                             "op of main it comes from (graph not ingested from a StableHLO program?)")
        by_pos.setdefault(op.main_op, []).append(op.id)
    n_top = max(by_pos) + 2 if by_pos else 1
    return by_pos, n_top


def _is_comm(graph: OpGraph, ids: list[int]) -> bool:
    if len(ids) != 1:
        return False
    op = graph.ops[ids[0]]
    return op.kind in HESPAS_COMM_KINDS and op.func == "main" and op.loop is None and op.fusion is None


def hespas_blocks(graph: OpGraph, limit: int = BLOCK_LIMIT) -> list[Block]:
    """Every block of Hespas's split of ``graph`` (compute and collective), in split order; no regions."""
    if limit < 1:
        raise SplitError(f"block limit must be at least 1, not {limit}")
    by_pos, n_top = _positions(graph)
    blocks: list[Block] = []
    pending: list[int] = []

    def flush() -> None:
        if pending:
            ids = [i for p in pending for i in by_pos.get(p, ())]
            blocks.append(Block(len(blocks), "compute", pending[0], len(pending), ids))
            pending.clear()

    for pos in range(n_top):
        ids = by_pos.get(pos, [])
        if _is_comm(graph, ids):
            flush()
            blocks.append(Block(len(blocks), "collective", pos, 1, list(ids)))
            continue
        pending.append(pos)
        if len(pending) >= limit:
            flush()
    flush()
    return blocks


__all__ = ["BLOCK_LIMIT", "Block", "HESPAS_COMM_KINDS", "hespas_blocks"]
