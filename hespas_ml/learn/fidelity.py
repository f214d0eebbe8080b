"""A learned surrogate as a fidelity: ``surrogate:<model>`` times regions in bulk, with an interval.

``get_fidelity("surrogate:roofline")`` (and ``surrogate:scalesim``, ``surrogate:profiling``,
``surrogate:NAME@alias``, ``surrogate:models:/NAME/3``, ``surrogate:/path/to/model``) returns a
:class:`SurrogateFidelity`: the same interface as the analytical and measured fidelities
(``label_regions(regions, target) -> list[Label]``), so the pipeline, dataset builder, sweeps and
studies use it unchanged. A fidelity name means the shipped model (``hespas_ml/models/<fidelity>/``); other
references are resolved by :func:`hespas_ml.learn.registry.load_surrogate`. ``surrogate:profiling`` on a
target whose timings the shipped model did not learn is answered by the shipped model beside it that
learned them (``hespas_ml/models/profiling-h100/`` for the H100), when there is one.

All regions of a call are featurised and predicted together, and identical regions (same structural
signature) once. Each label's ``meta`` holds the interval: ``lower_s`` / ``upper_s`` (also as
``interval``), its nominal ``coverage``, the ensemble ``spread`` (log-seconds), the analytical
``roofline_s`` and the ``model`` used.

**Outside what it learned.** A model that knows its training domain (:mod:`hespas_ml.learn.domain`) marks
each label ``in_domain``, and names in ``outside`` why a region is not. Such a region's interval is widened
to the domain's ``ood_half_width`` (what held-out families and sizes showed); one whose SCALE-Sim label mode
the default labeller changes is first scaled by what such a change was measured to do (the domain's
``mode_change``; its answer before is kept as ``learned_mode_s``). Every such label carries
one ``caveat`` line saying how many regions of the call were outside and why. ``fallback`` decides who
answers them: ``off`` keeps the surrogate's (widened) answer; ``labeller`` the fidelity the model learned
(SCALE-Sim, the profiler: only where it can run here for that target); ``roofline`` the analytical roofline;
``auto`` the labeller where it can run, else the calibrated roofline on a target measured for one (the
H100's profiling surrogate), else the roofline. A label answered so says ``bound:
fallback:<fidelity>`` and keeps the surrogate's own answer as ``surrogate_s``. Every label also says
whether the program of the call is one whose regions the model learned (``program_seen_in_training``):
its figures for such a program are not out of sample.
"""
from __future__ import annotations

import math
import os
import threading
from pathlib import Path
from typing import Any, Sequence

from ..label.fidelity import FidelityError, Label, label_in_chunks
from ..label.region_records import is_empty
from ..label.registry import get_labeller
from ..label.scalesim import require_systolic
from .config import FIDELITIES, LearnError
from .domain import program_fingerprint, reason_kind
from .features import HW_FEATURES, hardware_vector, resolve_target
from .registry import LoadedModel, load_surrogate, parse_model_ref, shipped_models
from .surrogate import Surrogate

