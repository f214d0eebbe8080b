"""The metrics of a fidelity study, as pure functions of tables (pandas DataFrames).

Inputs:

* ``steps``: one row per configuration and source — ``workload, system, target, source, step_time_s`` —
  only configurations that the source timed completely (failed or partial ones are left out before);
* ``regions``: per configuration, source and distinct region — ``workload, system, target, source, split,
  signature, seconds`` — and ``infos``: per workload, system, split and signature — ``count, family,
  op_kinds, shape``.

Metrics:

* **absolute % error** against the *reference*: per configuration, the first source of the reference chain
  that timed it; ``100 · |predicted / reference − 1|``;
* **speedup error** of a target transition A → B: speedup = ``t(A) / t(B)``; error =
  ``|predicted speedup / reference speedup − 1|`` (the reference: the first source of the chain that timed
  both A and B);
* **rank agreement**: Kendall τ-b between two sources' step times over the *designs* (target × system) of
  one workload, and over the workloads of one design; and whether both pick the same fastest one;
* **disagreement by op family and by region** between two fidelities on the same split: per region the log
  ratio ``ln(t_a / t_b)``; per family the weighted mean of ``|ln ratio|`` (weights: the region's share of
  its configuration's time, executions included) reported as ``100 · (e^mean − 1)`` %; per region its
  *step share*: ``100 · count · |t_a − t_b|`` over the larger of the two sources' configuration times
  (sums of the region times both have).
"""
from __future__ import annotations

import math
from itertools import combinations
from typing import Sequence

import numpy as np
import pandas as pd

from .study_spec import MEASURED

KEYS = ["workload", "system", "target"]
COLUMNS = {
    "errors": ["workload", "system", "target", "source", "reference", "predicted_s", "reference_s",
               "abs_pct_error", "signed_pct_error"],
    "error_summary": ["source", "reference", "n", "mean_abs_pct_error", "median_abs_pct_error",
                      "max_abs_pct_error", "mean_signed_pct_error"],
    "speedups": ["workload", "system", "from_target", "to_target", "source", "from_s", "to_s", "speedup",
                 "reference", "reference_speedup", "speedup_error"],
    "speedup_summary": ["source", "reference", "n", "mean_speedup_error", "median_speedup_error",
                        "max_speedup_error"],
    "rank_agreement": ["group_by", "group", "source_a", "source_b", "n", "kendall_tau", "best_a", "best_b",
                       "same_best"],
    "rank_summary": ["group_by", "source_a", "source_b", "groups", "mean_kendall_tau", "same_best_rate"],
    "family_disagreement": ["source_a", "source_b", "family", "targets", "n_regions", "weight",
                            "disagreement_pct", "ratio_a_over_b"],
    "top_regions": ["source_a", "source_b", "rank", "workload", "system", "target", "region", "family",
                    "op_kinds", "shape", "count", "a_s", "b_s", "ratio_a_over_b", "impact_s", "step_share_pct"],
}


def _frame(name: str, rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=COLUMNS[name])


def abs_pct_error(predicted: float, reference: float) -> float:
    """``100 · |predicted / reference − 1|``."""
    return 100.0 * abs(predicted / reference - 1.0)


def speedup_error(pred_from: float, pred_to: float, ref_from: float, ref_to: float) -> float:
    """``|(pred_from / pred_to) / (ref_from / ref_to) − 1|``: how wrong the predicted speedup of a move
    from one design to another is."""
    return abs((pred_from / pred_to) / (ref_from / ref_to) - 1.0)


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's τ-b of two equally long sequences (ties in either lower it); NaN for fewer than two
    items or when one side is constant."""
    n = len(a)
    if n != len(b):
        raise ValueError("kendall_tau needs sequences of equal length")
    concordant = discordant = ties_a = ties_b = 0
    for i in range(n):
        for j in range(i + 1, n):
            da = np.sign(a[i] - a[j])
            db = np.sign(b[i] - b[j])
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif da == db:
                concordant += 1
            else:
                discordant += 1
    denom = math.sqrt((concordant + discordant + ties_a) * (concordant + discordant + ties_b))
    return (concordant - discordant) / denom if denom else math.nan


def _lookup(steps: pd.DataFrame) -> dict[tuple, dict[str, float]]:
    """{(workload, system, target): {source: step time}}."""
    out: dict[tuple, dict[str, float]] = {}
    for row in steps.itertuples(index=False):
        out.setdefault((row.workload, row.system, row.target), {})[row.source] = float(row.step_time_s)
    return out


def _ordered(sources: Sequence[str], order: Sequence[str]) -> list[str]:
    rank = {s: i for i, s in enumerate(order)}
    return sorted(sources, key=lambda s: (rank.get(s, len(rank)), s))


def reference_errors(steps: pd.DataFrame, chain: Sequence[str], order: Sequence[str] = ()) -> pd.DataFrame:
    """Absolute and signed % error of every source against the configuration's reference (COLUMNS['errors'])."""
    rows = []
    for (w, s, t), times in _lookup(steps).items():
        ref = next((r for r in chain if r in times), None)
        if ref is None:
            continue
        for src in _ordered(times, order):
            if src in (ref, MEASURED):
                continue
            p, r = times[src], times[ref]
            rows.append({"workload": w, "system": s, "target": t, "source": src, "reference": ref,
                         "predicted_s": p, "reference_s": r, "abs_pct_error": abs_pct_error(p, r),
                         "signed_pct_error": 100.0 * (p / r - 1.0)})
    return _frame("errors", rows)


