"""Analytical estimates of a region's time on a target, vectorised over many regions.

* :meth:`Estimator.roofline_parts` — exactly the roofline fidelity (:func:`hespas_ml.label.roofline.
  kernel_seconds` per kernel, ``max(compute, memory)``, summed over kernels) and its parts.
* :meth:`Estimator.calibrated_seconds` — exactly the calibrated-roofline fidelity on targets whose file
  holds a ``calibration`` (measured efficiencies, per-kernel overhead, the floors of library calls), the
  roofline elsewhere.
* :meth:`Estimator.systolic_seconds` — the same structure with each GEMM's matrix time replaced by
  SCALE-Sim's stall-free cycle count on the target's systolic arrays (the GEMMs the scalesim fidelity maps
  an op to, spread over the arrays the way it spreads them): the scalesim fidelity without memory stalls.

Both work on the small kernel / GEMM arrays of :class:`~hespas_ml.learn.features.RegionArrays` and cache
each target's peak rate per element type.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Sequence

import numpy as np

from ..ingest.graph import Op, TensorType
from ..label.calibration import FLOOR_OPS
from ..label.roofline import matrix_efficiency
from ..label.scalesim import matrix_work
from ..label.targets import Target

MIN_SECONDS = 1e-12                                    # floor of estimates before taking logs


class Estimator:
    """Roofline and systolic estimates for lists of region arrays (see the module docstring)."""

    def __init__(self) -> None:
        self._peaks: dict[int, tuple[Target, dict[tuple[str, str], float]]] = {}

    def _peak_table(self, target: Target) -> dict[tuple[str, str], float]:
        hit = self._peaks.get(id(target))
        if hit is None or hit[0] is not target:
            hit = (target, {})
            self._peaks[id(target)] = hit
        return hit[1]

    def _peak(self, target: Target, dtype: str, unit: str) -> float:
        table = self._peak_table(target)
        value = table.get((dtype, unit))
        if value is None:
            value = table[(dtype, unit)] = float(target.op_rate(dtype, unit))
        return value

    def roofline_parts(self, regions: Sequence[Any], target: Target) -> dict[str, np.ndarray]:
        """Per region on ``target``: roofline seconds (Σ over kernels of max(compute, memory), exactly the
        roofline fidelity), and the sums of its compute, memory, matrix and vector parts."""
        counts = np.fromiter((len(r.kernels) for r in regions), dtype=np.int64, count=len(regions))
        seg = np.repeat(np.arange(len(regions)), counts)
        if seg.size == 0:
            z = np.zeros(len(regions))
            return {"roofline": z, "compute": z, "memory": z, "matrix": z, "vector": z}
        kern = np.concatenate([r.kernels for r in regions])
        dtypes = [pair for r in regions for pair in r.kernel_dtypes]        # (matrix, vector) per kernel
        peak = {pair: (self._peak(target, pair[0], "matrix"), self._peak(target, pair[1], "vector"))
                for pair in set(dtypes)}
        mpeak, vpeak = np.array([peak[pair] for pair in dtypes], dtype=np.float64).reshape(-1, 2).T
        matrix = kern[:, 0] / mpeak
        vector = kern[:, 1] / vpeak
        compute = matrix + vector
        memory = kern[:, 2] / target.mem_bw
        n = len(regions)
        return {"roofline": np.bincount(seg, np.maximum(compute, memory), n),
                "compute": np.bincount(seg, compute, n), "memory": np.bincount(seg, memory, n),
                "matrix": np.bincount(seg, matrix, n), "vector": np.bincount(seg, vector, n),
                "_seg": seg, "_kcompute": compute, "_kmemory": memory, "_kvector": vector, "_kmpeak": mpeak}

    def calibrated_seconds(self, regions: Sequence[Any], target: Target,
                           parts: dict[str, np.ndarray]) -> np.ndarray:
        """Per region: Σ over kernels of max(matrix time / matrix efficiency + vector time, memory time /
        memory efficiency) + kernel overhead, at least the floor of a library call the kernel makes, with
        the figures of ``target.calibration`` (as :class:`~hespas_ml.label.roofline.
        CalibratedRooflineFidelity` charges); the roofline estimate on a target without one."""
        cal = target.calibration
        if cal is None or "_seg" not in parts:
            return parts["roofline"]
        dtypes = [pair[0] for r in regions for pair in r.kernel_dtypes]
        eff = {d: matrix_efficiency(target, target.matrix_type(d)) for d in set(dtypes)}
        matrix = parts["_kcompute"] - parts["_kvector"]
        compute = matrix / np.array([eff[d] for d in dtypes]) + parts["_kvector"]
        seconds = np.maximum(compute, parts["_kmemory"] / cal.memory_efficiency) + cal.kernel_overhead_s
        calls = np.concatenate([r.kernel_calls for r in regions])
        floor = np.zeros(len(calls))
        for bit, kind in reversed(list(enumerate(FLOOR_OPS))):      # the first kind found wins
            if kind in cal.kernel_floor_s:
                floor = np.where(calls & (1 << bit), cal.kernel_floor_s[kind], floor)
        return np.bincount(parts["_seg"], np.maximum(seconds, floor), len(regions))

    def systolic_seconds(self, regions: Sequence[Any], target: Target,
                         parts: dict[str, np.ndarray]) -> np.ndarray:
        """Per region: Σ over kernels of max(fold-estimated array time + vector time, memory time).

        A GEMM's array time is SCALE-Sim's stall-free cycle count (folds × rows per fold of its dataflow,
        minus one) on the busiest array, for the spread of ``count`` / ``N`` / ``M`` over the arrays with
        the fewest cycles (as the scalesim fidelity maps it), times the target's passes for the element type
        (snapped to an integer within 2 %), over the clock. Targets without systolic arrays get the
        roofline estimate.
        """
        sa = target.systolic
        if sa is None:
            return parts["roofline"]
        counts = np.fromiter((len(r.gemms) for r in regions), dtype=np.int64, count=len(regions))
        kcounts = np.fromiter((len(r.kernels) for r in regions), dtype=np.int64, count=len(regions))
        koff = np.concatenate([[0], np.cumsum(kcounts)[:-1]]) if len(regions) else np.zeros(0, np.int64)
        array_s = np.zeros(int(kcounts.sum()))
        if counts.sum():
            g = np.concatenate([r.gemms for r in regions])
            kidx = g[:, 0].astype(np.int64) + np.repeat(koff, counts)
            count, m, nn, k = (np.maximum(g[:, j], 1.0) for j in (1, 2, 3, 4))
            b, n_ways, m_ways = _array_splits(sa.count)                  # [splits, 1] each, against [gemms]
            per_array = np.ceil(count / np.minimum(b, count))
            mm = np.ceil(m / np.minimum(m_ways, m))
            nw = np.ceil(nn / np.minimum(n_ways, nn))
            cycles = (per_array * (_fold_rows(mm, nw, k, sa) - 1)).min(axis=0)
            nominal = 2.0 * sa.macs_per_cycle * target.clock_hz
            ratio = nominal / parts["_kmpeak"][kidx]                # the GEMM's kernel's matrix dtype
            nearest = np.round(ratio)
            passes = np.where((nearest >= 1) & (np.abs(ratio - nearest) <= 0.02 * ratio), nearest, ratio)
            array_s = np.bincount(kidx, cycles * passes / target.clock_hz, len(array_s))
        kseconds = np.maximum(array_s + parts["_kvector"], parts["_kmemory"])
        # kernels whose matrix work is no GEMM (cholesky …) keep the roofline's matrix time
        kseconds = np.where((array_s == 0) & (parts["_kcompute"] > parts["_kvector"]),
                            np.maximum(parts["_kcompute"], parts["_kmemory"]), kseconds)
        return np.bincount(parts["_seg"], kseconds, len(regions))


def systolic_gemms(node: dict[str, Any], kernel: int, fallback: tuple[float, ...]) -> list[list[float]]:
    """[kernel, count, M, N, K] rows of the GEMMs the scalesim fidelity maps a matrix op to
    (:func:`hespas_ml.label.scalesim.matrix_work`: tap groups of convolutions included); the node's
    single representative GEMM when that mapping cannot be made."""
    op = Op(0, node["opcode"], [-1] * len(node["operand_types"]),
            [TensorType(tuple(sh), dt) for sh, dt in node["operand_types"]],
            [TensorType(tuple(sh), dt) for sh, dt in node["result_types"]], node["attrs"])
    works = matrix_work(op)
    if not works:
        return [[float(kernel), *fallback]]
    return [[float(kernel), float(w.count), float(w.gemm.m), float(w.gemm.n), float(w.gemm.k)] for w in works]


@lru_cache(maxsize=64)
def _array_splits(arrays: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (count ways, N ways, M ways) whose product is ``arrays``, as three float columns [splits, 1]."""
    divisors = [d for d in range(1, arrays + 1) if arrays % d == 0]
    splits = np.asarray([(b, n, arrays // (b * n)) for b in divisors for n in divisors if (arrays // b) % n == 0],
                        dtype=np.float64)
    splits.flags.writeable = False                                     # shared by every call (cached)
    return splits[:, 0:1], splits[:, 1:2], splits[:, 2:3]


def _fold_rows(m: np.ndarray, n: np.ndarray, k: np.ndarray, sa) -> np.ndarray:
    """SCALE-Sim's demand rows (one per cycle) of GEMMs [m, k] · [k, n] on one ``rows × cols`` array."""
    r, c = float(sa.rows), float(sa.cols)
    if sa.dataflow == "ws":        # K on rows, N on columns, M streamed
        return np.ceil(k / r) * np.ceil(n / c) * (2 * r + c + m - 2)
    if sa.dataflow == "os":        # M on rows, N on columns, K streamed
        return np.ceil(m / r) * np.ceil(n / c) * (r + c + k - 2)
    return np.ceil(k / r) * np.ceil(m / c) * (2 * r + c + n - 2)     # is: K on rows, M on columns
