"""Fidelities by name: the one place that knows every way of timing a region."""
from __future__ import annotations

from .fidelity import Fidelity, FidelityError

FIDELITIES = ("roofline", "scalesim", "profiling", "measured")
SURROGATE_PREFIX = "surrogate:"


def _surrogate_model(name: str) -> str | None:
    """The model reference of a ``surrogate:<model>`` name (None for other names); the reference keeps
    its case (it may be a path or a registered model name)."""
    text = name.strip()
    if text[:len(SURROGATE_PREFIX)].lower() != SURROGATE_PREFIX:
        return None
    return text[len(SURROGATE_PREFIX):].strip()


def fidelity_class(name: str) -> type:
    """The class of the fidelity called ``name`` (imported on demand: SCALE-Sim and XLA load slowly).
    ``surrogate:<model>`` (a learned surrogate: see :mod:`hespas_ml.learn.fidelity`) is checked to name a
    model that can exist (a shipped fidelity model, a folder or a registry reference)."""
    model = _surrogate_model(name)
    if model is not None:
        from ..learn.config import LearnError
        from ..learn.fidelity import SurrogateFidelity, check_reference
        try:
            check_reference(model)
        except LearnError as exc:
            raise FidelityError(f"fidelity '{name.strip()}': {exc}") from None
        return SurrogateFidelity
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
    if key == "measured":
        from .measured_fidelity import MeasuredFidelity
        return MeasuredFidelity
    raise FidelityError(f"unknown fidelity '{name}' (available: {', '.join(FIDELITIES)}, "
                        f"{SURROGATE_PREFIX}<fidelity|NAME@alias|path>)")


def label_version(name: str) -> int:
    """What the labels of the fidelity called ``name`` measure (its class's ``LABEL_VERSION``; 1 for a
    fidelity whose labels never changed meaning). Caches of labels and of results built on them key on it."""
    return int(getattr(fidelity_class(name), "LABEL_VERSION", 1))


def changed_label_versions(names) -> dict[str, int]:
    """``{name: version}`` of those fidelities whose labels changed meaning (version above 1), for keys
    that stay as they were for every other fidelity."""
    return {n: v for n in names if (v := label_version(n)) > 1}


def get_fidelity(name: str, **options) -> Fidelity:
    """A fidelity by name (``roofline``, ``scalesim``, ``profiling``, ``measured`` or ``surrogate:<model>``),
    built with ``options``."""
    model = _surrogate_model(name)
    if model is not None:
        return fidelity_class(name)(model, **options)
    return fidelity_class(name)(**options)
