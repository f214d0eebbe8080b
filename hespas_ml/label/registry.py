"""Fidelities by name: the one place that knows every way of timing a region."""
from __future__ import annotations

from .fidelity import Fidelity, FidelityError

FIDELITIES = ("roofline", "scalesim", "profiling")


def fidelity_class(name: str) -> type:
    """The class of the fidelity called ``name`` (imported on demand: SCALE-Sim and XLA load slowly)."""
    key = name.strip().lower()
    if key == "roofline":
        from .roofline import RooflineFidelity
        return RooflineFidelity
    if key == "scalesim":
        from .scalesim import ScaleSimFidelity
        return ScaleSimFidelity
    if key == "profiling":
        from .profiling import ProfilingFidelity
        return ProfilingFidelity
    raise FidelityError(f"unknown fidelity '{name}' (available: {', '.join(FIDELITIES)})")


def get_fidelity(name: str, **options) -> Fidelity:
    """A fidelity by name (``roofline``, ``scalesim`` or ``profiling``), built with ``options``."""
    return fidelity_class(name)(**options)
