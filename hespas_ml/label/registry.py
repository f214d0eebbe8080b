"""The labellers by name: the ways of timing a region that label datasets (learned surrogates, which learn
from those labels, are named in :mod:`hespas_ml.fidelities`)."""
from __future__ import annotations

from .fidelity import Fidelity, FidelityError

LABELLERS = ("roofline", "calibrated-roofline", "scalesim", "profiling", "measured")
SURROGATE_PREFIX = "surrogate:"


def labeller_class(name: str) -> type:
    """The class of the labeller called ``name`` (imported on demand: SCALE-Sim and XLA load slowly)."""
    key = name.strip().lower()
    if key == "roofline":
        from .roofline import RooflineFidelity
        return RooflineFidelity
    if key == "calibrated-roofline":
        from .roofline import CalibratedRooflineFidelity
        return CalibratedRooflineFidelity
    if key == "scalesim":
        from .scalesim import ScaleSimFidelity
        return ScaleSimFidelity
    if key == "profiling":
        from .profiling import ProfilingFidelity
        return ProfilingFidelity
    if key == "measured":
        from .measured_fidelity import MeasuredFidelity
        return MeasuredFidelity
    raise FidelityError(f"unknown fidelity '{name}' (available: {', '.join(LABELLERS)}, "
                        f"{SURROGATE_PREFIX}<fidelity|NAME@alias|path>)")


def get_labeller(name: str, **options) -> Fidelity:
    """A labeller by name, built with ``options``."""
    return labeller_class(name)(**options)


def version_of(cls: type) -> int:
    """What a fidelity class's labels measure (its ``LABEL_VERSION``; 1 for a fidelity whose labels never
    changed meaning). Caches of labels and of results built on them key on it."""
    return int(getattr(cls, "LABEL_VERSION", 1))


def label_version(name: str) -> int:
    """:func:`version_of` the labeller called ``name``."""
    return version_of(labeller_class(name))
