"""The profiling worker: a process that compiles StableHLO modules with XLA and times them, one at a time.

It runs apart from the caller so that jax's x64 mode and XLA's flags never leak into it, and so that
XLA crashing or hanging on a module cannot take the caller down (the caller kills it instead).

Protocol (one JSON object per line; the worker's lines start with ``@@ `` so stray output of XLA is
ignored):

* worker → ``{"event": "ready", "backend", "device_kind", "cores", "platform_version", "jax_version",
  "overhead_s"}`` once jax is up (``overhead_s``: one execution of a trivial module, the dispatch cost
  every timed execution carries);
* caller → ``{"id", "text", "lock", "lock_timeout_s", "measure_s", "min_repeats", "max_repeats",
  "target_noise", "sample_s", "seed"}``;
* worker → ``{"id", "event": "locked", "lock_wait_s"}`` when it holds the timing lock (a file lock, so
  no two processes on the machine time at once), then ``{"id", "event": "result", ...}`` with
  :func:`profile`'s fields, or ``{"id", "event": "result", "error", "kind"}`` (``kind``: ``lock``,
  ``compile``, ``inputs``, ``run``).
* A batch: the same request with ``"texts"`` (a list) in place of ``"text"`` and ``"threads"``. The worker
  takes the lock, compiles every module on that many threads (``{"id", "event": "compiled"}`` when all
  are), then times them one after another, each ``{"id", "event": "result", "index", ...}`` as it ends.
  Compiling never overlaps a timing: XLA:GPU autotunes on the device and XLA:CPU compiles on the cores
  being timed.

Timing (:func:`measure`): one warm-up execution (two more when they are cheap), then *samples*, each
the mean of ``calls`` back-to-back executions (enough for a sample to last ``sample_s``, so short modules
are not drowned in timer and dispatch jitter), until the spread is small and settled, or the spread
itself has settled, or ``measure_s`` is spent, or ``max_repeats`` samples are taken.

On the CPU every execution is waited for (``timing: blocking``). On a GPU the executions of a sample are
queued back to back and the sample ends when the last one has finished (``timing: pipelined``): the
device runs them as it runs a program's kernels, one after another on its stream, and the host's
dispatch overlaps the device's work instead of adding to it. A label still carries the dispatch cost of
one execution where the kernel is shorter than it; ``overhead_s`` (a trivial module timed the same way)
says how much that is.
"""
from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from ..host import package_version

CORES_ENV = "HESPAS_ML_PROFILE_CORES"     # set by the parent: run on that many cores (see pin_cores)
TRIVIAL_MODULE = """func.func @main(%a: tensor<f32>) -> tensor<f32> {
  %0 = stablehlo.add %a, %a : tensor<f32>
  return %0 : tensor<f32>
}"""


def send(message: dict[str, Any]) -> None:
    sys.stdout.write("@@ " + json.dumps(message) + "\n")
    sys.stdout.flush()


def numpy_dtype(element: str):
    """The numpy dtype of an MLIR element type spelling (``f32``, ``bf16``, ``i1``, ``ui8`` …)."""
    import ml_dtypes
    import numpy as np

    fixed = {"f64": np.float64, "f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16,
             "i1": np.bool_, "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64,
             "ui8": np.uint8, "ui16": np.uint16, "ui32": np.uint32, "ui64": np.uint64,
             "complex<f32>": np.complex64, "complex<f64>": np.complex128,
             "i4": ml_dtypes.int4, "ui4": ml_dtypes.uint4, "i2": ml_dtypes.int2, "ui2": ml_dtypes.uint2}
    if element in fixed:
        return np.dtype(fixed[element])
    if element.startswith("f8") or element.startswith(("f4", "f6")):   # f8E4M3FN -> float8_e4m3fn
        name = "float" + element[1] + "_" + element[2:].lower()
        if hasattr(ml_dtypes, name):
            return np.dtype(getattr(ml_dtypes, name))
    raise ValueError(f"no numpy type for element type {element}")


