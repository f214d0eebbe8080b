"""Parse StableHLO (text or MLIR bytecode) with the MLIR bindings that ship in jaxlib into an :class:`OpGraph`.

Decoded attribute forms (``Op.attrs``), so later stages never touch MLIR objects:

* integers, floats, bools, strings, dense arrays → Python scalars / lists;
* ``dot_dimension_numbers`` → ``{"lhs_batch", "rhs_batch", "lhs_contract", "rhs_contract"}`` (lists);
  ``stablehlo.dot`` gets the equivalent (contract lhs dim rank-1 with rhs dim 0);
* ``dimension_numbers`` of ``convolution`` → ``{"input_batch", "input_feature", "input_spatial",
  "kernel_input_feature", "kernel_output_feature", "kernel_spatial", "output_batch", "output_feature",
  "output_spatial"}``; ``padding`` → list of ``[low, high]``;
* gather / scatter dimension numbers → dicts of their fields;
* ``replica_groups`` → list of device-id lists (mesh-axes groups resolved against ``sdy.mesh``);
  ``source_target_pairs`` → list of ``[src, dst]``; ``channel_handle`` → ``{"handle", "type"}``;
* ``comparison_direction`` → ``"LT"`` …; other dialect attributes → their text;
* large constants are not kept: a constant's ``value`` is its scalar when it is a splat, else dropped;
* ops with reducer bodies (reduce, sort, scatter, all_reduce …) get ``body_ops`` = ops in the body.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .errors import IngestError
from .graph import Loop, Op, OpGraph, TensorType

_MLIR = None  # (jmlir, ir, stablehlo) imported lazily: importing jax costs ~1 s


def _mlir():
    global _MLIR
    if _MLIR is None:
        from jax.extend.mlir import ir
        from jax.extend.mlir.dialects import stablehlo as sh
        from jax.interpreters import mlir as jmlir

        _MLIR = (jmlir, ir, sh)
    return _MLIR


# Ops whose regions are reducer/comparator bodies: costed by the op itself, never inlined.
_BODY_OPS = {"stablehlo.reduce", "stablehlo.reduce_window", "stablehlo.select_and_scatter",
             "stablehlo.scatter", "stablehlo.sort", "stablehlo.all_reduce", "stablehlo.reduce_scatter",
             "stablehlo.map", "stablehlo.custom_call", "mhlo.reduce", "mhlo.sort", "mhlo.scatter",
             "mhlo.all_reduce", "mhlo.reduce_scatter", "mhlo.reduce_window"}
# Terminators: not ops of the graph.
_TERMINATORS = {"func.return", "stablehlo.return", "mhlo.return", "sdy.return", "mpmd.return"}
# Ops inlined into their parent (their single region's block arguments are the op's operands).
_INLINED_REGION_OPS = {"mhlo.fusion", "sdy.manual_computation", "sdy.named_computation", "mpmd.fragment"}
# Attributes no stage reads (layouts, shardings, opaque backend configs): not decoded.
_SKIPPED_ATTRS = {"mhlo.sharding", "mhlo.frontend_attributes", "sdy.sharding", "backend_config",
                  "output_operand_aliases", "result_layout", "operand_layouts", "mhlo.backend_config",
                  "sdy.sharding_rule", "xla_shape", "precision_config", "sdy.sharding_per_value"}
MAX_DERIVED_TRIPS = 100_000
MAX_INLINED_OPS = 5_000_000


def parse_file(path: str | Path) -> OpGraph:
    """Read a ``.mlir`` file (text or bytecode) and ingest it."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise IngestError(str(path), "no such file") from None
    except IsADirectoryError:
        raise IngestError(str(path), "is a directory, not an MLIR file") from None
    except OSError as exc:
        raise IngestError(str(path), f"cannot read: {exc.strerror or exc}") from None
    return parse_module(data, source=str(path), name=path.stem)


