"""What a surrogate learned from: its training domain, and whether a region lies inside it.

A :class:`Domain` is fitted on the regions a model trained on (their target-independent features,
:class:`~hespas_ml.learn.features.RegionArrays`): the ops that occurred, and the range of every region
aggregate (:data:`~hespas_ml.learn.features.REGION_FEATURES`) and of the largest GEMM dimensions. A region
is outside when it holds an op no training region held, or when one of those figures lies beyond the
trained range by more than ``margin`` (the features are base-2 logarithms: a margin of 1 lets a region be
up to twice as large or small as anything learned). The target is checked separately, against the hardware
vectors the model saw (:meth:`~hespas_ml.learn.surrogate.Surrogate.hardware_outside_training`; not for a
profiling model, whose machine the fidelity's caveat speaks for), and so are the labeller's
options the labels were taken with (``label_options``): a SCALE-Sim label depends on its budget (a layer
too slow to simulate in full within it is simulated without its memory stalls), so a model of labels
taken with a 2 s budget does not know what the default labeller does with such a layer
(:mod:`hespas_ml.learn.fidelity`).

When a region's label mode changes so, what the change does is known from measurements
(``mode_change``: the 5th, 50th and 95th percentiles of log(default labeller / learned options' labeller) over
the mode-changed regions of other programs, ``eval/fit_mode_change.py``): the surrogate's answer for such a region
is scaled by the median ratio and its interval reaches the 5th and 95th percentiles (:meth:`Domain.shift`).

A network answers such a region anyway, usually as the nearest thing it knows, and its ensemble agrees on
that answer: its interval says nothing about how wrong it is. So the surrogate widens the interval of an
outside region to ``ood_half_width`` (log-space, what held-out families and sizes showed), and the surrogate
fidelity warns and can answer it from the labeller instead (:mod:`hespas_ml.learn.fidelity`).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from .config import LearnError
from .features import REGION_FEATURES, RegionArrays

GEMM_FEATURES = ("log_gemm_m", "log_gemm_n", "log_gemm_k")
FEATURES = (*REGION_FEATURES, *GEMM_FEATURES)
DEFAULT_MARGIN = 1.0

__all__ = ["DEFAULT_MARGIN", "Domain", "FEATURES", "domain_features", "learned_programs", "program_fingerprint",
           "reason_kind"]


def reason_kind(reason: str) -> str:
    """What kind of reason :meth:`Domain.outside` gave, for counting: ``log_bytes above the learned range``
    for any ``log_bytes … above the learned …``; other reasons as they are."""
    words = reason.split(" ")
    return f"{words[0]} {words[2]} the learned range" if words[2:3] in (["above"], ["below"]) else reason


def program_fingerprint(hashes: Iterable[str]) -> str:
    """A program's fingerprint: a hash of the set of its regions' structural hashes (empty regions left
    out, as a dataset build leaves them out), so the same program exported twice, or given as a file and
    as a zoo spec, has one fingerprint under one split."""
    return hashlib.sha256("\n".join(sorted(set(hashes))).encode()).hexdigest()[:16]


def learned_programs(dataset, hashes: Iterable[str]) -> dict[str, str]:
    """``{fingerprint: source}`` of the programs of ``dataset`` that hold at least one of the regions
    ``hashes`` (the regions a model learned); a file's source is its name, without its folders."""
    regions = dataset.regions
    learned = set(hashes)
    by_program: dict[str, list[str]] = {}
    for digest, programs in zip(regions["hash"], regions["programs"]):
        for source in (json.loads(programs) if isinstance(programs, str) else programs):
            by_program.setdefault(source, []).append(digest)
    return {program_fingerprint(digests): _portable(source) for source, digests in sorted(by_program.items())
            if learned.intersection(digests)}


def _portable(source: str) -> str:
    """A program's name without the folders of the machine that read it (zoo specs as they are)."""
    return source if source.startswith("zoo:") else Path(source).name


def domain_features(arrays: Sequence[RegionArrays]) -> np.ndarray:
    """``[regions, len(FEATURES)]``: the region aggregates and log2(1 + the largest GEMM M, N and K)
    (0 for a region without a GEMM)."""
    out = np.zeros((len(arrays), len(FEATURES)))
    for i, a in enumerate(arrays):
        out[i, :len(REGION_FEATURES)] = a.region
        if len(a.gemms):
            out[i, len(REGION_FEATURES):] = np.log2(1.0 + a.gemms[:, 2:5].max(axis=0))
    return out


