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
  ``source_target_pairs`` → list of ``[src, dst]``; ``channel_handle`` → ``{"handle", "type"}``.
  Ids are logical device ids (``replica * num_partitions + partition``): groups written in replica or
  partition ids are expanded to device ids following XLA's collective group modes, and an empty group
  list (= all participants) becomes the explicit groups. Ids outside the program's devices are an error;
* ``comparison_direction`` → ``"LT"`` …; other dialect attributes → their text;
* large constants are not kept: a constant's ``value`` is its scalar when it is a splat, else dropped;
* ops with reducer bodies (reduce, sort, scatter, all_reduce …) get ``body_ops`` = ops in the body and
  ``body_op_kinds`` = one list of op kinds per body region (terminators left out).

Bad input of any kind (not MLIR, truncated, dynamic shapes, missing ``main``, recursion …) raises
:class:`IngestError` with a one-line message. Inputs on which MLIR's C++ would crash or hang the process
are refused before parsing: text nested deeper than its recursive parser's stack allows, convolution
``dim_numbers`` that make it allocate in proportion to a dimension index, escaped names that are not
UTF-8 (the bindings abort converting a diagnostic that quotes them); untrusted bytecode is parsed
first by a checker child process, because the bytecode reader is not hardened against damage.

This module is the walker; its helpers live beside it: :mod:`.prevalidate` (checks before parsing),
:mod:`.bytecode_check` (the checker child), :mod:`.attributes` (decoded forms), :mod:`.device_groups`
(collective groups), :mod:`.trip_count` (loop trip counts), :mod:`.bindings` (the MLIR bindings). The
walker's ``hook_*`` methods let :mod:`.extract` re-walk a program and record the MLIR op behind each op id.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .attributes import SKIPPED_ATTRS, decode, int_attr
from .bindings import TERMINATORS, describe_mlir_error, line_of, mlir, text_of
from .bytecode_check import CHECKER
from .device_groups import MAX_DEVICES, DeviceGroups
from .errors import IngestError
from .graph import FUSED_ATTENTION_TARGETS, ROLES_ATTR, Loop, Op, OpGraph, TensorType
from .prevalidate import MAX_RANK, MAX_TEXT_NESTING, prevalidate
from .trip_count import EXACT_TRIP_STEPS, MAX_DERIVED_TRIPS, TripCounter

_mlir = mlir     # the bindings, imported on first use (also used by eval/bench_pipeline.py)

# Ops whose regions are reducer/comparator bodies: costed by the op itself, never inlined.
_BODY_OPS = {"stablehlo.reduce", "stablehlo.reduce_window", "stablehlo.select_and_scatter",
             "stablehlo.scatter", "stablehlo.sort", "stablehlo.all_reduce", "stablehlo.reduce_scatter",
             "stablehlo.map", "stablehlo.custom_call", "mhlo.reduce", "mhlo.sort", "mhlo.scatter",
             "mhlo.all_reduce", "mhlo.reduce_scatter", "mhlo.reduce_window"}
_TERMINATORS = TERMINATORS
# Ops inlined into their parent (their single region's block arguments are the op's operands).
_INLINED_REGION_OPS = {"mhlo.fusion", "sdy.manual_computation", "sdy.named_computation", "mpmd.fragment"}

MAX_INLINED_OPS = 5_000_000      # graph ops after inlining
MAX_VISITED_OPS = 20_000_000     # ops walked (incl. calls/terminators): bounds call-tree blow-ups
MAX_REGION_DEPTH = 100           # nested regions + calls while walking

__all__ = ["parse_file", "parse_module", "MAX_DERIVED_TRIPS", "EXACT_TRIP_STEPS", "MAX_INLINED_OPS",
           "MAX_VISITED_OPS", "MAX_TEXT_NESTING", "MAX_REGION_DEPTH", "MAX_DEVICES", "MAX_RANK"]


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


def parse_module(data: str | bytes, source: str = "<string>", name: str | None = None, *,
                 trusted: bool = False) -> OpGraph:
    """Ingest StableHLO given as text or MLIR bytecode. ``source`` names it in error messages.

    MLIR's bytecode reader can crash the process on damaged bytecode, so untrusted bytecode is first
    parsed by a checker child process (started once, ~1 s). ``trusted=True`` skips that for bytecode
    this machine produced itself (e.g. a checksummed zoo cache entry).
    """
    ctx, module = load_module(data, source, trusted=trusted)
    with ctx:
        if name is None and source != "<string>":
            name = Path(source).stem
        return run_ingester(_Ingester(module, source, name))


