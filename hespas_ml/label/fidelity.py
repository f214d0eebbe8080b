"""One interface for every way of timing a compute region: region + target -> seconds, with metadata.

The contract every fidelity keeps (labellers here, learned surrogates in :mod:`hespas_ml.learn.fidelity`;
``tests/test_fidelity_contract.py`` checks it for every one :mod:`hespas_ml.fidelities` names):

* ``name``;
* ``check_target(target)``: nothing when it answers for ``target``, else :class:`FidelityError` in one line
  (a SCALE-Sim fidelity needs systolic arrays, profiling times only the machine it runs on, …);
* ``label_regions(regions, target)``: one :class:`Label` per compute region, in order; an ok label has a
  finite time of at least 0 s, a failed one NaN and a ``reason`` in its ``meta``; a label with an interval
  has ``meta["interval"] = (lower, upper)`` around its time; ``label(region, target)`` is the same for one;
* ``provenance(target)``: what answers on ``target``, as JSON (the fidelity, its version and options, the
  model or the machine or the measurements behind it).

Fidelities are looked up by name with :func:`hespas_ml.fidelities.get_fidelity`.
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


def label_in_chunks(fid, regions: Sequence, target, *, desc: str, progress: bool, chunk: int = 32) -> list[Label]:
    """``fid.label_regions(regions, target)``, in chunks of ``chunk`` regions with a progress bar (rate and
    ETA) on stderr when ``progress``; in one call otherwise. For the slow fidelities (SCALE-Sim, profiling),
    whose labels do not depend on what else is in a call."""
    regions = list(regions)
    if not progress or len(regions) <= chunk:
        return fid.label_regions(regions, target)
    from ..units import progress_bar

    out: list[Label] = []
    with progress_bar(len(regions), desc, "region", True) as bar:
        for start in range(0, len(regions), chunk):
            part = regions[start:start + chunk]
            out += fid.label_regions(part, target)
            bar.update(len(part))
    return out


class Fidelity(Protocol):
    name: str

    def check_target(self, target) -> None: ...

    def label(self, region, target) -> Label: ...

    def label_regions(self, regions: Sequence, target) -> list[Label]: ...

    def provenance(self, target) -> dict[str, Any]: ...
