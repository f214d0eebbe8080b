"""Cut a set of ops out of a program as a standalone StableHLO module (e.g. one compute region).

:func:`extract_region` re-walks the program exactly as the ingester does (same op ids), recording the MLIR
operation behind each wanted op id and where each of its operands comes from. It then clones those
operations, attributes and reducer regions included, into the ``@main`` of a new module:

* values produced outside the set, program inputs, loop-carried values (block arguments of a while body
  or condition) and values crossing an ``sdy.manual_computation`` boundary (local vs global shapes)
  become parameters of ``@main``, one per distinct value, typed as the consumer sees them: program
  inputs first (in the program's order), then the others in order of first use;
* values of the set used outside it, returned by the program, carried by a loop to its next trip, or
  used by nothing at all (so no work of the set is dead code) become results.

Functions the cloned ops name (``called_computations``, …) and ``sdy.mesh`` symbols they mention are
copied along. The module keeps ``mhlo.num_replicas`` / ``mhlo.num_partitions`` only when the set holds
ops that need them (collectives, replica or partition ids). The result verifies, so XLA can compile it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .bindings import text_of
from .errors import IngestError
from .graph import COLLECTIVE_KINDS, OpGraph
from .stablehlo import _Ingester, load_module, run_ingester

# Ops that need the program's device counts to mean anything.
_DEVICE_KINDS = frozenset(COLLECTIVE_KINDS) | {"replica_id", "partition_id"}
_DEVICE_ATTRS = ("mhlo.num_replicas", "mhlo.num_partitions")


class ExtractError(IngestError):
    """An op set cannot be extracted from its program (bad op ids, a program without its data …)."""


def program_data(graph: OpGraph) -> str | bytes:
    """The program text or bytecode ``graph`` was ingested from: its ``source`` file, or its zoo spec."""
    from .zoo import is_zoo_spec, zoo_program

    source = graph.source
    if is_zoo_spec(source):
        return zoo_program(source)
    if not source or source.startswith("<"):
        raise ExtractError(source or "<string>", f"program '{graph.name}' was parsed from an in-memory "
                           "string, not a file or zoo spec: pass its data to extract_region yourself")
    path = Path(source)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ExtractError(source, "the program's file is gone (cannot re-read it to extract regions)") from None
    except OSError as exc:
        raise ExtractError(source, f"cannot re-read the program's file: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class ExtractedModule:
    """An extracted module and its interface.

    ``params`` / ``results`` name what each parameter / result of ``@main`` is, in order:
    ``("op", op id, result index)`` for a result of an op of the program, ``("input", i)`` for the
    program's i-th input, ``("loop", loop id, i)`` for the i-th value a loop carries, ``("boundary", n, i)``
    for a value crossing an ``sdy.manual_computation`` boundary, ``("free", n)`` for a value no scope
    bound.
    """

    text: str
    params: list[tuple]
    results: list[tuple]


def extract_region(data: str | bytes, op_ids: Sequence[int], *, source: str = "<string>",
                   name: str = "region", trusted: bool = False) -> str:
    """StableHLO text of a module whose ``@main`` computes exactly the ops ``op_ids`` of ``data``.

    ``op_ids`` are ids of ``OpGraph.ops`` of the graph ingested from the same ``data`` (e.g. a
    ``Region.op_ids``). ``source`` names the program in errors; ``name`` becomes the module's name.
    ``trusted`` is as for :func:`~hespas_ml.ingest.stablehlo.parse_module`.
    """
    return extract_modules(data, [op_ids], source=source, names=[name], trusted=trusted)[0].text


def extract_regions(data: str | bytes, op_id_sets: Sequence[Sequence[int]], *, source: str = "<string>",
                    names: Sequence[str] | None = None, trusted: bool = False) -> list[str]:
    """:func:`extract_region` for several op sets of one program, with a single walk of the program."""
    return [m.text for m in extract_modules(data, op_id_sets, source=source, names=names, trusted=trusted)]


def extract_modules(data: str | bytes, op_id_sets: Sequence[Sequence[int]], *, source: str = "<string>",
                    names: Sequence[str] | None = None, trusted: bool = False) -> list[ExtractedModule]:
    """:func:`extract_regions` with each module's interface (:class:`ExtractedModule`)."""
    sets = [_check_ids(ids, source) for ids in op_id_sets]
    names = list(names) if names is not None else [f"region_{i}" for i in range(len(sets))]
    if len(names) != len(sets):
        raise ExtractError(source, f"{len(names)} names for {len(sets)} op sets")
    ctx, module = load_module(data, source, trusted=trusted)
    with ctx:
        recorder = _Recorder(module, source, set().union(*sets))
        graph = run_ingester(recorder)
        missing = sorted(recorder.wanted - recorder.picked.keys())
        if missing:
            raise ExtractError(source, f"op id {missing[0]} is out of range (the program has "
                               f"{len(graph.ops)} ops)")
        out = []
        for wanted, name in zip(sets, names):
            kinds = {graph.ops[i].kind for i in wanted}
            builder = _Builder(module, recorder, source, name, keep_devices=bool(kinds & _DEVICE_KINDS))
            out.append(builder.build(wanted))
        return out