def error_summary(errors: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (src, ref), g in errors.groupby(["source", "reference"], sort=False):
        e = g["abs_pct_error"]
        rows.append({"source": src, "reference": ref, "n": len(g), "mean_abs_pct_error": e.mean(),
                     "median_abs_pct_error": e.median(), "max_abs_pct_error": e.max(),
                     "mean_signed_pct_error": g["signed_pct_error"].mean()})
    return _frame("error_summary", rows)


def speedups(steps: pd.DataFrame, chain: Sequence[str], transitions: Sequence[tuple[str, str]],
             order: Sequence[str] = ()) -> pd.DataFrame:
    """Every source's speedup over each transition, with the reference's and the speedup error
    (COLUMNS['speedups']; reference empty and error NaN where no source of the chain timed both ends, and
    for the reference itself)."""
    look = _lookup(steps)
    pairs = list(dict.fromkeys((w, s) for w, s, _ in look))
    rows = []
    for w, s in pairs:
        for a, b in transitions:
            ta, tb = look.get((w, s, a), {}), look.get((w, s, b), {})
            common = [x for x in _ordered(ta, order) if x in tb]
            ref = next((r for r in chain if r in common), None)
            for src in common:
                sp = ta[src] / tb[src]
                has_ref = ref is not None and src != ref
                rows.append({"workload": w, "system": s, "from_target": a, "to_target": b, "source": src,
                             "from_s": ta[src], "to_s": tb[src], "speedup": sp,
                             "reference": ref if has_ref else "",
                             "reference_speedup": ta[ref] / tb[ref] if has_ref else math.nan,
                             "speedup_error": speedup_error(ta[src], tb[src], ta[ref], tb[ref]) if has_ref
                             else math.nan})
    return _frame("speedups", rows)


def speedup_summary(table: pd.DataFrame) -> pd.DataFrame:
    rows = []
    scored = table[table["reference"] != ""]
    for (src, ref), g in scored.groupby(["source", "reference"], sort=False):
        e = g["speedup_error"]
        rows.append({"source": src, "reference": ref, "n": len(g), "mean_speedup_error": e.mean(),
                     "median_speedup_error": e.median(), "max_speedup_error": e.max()})
    return _frame("speedup_summary", rows)


def rank_agreement(steps: pd.DataFrame, order: Sequence[str] = ()) -> pd.DataFrame:
    """Kendall τ-b and fastest-choice agreement of every pair of sources, over the designs (target ×
    system) of each workload (``group_by = workload``) and over the workloads of each design
    (``group_by = design``); groups where the pair shares fewer than two items are left out."""
    rows = []
    groupings = (("workload", ["workload"], ["target", "system"]), ("design", ["target", "system"], ["workload"]))
    for group_by, by, items in groupings:
        for key, g in steps.groupby(by, sort=False):
            key = key if isinstance(key, tuple) else (key,)
            label = key[0] if group_by == "workload" else (key[0] if key[1] == "single" else f"{key[0]} @ {key[1]}")
            wide = g.pivot_table(index=items, columns="source", values="step_time_s", aggfunc="first")
            for a, b in combinations(_ordered(list(wide.columns), order), 2):
                both = wide[[a, b]].dropna()
                if len(both) < 2:
                    continue
                names = [" @ ".join(str(x) for x in (i if isinstance(i, tuple) else (i,)) if x != "single")
                         for i in both.index]
                best_a = names[int(np.argmin(both[a].to_numpy()))]
                best_b = names[int(np.argmin(both[b].to_numpy()))]
                rows.append({"group_by": group_by, "group": label, "source_a": a, "source_b": b, "n": len(both),
                             "kendall_tau": kendall_tau(list(both[a]), list(both[b])), "best_a": best_a,
                             "best_b": best_b, "same_best": best_a == best_b})
    return _frame("rank_agreement", rows)


def rank_summary(table: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (gb, a, b), g in table.groupby(["group_by", "source_a", "source_b"], sort=False):
        rows.append({"group_by": gb, "source_a": a, "source_b": b, "groups": len(g),
                     "mean_kendall_tau": g["kendall_tau"].mean(), "same_best_rate": g["same_best"].mean()})
    return _frame("rank_summary", rows)


def region_pairs(regions: pd.DataFrame, infos: pd.DataFrame, order: Sequence[str] = ()) -> pd.DataFrame:
    """Per pair of sources on the same split and per region both timed (positive times): ``a_s``, ``b_s``,
    ``count``, family, op kinds, shape, ``log_ratio`` = ln(a/b), ``weight`` (the region's share of its
    configuration's time, mean of the two sources), ``impact_s`` (executions × |a − b|) and
    ``step_share_pct`` (``impact_s`` over the larger of the two sources' sums of the configuration's region
    times, so at most 100)."""
    frames = []
    if regions.empty:
        return pd.DataFrame()
    ok = regions[np.isfinite(regions["seconds"]) & (regions["seconds"] > 0)]
    for split, g in ok.groupby("split", sort=False):
        wide = g.pivot_table(index=["workload", "system", "target", "signature"], columns="source",
                             values="seconds", aggfunc="first")
        for a, b in combinations(_ordered(list(wide.columns), order), 2):
            both = wide[[a, b]].dropna().reset_index().rename(columns={a: "a_s", b: "b_s"})
            if both.empty:
                continue
            both = both.merge(infos[infos["split"] == split], on=["workload", "system", "signature"], how="left")
            both["source_a"], both["source_b"] = a, b
            keys = [both["workload"], both["system"], both["target"]]
            mean_t = both["count"] * (both["a_s"] + both["b_s"]) / 2.0
            total_a = (both["count"] * both["a_s"]).groupby(keys).transform("sum")
            total_b = (both["count"] * both["b_s"]).groupby(keys).transform("sum")
            both["log_ratio"] = np.log(both["a_s"] / both["b_s"])
            both["weight"] = mean_t / mean_t.groupby(keys).transform("sum")
            both["impact_s"] = both["count"] * (both["a_s"] - both["b_s"]).abs()
            both["step_share_pct"] = 100.0 * both["impact_s"] / np.maximum(total_a, total_b)
            frames.append(both)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def family_disagreement(pairs: pd.DataFrame, families: Sequence[str]) -> pd.DataFrame:
    rows = []
    if pairs.empty:
        return _frame("family_disagreement", rows)
    rank = {f: i for i, f in enumerate(families)}
    for (a, b), g in pairs.groupby(["source_a", "source_b"], sort=False):
        for fam, h in sorted(g.groupby("family"), key=lambda kv: rank.get(kv[0], len(rank))):
            w = h["weight"].to_numpy()
            lr = h["log_ratio"].to_numpy()
            wsum = w.sum()
            mean_abs = float((w * np.abs(lr)).sum() / wsum) if wsum > 0 else float(np.abs(lr).mean())
            mean_signed = float((w * lr).sum() / wsum) if wsum > 0 else float(lr.mean())
            rows.append({"source_a": a, "source_b": b, "family": fam,
                         "targets": ", ".join(dict.fromkeys(h["target"])), "n_regions": len(h),
                         "weight": float(wsum), "disagreement_pct": 100.0 * (math.exp(mean_abs) - 1.0),
                         "ratio_a_over_b": math.exp(mean_signed)})
    return _frame("family_disagreement", rows)


def top_regions(pairs: pd.DataFrame, n: int) -> pd.DataFrame:
    """Per pair of sources, the ``n`` regions whose disagreement moves the step time most."""
    rows = []
    if pairs.empty:
        return _frame("top_regions", rows)
    for (a, b), g in pairs.groupby(["source_a", "source_b"], sort=False):
        top = g.sort_values("step_share_pct", ascending=False, kind="stable").head(n)
        for i, r in enumerate(top.itertuples(index=False), 1):
            rows.append({"source_a": a, "source_b": b, "rank": i, "workload": r.workload, "system": r.system,
                         "target": r.target, "region": r.signature[:12], "family": r.family,
                         "op_kinds": r.op_kinds, "shape": r.shape, "count": int(r.count), "a_s": r.a_s,
                         "b_s": r.b_s, "ratio_a_over_b": r.a_s / r.b_s, "impact_s": r.impact_s,
                         "step_share_pct": r.step_share_pct})
    return _frame("top_regions", rows)
