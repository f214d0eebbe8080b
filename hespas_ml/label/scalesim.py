"""The SCALE-Sim fidelity: matrix work timed cycle by cycle on the target's systolic arrays.

**Matrix ops → GEMMs** (:func:`matrix_work`). Every matrix op becomes a list of :class:`GemmWork`, each
``count`` identical GEMMs ``[M, K] · [K, N]``; the right operand is the one held in the array (SCALE-Sim's
"filter"):

* ``dot_general`` / ``dot``: ``count`` = product of the batch dims, ``M`` = lhs free dims, ``N`` = rhs
  free dims, ``K`` = contracting dims.
* ``convolution``: im2col. ``M`` = batch × output positions, ``K`` = input features per group × kernel
  taps, ``N`` = output features per group; ``feature_group_count`` × ``batch_group_count`` groups are
  independent GEMMs (depthwise: one per channel). Strides and ``rhs_dilation`` only decide which inputs a
  window reads. Taps that land in padding or in the holes of an lhs (base) dilation are not computed:
  along each spatial dim the outputs are grouped by the set of taps that read real input (interior
  outputs all taps; border outputs fewer; for an lhs dilation ``d`` the outputs fall into ``d`` phases,
  each with about 1/d of the taps — the "sub-pixel" decomposition of backward-data convolutions), and
  each combination of groups is one GEMM. Backward-filter convolutions need nothing special: their
  dimension numbers already make ``M`` = input features × kernel positions, ``K`` = batch × output
  positions.
* ``ragged_dot``: ``g`` groups of ``m / g`` rows each against one ``[K, N]`` matrix (uniform groups).
* ``cholesky`` / ``triangular_solve`` are not GEMMs: they keep the roofline's matrix rate.

So the mapping's FLOPs equal ``op_cost(op).flops`` (XLA's count) exactly, for every dot and convolution.

**Several arrays** (``Systolic.count``): each :class:`GemmWork` runs on all arrays at once, split three
ways at most — its ``count`` (independent GEMMs), its ``N`` (each array holds a slice of the weights) and
its ``M`` (each array streams a slice of the rows against a copy of the weights), never ``K`` (that would
need a reduction across arrays). Of the factorisations ``count = b · n · m`` the one with the fewest
cycles on the busiest array is taken (:func:`split_work`); ties prefer splitting ``count``, then ``N``.
The busiest array's GEMM is what is simulated, and its cycles × its share of ``count`` are the op's.

**Cycles → seconds.** ``cycles × passes / clock``, where ``passes`` = the arrays' nominal rate
(``2 · rows · cols · count · clock``) over the target's matrix rate for the op's element type (e.g. 6 for
f32 at precision HIGHEST on a TPU: six bf16 passes), snapped to an integer within 2 %.

**A kernel's time** (the same structure as :func:`hespas_ml.label.roofline.kernel_seconds`)::

    matrix_s = Σ GEMM cycles × passes / clock   (+ roofline time of matrix ops that are no GEMM)
    vector_s = (vector FLOPs + 4 × transcendentals) / vector peak of the kernel's element type
    memory_s = max(kernel boundary bytes, DRAM bytes SCALE-Sim moved in ``full`` mode) / mem_bw
    seconds  = max(matrix_s + vector_s, memory_s)

so a fused epilogue runs after the array work on the vector unit and the kernel is bound by whichever of
compute and memory is slower. With a 100 %-utilised array this is the roofline label (up to the rounding
of ``passes``).

**Modes, budget and caching.** Each distinct (per-array GEMM, array config) is a *layer*, simulated once
per :class:`LayerCache` (an in-process LRU shared by all fidelities, plus JSON files under
``$HESPAS_ML_CACHE/scalesim/``). A layer runs ``full`` when :func:`~.scalesim_worker.choose_mode`
predicts it fits the :class:`~.scalesim_worker.Budget`, else ``compute-only``, else ``analytical-tail``
(the exact fold formula of SCALE-Sim's compute cycles). SCALE-Sim runs in worker processes; a time or
memory overrun falls back to the next mode (``meta["fallbacks"]`` says why), while a crash, a kill or an
error gives a failed label with its reason. With ``analytical_tail=False`` a layer that no SCALE-Sim mode
can do in budget fails instead.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

from ..ingest.graph import DTYPE_BYTES, Op
from ..costs import op_cost
from .fidelity import FidelityError, Label
from .roofline import TRANSCENDENTAL_FLOPS
from .scalesim_worker import (ANALYTICAL, MODES, SIM_MODES, ArrayConfig, Budget, Gemm, analytical_cycles,
                              analytical_result, fits, run_isolated)
from ..host import cache_dir, package_version
from .targets import Systolic, Target

CACHE_VERSION = 1
GEMM_KINDS = frozenset({"dot_general", "dot", "convolution", "dynamic_conv", "ragged_dot"})
MODE_RANK = {mode: rank for rank, mode in enumerate(MODES)}      # full 0 < compute-only 1 < analytical 2


# ------------------------------------------------------------------------------------------ mapping

@dataclass(frozen=True)
class GemmWork:
    """``count`` identical, independent GEMMs (batch elements, groups, or tap groups of a convolution)."""

    count: int
    gemm: Gemm

    @property
    def macs(self) -> int:
        return self.count * self.gemm.macs


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def dot_work(op: Op) -> list[GemmWork]:
    """The GEMMs of a ``dot_general`` / ``dot`` (see the module docstring)."""
    lhs, rhs = op.operand_types[0].shape, op.operand_types[1].shape
    dims = op.attrs.get("dot_dimension_numbers") or {}
    lhs_batch, rhs_batch = list(dims.get("lhs_batch") or []), list(dims.get("rhs_batch") or [])
    lhs_contract = dims.get("lhs_contract")
    rhs_contract = dims.get("rhs_contract")
    if lhs_contract is None:
        lhs_contract = [len(lhs) - 1] if lhs else []
    if rhs_contract is None:
        rhs_contract = [0] if rhs else []
    count = _prod(lhs[d] for d in lhs_batch)
    k = _prod(lhs[d] for d in lhs_contract)
    m = _prod(lhs[d] for d in range(len(lhs)) if d not in lhs_batch and d not in lhs_contract)
    n = _prod(rhs[d] for d in range(len(rhs)) if d not in rhs_batch and d not in rhs_contract)
    if min(count, m, n, k) < 1:
        return []
    return [GemmWork(count, Gemm(m, n, k))]


@lru_cache(maxsize=4096)
def _tap_groups(size_in: int, outputs: int, taps: int, stride: int, pad_low: int, lhs_dil: int,
                rhs_dil: int) -> tuple[tuple[int, int], ...]:
    """Along one spatial dim: ((outputs, taps that read real input), …), one entry per distinct tap set.

    Output ``o`` reads the padded, lhs-dilated input at ``u = o·stride − pad_low + t·rhs_dil`` for tap
    ``t``; the tap reads a real element when ``0 ≤ u ≤ (size_in − 1)·lhs_dil`` and ``u`` is a multiple of
    ``lhs_dil``. Outputs reading the same set of taps form one GEMM; taps landing in padding or in
    dilation holes are not computed.
    """
    stride, lhs_dil, rhs_dil = max(stride, 1), max(lhs_dil, 1), max(rhs_dil, 1)
    last = (size_in - 1) * lhs_dil
    groups: dict[tuple[int, ...], int] = {}
    for o in range(outputs):
        start = o * stride - pad_low
        valid = tuple(t for t in range(taps)
                      if 0 <= start + t * rhs_dil <= last and (start + t * rhs_dil) % lhs_dil == 0)
        if valid:
            groups[valid] = groups.get(valid, 0) + 1
    return tuple((n_out, len(valid)) for valid, n_out in groups.items())


def conv_work(op: Op) -> list[GemmWork]:
    """The im2col GEMMs of a ``convolution`` (see the module docstring)."""
    a = op.attrs
    dn = a["dimension_numbers"]
    lhs, rhs, out = op.operand_types[0].shape, op.operand_types[1].shape, op.result_types[0].shape
    fgc = int(a.get("feature_group_count") or 1)
    bgc = int(a.get("batch_group_count") or 1)
    n_sp = len(dn["input_spatial"])
    strides = a.get("window_strides") or [1] * n_sp
    padding = a.get("padding") or [[0, 0]] * n_sp
    lhs_dil = a.get("lhs_dilation") or [1] * n_sp
    rhs_dil = a.get("rhs_dilation") or [1] * n_sp
    groups = fgc * bgc
    cin_g = lhs[dn["input_feature"]] // fgc
    cout_g = out[dn["output_feature"]] // groups
    batch_g = lhs[dn["input_batch"]] // bgc
    per_dim = [_tap_groups(int(lhs[dn["input_spatial"][i]]), int(out[dn["output_spatial"][i]]),
                           int(rhs[dn["kernel_spatial"][i]]), int(strides[i]), int(padding[i][0]),
                           int(lhs_dil[i]), int(rhs_dil[i])) for i in range(n_sp)]
    shapes: dict[tuple[int, int], int] = {}
    for combo in itertools.product(*per_dim):
        m, k = batch_g, cin_g
        for outputs, taps in combo:
            m *= outputs
            k *= taps
        shapes[(m, k)] = shapes.get((m, k), 0) + 1
    if min(cin_g, cout_g, batch_g) < 1:
        return []
    return [GemmWork(groups * c, Gemm(m, cout_g, k)) for (m, k), c in sorted(shapes.items())
            if m >= 1 and k >= 1]


def ragged_dot_work(op: Op) -> list[GemmWork]:
    """``ragged_dot`` (lhs ``[m, k]``, rhs ``[g, k, n]``) as ``g`` equal row groups."""
    lhs, rhs = op.operand_types[0].shape, op.operand_types[1].shape
    g, k, n = rhs[-3], rhs[-2], rhs[-1]
    m = lhs[-2]
    if min(g, k, n, m) < 1:
        return []
    return [GemmWork(g, Gemm(math.ceil(m / g), n, k))]


def matrix_work(op: Op) -> list[GemmWork] | None:
    """The GEMMs of a matrix op, or None when it is no GEMM (cholesky, triangular_solve) or its attributes
    cannot be read."""
    try:
        if op.kind in ("dot_general", "dot"):
            return dot_work(op)
        if op.kind in ("convolution", "dynamic_conv"):
            return conv_work(op)
        if op.kind == "ragged_dot":
            return ragged_dot_work(op)
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError):
        return None
    return None


def work_flops(works: Sequence[GemmWork]) -> float:
    """FLOPs of a mapping (2 per multiply-add), comparable with ``op_cost(op).flops``."""
    return 2.0 * sum(w.macs for w in works)


# ------------------------------------------------------------------------------------------ arrays

@dataclass(frozen=True)
class Split:
    """How one :class:`GemmWork` is spread over the arrays: ``count`` / ``N`` / ``M`` divided ``ways``,
    and what the busiest array runs (``per_array`` GEMMs of ``gemm``)."""

    ways: tuple[int, int, int]         # (count, N, M)
    per_array: int
    gemm: Gemm
    arrays_used: int


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def split_work(work: GemmWork, systolic: Systolic) -> Split:
    """The factorisation of ``systolic.count`` over (count, N, M) with the fewest cycles on the busiest
    array (see the module docstring). Ways beyond a dimension's size are cut to it (those arrays idle)."""
    arrays = systolic.count
    best: tuple[tuple[int, int, int], Split] | None = None
    for b in _divisors(arrays):
        for n in _divisors(arrays // b):
            m = arrays // (b * n)
            ways = (min(b, work.count), min(n, work.gemm.n), min(m, work.gemm.m))
            gemm = Gemm(math.ceil(work.gemm.m / ways[2]), math.ceil(work.gemm.n / ways[1]), work.gemm.k)
            per_array = math.ceil(work.count / ways[0])
            cycles = per_array * analytical_cycles(gemm, systolic.rows, systolic.cols, systolic.dataflow)
            rank = (cycles, ways[2], ways[1])
            if best is None or rank < best[0]:
                best = (rank, Split(ways, per_array, gemm, ways[0] * ways[1] * ways[2]))
    return best[1]


def require_systolic(target: Target) -> Systolic:
    """``target``'s systolic arrays; FidelityError if it has none (the scalesim fidelity needs them)."""
    if target.systolic is None:
        raise FidelityError(f"target {target.name} has no systolic arrays; the scalesim fidelity needs them")
    return target.systolic


def array_config(target: Target, dtype: str) -> ArrayConfig:
    """One of ``target``'s arrays for elements of ``dtype``: SRAM sizes in kilo-elements and the array's
    share of the memory bandwidth in elements per cycle (SCALE-Sim counts words, one element each)."""
    sa = require_systolic(target)
    elem = max(1, int(DTYPE_BYTES.get(dtype, 4)))
    bandwidth = target.mem_bw / target.clock_hz / sa.count / elem
    return ArrayConfig(rows=sa.rows, cols=sa.cols, dataflow=sa.dataflow,
                       ifmap_kwords=max(1, sa.ifmap_sram_kb // elem), filter_kwords=max(1, sa.filter_sram_kb // elem),
                       ofmap_kwords=max(1, sa.ofmap_sram_kb // elem), dram_words_per_cycle=max(1, round(bandwidth)))


def passes(target: Target, dtype: str) -> float:
    """Array passes per GEMM for ``dtype``: nominal array rate / the target's matrix rate for it."""
    sa = target.systolic
    nominal = 2.0 * sa.macs_per_cycle * target.clock_hz
    ratio = nominal / target.peak_flops(dtype, "matrix")
    nearest = round(ratio)
    return float(nearest) if nearest >= 1 and abs(ratio - nearest) <= 0.02 * ratio else ratio


# ------------------------------------------------------------------------------------------ caching

def layer_key(gemm: Gemm, array: ArrayConfig, mode: str) -> dict[str, Any]:
    """Everything a layer's result in ``mode`` depends on."""
    return {"v": CACHE_VERSION, "scalesim": package_version("scalesim"), "mode": mode,
            "gemm": [gemm.m, gemm.n, gemm.k], **array.key(mode)}


class LayerCache:
    """Results of simulated layers: an in-process LRU, backed by one JSON file per layer on disk.

    ``disk``: True for ``$HESPAS_ML_CACHE/scalesim`` (default ``~/.cache/hespas-ml/scalesim``, resolved at
    each access), a path for another folder, False for memory only. ``hits``/``disk_hits``/``stores``
    count what happened. It also remembers (in memory only) which layer overran which budget, so a
    mode that overran is not tried again under a budget no larger.
    """

    def __init__(self, maxsize: int = 4096, disk: bool | str | os.PathLike[str] = True):
        self.maxsize = maxsize
        self.disk = disk
        self._memory: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._overruns: dict[str, tuple[float, int]] = {}
        self.hits = self.disk_hits = self.stores = 0

    def directory(self) -> Path | None:
        if self.disk is False or self.disk is None:
            return None
        if self.disk is True:
            return cache_dir() / "scalesim"
        return Path(self.disk)

    @staticmethod
    def _digest(key: dict[str, Any]) -> str:
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]

    def get(self, key: dict[str, Any]) -> dict[str, Any] | None:
        digest = self._digest(key)
        if digest in self._memory:
            self._memory.move_to_end(digest)
            self.hits += 1
            return dict(self._memory[digest])
        folder = self.directory()
        if folder is None:
            return None
        try:
            stored = json.loads((folder / f"{digest}.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(stored, dict) or stored.get("key") != key or not isinstance(stored.get("result"), dict):
            return None
        self._remember(digest, stored["result"])
        self.disk_hits += 1
        return dict(stored["result"])

    def put(self, key: dict[str, Any], result: dict[str, Any]) -> None:
        digest = self._digest(key)
        self._remember(digest, dict(result))
        self.stores += 1
        folder = self.directory()
        if folder is None:
            return
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=digest, suffix=".tmp", dir=folder)
            with os.fdopen(fd, "w") as handle:
                json.dump({"key": key, "result": result}, handle)
            os.replace(tmp, folder / f"{digest}.json")
        except OSError:
            pass                      # a read-only cache folder only costs re-simulation

    def _remember(self, digest: str, result: dict[str, Any]) -> None:
        self._memory[digest] = result
        self._memory.move_to_end(digest)
        while len(self._memory) > self.maxsize:
            self._memory.popitem(last=False)

    def note_overrun(self, key: dict[str, Any], budget: Budget) -> None:
        """Remember that the layer ``key`` (which names its mode) overran ``budget``."""
        digest = self._digest(key)
        seconds, nbytes = self._overruns.get(digest, (0.0, 0))
        self._overruns[digest] = (max(seconds, budget.seconds), max(nbytes, budget.memory_bytes))

    def overran(self, key: dict[str, Any], budget: Budget) -> bool:
        """Whether ``key`` overran a budget at least as large as ``budget`` before."""
        seen = self._overruns.get(self._digest(key))
        return seen is not None and budget.seconds <= seen[0] and budget.memory_bytes <= seen[1]

    def clear_memory(self) -> None:
        self._memory.clear()
        self._overruns.clear()


_SHARED_CACHE = LayerCache()


# ------------------------------------------------------------------------------------------ fidelity

@dataclass
class _Layer:
    """One distinct simulation request and how it was resolved."""

    gemm: Gemm
    array: ArrayConfig
    chain: list[str]
    result: dict[str, Any] | None = None
    fallbacks: list[str] | None = None


class ScaleSimFidelity:
    """Region times from SCALE-Sim cycles of the matrix work plus the roofline of the rest.

    ``budget`` limits each SCALE-Sim call; ``mode`` is ``auto`` (predict per layer) or the mode to start
    from (``full`` / ``compute-only`` / ``analytical-tail``; overruns still fall back). ``workers``:
    SCALE-Sim calls at a time (default: half the cores, at least 1). ``cache``: a :class:`LayerCache`
    (default: the process-wide one, with its disk folder). ``on_worker_start(pid)`` sees each worker
    process start (for monitoring). ``stats`` counts layers simulated, served from cache, computed
    analytically and failed.

    Label metadata: ``mode`` (the least detailed mode among the region's GEMMs — ``full``,
    ``compute-only``, ``analytical-tail`` — or ``no-matrix``), ``cycles`` (array cycles of all GEMMs,
    passes included), ``utilization`` (the GEMMs' multiply-adds over ``cycles`` × MACs per cycle of all
    arrays), ``matrix_s`` / ``vector_s`` / ``memory_s`` / ``compute_s``, ``bound``, and ``gemms``: per
    GEMM its op id and kind, ``count`` × ``gemm`` [M, N, K], the ``split`` ways (count, N, M),
    ``per_array`` [GEMMs, M, N, K] of the busiest array, ``passes``, ``mode``, ``cycles``,
    ``layer_cycles`` (one simulated GEMM), ``stall_cycles``, SCALE-Sim's ``utilization`` of that GEMM,
    ``sim_seconds`` and ``peak_rss_bytes`` of its simulation, ``dram_bytes`` (``full``) and
    ``fallbacks`` (why more detailed modes were given up). A failed label has ``reason``.
    """

    name = "scalesim"
    RUN_OPTIONS = ("workers",)          # how many SCALE-Sim calls at a time: never what a label is

    def __init__(self, budget: Budget | None = None, mode: str = "auto", analytical_tail: bool = True,
                 workers: int | None = None, cache: LayerCache | None = None,
                 on_worker_start: Callable[[int], None] | None = None):
        if mode != "auto" and mode not in MODES:
            raise FidelityError(f"scalesim mode must be auto or one of {', '.join(MODES)}, got {mode!r}")
        if mode == ANALYTICAL and not analytical_tail:
            raise FidelityError("scalesim mode analytical-tail needs analytical_tail=True")
        self.budget = budget or Budget()
        self.mode = mode
        self.analytical_tail = analytical_tail
        self.workers = workers or max(1, (os.cpu_count() or 2) // 2)
        self.cache = cache if cache is not None else _SHARED_CACHE
        self.on_worker_start = on_worker_start
        self.stats = {"simulated": 0, "cached": 0, "analytical": 0, "failed": 0}

    @classmethod
    def from_options(cls, options: dict[str, Any], workers: int | None = None) -> "ScaleSimFidelity":
        """The labeller a dataset spec's ``scalesim`` options describe (``budget_s``, ``memory_gb``,
        ``mode``, ``analytical_tail``, ``workers``)."""
        budget = Budget(seconds=options.get("budget_s", Budget.seconds),
                        memory_bytes=int(options.get("memory_gb", Budget.memory_bytes / 2**30) * 2**30))
        return cls(budget=budget, mode=options.get("mode", "auto"),
                   analytical_tail=options.get("analytical_tail", True), workers=options.get("workers", workers))

    # -- public interface ---------------------------------------------------------------------------

    def planned_modes(self, regions: Sequence, target: Target) -> list[list[str]]:
        """Per region, the mode each of its GEMMs starts in under this labeller's budget and mode (what
        :meth:`label_regions` would try first, before any overrun), without running SCALE-Sim."""
        self.check_target(target)
        return [[self._chain(g["split"].gemm, g["array"])[0] for kernel in self._plan(region, target)
                 for g in kernel["gemms"]] for region in regions]

    def deeper_modes(self, regions: Sequence, target: Target, options: dict[str, Any]) -> list[list[str]]:
        """Per region, the ``"before -> after"`` mode changes (sorted, distinct) of the GEMMs this labeller
        starts in a more detailed mode than the labeller of ``options`` (:meth:`from_options`) would: e.g. a
        layer simulated in full here that a smaller budget simulated ``compute-only``. Runs no SCALE-Sim."""
        then = ScaleSimFidelity.from_options(options, workers=1).planned_modes(regions, target)
        now = self.planned_modes(regions, target)
        return [sorted({f"{b} -> {a}" for b, a in zip(before, after) if MODE_RANK[a] < MODE_RANK[b]})
                for before, after in zip(then, now)]

    def check_target(self, target: Target) -> None:
        """SCALE-Sim simulates systolic arrays: FidelityError for a target without them."""
        require_systolic(target)

    def provenance(self, target: Target) -> dict[str, Any]:
        return {"fidelity": self.name, "target": target.name, "scalesim": package_version("scalesim"),
                "mode": self.mode, "budget_s": self.budget.seconds, "memory_bytes": self.budget.memory_bytes,
                "analytical_tail": self.analytical_tail}

    def label(self, region, target: Target) -> Label:
        return self.label_regions([region], target)[0]

    def label_regions(self, regions: Sequence, target: Target) -> list[Label]:
        """Labels of ``regions`` (compute regions carrying ``region.graph``) on ``target``."""
        self.check_target(target)
        plans = [self._plan(region, target) for region in regions]
        layers: dict[tuple[Gemm, ArrayConfig], _Layer] = {}
        for plan in plans:
            for kernel in plan:
                for g in kernel["gemms"]:
                    key = (g["split"].gemm, g["array"])
                    if key not in layers:
                        layers[key] = _Layer(g["split"].gemm, g["array"], self._chain(*key))
        self._resolve(list(layers.values()))
        return [self._assemble(region, plan, layers, target) for region, plan in zip(regions, plans)]

    # -- planning -----------------------------------------------------------------------------------

    def _plan(self, region, target: Target) -> list[dict[str, Any]]:
        """Per kernel: its GEMMs (op, work, split, array, passes) and the matrix ops that are no GEMM."""
        graph = getattr(region, "graph", None)
        if graph is None:
            raise FidelityError(f"region {getattr(region, 'id', '?')} carries no op graph (region.graph); the "
                                f"scalesim fidelity needs the ops")
        ops = graph.ops
        plan = []
        for kernel in region.kernels:
            gemms, other_flops, other_dtype = [], 0.0, None
            for i in kernel.op_ids:
                op = ops[i]
                cost = op_cost(op)
                if cost.unit != "matrix":
                    continue
                works = matrix_work(op) if op.kind in GEMM_KINDS else None
                if works is None:
                    other_flops += cost.flops
                    other_dtype = other_dtype or op.dtype
                    continue
                array = array_config(target, op.dtype)
                for work in works:
                    gemms.append({"op": op, "work": work, "split": split_work(work, target.systolic),
                                  "array": array, "passes": passes(target, op.dtype)})
            plan.append({"kernel": kernel, "gemms": gemms, "other_flops": other_flops,
                         "other_dtype": other_dtype})
        return plan

    def _chain(self, gemm: Gemm, array: ArrayConfig) -> list[str]:
        """The modes to try for one layer, most detailed first."""
        if self.mode == "auto":
            start = next((m for m in SIM_MODES if fits(gemm, array, m, self.budget)), ANALYTICAL)
        else:
            start = self.mode
        chain = list(MODES[MODE_RANK[start]:])
        if not self.analytical_tail:
            chain = [m for m in chain if m != ANALYTICAL]
        return chain

    # -- resolving layers ---------------------------------------------------------------------------

    def _resolve(self, layers: list[_Layer]) -> None:
        """Give every layer a result: from cache, the formula, or SCALE-Sim (falling back on overruns)."""
        todo = list(layers)
        while todo:
            to_run: list[_Layer] = []
            for layer in todo:
                while layer.chain:
                    mode = layer.chain[0]
                    if mode == ANALYTICAL:
                        layer.result = analytical_result(layer.gemm, layer.array)
                        self.stats["analytical"] += 1
                        break
                    key = layer_key(layer.gemm, layer.array, mode)
                    hit = self.cache.get(key)
                    if hit is not None:
                        layer.result = hit
                        self.stats["cached"] += 1
                        break
                    if self.cache.overran(key, self.budget):
                        self._note(layer, f"{mode} skipped: it overran a budget at least this large before")
                        layer.chain.pop(0)
                        continue
                    to_run.append(layer)
                    break
                if not layer.chain and layer.result is None:
                    reasons = "; ".join(layer.fallbacks or []) or "no SCALE-Sim mode fits the budget"
                    layer.result = {"failed": True, "kind": "budget",
                                    "reason": f"over budget ({self.budget.seconds:g} s, "
                                              f"{self.budget.memory_bytes / 2**30:.3g} GiB): {reasons}"}
                    self.stats["failed"] += 1
            if not to_run:
                return
            on_start = None
            if self.on_worker_start is not None:
                on_start = lambda _index, pid: self.on_worker_start(pid)  # noqa: E731
            results = run_isolated([(x.gemm, x.array, x.chain[0]) for x in to_run], self.budget,
                                   self.workers, on_start)
            todo = []
            for layer, result in zip(to_run, results):
                mode = layer.chain[0]
                if not result.get("failed"):
                    self.cache.put(layer_key(layer.gemm, layer.array, mode), result)
                    layer.result = result
                    self.stats["simulated"] += 1
                elif result.get("kind") in ("time", "memory") and len(layer.chain) > 1:
                    self.cache.note_overrun(layer_key(layer.gemm, layer.array, mode), self.budget)
                    self._note(layer, result["reason"])
                    layer.chain.pop(0)
                    todo.append(layer)
                else:
                    if result.get("kind") in ("time", "memory"):
                        self._note(layer, result["reason"])
                    layer.result = result
                    self.stats["failed"] += 1

    @staticmethod
    def _note(layer: _Layer, reason: str) -> None:
        layer.fallbacks = [*(layer.fallbacks or []), reason]

    # -- labels -------------------------------------------------------------------------------------

    @staticmethod
    def _gemm_entry(g: dict[str, Any], layer: _Layer) -> dict[str, Any]:
        """Label metadata of one planned GEMM: shapes, split, and its layer's result scaled to the work
        (``cycles`` with the busiest array's share and the passes; ``dram_bytes`` per MAC of the work)."""
        split: Split = g["split"]
        work: GemmWork = g["work"]
        op = g["op"]
        entry: dict[str, Any] = {"op": op.id, "kind": op.kind, "count": work.count,
                                 "gemm": [work.gemm.m, work.gemm.n, work.gemm.k], "split": list(split.ways),
                                 "per_array": [split.per_array, split.gemm.m, split.gemm.n, split.gemm.k],
                                 "passes": g["passes"]}
        if layer.fallbacks:
            entry["fallbacks"] = list(layer.fallbacks)
        result = layer.result or {"failed": True, "reason": "not resolved"}
        if result.get("failed"):
            entry.update(mode="failed", reason=result.get("reason", "unknown"))
            return entry
        entry.update(mode=result["mode"], cycles=float(result["cycles"]) * split.per_array * g["passes"],
                     layer_cycles=result["cycles"], stall_cycles=result.get("stall_cycles", 0),
                     utilization=result.get("utilization"), sim_seconds=result.get("sim_seconds", 0.0))
        if "peak_rss_bytes" in result:
            entry["peak_rss_bytes"] = result["peak_rss_bytes"]
        if result["mode"] == "full":
            words = result["dram_ifmap_reads"] + result["dram_filter_reads"] + result["dram_ofmap_writes"]
            elem = max(1, int(DTYPE_BYTES.get(op.dtype, 4)))
            entry["dram_bytes"] = words * elem * work.macs / split.gemm.macs
        return entry

    def _assemble(self, region, plan: list[dict[str, Any]], layers, target: Target) -> Label:
        """A region's label from its kernels' plans and the resolved layers (module docstring)."""
        matrix_total = vector_total = memory_total = seconds = cycles_total = macs = 0.0
        entries: list[dict[str, Any]] = []
        for kernel_plan in plan:
            kernel = kernel_plan["kernel"]
            matrix_s = dram_bytes = 0.0
            for g in kernel_plan["gemms"]:
                entry = self._gemm_entry(g, layers[(g["split"].gemm, g["array"])])
                entries.append(entry)
                if entry["mode"] == "failed":
                    continue
                matrix_s += entry["cycles"] / target.clock_hz
                cycles_total += entry["cycles"]
                macs += g["work"].macs
                dram_bytes += entry.get("dram_bytes", 0.0)
            if kernel_plan["other_flops"]:
                matrix_s += kernel_plan["other_flops"] / target.peak_flops(kernel_plan["other_dtype"], "matrix")
            vector = kernel.vector_flops + TRANSCENDENTAL_FLOPS * kernel.transcendentals
            vector_s = vector / target.peak_flops(kernel.dtype, "vector") if vector else 0.0
            memory_s = max(kernel.bytes, dram_bytes) / target.mem_bw
            seconds += max(matrix_s + vector_s, memory_s)
            matrix_total += matrix_s
            vector_total += vector_s
            memory_total += memory_s
        failures = [f"op {e['op']} ({e['kind']} {'x'.join(map(str, e['gemm']))}): {e['reason']}"
                    for e in entries if e["mode"] == "failed"]
        if failures:
            return Label(math.nan, "failed", {"reason": "; ".join(failures), "mode": "failed", "gemms": entries,
                                              "budget": {"seconds": self.budget.seconds,
                                                         "memory_bytes": self.budget.memory_bytes}})
        modes = [e["mode"] for e in entries]
        compute = matrix_total + vector_total
        if memory_total > compute:
            bound = "memory"
        elif compute > 0:
            bound = "matrix" if matrix_total >= vector_total else "vector"
        else:
            bound = "none"
        meta: dict[str, Any] = {"mode": max(modes, key=MODE_RANK.__getitem__) if modes else "no-matrix",
                                "cycles": cycles_total, "matrix_s": matrix_total, "vector_s": vector_total,
                                "memory_s": memory_total, "compute_s": compute, "bound": bound, "gemms": entries}
        if cycles_total:
            meta["utilization"] = macs / (cycles_total * target.systolic.macs_per_cycle)
        return Label(seconds, "ok", meta)