def _check_ids(op_ids: Sequence[int], source: str) -> set[int]:
    try:
        ids = [int(i) for i in op_ids]
    except (TypeError, ValueError):
        raise ExtractError(source, f"op ids must be integers, got {op_ids!r:.80}") from None
    if not ids:
        raise ExtractError(source, "no op ids to extract")
    if min(ids) < 0:
        raise ExtractError(source, f"op id {min(ids)} is negative")
    return set(ids)


class _Ref(int):
    """What an MLIR value stands for during the recording walk: still the producing op id for the
    ingester (an ``int``), plus ``key`` naming the value itself and ``value`` (the MLIR value of that
    name, whose type a parameter takes). Keys: ``("r", op id, result index)``, ``("in", main argument)``,
    ``("carry", loop id, index)``, ``("cross", n, index)`` (a manual-computation boundary), ``("free",
    value)`` (a value no scope bound)."""

    key: tuple
    value: Any

    def __new__(cls, producer: int, key: tuple, value: Any) -> _Ref:
        ref = super().__new__(cls, int(producer))
        ref.key = key
        ref.value = value
        return ref


class _Recorder(_Ingester):
    """The ingester's walk, recording the wanted ops and who reads their results."""

    def __init__(self, module, source: str, wanted: set[int]):
        super().__init__(module, source, None)
        self.wanted = wanted
        self.picked: dict[int, tuple[Any, list]] = {}   # op id -> (MLIR op, what its operands stand for)
        self.readers: dict[tuple, list[int]] = {}     # key of a wanted op's result -> ids of ops reading it
        self.escaping: set[tuple] = set()             # keys leaving the walk (returned, loop-carried …)
        self.crossings = 0

    def hook_main_args(self, block) -> list[int]:
        return [_Ref(-1, ("in", i), a) for i, a in enumerate(block.arguments)]

    def hook_bind_op(self, oid: int, op, operands: list[int], env: dict) -> None:
        for i, r in enumerate(op.results):
            env[r] = _Ref(oid, ("r", oid, i), r)
        wanted = self.wanted
        if oid in wanted:
            self.picked[oid] = (op, operands)
        for p in operands:
            if p in wanted and isinstance(p, _Ref) and p.key[0] == "r":
                self.readers.setdefault(p.key, []).append(oid)

    def hook_loop_args(self, lid: int, block, carried: list[int]) -> list[int]:
        return [_Ref(c, ("carry", lid, i), a) for i, (a, c) in enumerate(zip(block.arguments, carried))]

    def hook_region_args(self, op, block, ids: list[int]) -> list[int]:
        out = list(ids)
        for i, (arg, ref) in enumerate(zip(block.arguments, ids)):
            if not isinstance(ref, _Ref) or ref.value.type != arg.type:   # e.g. global -> local shape
                self.crossings += 1
                out[i] = _Ref(ref, ("cross", self.crossings, i), arg)
        return out

    def hook_region_results(self, op, ids: list[int]) -> list[int]:
        out = list(ids)
        for i, (res, ref) in enumerate(zip(op.results, ids)):
            if not isinstance(ref, _Ref) or ref.value.type != res.type:   # e.g. local -> global shape
                self.escaping.add(_key(ref))
                self.crossings += 1
                out[i] = _Ref(ref, ("cross", self.crossings, i), res)
        return out

    def hook_unbound(self, value) -> int:
        return _Ref(-1, ("free", value), value)

    def hook_escaping(self, ids: list[int]) -> None:
        self.escaping.update(_key(p) for p in ids)


def _key(ref: int) -> tuple:
    return ref.key if isinstance(ref, _Ref) else ("unknown", int(ref))