def load_module(data: str | bytes, source: str, *, trusted: bool = False):
    """``(context, module)``: ``data`` checked (see :func:`parse_module`) and parsed by MLIR."""
    data = prevalidate(data, source)
    if isinstance(data, bytes) and not trusted:
        problem = CHECKER.check(data)
        if problem is not None:
            raise IngestError(source, problem)
    jmlir, ir, _ = mlir()
    ctx = jmlir.make_ir_context()
    with ctx:
        try:
            module = ir.Module.parse(data)
        except ir.MLIRError as exc:
            raise IngestError(source, describe_mlir_error(exc)) from None
        except Exception as exc:  # the bindings raise plain errors for some bytecode failures
            first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
            raise IngestError(source, f"not a valid MLIR module ({first})") from None
    return ctx, module


def run_ingester(ingester: _Ingester) -> OpGraph:
    """Walk a parsed module (inside its context); every failure becomes one :class:`IngestError` line."""
    source = ingester.source
    try:
        return ingester.run()
    except IngestError:
        raise
    except RecursionError:
        raise IngestError(source, "regions or calls nested too deeply to walk") from None
    except Exception as exc:  # a defect of ours, not of the input: still one clean line
        raise IngestError(source, f"internal error while ingesting near {ingester.where} "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})"
                          ) from exc


