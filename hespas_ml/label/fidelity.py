"""One interface for every way of timing a compute region: region + target -> seconds, with metadata.

A fidelity is any object with a ``name`` and ``label_regions(regions, target) -> list[Label]``
(``label(region, target)`` for one). Fidelities are looked up by name with
:func:`hespas_ml.fidelities.get_fidelity`.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from ..ingest.errors import HespasError


class FidelityError(HespasError):
    pass


@dataclass(slots=True)
class Label:
    """The time of one execution of a region, as one fidelity sees it."""

    seconds: float
    status: str = "ok"                 # "ok" | "failed"
    meta: dict[str, Any] = field(default_factory=dict)


def option_defaults(cls: type) -> dict[str, Any]:
    """The default of each constructor option of fidelity class ``cls`` that has one."""
    return {k: p.default for k, p in inspect.signature(cls).parameters.items()
            if p.default is not inspect.Parameter.empty}


def options_off_default(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` of fidelity class ``cls`` less those equal to its constructor's default (so that writing a
    default down changes no key or fingerprint)."""
    defaults = option_defaults(cls)
    return {k: v for k, v in options.items() if k not in defaults or defaults[k] != v}


def label_caveats(labels) -> list[str]:
    """The distinct caveats (``meta["caveat"]``: what to know about an ok answer) of ``labels``, in order."""
    return list(dict.fromkeys(lab.meta["caveat"] for lab in labels if "caveat" in lab.meta))


class Fidelity(Protocol):
    name: str

    def label(self, region, target) -> Label: ...

    def label_regions(self, regions: Sequence, target) -> list[Label]: ...