_CACHE: dict[tuple, LoadedModel] = {}
# log10 distance beyond which a host-cpu is another machine (~25 %): the host micro-benchmark itself gives one
# box rates ~5-10 % apart from one measurement to the next
HOST_TOLERANCE = 0.1
_LOCK = threading.Lock()
_SIBLINGS_LOCK = threading.Lock()
FALLBACKS = ("auto", "labeller", "roofline", "off")


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
    references (default ``$HESPAS_ML_TRACKING_URI`` or ``./mlruns``). ``fallback``: who answers regions
    outside the model's training domain (one of :data:`FALLBACKS`; see the module docstring); ``progress``:
    a progress bar with an ETA on stderr while the fallback labels them.
    """

    def __init__(self, model: str | os.PathLike[str] | Surrogate = "roofline",
                 tracking_uri: str | os.PathLike[str] | None = None, fallback: str = "off", progress: bool = False):
        if fallback not in FALLBACKS:
            raise FidelityError(f"surrogate: fallback must be one of {', '.join(FALLBACKS)}, got {fallback!r}")
        self.fallback = fallback
        self.progress = progress
        self._fallbacks: dict[str, Any] = {}
        if isinstance(model, Surrogate):
            self.surrogate, self.source, self.load_s = model, "in-memory", 0.0
            self.name = f"surrogate:{model.config.fidelity}"
        else:
            loaded = load_model(model, tracking_uri)
            self.surrogate, self.source, self.load_s = loaded.surrogate, loaded.describe(), loaded.load_s
            self.name = f"surrogate:{model}"
        self.fidelity = self.surrogate.config.fidelity
        self.trained_targets = set(self.surrogate.trained_on.get("targets") or [])
        self._tracking_uri = tracking_uri
        self._shipped = model if isinstance(model, str) and model in FIDELITIES else None
        self._siblings: dict[str, SurrogateFidelity] = {}

    def _answering(self, target) -> "SurrogateFidelity":
        """The fidelity that answers ``target``: this one, or, for the shipped profiling model when it did not
        learn ``target``'s timings, the shipped model beside it that did (same name, fallback and progress)."""
        name = target.name
        if (self._shipped is None or self.fidelity != "profiling" or not self.trained_targets
                or name in self.trained_targets):
            return self
        with _SIBLINGS_LOCK:
            if not self._siblings:
                for ref in shipped_models(self._shipped)[1:]:
                    other = SurrogateFidelity(ref, self._tracking_uri, self.fallback, self.progress)
                    other.name = self.name
                    for learned in other.trained_targets:
                        self._siblings.setdefault(learned, other)
            return self._siblings.get(name, self)

    def label(self, region, target) -> Label:
        return self.label_regions([region], target)[0]

    def check_target(self, target) -> None:
        """Refuse (FidelityError, one line) what the learned fidelity itself refuses: a SCALE-Sim surrogate needs systolic
        arrays, and a profiling surrogate answers only for the machines whose timings it learned (profiling
        measures the machine it runs on; one machine's timings say nothing about another's, and with a single
        training target the hardware vector never varied, so the model could not even tell them apart)."""
        target = resolve_target(target)
        if (answering := self._answering(target)) is not self:
            return answering.check_target(target)
        name = target.name
        if self.fidelity == "scalesim":
            try:
                require_systolic(target)
            except FidelityError as exc:
                raise FidelityError(f"{self.name}: {exc}") from None
        if self.fidelity == "profiling" and self.trained_targets and name not in self.trained_targets:
            learned = sorted(self.trained_targets | set(self._siblings))
            raise FidelityError(f"{self.name}: learned the profiling timings of {', '.join(learned)} only, not of "
                                f"{name} (profiling measures the machine it runs on; use --target {learned[0]}, "
                                "or another fidelity)")

    def provenance(self, target) -> dict[str, Any]:
        """The model that answers: where it was loaded from, what it learned, its interval's coverage."""
        target = resolve_target(target)
        if (answering := self._answering(target)) is not self:
            return answering.provenance(target)
        trained = self.surrogate.trained_on
        return {"fidelity": self.name, "target": target.name, "model": self.source,
                "learned": self.fidelity, "targets_learned": sorted(self.trained_targets),
                "families_learned": trained.get("families"), "coverage": self.surrogate.calibration.coverage}

    def caveat(self, target) -> str | None:
        """What a user must know about these predictions on ``target``, in one line, or None. A profiling
        surrogate learned the timings of the machine its labels were measured on: when this machine's
        ``host-cpu`` (same name) measures differently, the predictions are still the other machine's. When
        ``host-cpu`` was measured on fewer cores than the machine has (the process was pinned), it says so:
        that alone makes the same machine measure as another."""
        target = resolve_target(target)
        if (answering := self._answering(target)) is not self:
            return answering.caveat(target)
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
        if (answering := self._answering(target)) is not self:
            return answering.label_regions(regions, target)
        self.check_target(target)
        pred = self.surrogate.predict_regions(regions, target)
        changed = [False] * len(regions)
        if len(pred.outside) == len(pred.seconds):
            modes = self._label_mode_changes(regions, target)
            changed = [bool(m) for m in modes]
            pred.outside = [[*reasons, *more] for reasons, more in zip(pred.outside, modes)]
            learned_s = pred.seconds
            self.surrogate.domain.shift(pred, changed)
            self.surrogate.domain.widen(pred)
        caveat = self.caveat(target)
        seen = target.name in self.trained_targets and caveat is None if self.trained_targets else None
        coverage = self.surrogate.calibration.coverage
        roof = pred.roofline if len(pred.roofline) == len(pred.seconds) else None
        outside = pred.outside if len(pred.outside) == len(pred.seconds) else None
        program_seen = self.seen_in_training(regions, pred.hashes)
        out = []
        for i in range(len(pred.seconds)):
            lo, s, hi = float(pred.lower[i]), float(pred.seconds[i]), float(pred.upper[i])
            meta: dict[str, Any] = {"coverage": coverage,
                                    "spread": float(pred.spread[i]) if len(pred.spread) else 0.0,
                                    "model": self.source, "bound": "learned", "seen_target": seen}
            if program_seen is not None:
                meta["program_seen_in_training"] = program_seen
            if outside is not None:
                meta["in_domain"] = not outside[i]
                if outside[i]:
                    meta["outside"] = list(outside[i])
            meta.update(lower_s=lo, upper_s=hi, interval=(lo, hi))
            if roof is not None:
                meta["roofline_s"] = float(roof[i])
            if changed[i] and self.surrogate.domain.mode_change is not None:
                meta["learned_mode_s"] = float(learned_s[i])        # its answer before the measured ratio
            if caveat is not None:
                meta["caveat"] = caveat
            out.append(Label(s, "ok", meta))
        away = [i for i, lab in enumerate(out) if lab.meta.get("in_domain") is False]
        if away:
            self._answer_outside(regions, out, away, target)
        return out

    def seen_in_training(self, regions: list, hashes: list[str]) -> bool | None:
        """Whether the program ``regions`` make up is one whose regions the model learned (by
        :func:`~hespas_ml.learn.domain.program_fingerprint`); None for a model that does not know."""
        domain = self.surrogate.domain
        if domain is None or not domain.programs or len(hashes) != len(regions):
            return None
        return program_fingerprint(h for r, h in zip(regions, hashes) if not is_empty(r)) in domain.programs

    def _label_mode_changes(self, regions: list, target) -> list[list[str]]:
        """Per region, where the labeller the model stands for (its fidelity at its default options)
        would label it in another way than the labels the model learned: a SCALE-Sim layer it simulates
        in full (memory stalls and all) that the learned labels' budget simulated without them."""
        learned = self.surrogate.domain.label_options if self.surrogate.domain is not None else None
        if self.fidelity != "scalesim" or learned is None:
            return [[] for _ in regions]
        from ..label.scalesim import ScaleSimFidelity

        budget = learned.get("budget_s")
        return [[f"label mode {', '.join(deeper)}: the labeller simulates it in more detail than the labels "
                 f"learned ({budget} s budget)"] if deeper else []
                for deeper in ScaleSimFidelity().deeper_modes(regions, target, learned)]

    def _fallback_for(self, target) -> tuple[str, Any] | None:
        """(name, fidelity) answering regions outside the training domain on ``target``, or None to keep the
        surrogate's answers."""
        if self.fallback == "off":
            return None
        names = {"auto": (self.fidelity, "calibrated-roofline", "roofline"), "labeller": (self.fidelity,),
                 "roofline": ("roofline",)}
        refused = None
        for name in dict.fromkeys(names[self.fallback]):
            try:
                fid = self._fallbacks.get(name) or get_labeller(name)
                fid.check_target(target)
            except FidelityError as exc:
                refused = exc
                continue
            self._fallbacks[name] = fid
            return name, fid
        raise FidelityError(f"{self.name}: --fallback {self.fallback}: {refused}")

    def _answer_outside(self, regions: list, labels: list[Label], away: list[int], target) -> None:
        """Answer the labels at ``away`` (regions outside the training domain) as :attr:`fallback` says,
        and give each of them the one-line caveat."""
        reasons: dict[str, int] = {}
        for i in away:
            for reason in labels[i].meta["outside"]:
                kind = reason_kind(reason)
                reasons[kind] = reasons.get(kind, 0) + 1
        why = "; ".join(f"{k}: {n}" for k, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:4])
        chosen = self._fallback_for(target)
        if chosen is None:
            pct = math.expm1(self.surrogate.domain.ood_half_width) * 100
            moved = self.surrogate.domain.mode_change
            scaled = ("; those whose label mode changes are scaled by the ratio measured for such a change, "
                      f"x{math.exp(moved['log_mid']):.2f} (x{math.exp(moved['log_low']):.2f} .. "
                      f"x{math.exp(moved['log_high']):.2f})" if moved is not None and any(
                          "label mode" in r for i in away for r in labels[i].meta["outside"]) else "")
            answer = (f"its answers there have intervals widened to ±{pct:.0f} %{scaled} (--fallback answers them "
                      "from the labeller or the roofline)")
        else:
            name, fid = chosen
            answered = label_in_chunks(fid, [regions[i] for i in away], target, progress=self.progress,
                                       desc=f"{name} labels of the regions outside {self.name}")
            for i, lab in zip(away, answered):
                if lab.status != "ok":
                    continue
                meta = {**labels[i].meta, **{k: v for k, v in lab.meta.items() if k != "bound"},
                        "surrogate_s": labels[i].seconds, "bound": f"fallback:{name}", "fallback": name}
                meta.update(lower_s=lab.seconds, upper_s=lab.seconds, interval=(lab.seconds, lab.seconds))
                labels[i] = Label(lab.seconds, "ok", meta)
            answer = (f"answered by the {name} {'labeller' if name != 'roofline' else 'estimate'} "
                      "(--fallback off keeps the surrogate's answer, interval widened)")
        line = (f"{self.name}: {len(away)} of {len(labels)} regions lie outside what it learned ({why}); {answer}")
        for i in away:
            labels[i].meta["caveat"] = line


def check_reference(model: str) -> None:
    """Raise a one-line error unless ``model`` parses as a model reference whose shipped folder (for a
    fidelity name) or path exists; registry references are checked when loaded."""
    ref = parse_model_ref(model)
    if ref.kind == "shipped" and not Path(ref.uri).is_dir():
        raise LearnError(f"surrogate:{model}: no shipped model in {ref.uri}")
