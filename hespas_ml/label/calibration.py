"""How far a target's real kernels stay from its peaks, fitted on region labels measured on it.

The calibrated roofline (:class:`hespas_ml.label.roofline.CalibratedRooflineFidelity`) charges each kernel

    max(matrix FLOPs / (matrix rate x matrix efficiency) + vector time, bytes / (bandwidth x memory efficiency))
    + kernel overhead

and never less than the floor of the library call it makes (a convolution, a dot), with the figures of a
:class:`Calibration`, which a target file holds under ``calibration``. :func:`fit_calibration` fits them on a
measured dataset folder (``datasets/measured/``). Labels of the folder's held-out families never count. The
efficiencies and the overhead come from labels timed in a loop inside one executable (``loop`` in their meta:
a region's time inside a program, the loop's own per-pass cost taken off), since a region timed alone pays a
whole executable's launch.

* matrix efficiency, per element type as the target runs it (``tf32`` for f32 where the target's
  ``f32_matmul`` says so): the median of roofline matrix time / measured time over the compute-bound
  labels of that type (matrix time at least the memory time);
* memory efficiency and kernel overhead: a least-squares line, measured time = overhead + bytes /
  (bandwidth x efficiency), over the memory-bound labels (matrix time under a fifth of the memory time);
* kernel floors, per op kind in ``FLOOR_OPS``: the median time inside a program of the one-kernel regions
  holding that op whose work would take under ``SMALL_WORK_S`` at the datasheet peaks. Looped or not: a
  label timed alone counts less the launch of a trivial executable measured beside it (its ``overhead_s``).
  A cuDNN convolution launched by XLA:GPU takes tens of microseconds however little it computes; this is
  what charges it.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..ingest.errors import HespasError
from .measured_fidelity import in_program

MIN_LABELS = 5                 # fewest labels an efficiency or a floor is fitted on
FLOOR_OPS = ("convolution", "dot_general")   # library calls whose kernels get a floor, the first found wins
SMALL_WORK_S = 5e-6            # a kernel whose work takes less at the datasheet peaks shows its floor


class CalibrationError(HespasError, ValueError):
    """A calibration could not be fitted, or a target file's calibration is malformed (one line)."""


@dataclass(frozen=True)
class Calibration:
    """Measured efficiencies of one target (see the module docstring)."""

    matrix_efficiency: dict[str, float]
    memory_efficiency: float
    kernel_overhead_s: float
    measured_on: str                       # the device the labels were measured on
    source: str                            # the measured folder they come from
    labels: dict[str, int] = field(default_factory=dict)   # how many labels each figure was fitted on
    kernel_floor_s: dict[str, float] = field(default_factory=dict)   # op kind -> least time of its kernel

    def to_mapping(self) -> dict[str, Any]:
        return asdict(self)


def calibration_from_mapping(data: Any, origin: str) -> Calibration:
    """Validate a target file's ``calibration`` mapping; ``origin`` prefixes every error."""
    if not isinstance(data, dict):
        raise CalibrationError(f"{origin}: key 'calibration' must be a mapping")
    for key in ("matrix_efficiency", "memory_efficiency", "kernel_overhead_s", "measured_on", "source"):
        if key not in data:
            raise CalibrationError(f"{origin}: key 'calibration.{key}' is missing")
    matrix = data["matrix_efficiency"]
    if not isinstance(matrix, dict) or not matrix:
        raise CalibrationError(f"{origin}: key 'calibration.matrix_efficiency' must map element types to "
                               "efficiencies")
    efficiencies = {str(k): _fraction(v, origin, f"calibration.matrix_efficiency.{k}") for k, v in matrix.items()}
    overhead = _float(data["kernel_overhead_s"], origin, "calibration.kernel_overhead_s")
    if overhead < 0:
        raise CalibrationError(f"{origin}: key 'calibration.kernel_overhead_s' must be at least 0")
    labels = data.get("labels") or {}
    if not isinstance(labels, dict):
        raise CalibrationError(f"{origin}: key 'calibration.labels' must be a mapping")
    floors = data.get("kernel_floor_s") or {}
    if not isinstance(floors, dict) or not set(floors) <= set(FLOOR_OPS):
        raise CalibrationError(f"{origin}: key 'calibration.kernel_floor_s' must map op kinds among "
                               f"{', '.join(FLOOR_OPS)} to seconds")
    floor_s = {str(k): _float(v, origin, f"calibration.kernel_floor_s.{k}") for k, v in floors.items()}
    if any(v < 0 for v in floor_s.values()):
        raise CalibrationError(f"{origin}: key 'calibration.kernel_floor_s' must hold no negative time")
    return Calibration(efficiencies, _fraction(data["memory_efficiency"], origin, "calibration.memory_efficiency"),
                       overhead, str(data["measured_on"]), str(data["source"]),
                       {str(k): int(_float(v, origin, f"calibration.labels.{k}")) for k, v in labels.items()},
                       floor_s)