def parse_module(data: str | bytes, source: str = "<string>", name: str | None = None) -> OpGraph:
    """Ingest StableHLO given as text or MLIR bytecode. ``source`` names it in error messages."""
    jmlir, ir, _ = _mlir()
    if isinstance(data, bytes) and not data.startswith(b"ML\xefR"):
        if data[:2] == b"\x1f\x8b":
            raise IngestError(source, "is gzip-compressed; decompress it first")
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise IngestError(source, f"is neither MLIR text nor MLIR bytecode (byte {exc.start} is not UTF-8)") from None
    if isinstance(data, str):
        if not data.strip():
            raise IngestError(source, "is empty")
        if "\x00" in data:
            raise IngestError(source, "is not MLIR text (contains NUL bytes)")
    ctx = jmlir.make_ir_context()
    with ctx:
        try:
            module = ir.Module.parse(data)
        except ir.MLIRError as exc:
            raise IngestError(source, _describe_mlir_error(exc)) from None
        except Exception as exc:  # the bindings raise plain errors for some bytecode failures
            raise IngestError(source, f"not a valid MLIR module ({str(exc).splitlines()[0][:200]})") from None
        return _Ingester(module, source, name or Path(source).stem).run()


def _describe_mlir_error(exc: Exception) -> str:
    diags = getattr(exc, "error_diagnostics", None) or []
    if diags:
        d = diags[0]
        loc = re.search(r':(\d+):(\d+)\)', str(d.location))
        where = f"line {loc.group(1)}, column {loc.group(2)}: " if loc and loc.group(1) != "0" else ""
        return f"not valid MLIR ({where}{d.message.splitlines()[0][:300]})"
    text = str(exc).splitlines()
    return f"not valid MLIR ({(text[-1] if text else 'parse failed')[:300]})"


def _line_of(op) -> str:
    m = re.search(r':(\d+):(\d+)', str(op.location))
    return f"line {m.group(1)}" if m and m.group(1) != "0" else "an unknown line"


