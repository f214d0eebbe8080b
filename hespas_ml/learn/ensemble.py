"""Uncertainty: from the ensemble members' predictions to a calibrated interval, and :class:`Prediction`.

The members (different initialisations, bootstrap weights and data order; trained together, see
:mod:`hespas_ml.learn.model`) each predict log-seconds. The point prediction is their mean ``μ``; their
spread ``σ`` (standard deviation) measures disagreement. The interval is normalised split-conformal on
the validation regions: with scores ``|y − μ| / (σ + σ₀)`` (``σ₀`` = the median validation spread, so that
members that happen to agree still get a sensible width), the half-width is ``q · (σ + σ₀)`` where ``q``
is the ``⌈(n + 1)·coverage⌉ / n`` quantile of the validation scores. Intervals are symmetric in log space,
always contain the point prediction, and widen monotonically with disagreement. Coverage is only
guaranteed for data like the validation set; the evaluation reports the coverage reached on held-out
families / sizes / arrays.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .config import LearnError


@dataclass
class Prediction:
    """Per record: ``seconds`` (the point prediction) and the interval ``[lower, upper]``; ``spread``
    (the members' standard deviation of log-seconds), ``roofline`` (the analytical estimate) and, where the
    model knows its training domain, ``outside`` (why a record lies outside it; empty when inside) too."""

    seconds: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    spread: np.ndarray = field(default_factory=lambda: np.zeros(0))
    roofline: np.ndarray = field(default_factory=lambda: np.zeros(0))
    outside: list[list[str]] = field(default_factory=list)   # per record, why it is outside the training domain
    hashes: list[str] = field(default_factory=list)           # per live region predicted, its structural hash

    def __len__(self) -> int:
        return len(self.seconds)


def member_stats(log_members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean, standard deviation) over members (axis 0) of ``[members, rows]`` log-seconds."""
    log_members = np.asarray(log_members, dtype=np.float64)
    if log_members.ndim != 2 or log_members.shape[0] < 1:
        raise LearnError(f"member predictions must be [members, rows], got shape {log_members.shape}")
    std = log_members.std(axis=0) if log_members.shape[0] > 1 else np.zeros(log_members.shape[1])
    return log_members.mean(axis=0), std


@dataclass
class IntervalCalibration:
    """Half-width of the log-space interval: ``scale · (σ + floor)``."""

    scale: float = 1.6448536269514722     # a normal 90 % quantile until calibrated
    floor: float = 0.05
    coverage: float = 0.9
    n: int = 0                            # validation rows it was calibrated on

    @classmethod
    def fit(cls, mean: np.ndarray, std: np.ndarray, y: np.ndarray, coverage: float) -> "IntervalCalibration":
        """Calibrate on validation rows (log-space mean, spread and truth)."""
        mean, std, y = (np.asarray(a, dtype=np.float64) for a in (mean, std, y))
        if len(y) == 0:
            raise LearnError("interval calibration needs at least one validation row")
        floor = float(max(np.median(std), 1e-3))
        scores = np.abs(y - mean) / (std + floor)
        level = min(1.0, math.ceil((len(y) + 1) * coverage) / len(y))
        scale = float(np.quantile(scores, level, method="higher"))
        return cls(scale=scale, floor=floor, coverage=coverage, n=int(len(y)))

    def half_width(self, std: np.ndarray) -> np.ndarray:
        return self.scale * (np.asarray(std, dtype=np.float64) + self.floor)

    def predict(self, mean: np.ndarray, std: np.ndarray, roofline: np.ndarray | None = None) -> Prediction:
        """A :class:`Prediction` from log-space mean and spread."""
        hw = self.half_width(std)
        return Prediction(seconds=np.exp(mean), lower=np.exp(mean - hw), upper=np.exp(mean + hw),
                          spread=np.asarray(std, dtype=np.float64),
                          roofline=np.zeros(0) if roofline is None else np.exp(np.asarray(roofline, np.float64)))

    def to_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "floor": self.floor, "coverage": self.coverage, "n": self.n}

    @classmethod
    def from_dict(cls, data: dict, origin: str) -> "IntervalCalibration":
        try:
            out = cls(scale=float(data["scale"]), floor=float(data["floor"]), coverage=float(data["coverage"]),
                      n=int(data["n"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise LearnError(f"{origin}: bad interval calibration ({type(exc).__name__}: {exc})") from None
        if not (math.isfinite(out.scale) and out.scale >= 0 and math.isfinite(out.floor) and out.floor > 0):
            raise LearnError(f"{origin}: bad interval calibration values {data}")
        return out