class _Builder:
    """Clones the recorded ops into a new module."""

    def __init__(self, module, recorder: _Recorder, source: str, name: str, keep_devices: bool):
        self.module = module
        self.rec = recorder
        self.source = source
        self.name = name
        self.keep_devices = keep_devices
        self.ir = recorder.ir
        self._free: dict[tuple, int] = {}

    def build(self, wanted: set[int]) -> ExtractedModule:
        """The module of the ops ``wanted`` (all recorded), verified."""
        ir = self.ir
        from jax.extend.mlir.dialects import func

        picked, rec = self.rec.picked, self.rec
        order = sorted(wanted)
        params: dict[tuple, Any] = {}          # key -> MLIR value whose type the parameter takes
        for oid in order:
            op, operands = picked[oid]
            for j, ref in enumerate(operands):
                if not isinstance(ref, _Ref):
                    raise ExtractError(self.source, f"operand {j} of {op.name} (op {oid}) comes from a value "
                                       "the walk could not name")
                inside = ref.key[0] == "r" and ref.key[1] in wanted
                if not inside and ref.key not in params:
                    params[ref.key] = ref.value
        # program inputs first, in the program's order; then the rest in order of first use
        params = dict(sorted(params.items(), key=lambda kv: kv[0][1] if kv[0][0] == "in" else math.inf))
        results = []
        for oid in order:
            for i in range(len(picked[oid][0].results)):
                key = ("r", oid, i)
                readers = rec.readers.get(key, ())
                if key in rec.escaping or not readers or any(u not in wanted for u in readers):
                    results.append(key)
        with ir.Location.unknown():
            new = ir.Module.create()
            attrs = new.operation.attributes
            attrs["sym_name"] = ir.StringAttr.get(self.name)
            if self.keep_devices:
                old = self.module.operation.attributes
                for key in _DEVICE_ATTRS:
                    if key in old:
                        attrs[key] = old[key]
            values: dict[tuple, Any] = {}
            result_types = [self._result_type(k) for k in results]
            with ir.InsertionPoint(new.body):
                main = func.FuncOp("main", ([v.type for v in params.values()], result_types))
                main.attributes["sym_visibility"] = ir.StringAttr.get("public")
                block = main.add_entry_block()
            for key, arg in zip(params, block.arguments):
                values[key] = arg
            with ir.InsertionPoint(block):
                for oid in order:
                    op, operands = picked[oid]
                    clone = op.clone()
                    for j, ref in enumerate(operands):
                        clone.operands[j] = values[ref.key]
                    for i, r in enumerate(clone.results):
                        values[("r", oid, i)] = r
                func.ReturnOp([values[k] for k in results])
            self._copy_symbols(new, main)
        try:
            new.operation.verify()
        except ir.MLIRError as exc:
            first = (str(exc).splitlines() or ["verification failed"])
            raise ExtractError(self.source, f"the extracted module does not verify: {' '.join(first)[:300]}"
                               ) from None
        text = new.operation.get_asm(large_elements_limit=None)
        return ExtractedModule(text, [self._describe(k) for k in params], [self._describe(k) for k in results])

    def _describe(self, key: tuple) -> tuple:
        kind = key[0]
        if kind == "r":
            return ("op", key[1], key[2])
        if kind == "in":
            return ("input", key[1])
        if kind == "carry":
            return ("loop", key[1], key[2])
        if kind == "cross":
            return ("boundary", key[1], key[2])
        return ("free", self._free.setdefault(key, len(self._free)))

    def _result_type(self, key: tuple):
        op, _ = self.rec.picked[key[1]]
        return op.results[key[2]].type

    def _copy_symbols(self, new, main) -> None:
        """Copy functions the cloned ops name, and ``sdy.mesh`` symbols they mention, before ``main``."""
        ir = self.ir
        symbols: dict[str, Any] = {}
        for op in self.module.body.operations:
            op = op.operation
            if op.name in ("func.func", "sdy.mesh") and "sym_name" in op.attributes:
                symbols[text_of(op.attributes["sym_name"])] = op
        meshes = [n for n, op in symbols.items() if op.name == "sdy.mesh"]
        needed: list[str] = []
        pending = [main.operation]
        while pending:
            for ref in _symbol_refs(pending.pop(), meshes, ir):
                if ref in symbols and ref not in needed and ref != "main":
                    needed.append(ref)
                    if symbols[ref].name == "func.func":
                        pending.append(symbols[ref])
        first = main.operation
        for ref in needed:
            clone = symbols[ref].clone(ip=ir.InsertionPoint(first))
            if clone.name == "func.func":
                clone.attributes["sym_visibility"] = ir.StringAttr.get("private")


def _symbol_refs(root, meshes: list[str], ir) -> set[str]:
    """Symbols that ops under ``root`` name in their attributes (symbol references, and mesh names that
    sdy attributes mention in their text)."""
    found: set[str] = set()

    def from_attr(attr, depth: int = 0) -> None:
        if isinstance(attr, ir.FlatSymbolRefAttr):
            found.add(text_of(attr))
        elif isinstance(attr, ir.SymbolRefAttr):
            found.add(text_of(attr).split("::")[0].lstrip("@"))
        elif isinstance(attr, ir.ArrayAttr) and depth < 8:
            for a in attr:
                from_attr(a, depth + 1)
        elif isinstance(attr, ir.DictAttr) and depth < 8:
            for i in range(len(attr)):
                from_attr(attr[i].attr, depth + 1)
        elif meshes:
            text = str(attr)
            if "@" in text:
                found.update(m for m in meshes if re.search(rf'@"?{re.escape(m)}(?![\w.$-])', text))

    def visit(op):
        for _, attr in op.attributes.items():
            from_attr(attr)
        return ir.WalkResult.ADVANCE

    root.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


__all__ = ["ExtractError", "ExtractedModule", "extract_modules", "extract_region", "extract_regions", "program_data"]