def _float(value: Any, origin: str, key: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise CalibrationError(f"{origin}: key '{key}' must be a number, got {value!r}") from None


def _fraction(value: Any, origin: str, key: str) -> float:
    number = _float(value, origin, key)
    if not 0 < number <= 1:
        raise CalibrationError(f"{origin}: key '{key}' must lie in (0, 1], got {number}")
    return number


def fit_calibration(folder: str | Path, target) -> Calibration:
    """Fit ``target``'s :class:`Calibration` on the labels of the measured folder ``folder``."""
    import pandas as pd

    folder = Path(folder)
    try:
        labels = pd.read_parquet(folder / "labels.parquet")
        regions = pd.read_parquet(folder / "regions.parquet")
    except (OSError, ValueError) as exc:
        raise CalibrationError(f"{folder}: not a measured dataset folder ({str(exc).splitlines()[0]})") from None
    labels = labels[(labels["fidelity"] == "profiling") & (labels["status"] == "ok")
                    & (labels["target"] == target.name)]
    rows = labels.merge(regions[["hash", "matrix_flops", "bytes", "dtype", "n_kernels", "op_counts"]], on="hash")
    compute: dict[str, list[float]] = {}
    memory: list[tuple[float, float]] = []
    floors: dict[str, list[float]] = {}
    devices: set[str] = set()
    for label in rows.itertuples(index=False):
        meta = json.loads(label.meta or "{}")
        if meta.get("phase") == "held_out":
            continue
        dtype = str(label.dtype)
        matrix_s = float(label.matrix_flops) / target.op_rate(dtype, "matrix") if label.matrix_flops else 0.0
        memory_s = float(label.bytes) / target.mem_bw
        if int(label.n_kernels) == 1 and max(matrix_s, memory_s) < SMALL_WORK_S:
            ops = json.loads(label.op_counts or "{}")
            kind = next((k for k in FLOOR_OPS if k in ops), None)
            if kind is not None:
                floors.setdefault(kind, []).append(in_program(float(label.seconds), label.meta))
        if not meta.get("loop"):
            continue
        seconds = in_program(float(label.seconds), label.meta)
        if seconds <= 0:
            continue
        devices.add(str(meta.get("device") or target.name))
        rate_dtype = target.matrix_type(dtype)
        if matrix_s and matrix_s >= memory_s:
            compute.setdefault(rate_dtype, []).append(min(1.0, matrix_s / seconds))
        elif matrix_s < 0.2 * memory_s and label.bytes:
            memory.append((float(label.bytes), seconds))
    matrix = {k: round(statistics.median(v), 3) for k, v in sorted(compute.items()) if len(v) >= MIN_LABELS}
    if not matrix:
        raise CalibrationError(f"{folder}: fewer than {MIN_LABELS} looped compute-bound labels of any element "
                               f"type on {target.name}")
    if len(memory) < MIN_LABELS:
        raise CalibrationError(f"{folder}: fewer than {MIN_LABELS} looped memory-bound labels on {target.name}")
    overhead, per_byte = _line([b for b, _ in memory], [s for _, s in memory])
    if per_byte <= 0:
        raise CalibrationError(f"{folder}: the memory-bound labels on {target.name} do not grow with their bytes")
    floor_s = {k: float(f"{statistics.median(v):.3g}") for k, v in floors.items() if len(v) >= MIN_LABELS}
    counts = ({f"matrix_{k}": len(compute[k]) for k in matrix} | {"memory": len(memory)}
              | {f"floor_{k}": len(floors[k]) for k in floor_s})
    return Calibration(matrix, round(min(1.0, 1.0 / (per_byte * target.mem_bw)), 3),
                       float(f"{max(0.0, overhead):.3g}"), ", ".join(sorted(devices)), folder.name, counts,
                       floor_s)


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope of ys against xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - slope * mx, slope


__all__ = ["FLOOR_OPS", "Calibration", "CalibrationError", "calibration_from_mapping", "fit_calibration"]
