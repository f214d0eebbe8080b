"""The analytical fidelity: each kernel takes max(compute time, memory time) on the target.

Compute time = matrix FLOPs at the matrix-unit peak for the matrix operands' element type
+ vector FLOPs at the vector-unit peak for the kernel's element type
+ transcendental elements, each costing ``TRANSCENDENTAL_FLOPS`` vector FLOPs (special-function units
run at a fraction of the FMA rate). Memory time = the kernel's boundary bytes at the memory bandwidth.
A region's time is the sum over its kernels: one kernel for the fusion-aware split, one per op otherwise.
"""
from __future__ import annotations

from typing import Any, Sequence

from .fidelity import Label

TRANSCENDENTAL_FLOPS = 4.0


def kernel_seconds(kernel, target) -> tuple[float, float]:
    """(compute seconds, memory seconds) of one kernel on ``target``."""
    compute = 0.0
    if kernel.matrix_flops:
        compute += kernel.matrix_flops / target.peak_flops(kernel.matrix_dtype or kernel.dtype, "matrix")
    vector = kernel.vector_flops + TRANSCENDENTAL_FLOPS * kernel.transcendentals
    if vector:
        compute += vector / target.peak_flops(kernel.dtype, "vector")
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
