"""The analytical fidelities: each kernel takes max(compute time, memory time) on the target.

Compute time = matrix FLOPs at the matrix-unit rate for the matrix operands' element type as XLA runs it
(:meth:`~hespas_ml.label.targets.Target.op_rate`: f32 on TF32 Tensor Cores where the target says so)
+ vector FLOPs at the vector-unit peak for the kernel's element type
+ transcendental elements, each costing ``TRANSCENDENTAL_FLOPS`` vector FLOPs (special-function units
run at a fraction of the FMA rate). Memory time = the kernel's boundary bytes at the memory bandwidth.
A region's time is the sum over its kernels: one kernel for the fusion-aware split, one per op otherwise.

``roofline`` charges the datasheet peaks. ``calibrated-roofline`` charges what the target's kernels were
measured to reach (its file's ``calibration``: :mod:`hespas_ml.label.calibration`): matrix and memory
time over their measured efficiencies, plus the measured overhead of each kernel, and at least the measured
floor of a kernel that calls a convolution or a dot; it refuses targets without one.
"""
from __future__ import annotations

import statistics
from typing import Any, Sequence

from .calibration import FLOOR_OPS
from .fidelity import FidelityError, Label

TRANSCENDENTAL_FLOPS = 4.0


def kernel_seconds(kernel, target) -> tuple[float, float]:
    """(compute seconds, memory seconds) of one kernel on ``target``."""
    compute = 0.0
    if kernel.matrix_flops:
        compute += kernel.matrix_flops / target.op_rate(kernel.matrix_dtype or kernel.dtype, "matrix")
    vector = kernel.vector_flops + TRANSCENDENTAL_FLOPS * kernel.transcendentals
    if vector:
        compute += vector / target.op_rate(kernel.dtype, "vector")
    memory = kernel.bytes / target.mem_bw
    return compute, memory


class RooflineFidelity:
    """Roofline on every target (a preset or a target file); deterministic and instant."""

    name = "roofline"

    def check_target(self, target) -> None:
        """Every target has the peaks and the bandwidth a roofline needs."""

    def provenance(self, target) -> dict[str, Any]:
        return {"fidelity": self.name, "target": target.name, "transcendental_flops": TRANSCENDENTAL_FLOPS}

    def label(self, region, target) -> Label:
        compute = memory = seconds = 0.0
        for k in region.kernels:
            c, m = kernel_seconds(k, target)
            compute += c
            memory += m
            seconds += max(c, m)
        bound = "compute" if compute >= memory else "memory"
        return Label(seconds, "ok", {"compute_s": compute, "memory_s": memory, "bound": bound})

    def label_regions(self, regions: Sequence, target) -> list[Label]:
        return [self.label(r, target) for r in regions]


def matrix_efficiency(target, rate_dtype: str) -> float:
    """The calibration's matrix efficiency for ``rate_dtype`` on ``target``; a type it did not measure takes
    that of a measured type the matrix units run at the same rate (f16 as bf16 on NVIDIA Tensor Cores),
    else the median of the measured ones."""
    cal = target.calibration
    if rate_dtype in cal.matrix_efficiency:
        return cal.matrix_efficiency[rate_dtype]
    rate = target.peak_flops(rate_dtype, "matrix")
    same = [e for d, e in sorted(cal.matrix_efficiency.items()) if target.peak_flops(d, "matrix") == rate]
    return same[0] if same else statistics.median(cal.matrix_efficiency.values())


def calibrated_kernel_seconds(kernel, target) -> tuple[float, float, float]:
    """(compute seconds, memory seconds, overhead seconds) of one kernel on ``target`` at its measured
    efficiencies (``target.calibration``)."""
    cal = target.calibration
    compute, memory = kernel_seconds(kernel, target)
    if kernel.matrix_flops:
        dtype = kernel.matrix_dtype or kernel.dtype
        matrix = kernel.matrix_flops / target.op_rate(dtype, "matrix")
        compute += matrix / matrix_efficiency(target, target.matrix_type(dtype)) - matrix
    return compute, memory / cal.memory_efficiency, cal.kernel_overhead_s


def kernel_floor(kernel, ops, target) -> float:
    """The least time ``target``'s calibration allows ``kernel`` (ops: its program's ``graph.ops``): the floor
    of the first op kind in ``FLOOR_OPS`` it holds that the calibration has one for, else 0."""
    floors = target.calibration.kernel_floor_s
    kinds = {ops[i].kind for i in kernel.op_ids}
    return next((floors[k] for k in FLOOR_OPS if k in floors and k in kinds), 0.0)


class CalibratedRooflineFidelity(RooflineFidelity):
    """The roofline at the efficiencies measured on the target itself (see the module docstring)."""

    name = "calibrated-roofline"

    def check_target(self, target) -> None:
        if target.calibration is None:
            raise FidelityError(f"calibrated-roofline: target {target.name} has no calibration (efficiencies "
                                "measured on it: hespas_ml/label/calibration.py); use roofline")

    def provenance(self, target) -> dict[str, Any]:
        self.check_target(target)
        return {**super().provenance(target), "calibration": target.calibration.to_mapping()}

    def label(self, region, target) -> Label:
        self.check_target(target)
        graph = getattr(region, "graph", None)
        if graph is None and target.calibration.kernel_floor_s:
            raise FidelityError(f"region {getattr(region, 'id', '?')} carries no op graph (region.graph); the "
                                f"calibrated roofline's kernel floors need its ops")
        compute = memory = overhead = seconds = 0.0
        floored = 0
        for k in region.kernels:
            c, m, o = calibrated_kernel_seconds(k, target)
            compute += c
            memory += m
            overhead += o
            floor = kernel_floor(k, graph.ops, target) if graph is not None else 0.0
            floored += floor > max(c, m) + o
            seconds += max(max(c, m) + o, floor)
        bound = "floor" if floored == len(region.kernels) else "compute" if compute >= memory else "memory"
        return Label(seconds, "ok", {"compute_s": compute, "memory_s": memory, "overhead_s": overhead,
                                     "floored_kernels": floored, "bound": bound,
                                     "calibrated_on": target.calibration.measured_on})

    def label_regions(self, regions: Sequence, target) -> list[Label]:
        self.check_target(target)
        return [self.label(r, target) for r in regions]