class _Ingester:
    """One walk over a parsed module, inlining calls, fusions and loop bodies into a flat op list."""

    def __init__(self, module, source: str, name: str):
        _, self.ir, self.sh = _mlir()
        self.module = module
        self.source = source
        self.name = name
        self.ops: list[Op] = []
        self.loops: list[Loop] = []
        self.warnings: list[str] = []
        self.funcs: dict[str, Any] = {}
        self.meshes: dict[str, list[tuple[str, int]]] = {}
        self.mesh_device_ids: dict[str, list[int]] = {}
        self.known_scalars: dict[int, Any] = {}   # op id -> statically known scalar result value
        self.fusion_count = 0
        self._warned: set[str] = set()

    # -- entry ---------------------------------------------------------------------------------
    def run(self) -> OpGraph:
        mod_op = self.module.operation
        attrs = dict(mod_op.attributes.items())
        replicas = _int_attr(attrs.get("mhlo.num_replicas"), 1)
        partitions = _int_attr(attrs.get("mhlo.num_partitions"), 1)
        for op in self.module.body.operations:
            op = op.operation
            if op.name == "func.func":
                self.funcs[op.attributes["sym_name"].value] = op
            elif op.name == "sdy.mesh":
                self._read_mesh(op)
        main = self.funcs.get("main")
        if main is None:
            found = ", ".join("@" + n for n in sorted(self.funcs)) or "none"
            raise IngestError(self.source, f"has no 'main' function (functions found: {found[:200]})")
        if len(main.regions) == 0 or len(main.regions[0].blocks) == 0:
            raise IngestError(self.source, "'main' has no body (it is only a declaration)")
        if partitions == 1 and self.meshes and not attrs.get("mhlo.num_partitions"):
            partitions = max((int(np.prod([s for _, s in axes])) for axes in self.meshes.values()), default=1)
        block = main.regions[0].blocks[0]
        inputs = [self._tensor_type(a.type, main, f"argument {i} of main") for i, a in enumerate(block.arguments)]
        env = {a: -1 for a in block.arguments}
        outputs = self._walk_block(block, env, count=1, loop=None, fusion=None, path="main", depth=0)
        return OpGraph(name=self.name, ops=self.ops, loops=self.loops, num_replicas=replicas,
                       num_partitions=partitions, inputs=[t for t in inputs if t is not None],
                       outputs=outputs, warnings=self.warnings, source=self.source)

    def warn(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            self.warnings.append(message)

    # -- types -----------------------------------------------------------------------------------
    def _tensor_type(self, ty, op, what: str) -> TensorType | None:
        ir = self.ir
        if isinstance(ty, ir.RankedTensorType):
            if not ty.has_static_shape:
                dims = "x".join("?" if d < 0 else str(d) for d in ty.shape)
                raise IngestError(self.source, f"dynamic shape tensor<{dims}x{ty.element_type}> in {what} "
                                  f"({_line_of(op)}); hespas-ml needs static shapes (export with concrete sizes)")
            return TensorType(tuple(ty.shape), str(ty.element_type))
        if isinstance(ty, ir.UnrankedTensorType):
            raise IngestError(self.source, f"unranked tensor type in {what} ({_line_of(op)}); "
                              "hespas-ml needs static shapes")
        return None  # tokens, tuples (flattened by the caller), !stablehlo.token …

    def _types(self, values, op, what: str) -> list[TensorType]:
        out: list[TensorType] = []
        for v in values:
            ty = v.type
            if isinstance(ty, self.ir.TupleType):
                for i in range(ty.num_types):
                    t = self._tensor_type(ty.get_type(i), op, what)
                    if t is not None:
                        out.append(t)
                continue
            t = self._tensor_type(ty, op, what)
            if t is not None:
                out.append(t)
        return out

    # -- walking ---------------------------------------------------------------------------------
    def _walk_block(self, block, env: dict, count: int, loop: int | None, fusion: int | None,
                    path: str, depth: int) -> list[int]:
        """Inline every op of ``block``; returns the producer ids of the block terminator's operands."""
        if depth > 64:
            raise IngestError(self.source, f"calls nested more than 64 deep at {path} (recursion?)")
        result: list[int] = []
        for op in block.operations:
            op = op.operation
            name = op.name
            if name in _TERMINATORS:
                result = [self._producer(v, env) for v in op.operands]
                continue
            if name == "func.call":
                self._inline_call(op, env, count, loop, fusion, path, depth)
            elif name in _INLINED_REGION_OPS and len(op.regions) == 1 and len(op.regions[0].blocks) == 1:
                fid = fusion
                if name == "mhlo.fusion" and fusion is None:
                    fid = self.fusion_count
                    self.fusion_count += 1
                inner = op.regions[0].blocks[0]
                sub = dict(env)
                for arg, v in zip(inner.arguments, op.operands):
                    sub[arg] = self._producer(v, env)
                outs = self._walk_block(inner, sub, count, loop, fid, path, depth)
                self._bind_results(op, outs, env)
            elif name == "stablehlo.composite":
                callee = op.attributes["decomposition"].value
                self._inline_function(op, callee, env, count, loop, fusion, path, depth)
            elif name == "stablehlo.while":
                self._inline_while(op, env, count, loop, fusion, path, depth)
            elif name in ("stablehlo.case", "stablehlo.if"):
                self._inline_branches(op, env, count, loop, fusion, path, depth)
            else:
                self._add_op(op, env, count, loop, fusion, path)
            if len(self.ops) > MAX_INLINED_OPS:
                raise IngestError(self.source, f"more than {MAX_INLINED_OPS} ops after inlining calls")
        return result

    def _producer(self, value, env: dict) -> int:
        pid = env.get(value)
        if pid is None:
            return -1  # a value from an enclosing scope we did not bind (e.g. a constant captured by a body)
        return pid

    def _bind_results(self, op, producer_ids: list[int], env: dict) -> None:
        for i, r in enumerate(op.results):
            env[r] = producer_ids[i] if i < len(producer_ids) else (producer_ids[-1] if producer_ids else -1)

    def _inline_call(self, op, env, count, loop, fusion, path, depth) -> None:
        callee = op.attributes["callee"].value
        self._inline_function(op, callee, env, count, loop, fusion, path, depth)

    def _inline_function(self, op, callee: str, env, count, loop, fusion, path, depth) -> None:
        func = self.funcs.get(callee)
        if func is None:
            raise IngestError(self.source, f"call to undefined function @{callee} ({_line_of(op)})")
        if not func.regions or not func.regions[0].blocks:
            self.warn(f"call to external function @{callee} has no body; counted as nothing")
            self._bind_results(op, [], env)
            return
        block = func.regions[0].blocks[0]
        sub = {arg: self._producer(v, env) for arg, v in zip(block.arguments, op.operands)}
        outs = self._walk_block(block, sub, count, loop, fusion, f"{path}/{callee}", depth + 1)
        self._bind_results(op, outs, env)

    def _inline_while(self, op, env, count, loop, fusion, path, depth) -> None:
        init = [self._producer(v, env) for v in op.operands]
        trips = self._trip_count(op, init)
        derived = trips is not None
        if not derived:
            self.warn(f"while loop at {_line_of(op)} in {path}: trip count not derivable, counted once")
            trips = 1
        lid = len(self.loops)
        self.loops.append(Loop(lid, trips, derived, loop, path))
        cond, body = op.regions[0].blocks[0], op.regions[1].blocks[0]
        sub = dict(env)
        for arg, pid in zip(body.arguments, init):
            sub[arg] = pid
        outs = self._walk_block(body, sub, count * trips, lid, fusion, path, depth)
        csub = dict(env)
        for arg, pid in zip(cond.arguments, outs or init):
            csub[arg] = pid
        self._walk_block(cond, csub, count * (trips + 1) if derived else count, lid, fusion, path, depth)
        self._bind_results(op, outs or init, env)

    def _inline_branches(self, op, env, count, loop, fusion, path, depth) -> None:
        """Conditionals: inline the branch with the most ops (a proxy for the most expensive one)."""
        branches = [r.blocks[0] for r in op.regions if len(r.blocks)]
        if not branches:
            self._bind_results(op, [], env)
            return
        sizes = [sum(1 for _ in b.operations) for b in branches]
        pick = int(np.argmax(sizes))
        if len(branches) > 1:
            self.warn(f"conditional at {_line_of(op)} in {path}: {len(branches)} branches, "
                      f"the largest ({sizes[pick]} ops) is counted")
        outs = self._walk_block(branches[pick], dict(env), count, loop, fusion, path, depth)
        self._bind_results(op, outs, env)

    def _add_op(self, op, env, count, loop, fusion, path) -> None:
        name = op.name
        oid = len(self.ops)
        operands = [self._producer(v, env) for v in op.operands]
        what = f"{name}"
        operand_types = self._types(op.operands, op, f"an operand of {what}")
        result_types = self._types(op.results, op, f"the result of {what}")
        attrs = self._decode_attrs(op)
        if name in _BODY_OPS and op.regions:
            attrs["body_ops"] = sum(1 for r in op.regions for b in r.blocks for o in b.operations
                                    if o.operation.name not in _TERMINATORS)
        if name == "stablehlo.custom_call":
            target = attrs.get("call_target_name", "?")
            self.warn(f"custom_call @{target} is not modelled (counted, costed as its memory traffic only)")
        self.ops.append(Op(oid, name, operands, operand_types, result_types, attrs, count, loop, fusion, path))
        for r in op.results:
            env[r] = oid
        self._fold_scalar(oid, name, operands, attrs, result_types)

    # -- attributes ------------------------------------------------------------------------------
    def _decode_attrs(self, op) -> dict[str, Any]:
        out: dict[str, Any] = {}
        name = op.name
        for key, attr in op.attributes.items():
            if key in _SKIPPED_ATTRS:
                continue
            try:
                out[key] = self._decode(key, attr, name)
            except Exception:  # an attribute we cannot decode is kept as text, never fatal
                out[key] = str(attr)
        if name == "stablehlo.dot":
            lhs = op.operands[0].type
            rank = len(lhs.shape) if isinstance(lhs, self.ir.RankedTensorType) else 1
            out["dot_dimension_numbers"] = {"lhs_batch": [], "rhs_batch": [],
                                            "lhs_contract": [rank - 1] if rank else [], "rhs_contract": [0]}
        return out

    def _decode(self, key: str, attr, opname: str) -> Any:
        ir, sh = self.ir, self.sh
        if key == "value" and isinstance(attr, ir.DenseElementsAttr):
            if attr.is_splat:
                return _scalar_of(attr.get_splat_value())
            return None
        if key == "dot_dimension_numbers":
            d = sh.DotDimensionNumbers(attr)
            return {"lhs_batch": list(d.lhs_batching_dimensions), "rhs_batch": list(d.rhs_batching_dimensions),
                    "lhs_contract": list(d.lhs_contracting_dimensions),
                    "rhs_contract": list(d.rhs_contracting_dimensions)}
        if key == "dimension_numbers" and "convolution" in opname:
            d = sh.ConvDimensionNumbers(attr)
            return {"input_batch": d.input_batch_dimension, "input_feature": d.input_feature_dimension,
                    "input_spatial": list(d.input_spatial_dimensions),
                    "kernel_input_feature": d.kernel_input_feature_dimension,
                    "kernel_output_feature": d.kernel_output_feature_dimension,
                    "kernel_spatial": list(d.kernel_spatial_dimensions),
                    "output_batch": d.output_batch_dimension, "output_feature": d.output_feature_dimension,
                    "output_spatial": list(d.output_spatial_dimensions)}
        if key == "dimension_numbers" and "gather" in opname:
            d = sh.GatherDimensionNumbers(attr)
            return {"offset_dims": list(d.offset_dims), "collapsed_slice_dims": list(d.collapsed_slice_dims),
                    "operand_batching_dims": list(d.operand_batching_dims),
                    "start_indices_batching_dims": list(d.start_indices_batching_dims),
                    "start_index_map": list(d.start_index_map), "index_vector_dim": d.index_vector_dim}
        if key == "scatter_dimension_numbers":
            d = sh.ScatterDimensionNumbers(attr)
            return {"update_window_dims": list(d.update_window_dims),
                    "inserted_window_dims": list(d.inserted_window_dims),
                    "input_batching_dims": list(d.input_batching_dims),
                    "scatter_indices_batching_dims": list(d.scatter_indices_batching_dims),
                    "scatter_dims_to_operand_dims": list(d.scatter_dims_to_operand_dims),
                    "index_vector_dim": d.index_vector_dim}
        if key == "channel_handle":
            d = sh.ChannelHandle(attr)
            return {"handle": d.handle, "type": d.channel_type}
        if key == "replica_groups":
            return self._replica_groups(attr)
        if key == "comparison_direction":
            return str(sh.ComparisonDirectionAttr(attr).value)
        return self._generic(attr)

    def _generic(self, attr) -> Any:
        ir = self.ir
        if isinstance(attr, ir.BoolAttr):
            return bool(attr.value)
        if isinstance(attr, ir.IntegerAttr):
            return int(attr.value)
        if isinstance(attr, ir.FloatAttr):
            return float(attr.value)
        if isinstance(attr, ir.StringAttr):
            return attr.value
        if isinstance(attr, ir.FlatSymbolRefAttr):
            return attr.value
        if isinstance(attr, (ir.DenseI64ArrayAttr, ir.DenseI32ArrayAttr, ir.DenseI16ArrayAttr,
                             ir.DenseI8ArrayAttr, ir.DenseBoolArrayAttr, ir.DenseF32ArrayAttr,
                             ir.DenseF64ArrayAttr)):
            return list(attr)
        if isinstance(attr, ir.DenseIntElementsAttr):
            arr = np.array(attr)
            return arr.tolist() if arr.size <= 65536 else None
        if isinstance(attr, ir.DenseElementsAttr):
            return None
        if isinstance(attr, ir.ArrayAttr):
            return [self._generic(a) for a in attr]
        if isinstance(attr, ir.UnitAttr):
            return True
        if isinstance(attr, ir.TypeAttr):
            return str(attr.value)
        return str(attr)

    # -- collectives -----------------------------------------------------------------------------
    def _read_mesh(self, op) -> None:
        name = op.attributes["sym_name"].value
        text = str(op.attributes["mesh"])
        axes = [(a, int(s)) for a, s in re.findall(r'"([^"]+)"\s*=\s*(\d+)', text)]
        self.meshes[name] = axes
        ids = re.search(r'device_ids\s*=\s*\[([\d,\s]+)\]', text)
        if ids:
            self.mesh_device_ids[name] = [int(x) for x in ids.group(1).split(",")]

    def _replica_groups(self, attr) -> list[list[int]]:
        ir = self.ir
        if isinstance(attr, ir.DenseIntElementsAttr):
            arr = np.array(attr)
            if arr.size == 0:
                return []
            arr = arr.reshape(arr.shape[0], -1) if arr.ndim != 2 else arr
            return [[int(x) for x in row if x >= 0] for row in arr]
        text = str(attr)
        m = re.search(r'mesh\s*=\s*@([\w.$-]+)', text)
        axes = re.findall(r'axis_ref<name\s*=\s*"([^"]+)"', text)
        if not m or m.group(1) not in self.meshes:
            raise ValueError(f"unresolvable replica groups {text[:100]}")
        mesh = self.meshes[m.group(1)]
        sizes = [s for _, s in mesh]
        names = [a for a, _ in mesh]
        ids = np.array(self.mesh_device_ids.get(m.group(1), range(int(np.prod(sizes))))).reshape(sizes)
        group_axes = [names.index(a) for a in axes if a in names]
        other = [i for i in range(len(names)) if i not in group_axes]
        arr = np.transpose(ids, other + group_axes).reshape(-1, int(np.prod([sizes[i] for i in group_axes] or [1])))
        return arr.tolist()

    # -- loop trip counts ------------------------------------------------------------------------
    def _fold_scalar(self, oid: int, name: str, operands: list[int], attrs: dict, rtypes) -> None:
        """Remember statically known scalar results (constants and simple folds) for trip counts."""
        if len(rtypes) != 1 or rtypes[0].shape != ():
            return
        if name == "stablehlo.constant":
            v = attrs.get("value")
            if isinstance(v, (int, bool, float)):
                self.known_scalars[oid] = v
            return
        vals = [self.known_scalars.get(p) for p in operands]
        if not operands or any(v is None for v in vals):
            return
        fn = _SCALAR_FOLDS.get(name)
        if fn is not None:
            try:
                self.known_scalars[oid] = fn(vals, attrs)
            except Exception:
                pass

    def _trip_count(self, op, init_ids: list[int]) -> int | None:
        """Run the loop's scalar induction logic symbolically (at most MAX_DERIVED_TRIPS iterations)."""
        init = [self.known_scalars.get(i) if i >= 0 else None for i in init_ids]
        if all(v is None for v in init):
            return None
        try:
            cond = _ScalarProgram(self, op.regions[0].blocks[0])
            body = _ScalarProgram(self, op.regions[1].blocks[0])
        except _NotScalar:
            return None
        state = init
        for trips in range(MAX_DERIVED_TRIPS + 1):
            c = cond.run(state)
            if not c or c[0] is None:
                return None
            if not c[0]:
                return trips
            nxt = body.run(state)
            if len(nxt) != len(state):
                return None
            state = nxt
        return None


class _NotScalar(Exception):
    pass


def _cmp(direction: str) -> Callable[[Any, Any], bool]:
    return {"LT": lambda a, b: a < b, "LE": lambda a, b: a <= b, "GT": lambda a, b: a > b,
            "GE": lambda a, b: a >= b, "EQ": lambda a, b: a == b, "NE": lambda a, b: a != b}[direction]


def _convert(vals, attrs):
    return vals[0]


_SCALAR_FOLDS: dict[str, Callable[[list, dict], Any]] = {
    "stablehlo.add": lambda v, a: v[0] + v[1],
    "stablehlo.subtract": lambda v, a: v[0] - v[1],
    "stablehlo.multiply": lambda v, a: v[0] * v[1],
    "stablehlo.maximum": lambda v, a: max(v[0], v[1]),
    "stablehlo.minimum": lambda v, a: min(v[0], v[1]),
    "stablehlo.negate": lambda v, a: -v[0],
    "stablehlo.convert": _convert,
    "mhlo.copy": _convert,
    "stablehlo.and": lambda v, a: v[0] and v[1],
    "stablehlo.or": lambda v, a: v[0] or v[1],
    "stablehlo.not": lambda v, a: not v[0],
    "stablehlo.select": lambda v, a: v[1] if v[0] else v[2],
    "stablehlo.compare": lambda v, a: _cmp(a.get("comparison_direction", "LT"))(v[0], v[1]),
    "stablehlo.divide": lambda v, a: int(v[0] / v[1]) if isinstance(v[0], int) else v[0] / v[1],
}


class _ScalarProgram:
    """A loop region compiled to straight-line scalar code: non-scalar values evaluate to ``None``."""

    def __init__(self, ing: _Ingester, block):
        self.steps: list[tuple] = []
        self.nargs = len(block.arguments)
        slots: dict = {a: i for i, a in enumerate(block.arguments)}
        self.nslots = self.nargs
        self.outputs = self._compile(ing, block, slots, 0)

    def _slot(self) -> int:
        self.nslots += 1
        return self.nslots - 1

    def _compile(self, ing: _Ingester, block, slots: dict, depth: int) -> list[int | None]:
        if depth > 16:
            raise _NotScalar()
        outs: list[int | None] = []
        for op in block.operations:
            op = op.operation
            name = op.name
            ins = [slots.get(v) for v in op.operands]
            if name in _TERMINATORS:
                outs = ins
                continue
            if name in ("mhlo.fusion", "func.call"):
                if name == "func.call":
                    f = ing.funcs.get(op.attributes["callee"].value)
                    if f is None or not f.regions or not f.regions[0].blocks:
                        continue
                    inner = f.regions[0].blocks[0]
                else:
                    inner = op.regions[0].blocks[0]
                sub = {a: s for a, s in zip(inner.arguments, ins)}
                res = self._compile(ing, inner, sub, depth + 1)
                for r, s in zip(op.results, res):
                    if s is not None:
                        slots[r] = s
                continue
            if len(op.results) != 1:
                continue
            ty = op.results[0].type
            if not isinstance(ty, ing.ir.RankedTensorType) or list(ty.shape) != []:
                continue
            if name == "stablehlo.constant":
                v = ing._decode("value", op.attributes["value"], name)
                if v is None:
                    continue
                s = self._slot()
                self.steps.append((s, None, (), v))
                slots[op.results[0]] = s
                continue
            fn = _SCALAR_FOLDS.get(name)
            if fn is None or any(i is None for i in ins):
                continue
            attrs = {"comparison_direction": str(ing.sh.ComparisonDirectionAttr(
                op.attributes["comparison_direction"]).value)} if name == "stablehlo.compare" else {}
            s = self._slot()
            self.steps.append((s, fn, tuple(ins), attrs))
            slots[op.results[0]] = s
        return outs

    def run(self, args: list) -> list:
        vals: list = list(args) + [None] * (self.nslots - self.nargs)
        for s, fn, ins, extra in self.steps:
            if fn is None:
                vals[s] = extra
                continue
            xs = [vals[i] for i in ins]
            if any(x is None for x in xs):
                vals[s] = None
                continue
            try:
                vals[s] = fn(xs, extra)
            except Exception:
                vals[s] = None
        return [vals[i] if i is not None else None for i in self.outputs]


def _scalar_of(value) -> Any:
    v = getattr(value, "value", None)
    if isinstance(v, (bool, int, float)):
        return v
    text = str(value)
    m = re.match(r'^\s*(true|false|-?\d+)\s*(?::|$)', text)
    if m:
        t = m.group(1)
        return True if t == "true" else False if t == "false" else int(t)
    try:
        return float(text.split(":")[0])
    except ValueError:
        return None


def _int_attr(attr, default: int) -> int:
    if attr is None:
        return default
    try:
        return int(attr.value)
    except Exception:
        return default
