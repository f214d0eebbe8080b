"""Every way of timing a compute region, by name: the labellers (:mod:`hespas_ml.label.registry`:
roofline, scalesim, profiling, measured) and the learned surrogates of their labels (``surrogate:<model>``,
:mod:`hespas_ml.learn.fidelity`). The pipeline, sweeps, studies and the command line look fidelities up
here and nowhere else."""
from __future__ import annotations

from .label.fidelity import Fidelity, FidelityError
from .label.registry import LABELLERS, SURROGATE_PREFIX, labeller_class, version_of

FIDELITIES = LABELLERS


def surrogate_model(name: str) -> str | None:
    """The model reference of a ``surrogate:<model>`` name (None for other names); the reference keeps
    its case (it may be a path or a registered model name)."""
    text = name.strip()
    if text[:len(SURROGATE_PREFIX)].lower() != SURROGATE_PREFIX:
        return None
    return text[len(SURROGATE_PREFIX):].strip()


def fidelity_class(name: str) -> type:
    """The class of the fidelity called ``name``. ``surrogate:<model>`` is checked to name a model that can
    exist (a shipped fidelity model, a folder or a registry reference); torch loads only then."""
    model = surrogate_model(name)
    if model is None:
        return labeller_class(name)
    from .learn.config import LearnError
    from .learn.fidelity import SurrogateFidelity, check_reference
    try:
        check_reference(model)
    except LearnError as exc:
        raise FidelityError(f"fidelity '{name.strip()}': {exc}") from None
    return SurrogateFidelity


def label_version(name: str) -> int:
    """What the labels of the fidelity called ``name`` measure (:func:`~hespas_ml.label.registry.version_of`)."""
    return version_of(fidelity_class(name))


def changed_label_versions(names) -> dict[str, int]:
    """``{name: version}`` of those fidelities whose labels changed meaning (version above 1), for keys
    that stay as they were for every other fidelity."""
    return {n: v for n in names if (v := label_version(n)) > 1}


def get_fidelity(name: str, **options) -> Fidelity:
    """A fidelity by name (``roofline``, ``scalesim``, ``profiling``, ``measured`` or ``surrogate:<model>``),
    built with ``options``."""
    model = surrogate_model(name)
    if model is not None:
        return fidelity_class(name)(model, **options)
    return fidelity_class(name)(**options)


__all__ = ["FIDELITIES", "changed_label_versions", "fidelity_class", "get_fidelity", "label_version",
           "surrogate_model"]
