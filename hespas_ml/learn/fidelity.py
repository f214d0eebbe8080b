"""A learned surrogate as a fidelity: ``surrogate:<model>`` times regions in bulk, with an interval.

``get_fidelity("surrogate:roofline")`` (and ``surrogate:scalesim``, ``surrogate:profiling``,
``surrogate:NAME@alias``, ``surrogate:models:/NAME/3``, ``surrogate:/path/to/model``) returns a
:class:`SurrogateFidelity`: the same interface as the analytical and measured fidelities
(``label_regions(regions, target) -> list[Label]``), so the pipeline, dataset builder, sweeps and
studies use it unchanged. A fidelity name means the shipped model (``hespas_ml/models/<fidelity>/``); other
references are resolved by :func:`hespas_ml.learn.registry.load_surrogate`.

All regions of a call are featurised and predicted together, and identical regions (same structural
signature) once. Each label's ``meta`` holds the interval: ``lower_s`` / ``upper_s`` (also as
``interval``), its nominal ``coverage``, the ensemble ``spread`` (log-seconds), the analytical
``roofline_s`` and the ``model`` used.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Sequence

from ..label.fidelity import FidelityError, Label
from ..label.scalesim import require_systolic
from .config import LearnError
from .features import HW_FEATURES, hardware_vector, resolve_target
from .registry import LoadedModel, load_surrogate, parse_model_ref
from .surrogate import Surrogate

_CACHE: dict[tuple, LoadedModel] = {}
# log10 distance beyond which a host-cpu is another machine (~25 %): the host micro-benchmark itself gives one
# box rates ~5-10 % apart from one measurement to the next
HOST_TOLERANCE = 0.1
_LOCK = threading.Lock()


def _cache_key(ref, tracking_uri) -> tuple | None:
    """A key that changes when the model behind a reference can have changed (None: do not cache)."""
    if ref.kind in ("path", "shipped"):
        folder = Path(ref.uri)
        try:
            stamp = tuple((folder / f).stat().st_mtime_ns for f in ("weights.pt", "surrogate.json"))
        except OSError:
            return None
        return ("folder", str(folder.resolve()), stamp)
    if ref.alias is not None:
        return None                        # aliases move: resolve them every time
    return ("registry", ref.uri, str(tracking_uri or os.environ.get("HESPAS_ML_TRACKING_URI") or ""))


def load_model(model: str | os.PathLike[str], tracking_uri: str | os.PathLike[str] | None = None) -> LoadedModel:
    """:func:`~hespas_ml.learn.registry.load_surrogate` with a per-process cache of unchanged models."""
    ref = parse_model_ref(model)
    key = _cache_key(ref, tracking_uri)
    if key is not None:
        with _LOCK:
            hit = _CACHE.get(key)
        if hit is not None:
            return hit
    loaded = load_surrogate(ref, tracking_uri)
    if key is not None:
        with _LOCK:
            _CACHE[key] = loaded
    return loaded


class SurrogateFidelity:
    """Times compute regions with a learned surrogate (see the module docstring).

    ``model``: a fidelity name (the shipped model), a saved folder, a registry reference, or a
    :class:`~hespas_ml.learn.surrogate.Surrogate`. ``tracking_uri``: the MLflow store of registry
    references (default ``$HESPAS_ML_TRACKING_URI`` or ``./mlruns``).
    """

    def __init__(self, model: str | os.PathLike[str] | Surrogate = "roofline",
                 tracking_uri: str | os.PathLike[str] | None = None):
        if isinstance(model, Surrogate):
            self.surrogate, self.source, self.load_s = model, "in-memory", 0.0
            self.name = f"surrogate:{model.config.fidelity}"
        else:
            loaded = load_model(model, tracking_uri)
            self.surrogate, self.source, self.load_s = loaded.surrogate, loaded.describe(), loaded.load_s
            self.name = f"surrogate:{model}"
        self.fidelity = self.surrogate.config.fidelity
        self.trained_targets = set(self.surrogate.trained_on.get("targets") or [])

    def label(self, region, target) -> Label:
        return self.label_regions([region], target)[0]

    def check_target(self, target) -> None:
        """Refuse (FidelityError, one line) what the learned fidelity itself refuses: a SCALE-Sim surrogate needs systolic
        arrays, and a profiling surrogate answers only for the machines whose timings it learned (profiling
        measures the machine it runs on; one machine's timings say nothing about another's, and with a single
        training target the hardware vector never varied, so the model could not even tell them apart)."""
        target = resolve_target(target)
        name = target.name
        if self.fidelity == "scalesim":
            try:
                require_systolic(target)
            except FidelityError as exc:
                raise FidelityError(f"{self.name}: {exc}") from None
        if self.fidelity == "profiling" and self.trained_targets and name not in self.trained_targets:
            raise FidelityError(f"{self.name}: learned the profiling timings of {', '.join(sorted(self.trained_targets))}"
                             f" only, not of {name} (profiling measures the machine it runs on; use --target "
                             f"{sorted(self.trained_targets)[0]}, or another fidelity)")

    def provenance(self, target) -> dict[str, Any]:
        """The model that answers: where it was loaded from, what it learned, its interval's coverage."""
        trained = self.surrogate.trained_on
        return {"fidelity": self.name, "target": resolve_target(target).name, "model": self.source,
                "learned": self.fidelity, "targets_learned": sorted(self.trained_targets),
                "families_learned": trained.get("families"), "coverage": self.surrogate.calibration.coverage}

    def caveat(self, target) -> str | None:
        """What a user must know about these predictions on ``target``, in one line, or None. A profiling
        surrogate learned the timings of the machine its labels were measured on: when this machine's
        ``host-cpu`` (same name) measures differently, the predictions are still the other machine's. When
        ``host-cpu`` was measured on fewer cores than the machine has (the process was pinned), it says so:
        that alone makes the same machine measure as another."""
        target = resolve_target(target)
        if self.fidelity != "profiling" or target.name not in self.trained_targets:
            return None
        if not self.surrogate.hardware_outside_training(target, tolerance=HOST_TOLERANCE):
            return None
        seen = {f: lo for f, (lo, _) in self.surrogate.hardware_range().items()}
        here = dict(zip(HW_FEATURES, hardware_vector(target).tolist()))

        def rates(v: dict[str, float]) -> str:
            return (f"f32 peak {10 ** v['log10_matrix_flops_f32'] / 1e9:,.0f} GFLOP/s, "
                    f"memory {10 ** v['log10_mem_bw'] / 1e9:,.0f} GB/s")
        cores, count = target.measured.get("cores"), target.measured.get("cpu_count")
        pinned = (f"; {target.name} was measured on {cores} of this machine's {count} cores, so a CPU affinity "
                  "or cpuset limit (taskset, numactl, a container's --cpuset-cpus) may be what differs"
                  if isinstance(cores, int) and isinstance(count, int) and cores < count else "")
        return (f"{self.name} learned the {target.name} timings of another machine ({rates(seen)}) and predicts "
                f"that machine's times, not this one's ({rates(here)}): label this machine (hespas-ml dataset "
                f"build) and train on it (hespas-ml train --fidelity profiling){pinned}")

    def label_regions(self, regions: Sequence, target) -> list[Label]:
        """One label per region, predicted in one batch (identical regions once). When :meth:`caveat` has
        something to say, every label carries it (``meta["caveat"]``) and ``seen_target`` is False."""
        regions = list(regions)
        if not regions:
            return []
        target = resolve_target(target)
        self.check_target(target)
        pred = self.surrogate.predict_regions(regions, target)
        caveat = self.caveat(target)
        seen = target.name in self.trained_targets and caveat is None if self.trained_targets else None
        coverage = self.surrogate.calibration.coverage
        roof = pred.roofline if len(pred.roofline) == len(pred.seconds) else None
        out = []
        for i in range(len(pred.seconds)):
            lo, s, hi = float(pred.lower[i]), float(pred.seconds[i]), float(pred.upper[i])
            meta: dict[str, Any] = {"lower_s": lo, "upper_s": hi, "interval": (lo, hi), "coverage": coverage,
                                    "spread": float(pred.spread[i]) if len(pred.spread) else 0.0,
                                    "model": self.source, "bound": "learned", "seen_target": seen}
            if roof is not None:
                meta["roofline_s"] = float(roof[i])
            if caveat is not None:
                meta["caveat"] = caveat
            out.append(Label(s, "ok", meta))
        return out


def check_reference(model: str) -> None:
    """Raise a one-line error unless ``model`` parses as a model reference whose shipped folder (for a
    fidelity name) or path exists; registry references are checked when loaded."""
    ref = parse_model_ref(model)
    if ref.kind == "shipped" and not Path(ref.uri).is_dir():
        raise LearnError(f"surrogate:{model}: no shipped model in {ref.uri}")