def random_array(shape: tuple[int, ...], element: str, rng, index_bound: int | None = None):
    """Random contents for a parameter: floats in [0.5, 1.5) (no NaNs from log/sqrt, no denormals),
    random booleans, and integers uniform in [0, ``index_bound``) for a parameter that indexes a gather
    or scatter (:func:`index_bounds`), else in [1, 4) (valid small indices, no division by zero). Indices
    spread over their whole range matter: a scatter-add whose indices all fall on three rows serialises
    its atomic updates on a GPU, many times slower than an embedding gradient over real tokens."""
    import numpy as np

    dtype = numpy_dtype(element)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.complexfloating):
        return (rng.random(shape) + 0.5 + 1j * rng.random(shape)).astype(dtype)
    if dtype.kind in "iu" or element.startswith(("i", "ui")):
        if index_bound is not None:
            return rng.integers(0, index_bound, size=shape).astype(dtype)
        return rng.integers(1, 4, size=shape).astype(dtype)
    return (rng.random(shape, dtype=np.float32) + 0.5).astype(dtype)


# ops whose result carries its index operands' values on (reshaped, converted, picked or offset): an
# index traced back through them is still the same index
_INDEX_CARRIERS = {"stablehlo.convert": None, "stablehlo.reshape": None, "stablehlo.broadcast_in_dim": None,
                   "stablehlo.transpose": None, "stablehlo.slice": None, "stablehlo.concatenate": None,
                   "stablehlo.select": (1, 2), "stablehlo.clamp": (1,), "stablehlo.add": None,
                   "stablehlo.subtract": None, "stablehlo.dynamic_slice": (0,)}


def _index_extent(op) -> int | None:
    """How many valid start positions the indices of a gather or scatter address (the smallest over
    the operand dimensions they index), or None."""
    from jax.extend.mlir import ir
    from jax.extend.mlir.dialects import stablehlo as sh

    name = op.name
    operand = ir.RankedTensorType(op.operands[0].type)
    if name == "stablehlo.gather":
        dims = sh.GatherDimensionNumbers(op.attributes["dimension_numbers"])
        sizes = list(ir.DenseI64ArrayAttr(op.attributes["slice_sizes"]))
        extents = [operand.shape[d] - sizes[d] + 1 for d in dims.start_index_map]
    elif name == "stablehlo.scatter":
        dims = sh.ScatterDimensionNumbers(op.attributes["scatter_dimension_numbers"])
        updates = ir.RankedTensorType(op.operands[-1].type)
        window = [d for d in range(operand.rank) if d not in set(dims.inserted_window_dims)
                  and d not in set(getattr(dims, "input_batching_dims", []) or [])]
        size = {d: updates.shape[u] for d, u in zip(window, dims.update_window_dims)}
        extents = [operand.shape[d] - size.get(d, 1) + 1 for d in dims.scattered_dims_to_operand_dims]
    else:
        return None
    return max(1, min(extents)) if extents else None


def may_index(text: str) -> bool:
    """Whether a module holds a gather or scatter (whose indices :func:`index_bounds` may trace to its
    parameters)."""
    return "stablehlo.gather" in text or "stablehlo.scatter" in text