@dataclass
class Domain:
    """The training domain of a surrogate (see the module docstring). ``ops``: the op names learned;
    ``ranges``: ``{feature: (lowest, highest)}``; ``ood_half_width``: the log-space interval half-width
    given to a region outside it; ``fitted_on``: what it was fitted from, in words; ``label_options``: the
    labeller options of the labels it learned (None: not known); ``programs``: ``{fingerprint: source}`` of
    the programs whose regions it learned (:func:`program_fingerprint`)."""

    ops: list[str] = field(default_factory=list)
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    margin: float = DEFAULT_MARGIN
    ood_half_width: float = math.log(2.0)
    regions: int = 0
    fitted_on: str = ""
    label_options: dict[str, Any] | None = None
    programs: dict[str, str] = field(default_factory=dict)     # fingerprint -> source of the programs learned
    mode_change: dict[str, Any] | None = None     # log_low / log_mid / log_high of a label-mode change, measured

    @classmethod
    def fit(cls, arrays: Sequence[RegionArrays], vocabulary: Sequence[str], *, fitted_on: str = "",
            ood_half_width: float = math.log(2.0), margin: float = DEFAULT_MARGIN,
            label_options: dict[str, Any] | None = None, programs: dict[str, str] | None = None) -> "Domain":
        """The domain of the training regions ``arrays`` (featurised with ``vocabulary``)."""
        if not len(arrays):
            raise LearnError("a training domain needs at least one region")
        feats = domain_features(arrays)
        seen = np.unique(np.concatenate([a.op for a in arrays]))
        ops = sorted(vocabulary[i - 1] for i in seen.tolist() if 0 < i <= len(vocabulary))
        ranges = {f: (float(feats[:, j].min()), float(feats[:, j].max())) for j, f in enumerate(FEATURES)}
        return cls(ops=ops, ranges=ranges, margin=margin, ood_half_width=ood_half_width, regions=len(arrays),
                   fitted_on=fitted_on, label_options=label_options, programs=dict(programs or {}))

    def outside(self, arrays: Sequence[RegionArrays], vocabulary: Sequence[str]) -> list[list[str]]:
        """Per region, why it lies outside the domain (empty: inside), e.g. ``op reduce_window not learned``
        or ``log_bytes 21.3 above the learned 18.9``."""
        known = {name: i + 1 for i, name in enumerate(vocabulary)}
        learned = {known[o] for o in self.ops if o in known}
        feats = domain_features(arrays)
        columns = [(j, f, *self.ranges[f]) for j, f in enumerate(FEATURES) if f in self.ranges]
        out: list[list[str]] = []
        for i, a in enumerate(arrays):
            reasons = []
            unseen = sorted({int(o) for o in a.op.tolist()} - learned)
            if unseen:
                names = [vocabulary[o - 1] if 0 < o <= len(vocabulary) else "an unknown op" for o in unseen]
                reasons.append(f"op {', '.join(names)} not learned")
            for j, f, lo, hi in columns:
                v = feats[i, j]
                if v > hi + self.margin:
                    reasons.append(f"{f} {v:.1f} above the learned {hi:.1f}")
                elif v < lo - self.margin:
                    reasons.append(f"{f} {v:.1f} below the learned {lo:.1f}")
            out.append(reasons)
        return out

    def widen(self, pred) -> None:
        """Widen, in place, the interval of every record of ``pred`` (a
        :class:`~hespas_ml.learn.ensemble.Prediction`) that lies outside (``pred.outside``) to at least
        ``ood_half_width`` either side of its point prediction."""
        away = np.asarray([bool(r) for r in pred.outside], dtype=bool)
        if len(away) != len(pred.seconds) or not away.any():
            return
        factor = math.exp(self.ood_half_width)
        pred.lower = np.where(away, np.minimum(pred.lower, pred.seconds / factor), pred.lower)
        pred.upper = np.where(away, np.maximum(pred.upper, pred.seconds * factor), pred.upper)

    def shift(self, pred, changed: Sequence[bool]) -> None:
        """Answer, in place, the records of ``pred`` whose label mode changes (``changed``) as the measured
        ``mode_change`` says: the point times the median ratio, the interval at least from the 5th to the 95th
        percentile ratio of the learned answer (and the learned interval moved with the point). Nothing without
        a measured ``mode_change``."""
        away = np.asarray(changed, dtype=bool)
        if self.mode_change is None or len(away) != len(pred.seconds) or not away.any():
            return
        low, mid, high = (math.exp(self.mode_change[k]) for k in ("log_low", "log_mid", "log_high"))
        learned = pred.seconds
        pred.seconds = np.where(away, learned * mid, learned)
        pred.lower = np.where(away, np.minimum(pred.lower * mid, learned * low), pred.lower)
        pred.upper = np.where(away, np.maximum(pred.upper * mid, learned * high), pred.upper)

    def to_dict(self) -> dict[str, Any]:
        return {"ops": list(self.ops), "ranges": {f: list(v) for f, v in self.ranges.items()},
                "margin": self.margin, "ood_half_width": self.ood_half_width, "regions": self.regions,
                "fitted_on": self.fitted_on, "label_options": self.label_options, "programs": dict(self.programs),
                "mode_change": self.mode_change}

    @classmethod
    def from_dict(cls, data: dict, origin: str) -> "Domain":
        try:
            out = cls(ops=[str(o) for o in data["ops"]],
                      ranges={str(f): (float(v[0]), float(v[1])) for f, v in data["ranges"].items()},
                      margin=float(data["margin"]), ood_half_width=float(data["ood_half_width"]),
                      regions=int(data.get("regions", 0)), fitted_on=str(data.get("fitted_on", "")),
                      label_options=dict(data["label_options"]) if data.get("label_options") is not None else None,
                      programs={str(k): str(v) for k, v in (data.get("programs") or {}).items()},
                      mode_change=_mode_change(data.get("mode_change")))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise LearnError(f"{origin}: bad training domain ({type(exc).__name__}: {exc})") from None
        if not (out.margin >= 0 and out.ood_half_width > 0 and math.isfinite(out.ood_half_width)):
            raise LearnError(f"{origin}: bad training domain values (margin {out.margin}, ood_half_width "
                             f"{out.ood_half_width})")
        return out


def _mode_change(data: Any) -> dict[str, Any] | None:
    """A domain's ``mode_change`` as stored (None when absent); KeyError/ValueError when malformed."""
    if data is None:
        return None
    out = {**data, **{k: float(data[k]) for k in ("log_low", "log_mid", "log_high")}}
    if not out["log_low"] <= out["log_mid"] <= out["log_high"]:
        raise ValueError(f"mode_change percentiles out of order: {data}")
    return out
