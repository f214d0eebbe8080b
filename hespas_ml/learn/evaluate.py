"""Accuracy figures of a surrogate (or a baseline) on labelled rows.

* APE — absolute percentage error ``|pred − true| / true`` of one (region, target) label; reported as
  the median and the 90th percentile.
* Kendall τ — rank agreement of predicted and true times. Rows of different targets are not mixed
  (that would reward getting the targets' speed ratios right, which the roofline already does): τ is
  computed within each target and averaged, weighted by rows; ``kendall_tau_pooled`` is over all rows.
* coverage — share of true labels inside ``[lower, upper]`` (when intervals are given).

:func:`report` returns these overall and per family (``regions.family``) and per target;
:func:`split_report` adds them per op family (:func:`hespas_ml.split.families.region_family`);
:func:`table` prints rows of such reports.
"""
from __future__ import annotations

import json
from typing import Any, Iterable

import numpy as np
import pandas as pd
from scipy.stats import kendalltau

from ..split.families import region_family

TARGETS = {"roofline": (0.02, 0.05, 0.98), "scalesim": (0.05, 0.15, 0.95), "profiling": (0.10, 0.25, 0.90)}
"""Per fidelity: (median APE, p90 APE, Kendall τ) the surrogate aims for on held-out families."""


def _tau(pred: np.ndarray, true: np.ndarray) -> float:
    if len(true) < 2:
        return float("nan")
    tau = kendalltau(pred, true).statistic
    return float(tau) if tau == tau else float("nan")


def metrics(pred: np.ndarray, true: np.ndarray, lower: np.ndarray | None = None, upper: np.ndarray | None = None,
            groups: np.ndarray | None = None) -> dict[str, float]:
    """The figures of one set of rows (``groups``: the target of each row, for τ)."""
    pred, true = np.asarray(pred, dtype=np.float64), np.asarray(true, dtype=np.float64)
    n = len(true)
    if n == 0:
        return {"n": 0}
    ape = np.abs(pred - true) / true
    out: dict[str, float] = {"n": n, "median_ape": float(np.median(ape)), "p90_ape": float(np.quantile(ape, 0.9)),
                             "mean_ape": float(np.mean(ape)),
                             "log_rmse": float(np.sqrt(np.mean((np.log(pred) - np.log(true)) ** 2)))}
    if groups is None:
        out["kendall_tau"] = _tau(pred, true)
    else:
        taus, weights = [], []
        for g in pd.unique(groups):
            sel = groups == g
            t = _tau(pred[sel], true[sel])
            if t == t:
                taus.append(t)
                weights.append(int(sel.sum()))
        out["kendall_tau"] = float(np.average(taus, weights=weights)) if taus else float("nan")
    out["kendall_tau_pooled"] = _tau(pred, true)
    if lower is not None and upper is not None and len(lower) == n:
        lower, upper = np.asarray(lower), np.asarray(upper)
        out["coverage"] = float(np.mean((true >= lower) & (true <= upper)))
        out["median_width"] = float(np.median(upper / np.maximum(lower, 1e-300)))
    return out


def report(rows: pd.DataFrame, pred: np.ndarray, lower: np.ndarray | None = None,
           upper: np.ndarray | None = None) -> dict[str, Any]:
    """Overall figures plus ``per_family`` and ``per_target`` dicts for label rows (from
    :func:`~hespas_ml.learn.tables.label_rows`) and their predictions."""
    true = rows["seconds"].to_numpy(dtype=np.float64)
    tg = rows["target"].to_numpy()
    out: dict[str, Any] = metrics(pred, true, lower, upper, tg)

    def part(sel: np.ndarray) -> dict[str, float]:
        return metrics(pred[sel], true[sel], None if lower is None else lower[sel],
                       None if upper is None else upper[sel], tg[sel])

    fam = rows["family"].to_numpy()
    out["per_family"] = {str(f): part(fam == f) for f in sorted(pd.unique(fam))}
    out["per_target"] = {str(t): part(tg == t) for t in sorted(pd.unique(tg))}
    return out


def op_families(dataset, hashes: Iterable[str]) -> np.ndarray:
    """The op family (:func:`~hespas_ml.split.families.region_family`) of each region hash of ``dataset``."""
    table = dataset.regions.set_index("hash")["op_counts"]
    cache: dict[str, str] = {}
    out = []
    for h in hashes:
        fam = cache.get(h)
        if fam is None:
            raw = table.get(h)
            counts = json.loads(raw) if isinstance(raw, str) else (raw or {})
            fam = cache[h] = region_family(counts)
        out.append(fam)
    return np.asarray(out, dtype=object)


def split_report(rows, pred, ops: np.ndarray) -> dict[str, Any]:
    """:func:`~hespas_ml.learn.evaluate.report` plus ``per_op`` (op family) figures."""
    lower, upper = getattr(pred, "lower", None), getattr(pred, "upper", None)
    seconds = getattr(pred, "seconds", pred)
    out = report(rows, seconds, lower, upper)
    true, tg = rows["seconds"].to_numpy(dtype=np.float64), rows["target"].to_numpy()
    out["per_op"] = {}
    for fam in sorted(set(ops)):
        sel = ops == fam
        out["per_op"][fam] = metrics(seconds[sel], true[sel], None if lower is None else lower[sel],
                                     None if upper is None else upper[sel], tg[sel])
    return out


def table(records: Iterable[dict[str, Any]], columns: list[str]) -> str:
    """A plain-text table of ``records`` (floats as percentages for *_ape / coverage, else 3 decimals)."""
    records = list(records)

    def fmt(key: str, value: Any) -> str:
        if isinstance(value, float):
            if value != value:
                return "-"
            if key.endswith("ape") or key == "coverage":
                return f"{100 * value:.2f}%"
            return f"{value:.3f}"
        return str(value)

    cells = [[fmt(c, r.get(c, "")) for c in columns] for r in records]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def measure_speed(surrogate, records: list[dict[str, Any]], target, repeats: int = 3) -> dict[str, float]:
    """Bulk prediction throughput of ``surrogate.predict_records(records, target)`` in regions per second.

    ``cold``: a fresh featuriser cache each time (featurise + forward, ensemble included); ``warm``: the
    records' features cached (forward and target features only), as when the same regions are asked
    for several targets. Best of ``repeats`` (the machine is shared). Records should have distinct
    hashes, or the deduplication in ``predict_records`` is what gets measured.
    """
    import time

    from .features import Featuriser

    vocab = surrogate.featuriser.vocabulary
    cold, warm = float("inf"), float("inf")
    for _ in range(repeats):
        surrogate.featuriser = Featuriser(vocab)
        t0 = time.perf_counter()
        surrogate.predict_records(records, target)
        cold = min(cold, time.perf_counter() - t0)
        t0 = time.perf_counter()
        surrogate.predict_records(records, target)
        warm = min(warm, time.perf_counter() - t0)
    n = len(records)
    return {"n": n, "cold_regions_per_s": n / cold, "warm_regions_per_s": n / warm}