def index_bounds(text: str) -> dict[int, int]:
    """The parameters of ``@main`` that index a gather or scatter, each with how many values are valid
    indices there: the index operands are traced back through the ops that carry indices on
    (:data:`_INDEX_CARRIERS`), across calls into and out of private functions, to ``@main``'s
    parameters. A parameter that indexes several places gets the smallest count."""
    from jax.extend.mlir import ir
    from jax.interpreters import mlir as jmlir

    bounds: dict[int, int] = {}
    with jmlir.make_ir_context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        funcs = {op.operation.attributes["sym_name"].value: op.operation for op in module.body.operations
                 if op.operation.name == "func.func"}
        calls: dict[str, list] = {}
        uses: list[tuple[Any, int]] = []

        def walk(operation) -> None:
            for region in operation.regions:
                for block in region.blocks:
                    for child in block.operations:
                        child = child.operation
                        if child.name == "func.call":
                            calls.setdefault(child.attributes["callee"].value, []).append(child)
                        elif child.name in ("stablehlo.gather", "stablehlo.scatter"):
                            extent = _index_extent(child)
                            if extent is not None:
                                uses.append((child.operands[1], extent))
                        walk(child)

        for f in funcs.values():
            walk(f)
        main = funcs.get("main")
        for start, extent in uses:
            seen: set = set()
            todo = [start]
            while todo:
                value = todo.pop().maybe_downcast()
                if value in seen or len(seen) > 10_000:
                    continue
                seen.add(value)
                if isinstance(value, ir.BlockArgument):
                    arg = value
                    owner = arg.owner.owner.operation
                    if owner.name != "func.func" or arg.owner.region.blocks[0] != arg.owner:
                        continue
                    name = owner.attributes["sym_name"].value
                    if owner == main:
                        bounds[arg.arg_number] = min(extent, bounds.get(arg.arg_number, extent))
                    for call in calls.get(name, []):
                        todo.append(call.operands[arg.arg_number])
                    continue
                if not isinstance(value, ir.OpResult):
                    continue
                result = value
                op = result.owner.operation
                if op.name == "func.call":
                    callee = funcs.get(op.attributes["callee"].value)
                    if callee is not None:
                        ret = callee.regions[0].blocks[0].operations[-1].operation    # its return
                        todo.append(ret.operands[result.result_number])
                elif op.name in _INDEX_CARRIERS:
                    picked = _INDEX_CARRIERS[op.name]
                    todo.extend(op.operands[i] for i in (picked or range(len(op.operands))))
    return bounds


def feedable(text: str) -> tuple[str, list[tuple[tuple[int, ...], str]]]:
    """``text`` with a ``@main`` that takes only tensors (tuple parameters are rebuilt from their
    elements, tokens are made inside), and the ``(shape, element type)`` of each parameter."""
    from jax.extend.mlir import ir
    from jax.extend.mlir.dialects import func
    from jax.extend.mlir.dialects import stablehlo as sh
    from jax.interpreters import mlir as jmlir

    with jmlir.make_ir_context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        main = next(op for op in module.body.operations
                    if op.operation.name == "func.func" and op.operation.attributes["sym_name"].value == "main")
        ftype = ir.FunctionType(ir.TypeAttr(main.operation.attributes["function_type"]).value)
        inputs = list(ftype.inputs)
        if all(isinstance(t, ir.RankedTensorType) for t in inputs):
            return text, [(tuple(t.shape), str(t.element_type)) for t in inputs]
        leaves: list = []

        def flatten(t) -> None:
            if isinstance(t, ir.TupleType):
                for i in range(t.num_types):
                    flatten(t.get_type(i))
            elif isinstance(t, ir.RankedTensorType):
                leaves.append(t)
            elif "token" not in str(t):
                raise ValueError(f"cannot make a parameter of type {t}")

        for t in inputs:
            flatten(t)
        main.operation.attributes["sym_name"] = ir.StringAttr.get("region_body")
        main.operation.attributes["sym_visibility"] = ir.StringAttr.get("private")
        with ir.InsertionPoint(module.body):
            wrapper = func.FuncOp("main", (leaves, list(ftype.results)))
            block = wrapper.add_entry_block()
        with ir.InsertionPoint(block):
            args = iter(block.arguments)

            def build(t):
                if isinstance(t, ir.TupleType):
                    return sh.TupleOp([build(t.get_type(i)) for i in range(t.num_types)]).result
                if isinstance(t, ir.RankedTensorType):
                    return next(args)
                return sh.AfterAllOp([]).result

            call = func.CallOp(list(ftype.results), ir.FlatSymbolRefAttr.get("region_body"),
                               [build(t) for t in inputs])
            func.ReturnOp(list(call.results))
        module.operation.verify()
        return str(module), [(tuple(t.shape), str(t.element_type)) for t in leaves]