class _Ingester:
    """One walk over a parsed module, inlining calls, fusions and loop bodies into a flat op list.

    The ``hook_*`` methods say what value each MLIR value stands for while walking (by default the id of
    the op producing it, ``-1`` for program inputs). :mod:`hespas_ml.ingest.extract` overrides them to
    record the MLIR operation behind every op id; they must never change the walk itself.
    """

    def __init__(self, module, source: str, name: str | None):
        _, self.ir, self.sh = mlir()
        self.module = module
        self.source = source
        self.name = name
        self.ops: list[Op] = []
        self.loops: list[Loop] = []
        self.warnings: list[str] = []
        self.funcs: dict[str, Any] = {}
        self.devices = DeviceGroups(source)
        self.trips = TripCounter(self.funcs)
        self.fusion_count = 0
        self.visited = 0
        self.call_stack: list[str] = []
        self.where_op = None                      # op being ingested, for internal-error messages
        self.main_op = -1                         # position in main's body of the top-level op being walked
        self._warned: set[str] = set()
        self._type_cache: dict = {}                # MLIR type -> its flattened TensorTypes
        self.main_args: dict = {}                  # main's block arguments -> their index
        self.local_inputs: dict[int, TensorType] = {}   # index -> the per-device type a shard_map body takes

    # -- entry ---------------------------------------------------------------------------------
    def run(self) -> OpGraph:
        mod_op = self.module.operation
        attrs = dict(self._attr_items(mod_op))
        devices = self.devices
        devices.replicas = self._count_attr(attrs, "mhlo.num_replicas")
        devices.partitions = self._count_attr(attrs, "mhlo.num_partitions")
        for op in self.module.body.operations:
            op = op.operation
            if op.name == "func.func":
                self.funcs[text_of(op.attributes["sym_name"])] = op
            elif op.name == "sdy.mesh":
                devices.read_mesh(op)
        main = self.funcs.get("main")
        if main is None:
            found = ", ".join("@" + n for n in sorted(self.funcs)) or "none"
            raise IngestError(self.source, f"has no 'main' function (functions found: {found[:200]})")
        if len(main.regions) == 0 or len(main.regions[0].blocks) == 0:
            raise IngestError(self.source, "'main' has no body (it is only a declaration)")
        # a mesh counts the devices where no count is declared, and where one device is (what jax.export
        # writes for a program over an abstract mesh: no device was there to count)
        if devices.meshes and ("mhlo.num_partitions" not in attrs or devices.replicas * devices.partitions == 1):
            devices.partitions = max(max(devices.mesh_size(m) for m in devices.meshes), devices.partitions)
        devices.implicit_devices = ("mhlo.num_replicas" not in attrs and "mhlo.num_partitions" not in attrs
                                    and not devices.meshes)
        if devices.replicas * devices.partitions > MAX_DEVICES:
            raise IngestError(self.source, f"declares {devices.replicas * devices.partitions} devices "
                              f"(more than {MAX_DEVICES})")
        block = main.regions[0].blocks[0]
        if len(main.regions[0].blocks) > 1:
            self.warn("'main' has more than one block; only the first is read")
        inputs = [self._tensor_type(a.type, main, f"argument {i} of main") for i, a in enumerate(block.arguments)]
        self.main_args = {a: i for i, a in enumerate(block.arguments)}
        env = dict(zip(block.arguments, self.hook_main_args(block)))
        self.call_stack = ["main"]
        outputs = self._walk_block(block, env, count=1, loop=None, fusion=None, path="main", depth=0)
        self.hook_escaping(outputs)
        if devices.inferred_devices:
            self.warn(f"module declares no device count; {devices.replicas} devices inferred from its "
                      "device groups")
        name = self.name or (text_of(attrs["sym_name"]) if "sym_name" in attrs else "") or "module"
        inputs = [self.local_inputs.get(i, t) for i, t in enumerate(inputs)]
        return OpGraph(name=name, ops=self.ops, loops=self.loops, num_replicas=devices.replicas,
                       num_partitions=devices.partitions, inputs=[t for t in inputs if t is not None],
                       outputs=outputs, warnings=self.warnings, source=self.source,
                       input_roles=self._input_roles(attrs, inputs))

    def _input_roles(self, attrs: dict, inputs: list) -> list[str] | None:
        """What each of main's arguments holds, from the ``hespas.argument_roles`` attribute the zoo writes
        (``"parameters:40,optimizer_state:80,batch:2"``); None when the module has none or it does not fit."""
        attr = attrs.get(ROLES_ATTR)
        if attr is None or any(t is None for t in inputs):
            return None
        roles: list[str] = []
        for part in text_of(attr).split(","):
            role, _, n = part.partition(":")
            if not n.isdigit():
                return None
            roles += [role.strip()] * int(n)
        return roles if len(roles) == len(inputs) else None

    def _count_attr(self, attrs: dict, key: str) -> int:
        attr = attrs.get(key)
        if attr is None:
            return 1
        value = int_attr(attr, None)
        if value is None or value < 1:
            raise IngestError(self.source, f"module attribute {key} = {str(attr)[:40]} is not a positive integer")
        if value > MAX_DEVICES:
            raise IngestError(self.source, f"module attribute {key} = {value} is more than {MAX_DEVICES} devices")
        return value

    def _attr_items(self, op) -> list[tuple[str, Any]]:
        """``(name, attribute)`` pairs of an op. Names that are not UTF-8 (only damaged bytecode has
        them) cannot be read safely one by one (the bindings abort), so such an op is refused."""
        try:
            return list(op.attributes.items())
        except (RuntimeError, UnicodeDecodeError):
            raise self.fail(op, "has an attribute whose name is not UTF-8 (damaged bytecode?)") from None

    def warn(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            self.warnings.append(message)

    @property
    def where(self) -> str:
        op = self.where_op
        return "the module" if op is None else f"{op.name} at {line_of(op)}"

    def fail(self, op, message: str) -> IngestError:
        return IngestError(self.source, f"{op.name} at {line_of(op)}: {message}")

    # -- hooks -----------------------------------------------------------------------------------
    def hook_main_args(self, block) -> list[int]:
        """What main's arguments stand for: program inputs (``-1``)."""
        return [-1] * len(block.arguments)

    def hook_bind_op(self, oid: int, op, operands: list[int], env: dict) -> None:
        """Bind the results of graph op ``oid`` (the MLIR ``op``, whose operands stand for ``operands``)."""
        for r in op.results:
            env[r] = oid

    def hook_loop_args(self, lid: int, block, carried: list[int]) -> list[int]:
        """What the block arguments of loop ``lid``'s body or condition stand for (``carried``: the
        values entering it)."""
        return carried

    def hook_region_args(self, op, block, ids: list[int]) -> list[int]:
        """What the block arguments of an inlined region op (``mhlo.fusion``, ``sdy.manual_computation``
        …) stand for, given what the op's operands stand for (``ids``)."""
        return ids

    def hook_region_results(self, op, ids: list[int]) -> list[int]:
        """What the results of an inlined region op stand for, given its region's returned values."""
        return ids

    def hook_unbound(self, value) -> int:
        """What a value stands for that no enclosing scope bound (``-1``)."""
        return -1

    def hook_escaping(self, ids: list[int]) -> None:
        """Values that leave the walk: main's results and the values a loop carries to its next trip."""

    # -- types -----------------------------------------------------------------------------------
    def _tensor_type(self, ty, op, what: str) -> TensorType | None:
        ir = self.ir
        if isinstance(ty, ir.RankedTensorType):
            if not ty.has_static_shape:
                dims = "x".join("?" if d < 0 else str(d) for d in ty.shape)
                raise IngestError(self.source, f"dynamic shape tensor<{dims}x{ty.element_type}> in {what} "
                                  f"({line_of(op)}); hespas-ml needs static shapes (export with concrete sizes)")
            return TensorType(tuple(ty.shape), str(ty.element_type))
        if isinstance(ty, ir.UnrankedTensorType):
            raise IngestError(self.source, f"unranked tensor type in {what} ({line_of(op)}); "
                              "hespas-ml needs static shapes")
        return None  # tokens, !stablehlo.token, scalars of other dialects …

    def _flat_types(self, ty, op, what: str, out: list[TensorType], depth: int = 0) -> None:
        if isinstance(ty, self.ir.TupleType):
            if depth > 32:
                raise self.fail(op, "tuple types nested too deeply")
            for i in range(ty.num_types):
                self._flat_types(ty.get_type(i), op, what, out, depth + 1)
            return
        t = self._tensor_type(ty, op, what)
        if t is not None:
            out.append(t)

    def _types(self, values, op, what: str) -> list[TensorType]:
        """Flattened tensor types of ``values``; MLIR uniques types, so each distinct one is converted once."""
        out: list[TensorType] = []
        cache = self._type_cache
        for v in values:
            ty = v.type
            hit = cache.get(ty)
            if hit is None:
                hit = []
                self._flat_types(ty, op, what, hit)
                cache[ty] = hit
            out.extend(hit)
        return out

    # -- walking ---------------------------------------------------------------------------------
    def _walk_block(self, block, env: dict, count: int, loop: int | None, fusion: int | None,
                    path: str, depth: int) -> list[int]:
        """Inline every op of ``block``; returns the producer ids of the block terminator's operands."""
        if depth > MAX_REGION_DEPTH:
            raise IngestError(self.source, f"regions and calls nested more than {MAX_REGION_DEPTH} deep at {path}")
        result: list[int] = []
        for pos, op in enumerate(block.operations):
            op = op.operation
            name = op.name
            if depth == 0:
                self.main_op = pos
            self.visited += 1
            if self.visited > MAX_VISITED_OPS:
                raise IngestError(self.source, f"more than {MAX_VISITED_OPS} ops walked while inlining calls "
                                  "(the call tree is too large)")
            if name in _TERMINATORS:
                result = [self._producer(v, env) for v in op.operands]
                continue
            self.where_op = op
            if name == "func.call":
                self._inline_function(op, self._symbol(op, "callee"), env, count, loop, fusion, path, depth)
            elif name in _INLINED_REGION_OPS and len(op.regions) == 1 and len(op.regions[0].blocks) == 1:
                fid = fusion
                if name == "mhlo.fusion" and fusion is None:
                    fid = self.fusion_count
                    self.fusion_count += 1
                inner = op.regions[0].blocks[0]
                if name == "sdy.manual_computation":      # main's arguments as one device holds them
                    for value, arg in zip(op.operands, inner.arguments):
                        if value in self.main_args:
                            self.local_inputs[self.main_args[value]] = self._tensor_type(arg.type, op, "argument")
                sub = dict(env)
                ids = [self._producer(v, env) for v in op.operands]
                sub.update(zip(inner.arguments, self.hook_region_args(op, inner, ids)))
                outs = self._walk_block(inner, sub, count, loop, fid, path, depth + 1)
                self._bind_results(op, self.hook_region_results(op, outs), env)
            elif name == "stablehlo.composite":
                self._inline_function(op, self._symbol(op, "decomposition"), env, count, loop, fusion, path, depth)
            elif name == "stablehlo.while":
                self._inline_while(op, env, count, loop, fusion, path, depth)
            elif name in ("stablehlo.case", "stablehlo.if"):
                self._inline_branches(op, env, count, loop, fusion, path, depth)
            else:
                self._add_op(op, env, count, loop, fusion, path)
            if len(self.ops) > MAX_INLINED_OPS:
                raise IngestError(self.source, f"more than {MAX_INLINED_OPS} ops after inlining calls")
        return result

    def _symbol(self, op, key: str) -> str:
        value = text_of(op.attributes[key]) if key in op.attributes else None
        if not value:
            raise self.fail(op, f"has no symbol in its '{key}' attribute")
        return value

    def _producer(self, value, env: dict) -> int:
        pid = env.get(value)
        if pid is None:   # a value from an enclosing scope we did not bind (e.g. a constant captured by a body)
            return self.hook_unbound(value)
        return pid

    def _bind_results(self, op, producer_ids: list[int], env: dict) -> None:
        for i, r in enumerate(op.results):
            env[r] = producer_ids[i] if i < len(producer_ids) else (producer_ids[-1] if producer_ids else -1)

    def _inline_function(self, op, callee: str, env, count, loop, fusion, path, depth) -> None:
        func = self.funcs.get(callee)
        if func is None:
            raise IngestError(self.source, f"call to undefined function @{callee} ({line_of(op)})")
        if callee in self.call_stack:
            cycle = " -> ".join("@" + f for f in self.call_stack[self.call_stack.index(callee):] + [callee])
            raise IngestError(self.source, f"recursive call {cycle} ({line_of(op)}); "
                              "recursion cannot be inlined")
        if not func.regions or not func.regions[0].blocks:
            self.warn(f"call to external function @{callee} has no body; counted as nothing")
            self._bind_results(op, [], env)
            return
        block = func.regions[0].blocks[0]
        sub = {arg: self._producer(v, env) for arg, v in zip(block.arguments, op.operands)}
        self.call_stack.append(callee)
        try:
            outs = self._walk_block(block, sub, count, loop, fusion, f"{path}/{callee}", depth + 1)
        finally:
            self.call_stack.pop()
        self._bind_results(op, outs, env)

    def _inline_while(self, op, env, count, loop, fusion, path, depth) -> None:
        init = [self._producer(v, env) for v in op.operands]
        trips = self.trips.trip_count(op, init)
        derived = trips is not None
        if not derived:
            self.warn(f"while loop at {line_of(op)} in {path}: trip count not derivable, counted once")
            trips = 1
        lid = len(self.loops)
        self.loops.append(Loop(lid, trips, derived, loop, path))
        cond, body = op.regions[0].blocks[0], op.regions[1].blocks[0]
        sub = dict(env)
        sub.update(zip(body.arguments, self.hook_loop_args(lid, body, init)))
        outs = self._walk_block(body, sub, count * trips, lid, fusion, path, depth + 1)
        self.hook_escaping(outs)
        csub = dict(env)
        csub.update(zip(cond.arguments, self.hook_loop_args(lid, cond, outs or init)))
        decision = self._walk_block(cond, csub, count * (trips + 1) if derived else count, lid, fusion, path,
                                    depth + 1)
        self.hook_escaping(decision)
        self._bind_results(op, outs or init, env)

    def _inline_branches(self, op, env, count, loop, fusion, path, depth) -> None:
        """Conditionals: inline the branch with the largest estimated cost (one branch runs)."""
        branches = [r.blocks[0] for r in op.regions if len(r.blocks)]
        if not branches:
            self._bind_results(op, [], env)
            return
        costs = [self._block_cost(b, 0) for b in branches]
        pick = int(np.argmax(costs))
        if len(branches) > 1:
            self.warn(f"conditional at {line_of(op)} in {path}: {len(branches)} branches, "
                      f"the costliest (branch {pick}) is counted")
        outs = self._walk_block(branches[pick], dict(env), count, loop, fusion, path, depth + 1)
        self._bind_results(op, outs, env)

    def _block_cost(self, block, depth: int) -> float:
        """Rough work of a block: elements produced, times the contraction size of dots/convolutions;
        calls and nested regions included (loops counted once)."""
        if depth > 16:
            return 0.0
        total = 0.0
        for op in block.operations:
            op = op.operation
            if op.name in _TERMINATORS:
                continue
            if op.name == "func.call":
                f = self.funcs.get(text_of(op.attributes["callee"])) if "callee" in op.attributes else None
                if f is not None and f.regions and f.regions[0].blocks:
                    total += self._block_cost(f.regions[0].blocks[0], depth + 1)
                continue
            for region in op.regions:
                for b in region.blocks:
                    total += self._block_cost(b, depth + 1)
            produced = sum(_numel(r.type, self.ir) for r in op.results)
            total += produced * _contraction(op)
        return total

    def _add_op(self, op, env, count, loop, fusion, path) -> None:
        name = op.name
        oid = len(self.ops)
        operands = [self._producer(v, env) for v in op.operands]
        operand_types = self._types(op.operands, op, f"an operand of {name}")
        result_types = self._types(op.results, op, f"the result of {name}")
        attrs = self._decode_attrs(op)
        if name in _BODY_OPS and op.regions:
            kinds = [[o.operation.name.split(".", 1)[-1] for b in r.blocks for o in b.operations
                      if o.operation.name not in _TERMINATORS] for r in op.regions]
            attrs["body_ops"] = sum(len(k) for k in kinds)
            attrs["body_op_kinds"] = kinds
        if "replica_groups" in attrs or "source_target_pairs" in attrs:
            self.devices.resolve(op, name.split(".", 1)[-1], attrs)
        if name == "stablehlo.custom_call" and attrs.get("call_target_name") not in FUSED_ATTENTION_TARGETS:
            target = attrs.get("call_target_name", "?")
            self.warn(f"custom_call @{target} is not modelled (counted, costed as its memory traffic only)")
        self.ops.append(Op(oid, name, operands, operand_types, result_types, attrs, count, loop, fusion, path,
                           main_op=self.main_op))
        self.hook_bind_op(oid, op, operands, env)
        self.trips.fold(oid, name, operands, attrs, result_types)

    # -- attributes ------------------------------------------------------------------------------
    def _decode_attrs(self, op) -> dict[str, Any]:
        out: dict[str, Any] = {}
        name = op.name
        for key, attr in self._attr_items(op):
            if key in SKIPPED_ATTRS:
                continue
            if key == "replica_groups":
                out[key] = self.devices.replica_groups(op, attr)
                continue
            try:
                out[key] = decode(key, attr, name)
            except Exception:  # an attribute we cannot decode is kept as text, never fatal
                out[key] = str(attr)
        if name == "stablehlo.dot" and op.operands:
            lhs = op.operands[0].type
            rank = len(lhs.shape) if isinstance(lhs, self.ir.RankedTensorType) else 1
            out["dot_dimension_numbers"] = {"lhs_batch": [], "rhs_batch": [],
                                            "lhs_contract": [rank - 1] if rank else [], "rhs_contract": [0]}
        return out


def _numel(ty, ir) -> int:
    if isinstance(ty, ir.RankedTensorType) and ty.has_static_shape:
        return int(np.prod(ty.shape, dtype=object)) if ty.shape else 1
    return 0


def _contraction(op) -> int:
    """Multiply-adds per result element of a dot or convolution (1 for other ops)."""
    try:
        if op.name in ("stablehlo.dot_general", "stablehlo.dot", "stablehlo.convolution") and op.operands:
            lhs, rhs = op.operands[0].type, op.operands[-1].type
            if op.name == "stablehlo.dot":
                return max(1, lhs.shape[-1]) if lhs.shape else 1
            if op.name == "stablehlo.dot_general":
                dims = decode("dot_dimension_numbers", op.attributes["dot_dimension_numbers"], op.name)
                return max(1, int(np.prod([lhs.shape[d] for d in dims["lhs_contract"]], dtype=object)))
            dims = decode("dimension_numbers", op.attributes["dimension_numbers"], op.name)
            kernel = int(np.prod(rhs.shape, dtype=object))
            return max(1, kernel // max(1, rhs.shape[dims["kernel_output_feature"]]))
    except Exception:
        pass
    return 1
