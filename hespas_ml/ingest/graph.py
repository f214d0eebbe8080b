"""The op graph: what ingest produces and every later stage reads.

A program becomes one flat, fully inlined dataflow graph of :class:`Op` in program order.

* ``func.call`` sites are inlined (each call site is its own copy of the callee's ops), so a function
  called three times contributes three times.
* ``stablehlo.while`` bodies are inlined once; their ops belong to a :class:`Loop` whose trip count
  (derived from the loop condition where possible) multiplies :attr:`Op.count`.
* ``mhlo.fusion`` / ``stablehlo.composite`` / ``sdy.manual_computation`` regions are inlined; ops from an
  XLA fusion carry the fusion's id in :attr:`Op.fusion`.
* Reducer bodies (of ``reduce``, ``all_reduce``, ``sort``, ``scatter``, …) are *not* graph ops; the
  number of ops in such a body is kept in ``attrs["body_ops"]``.

Everything here is plain Python (no MLIR objects), so graphs pickle, hash and cross process boundaries.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

# Bytes per element of each element type we know. Sub-byte types count as one byte (XLA pads them).
DTYPE_BYTES: dict[str, float] = {
    "f64": 8, "f32": 4, "tf32": 4, "f16": 2, "bf16": 2,
    "f8E4M3FN": 1, "f8E5M2": 1, "f8E4M3FNUZ": 1, "f8E5M2FNUZ": 1, "f8E4M3B11FNUZ": 1,
    "f8E4M3": 1, "f8E3M4": 1, "f8E8M0FNU": 1, "f4E2M1FN": 1, "f6E2M3FN": 1, "f6E3M2FN": 1,
    "i64": 8, "ui64": 8, "si64": 8, "i32": 4, "ui32": 4, "si32": 4, "i16": 2, "ui16": 2, "si16": 2,
    "i8": 1, "ui8": 1, "si8": 1, "i4": 1, "ui4": 1, "si4": 1, "i2": 1, "ui2": 1, "i1": 1,
    "complex<f32>": 8, "complex<f64>": 16, "index": 8, "token": 0,
}

FUSED_ATTENTION = "hespas_fused_attention"
FUSED_ATTENTION_GRAD = "hespas_fused_attention_grad"
FUSED_ATTENTION_TARGETS = (FUSED_ATTENTION, FUSED_ATTENTION_GRAD)
"""``custom_call`` targets standing for one fused causal attention kernel (FlashAttention, cuDNN's fused
attention) and its backward: ``(q [b, s, h, d], k [b, t, hk, d], v) -> o [b, s, h, d]`` and
``(q, k, v, o, do) -> (dq, dk, dv)``. The zoo writes them for ``attention=fused``; the cost model prices
them (:mod:`hespas_ml.costs`); XLA cannot run them."""

# The collective ops the pipeline splits out of compute (StableHLO names without the dialect).
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute",
                    "collective_broadcast")


@dataclass(frozen=True, slots=True)
class TensorType:
    """A ranked tensor type. ``dtype`` is the MLIR element type spelling (``f32``, ``bf16``, ``i1`` …)."""

    shape: tuple[int, ...]
    dtype: str
    numel: int = field(init=False, compare=False, repr=False)     # elements (computed once)
    nbytes: int = field(init=False, compare=False, repr=False)    # bytes (computed once)

    def __post_init__(self) -> None:
        n = 1
        for d in self.shape:
            n *= d
        object.__setattr__(self, "numel", n)
        object.__setattr__(self, "nbytes", int(n * DTYPE_BYTES.get(self.dtype, 4)))

    def __str__(self) -> str:  # tensor<4x8xf32> style, for messages and tables
        return "x".join([*map(str, self.shape), self.dtype])


@dataclass(slots=True)
class Op:
    """One operation of the inlined program.

    ``opcode`` is the full MLIR name (``stablehlo.dot_general``, ``mhlo.copy``, ``stablehlo.custom_call``).
    ``operands`` are ids of the ops producing each operand, or ``-1`` for a program input (argument of
    ``main``); ``operand_types`` has one entry per operand. ``attrs`` are decoded to plain Python values (see
    :mod:`hespas_ml.ingest.stablehlo` for the decoded form of each dialect attribute). ``count`` is how
    many times the op runs per program execution (loop trip counts multiplied in).
    """

    id: int
    opcode: str
    operands: list[int]
    operand_types: list[TensorType]
    result_types: list[TensorType]
    attrs: dict[str, Any] = field(default_factory=dict)
    count: int = 1
    loop: int | None = None          # innermost Loop id, if inside a while body
    fusion: int | None = None        # id of the enclosing XLA fusion (mhlo.fusion), if any
    func: str = "main"               # call path where the op was defined, e.g. "main/layer_0"
    main_op: int = field(default=-1, compare=False)   # position in main's body of the top-level op it comes from
    kind: str = field(init=False, compare=False)   # opcode without its dialect: dot_general, copy, all_reduce …

    def __post_init__(self) -> None:
        self.kind = self.opcode.split(".", 1)[-1]

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVE_KINDS

    @property
    def dtype(self) -> str:
        """Element type that decides the compute rate: the first operand's (result's if no operands)."""
        for t in self.operand_types:
            return t.dtype
        for t in self.result_types:
            return t.dtype
        return "f32"


@dataclass(slots=True)
class Loop:
    """A ``stablehlo.while`` that was inlined. ``trip_count`` is per entry into the loop."""

    id: int
    trip_count: int
    derived: bool                    # False when the trip count could not be derived (counted once)
    parent: int | None = None        # enclosing Loop id
    func: str = "main"


ROLES_ATTR = "hespas.argument_roles"    # module attribute: what main's arguments hold, "parameters:40,batch:2"


@dataclass(slots=True)
class OpGraph:
    """A whole ingested program."""

    name: str
    ops: list[Op]
    loops: list[Loop] = field(default_factory=list)
    num_replicas: int = 1
    num_partitions: int = 1
    inputs: list[TensorType] = field(default_factory=list)    # main's parameters, as one device holds them
    outputs: list[int] = field(default_factory=list)          # op ids that main returns (-1: an input)
    warnings: list[str] = field(default_factory=list)
    source: str = ""                 # file path or zoo spec it came from
    input_roles: list[str] | None = None   # what each input holds (parameters, optimizer_state, batch), if known

    @property
    def n_devices(self) -> int:
        return max(1, self.num_replicas * self.num_partitions)

    def op_counts(self) -> dict[str, int]:
        """Executions per opcode kind (loop trip counts included)."""
        out: dict[str, int] = {}
        for op in self.ops:
            out[op.kind] = out.get(op.kind, 0) + op.count
        return out

    def users(self) -> list[list[int]]:
        """For each op id, the ids of the ops that consume one of its results."""
        users: list[list[int]] = [[] for _ in self.ops]
        for op in self.ops:
            for src in op.operands:
                if src >= 0 and (not users[src] or users[src][-1] != op.id):
                    users[src].append(op.id)
        return users


# per kind of per-op table: the last graph asked about, its table, len(graph.ops) when computed
_last_tables: dict[str, list] = {}


def last_program_table(graph: OpGraph, kind: str, compute: Callable[[OpGraph], Any]) -> Any:
    """``compute(graph)``, remembered (per ``kind``) for the last program asked about: a pass over every op
    that splitting a program, hashing its regions and recording or predicting them all need."""
    hit = _last_tables.get(kind)
    if hit is not None and hit[0] is graph and hit[2] == len(graph.ops):
        return hit[1]
    table = compute(graph)
    _last_tables[kind] = [graph, table, len(graph.ops)]
    return table


def program_users(graph: OpGraph) -> list[list[int]]:
    """``graph.users()``, remembered for the last program asked about (see :func:`last_program_table`)."""
    return last_program_table(graph, "users", OpGraph.users)