def looped(text: str, times: int) -> str:
    """``text`` (a module whose ``@main`` takes and returns tensors only, as :func:`feedable` leaves it)
    with a ``@main`` that runs the old one ``times`` + 1 times in one execution: once, then ``times`` more
    in a ``while`` loop, so a timing pays one launch for all of them. Each pass takes the parameters
    through an ``optimization_barrier``, which keeps XLA from hoisting the loop-invariant work out of the
    loop, and its results replace the last pass's (they are what the program returns)."""
    from jax.extend.mlir import ir
    from jax.interpreters import mlir as jmlir

    with jmlir.make_ir_context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        main = next(op for op in module.body.operations
                    if op.operation.name == "func.func" and op.operation.attributes["sym_name"].value == "main")
        ftype = ir.FunctionType(ir.TypeAttr(main.operation.attributes["function_type"]).value)
        params = [str(t) for t in ftype.inputs]
        results = [str(t) for t in ftype.results]
        main.operation.attributes["sym_name"] = ir.StringAttr.get("region_body")
        main.operation.attributes["sym_visibility"] = ir.StringAttr.get("private")
        body = str(module)
    if not params or not results:
        raise ValueError("a module without parameters or results cannot be timed in a loop")
    n, m = len(params), len(results)
    ptypes, rtypes = ", ".join(params), ", ".join(results)
    args = ", ".join(f"%a{i}: {t}" for i, t in enumerate(params))
    carried = ", ".join([f"%x{i} = %a{i}" for i in range(n)] + [f"%y{j} = %first#{j}" for j in range(m)])
    xs = ", ".join(f"%x{i}" for i in range(n))
    bs = ", ".join(f"%b#{i}" for i in range(n))
    outs = ", ".join(f"%o#{j}" for j in range(m))
    wrapper = f"""
  func.func public @main({args}) -> ({rtypes}) {{
    %first:{m} = func.call @region_body({", ".join(f"%a{i}" for i in range(n))}) : ({ptypes}) -> ({rtypes})
    %c0 = stablehlo.constant dense<0> : tensor<i32>
    %w:{1 + n + m} = stablehlo.while(%i = %c0, {carried}) : tensor<i32>, {ptypes}, {rtypes}
     cond {{
      %k = stablehlo.constant dense<{times}> : tensor<i32>
      %p = stablehlo.compare LT, %i, %k, SIGNED : (tensor<i32>, tensor<i32>) -> tensor<i1>
      stablehlo.return %p : tensor<i1>
     }} do {{
      %one = stablehlo.constant dense<1> : tensor<i32>
      %next = stablehlo.add %i, %one : tensor<i32>
      %b:{n} = stablehlo.optimization_barrier {xs} : {ptypes}
      %o:{m} = func.call @region_body({bs}) : ({ptypes}) -> ({rtypes})
      stablehlo.return %next, {bs}, {outs} : tensor<i32>, {ptypes}, {rtypes}
     }}
    return {", ".join(f"%w#{1 + n + j}" for j in range(m))} : {rtypes}
  }}
"""
    end = body.rstrip().rfind("}")
    return body[:end] + wrapper + "}\n"


def _summary(samples: list[float]) -> dict[str, float]:
    import numpy as np

    q1, med, q3 = (float(x) for x in np.percentile(samples, [25, 50, 75]))
    return {"median_s": med, "iqr_s": q3 - q1, "q1_s": q1, "q3_s": q3, "min_s": float(min(samples)),
            "mean_s": float(np.mean(samples)), "repeats": len(samples)}


def measure(call: Callable[[], Any], measure_s: float, min_repeats: int, max_repeats: int,
            target_noise: float, sample_s: float, early_stop: bool = True,
            finish: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Time ``call`` (which blocks until its work is done) in about ``measure_s`` seconds at most.

    Warm-up, then samples of ``calls`` back-to-back calls each (a sample lasts about ``sample_s``).
    Once ``min_repeats`` samples are in, sampling stops when the spread is small and settled
    (IQR / median ≤ ``target_noise`` and the median moved by less than half of that since the previous
    sample: ``stable``), or when the figures themselves have settled on a noisy machine (between checks
    at ``min_repeats`` · 2^k samples the median moved by less than ``target_noise`` / 2 and the IQR by
    less than 10 % of the median: ``iqr_stable``), or after ``max_repeats`` samples. Once ``measure_s``
    of sampling is spent (counted after the warm-up, whose first call may hold one-off work such as a
    GPU library's plan selection) sampling stops (``measure_s``), with one sample at least.
    ``early_stop=False``: neither ``stable`` nor ``iqr_stable`` stops it (a minimum wants the whole window).
    ``finish``: ``call`` only queues its work and returns a handle; ``finish(handle)`` waits for it. The
    calls of a sample are then queued back to back and only the last one is waited for.
    """
    wait = finish or (lambda handle: handle)
    start = time.perf_counter()
    wait(call())
    first = time.perf_counter() - start
    warm = [first]
    while len(warm) < 3 and sum(warm) < min(0.05, 0.1 * measure_s):
        t = time.perf_counter()
        wait(call())
        warm.append(time.perf_counter() - t)
    per_call = min(warm[1:]) if len(warm) > 1 else first
    calls = max(1, min(1_000_000, math.ceil(sample_s / max(per_call, 1e-7))))
    samples: list[float] = []
    last: float | None = None                         # median one sample ago
    at_check: dict[str, float] | None = None          # figures at the last checkpoint
    checkpoint = min_repeats
    stop = "max_repeats"
    begin = time.perf_counter()
    gc.disable()
    try:
        while len(samples) < max_repeats:
            t = time.perf_counter()
            handle = None
            for _ in range(calls):
                handle = call()
            wait(handle)
            samples.append((time.perf_counter() - t) / calls)
            n = len(samples)
            if time.perf_counter() - begin >= measure_s:
                stop = "measure_s"
                break
            if n < min_repeats or not early_stop:
                continue
            s = _summary(samples)
            med, iqr = s["median_s"], s["iqr_s"]
            if iqr <= target_noise * med and last is not None and abs(med - last) <= 0.5 * target_noise * med:
                stop = "stable"
                break
            last = med
            if n >= checkpoint:
                if at_check is not None and abs(med - at_check["median_s"]) <= 0.5 * target_noise * med \
                        and abs(iqr - at_check["iqr_s"]) <= 0.1 * med:
                    stop = "iqr_stable"
                    break
                at_check, checkpoint = s, 2 * checkpoint
    finally:
        gc.enable()
    result = _summary(samples)
    result.update(calls_per_sample=calls, warmup_s=first, measure_s=time.perf_counter() - begin, stop=stop,
                  load_avg=_load())
    return result


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


GPU_PLATFORMS = ("gpu", "cuda", "rocm")


@dataclass
class Compiled:
    """A module compiled for the profiler's device, and what its parameters are."""

    exe: Any
    params: list[tuple[tuple[int, ...], str]]
    compile_s: float
    index_bounds: dict[int, int] | str    # parameters that index a gather or scatter: how many values are
                                          # valid (or why the indices could not be traced)
    passes: int = 1                       # times one execution runs the module (:func:`looped`)


class Profiler:
    """jax's backend, and compiling + timing modules on its first device."""

    def __init__(self) -> None:
        import jax

        jax.config.update("jax_enable_x64", True)    # i64 / f64 parameters stay themselves
        from jax.extend import backend as jeb

        self.jax = jax
        self.backend = jeb.get_backend()
        self.device = self.backend.local_devices()[0]
        self.options = jeb.get_compile_options(num_replicas=1, num_partitions=1)
        self.pipelined = self.backend.platform in GPU_PLATFORMS
        self.overhead_s = self._overhead()
        self._pass_overhead: dict[int, float] = {}

    def describe(self) -> dict[str, Any]:
        """What the labels are measured on: backend, device, versions, cores, dispatch overhead."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        facts = {"backend": self.backend.platform, "device_kind": self.device.device_kind, "cores": cores,
                 "platform_version": self.backend.platform_version, "jax_version": self.jax.__version__,
                 "jaxlib_version": package_version("jaxlib"), "overhead_s": self.overhead_s,
                 "timing": "pipelined" if self.pipelined else "blocking"}
        for name in ("compute_capability", "core_count"):     # GPU devices only
            value = getattr(self.device, name, None)
            if value is not None:
                facts[name] = str(value)
        try:
            limit = (self.device.memory_stats() or {}).get("bytes_limit")
        except Exception:  # noqa: BLE001 - not every backend reports memory
            limit = None
        if limit:
            facts["memory_bytes"] = int(limit)
        return facts

    def _overhead(self, loop: int = 0) -> float:
        """The time one execution of :data:`TRIVIAL_MODULE` takes (with ``loop`` > 0: one pass of it
        looped as :func:`looped` loops a region, its share of the launch plus what the loop itself costs
        per pass)."""
        import numpy as np

        compiled = self.compile(TRIVIAL_MODULE, loop)
        args = [self.jax.device_put(np.float32(1.0), self.device)]
        call, finish = self._caller(compiled.exe, args)
        result = measure(call, 0.5, 5, 100, 0.05, 0.002, finish=finish)
        return result["median_s"] / compiled.passes

    def pass_overhead(self, loop: int) -> float:
        """:meth:`_overhead` of ``loop``, timed once per worker."""
        if loop not in self._pass_overhead:
            self._pass_overhead[loop] = self._overhead(loop)
        return self._pass_overhead[loop]

    def compile(self, text: str, loop: int = 0) -> Compiled:
        """Compile a module (tuple parameters flattened, see :func:`feedable`; with ``loop`` > 0 run
        ``loop`` + 1 times per execution, see :func:`looped`); raises ProfileError."""
        try:
            text, params = feedable(text)
            if loop:
                text = looped(text, loop)
        except Exception as exc:  # noqa: BLE001 - any failure is the module's, reported as a reason
            raise ProfileError("inputs", f"cannot feed the module: {_first_line(exc)}") from None
        try:
            bounds: dict[int, int] | str = index_bounds(text) if may_index(text) else {}
        except Exception as exc:  # noqa: BLE001 - timed on small indices, and the result says why
            bounds = f"cannot trace its indices: {_first_line(exc)}"
        t = time.perf_counter()
        try:
            exe = self.backend.compile_and_load(text, [self.device], self.options)
        except Exception as exc:  # noqa: BLE001
            raise ProfileError("compile", f"XLA cannot compile it: {_first_line(exc)}") from None
        return Compiled(exe, params, time.perf_counter() - t, bounds, loop + 1)

    def _caller(self, exe, args) -> tuple[Callable[[], Any], Callable[[Any], Any] | None]:
        """``(call, finish)`` for :func:`measure`: blocking on the CPU, queued on a GPU."""
        if self.pipelined:
            return (lambda: exe.execute(args)), self.jax.block_until_ready
        return (lambda: self.jax.block_until_ready(exe.execute(args))), None

    def run(self, compiled: Compiled, request: dict[str, Any]) -> dict[str, Any]:
        """Time a compiled module on random inputs: :func:`measure`'s fields, ``compile_s``, XLA's cost
        analysis (``xla_flops``, ``xla_bytes``); or ``error`` and ``kind``."""
        import numpy as np

        try:
            rng = np.random.default_rng(request.get("seed", 0))
            bounds = compiled.index_bounds if isinstance(compiled.index_bounds, dict) else {}
            args = [self.jax.device_put(random_array(shape, elem, rng, bounds.get(i)), self.device)
                    for i, (shape, elem) in enumerate(compiled.params)]
        except Exception as exc:  # noqa: BLE001
            return {"error": f"cannot make its inputs: {_first_line(exc)}", "kind": "inputs"}
        call, finish = self._caller(compiled.exe, args)
        try:
            result = measure(call, request["measure_s"], request["min_repeats"], request["max_repeats"],
                             request["target_noise"], request["sample_s"], request.get("early_stop", True),
                             finish=finish)
        except Exception as exc:  # noqa: BLE001
            return {"error": f"XLA failed running it: {_first_line(exc)}", "kind": "run"}
        finally:
            del args
        if compiled.passes > 1:                    # one execution ran the module that many times
            for key in ("median_s", "iqr_s", "q1_s", "q3_s", "min_s", "mean_s"):
                result[key] /= compiled.passes
            result["loop"] = compiled.passes - 1
            result["pass_overhead_s"] = self.pass_overhead(compiled.passes - 1)
        result["compile_s"] = compiled.compile_s
        if isinstance(compiled.index_bounds, dict):
            result["index_inputs"] = len(compiled.index_bounds)
        else:                                      # no index_inputs: the next device call times it again
            result["index_inputs_error"] = compiled.index_bounds
        result.update(_cost(compiled.exe))
        return result

    def profile(self, request: dict[str, Any]) -> dict[str, Any]:
        """Compile and time one module (``request["text"]``): :meth:`run`'s result, or ``error`` and
        ``kind``."""
        try:
            compiled = self.compile(request["text"], int(request.get("loop", 0)))
        except ProfileError as exc:
            return exc.result()
        return self.run(compiled, request)

    def compile_all(self, texts: list[str], threads: int, loop: int = 0) -> list[Compiled | ProfileError]:
        """Compile ``texts`` on ``threads`` threads (XLA compiles without holding Python's lock)."""
        def one(text: str) -> Compiled | ProfileError:
            try:
                return self.compile(text, loop)
            except ProfileError as exc:
                return exc

        if threads <= 1 or len(texts) <= 1:
            return [one(t) for t in texts]
        with ThreadPoolExecutor(max_workers=threads) as pool:
            return list(pool.map(one, texts))


class ProfileError(Exception):
    """A module that cannot be profiled: ``kind`` (``inputs``, ``compile``) and the reason."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason

    def result(self) -> dict[str, Any]:
        return {"error": self.reason, "kind": self.kind}


def _cost(exe) -> dict[str, float]:
    try:
        cost = exe.cost_analysis()
        if isinstance(cost, list):
            cost = cost[0] if cost else {}
        return {"xla_flops": float(cost.get("flops", 0.0)), "xla_bytes": float(cost.get("bytes accessed", 0.0))}
    except Exception:  # noqa: BLE001 - cost analysis is extra information only
        return {}


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return (lines[0] if lines else type(exc).__name__)[:400]


class TimingLock:
    """An exclusive ``flock`` on a file: held while a module is compiled and timed."""

    def __init__(self, path: str):
        self.path = path
        self.fd: int | None = None

    def acquire(self, timeout_s: float) -> float | None:
        """Seconds waited, or None when the lock stayed busy for ``timeout_s``."""
        import fcntl

        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        start = time.monotonic()
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return time.monotonic() - start
            except BlockingIOError:
                if time.monotonic() - start >= timeout_s:
                    self.release()
                    return None
                time.sleep(0.01)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)          # closing drops the flock
            self.fd = None


def pin_cores(env: str = CORES_ENV) -> None:
    """Run on the first N cores this process may use (N from ``$HESPAS_ML_PROFILE_CORES``), before jax
    starts: XLA:CPU sizes its thread pool by them."""
    wanted = os.environ.get(env)
    if wanted and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cpus[:max(1, int(wanted))])


def _serve_batch(profiler: Profiler, request: dict[str, Any], waited: float) -> None:
    """Compile every module of a batch request, then time them one by one (see the protocol above)."""
    rid = request["id"]
    compiled = profiler.compile_all(request["texts"], int(request.get("threads", 1)), int(request.get("loop", 0)))
    send({"id": rid, "event": "compiled"})
    for index, item in enumerate(compiled):
        result = item.result() if isinstance(item, ProfileError) else profiler.run(item, request)
        compiled[index] = None                       # free the executable once it is timed
        send({"id": rid, "event": "result", "index": index, "lock_wait_s": waited, **result})


def main() -> None:
    from ..ingest.bytecode_check import die_with_parent

    die_with_parent()
    pin_cores()
    profiler = Profiler()
    send({"event": "ready", **profiler.describe()})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        rid = request["id"]
        lock = TimingLock(request["lock"])
        waited = lock.acquire(request["lock_timeout_s"])
        if waited is None:
            send({"id": rid, "event": "result", "kind": "lock",
                  "error": f"the timing lock {request['lock']} stayed busy for {request['lock_timeout_s']:.0f} s"})
            continue
        try:
            send({"id": rid, "event": "locked", "lock_wait_s": waited})
            if "texts" in request:
                _serve_batch(profiler, request, waited)
                continue
            result = profiler.profile(request)
        finally:
            lock.release()
        result["lock_wait_s"] = waited
        send({"id": rid, "event": "result", **result})


if __name__ == "__main__":
    main()
