"""The study's HTML report: one self-contained file (inline CSS, plots as base64 PNG, no script, no links out).

Sections: overview, step times, accuracy against the reference (parity plot, error bars, tables), speedups
across target transitions (trend lines, tables), rank agreement, where fidelities disagree (heat map of
fidelity pair × op family, top regions), and configurations that could not be timed.
"""
from __future__ import annotations

import base64
import html
import io
import math
import platform
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd

from .study_spec import MEASURED, StudySpec

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f",
           "#bcbd22")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
NOISY = 0.2                 # label noise (IQR / median) above which a configuration is listed as noisy

CSS = """
body{font-family:-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:24px auto;max-width:1320px;
color:#1d232a;background:#fff;line-height:1.45;padding:0 16px}
h1{font-size:26px;margin:0 0 4px}h2{font-size:20px;border-bottom:2px solid #e3e7ec;padding-bottom:4px;
margin-top:34px}h3{font-size:16px;margin:22px 0 6px}p.note{color:#56606b;font-size:13px;margin:4px 0 10px}p.warn{color:#9a3b00;font-weight:600;margin:6px 0 10px}
table{border-collapse:collapse;font-size:12.5px;margin:6px 0 14px}
th,td{border:1px solid #d5dbe1;padding:3px 6px;text-align:right;white-space:nowrap}
th{background:#eef2f6;position:sticky;top:0}td.t,th.t{text-align:left}tr:nth-child(even) td{background:#f8fafc}
td.wrap{white-space:normal;min-width:240px;max-width:420px;text-align:left;
font-family:ui-monospace,Menlo,Consolas,monospace;font-size:11.5px}
td.soft{white-space:normal;max-width:170px;text-align:left;overflow-wrap:anywhere}
.kpis{display:flex;flex-wrap:wrap;gap:10px;margin:12px 0}.kpi{border:1px solid #d5dbe1;border-radius:6px;
padding:8px 12px;min-width:120px}.kpi b{display:block;font-size:20px}.kpi span{color:#56606b;font-size:12px}
img.plot{max-width:100%;border:1px solid #e3e7ec;border-radius:4px;margin:6px 0}
details{margin:6px 0 12px}summary{cursor:pointer;color:#174ea6}
.scroll{overflow-x:auto}.bad{color:#b3261e}.good{color:#1e7b34}code{background:#f1f3f5;padding:0 3px}
"""


# ------------------------------------------------------------------------------------------ formatting

def fmt_time(s: float) -> str:
    """Seconds in a readable unit (ns, µs, ms, s)."""
    if s is None or not isinstance(s, (int, float)) or not math.isfinite(s):
        return "–"
    a = abs(s)
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if a >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def _num(v: Any, kind: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if kind == "time":
        return fmt_time(float(v))
    if kind == "pct":
        return f"{float(v):,.1f} %"
    if kind == "ratio":
        return f"{float(v):.3g}"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        return f"{float(v):.3g}"
    return str(v)


def _kind(col: str) -> str:
    if col.endswith("_s") or col in ("seconds",):
        return "time"
    if "pct" in col:
        return "pct"
    if col in ("kendall_tau", "mean_kendall_tau", "same_best_rate", "speedup", "reference_speedup",
               "speedup_error", "mean_speedup_error", "median_speedup_error", "max_speedup_error",
               "ratio_a_over_b", "weight"):
        return "ratio"
    return ""


def table_html(df: pd.DataFrame, *, kinds: dict[str, str] | None = None, limit: int | None = None,
               wrap: Sequence[str] = (), soft: Sequence[str] = ()) -> str:
    """An HTML table of ``df``: numbers right-aligned and formatted by column kind, text escaped; columns in
    ``wrap`` wrap in monospace (shapes), those in ``soft`` wrap in the body font."""
    if df is None or df.empty:
        return '<p class="note">(no rows)</p>'
    kinds = kinds or {}
    shown = df.head(limit) if limit else df
    head = "".join(f'<th class="{"" if pd.api.types.is_numeric_dtype(shown[c]) else "t"}">{html.escape(str(c))}</th>'
                   for c in shown.columns)
    body = []
    for row in shown.itertuples(index=False):
        cells = []
        for c, v in zip(shown.columns, row):
            k = kinds.get(c, _kind(str(c)))
            text = html.escape(_num(v, k))
            cls = "wrap" if c in wrap else ("soft" if c in soft else ("t" if isinstance(v, str) else ""))
            cells.append(f'<td class="{cls}">{text}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    more = f'<p class="note">… {len(df) - len(shown)} more rows in the CSV</p>' if len(shown) < len(df) else ""
    return (f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'
            f"</div>{more}")


# ------------------------------------------------------------------------------------------ plots

def _figure(w: float, h: float):
    from matplotlib.figure import Figure
    return Figure(figsize=(w, h), dpi=100, layout="constrained")


def _png(fig, alt: str) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img class="plot" alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _colors(sources: Iterable[str]) -> dict[str, str]:
    return {s: PALETTE[i % len(PALETTE)] for i, s in enumerate(dict.fromkeys(sources))}


def parity_plot(errors: pd.DataFrame, colors: dict[str, str]) -> str:
    """Predicted against reference step time, log-log, one colour per source, one marker per reference."""
    if errors.empty:
        return ""
    fig = _figure(7.5, 5.6)
    ax = fig.add_subplot()
    refs = list(dict.fromkeys(errors["reference"]))
    for (src, ref), g in errors.groupby(["source", "reference"], sort=False):
        ax.scatter(g["reference_s"], g["predicted_s"], s=34, color=colors[src], alpha=0.85, edgecolor="black",
                   linewidth=0.4, marker=MARKERS[refs.index(ref) % len(MARKERS)], label=f"{src} vs {ref}")
    lo = float(min(errors["reference_s"].min(), errors["predicted_s"].min())) / 2
    hi = float(max(errors["reference_s"].max(), errors["predicted_s"].max())) * 2
    xs = np.array([lo, hi])
    ax.plot(xs, xs, color="black", linewidth=1, label="exact")
    for f in (2.0, 0.5):
        ax.plot(xs, xs * f, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("reference step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title("Parity: predicted vs reference (dashed: 2× off)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return _png(fig, "parity plot of predicted against reference step times")


def error_bars(errors: pd.DataFrame, colors: dict[str, str]) -> str:
    """Mean absolute % error per source (bar), interquartile range (whisker) and each configuration (dots)."""
    if errors.empty:
        return ""
    groups = list(errors.groupby(["source", "reference"], sort=False))
    fig = _figure(max(5.0, 1.3 * len(groups) + 2), 4.4)
    ax = fig.add_subplot()
    rng = np.random.default_rng(0)
    for i, ((src, ref), g) in enumerate(groups):
        e = g["abs_pct_error"].to_numpy()
        mean, q1, q3 = e.mean(), np.percentile(e, 25), np.percentile(e, 75)
        ax.bar(i, mean, color=colors[src], alpha=0.55, width=0.6)
        ax.errorbar(i, mean, yerr=[[max(mean - q1, 0)], [max(q3 - mean, 0)]], color="black", capsize=6, linewidth=1.2)
        ax.scatter(i + rng.uniform(-0.18, 0.18, len(e)), e, s=12, color="black", alpha=0.6, zorder=3)
    ax.set_xticks(range(len(groups)), [f"{s}\nvs {r}" for (s, r), _ in groups], fontsize=9)
    ax.set_ylabel("absolute error (%)")
    vals = errors["abs_pct_error"]
    if vals.min() > 0 and vals.max() / max(vals.min(), 1e-9) > 100:
        ax.set_yscale("log")
    ax.set_title("Absolute % error per source (bar: mean, whisker: IQR, dots: configurations)")
    ax.grid(True, axis="y", alpha=0.3)
    return _png(fig, "absolute percent error per source")


def speedup_plot(speedups: pd.DataFrame, colors: dict[str, str], reference: Sequence[str]) -> str:
    """Per transition, every source's speedup across the workloads (reference sources drawn thick)."""
    if speedups.empty:
        return ""
    transitions = list(dict.fromkeys(zip(speedups["from_target"], speedups["to_target"])))
    fig = _figure(6.6 * min(2, len(transitions)), 4.2 * math.ceil(len(transitions) / 2))
    axes = fig.subplots(math.ceil(len(transitions) / 2), min(2, len(transitions)), squeeze=False).ravel()
    for ax, (a, b) in zip(axes, transitions):
        g = speedups[(speedups["from_target"] == a) & (speedups["to_target"] == b)]
        labels = list(dict.fromkeys(w if s == "single" else f"{w} @ {s}" for w, s in zip(g["workload"], g["system"])))
        for k, (src, h) in enumerate(g.groupby("source", sort=False)):
            x = [labels.index(w if s == "single" else f"{w} @ {s}") for w, s in zip(h["workload"], h["system"])]
            thick = src in reference
            ax.plot(x, h["speedup"], marker=MARKERS[k % len(MARKERS)], markersize=7 - k, color=colors[src],
                    linewidth=2.6 if thick else 1.4, alpha=0.85, linestyle="-" if thick else "--",
                    label=src + (" (reference)" if thick else ""))
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel(f"speedup t({a}) / t({b})")
        ax.set_title(f"{a} → {b}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[len(transitions):]:
        ax.set_visible(False)
    return _png(fig, "speedup trend lines per target transition")


def heatmap(fam: pd.DataFrame, families: Sequence[str]) -> str:
    """Disagreement (%) per fidelity pair (rows) and op family (columns), log colour scale."""
    if fam.empty:
        return ""
    from matplotlib.colors import LogNorm

    pairs = list(dict.fromkeys(zip(fam["source_a"], fam["source_b"])))
    cols = [f for f in families if f in set(fam["family"])]
    grid = np.full((len(pairs), len(cols)), np.nan)
    for r in fam.itertuples(index=False):
        grid[pairs.index((r.source_a, r.source_b)), cols.index(r.family)] = r.disagreement_pct
    fig = _figure(1.5 * len(cols) + 3.2, 0.6 * len(pairs) + 1.8)
    ax = fig.add_subplot()
    finite = grid[np.isfinite(grid)]
    vmin = max(float(finite.min()) if finite.size else 1.0, 0.1)
    vmax = max(float(finite.max()) if finite.size else 10.0, vmin * 10)
    im = ax.imshow(np.where(np.isfinite(grid), np.maximum(grid, vmin), np.nan), cmap="YlOrRd",
                   norm=LogNorm(vmin=vmin, vmax=vmax), aspect="auto")
    for i in range(len(pairs)):
        for j in range(len(cols)):
            v = grid[i, j]
            text = "–" if not np.isfinite(v) else (f"{v:.0f}%" if v >= 10 else f"{v:.1f}%")
            ax.text(j, i, text, ha="center", va="center", fontsize=9,
                    color="white" if np.isfinite(v) and v > math.sqrt(vmin * vmax) * 3 else "black")
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(pairs)), [f"{a} vs {b}" for a, b in pairs])
    ax.set_title("Disagreement by op family (time-weighted typical factor − 1)")
    fig.colorbar(im, ax=ax, label="disagreement (%)")
    return _png(fig, "heat map of disagreement by fidelity pair and op family")


# ------------------------------------------------------------------------------------------ page

def _machine() -> str:
    from ..host import cpu_model, schedulable_cores
    return f"{cpu_model()} ({schedulable_cores()} cores, {platform.machine()})"


def _kpi(value: str, label: str) -> str:
    return f'<div class="kpi"><b>{html.escape(value)}</b><span>{html.escape(label)}</span></div>'


def _overview(spec: StudySpec, tables: dict[str, pd.DataFrame], summary: dict[str, Any]) -> str:
    c = tables["configs"]
    m = summary["metrics"]
    kpis = [_kpi(str(len(spec.workloads)), "workloads"), _kpi(str(len(spec.targets)), "targets"),
            _kpi(str(len(spec.sources)), "fidelity sources"), _kpi(f"{int((c['status'] == 'ok').sum())} / {len(c)}",
                                                                  "configurations timed"),
            _kpi(str(int(c["cached"].sum())), "from the cache"), _kpi(str(len(summary["measurements"])),
                                                                       "measured step times"),
            _kpi(f"{m.get('wall_s', 0):.1f} s", "study wall time")]
    es = tables["error_summary"]
    best = ""
    if not es.empty:
        r = es.sort_values("mean_abs_pct_error").iloc[0]
        best = (f"<p>Closest to its reference: <b>{html.escape(r['source'])}</b> vs {html.escape(r['reference'])}, "
                f"mean absolute error {r['mean_abs_pct_error']:.1f} % over {int(r['n'])} configurations.</p>")
    rows = [("spec", str(spec.path)), ("split", spec.split), ("sources", ", ".join(spec.source_names())),
            ("reference chain", " → ".join(spec.reference) + "  (per configuration, the first that timed it)"),
            ("targets", ", ".join(t.name for t in spec.targets)),
            ("transitions", ", ".join(f"{a}→{b}" for a, b in spec.transitions)),
            ("measured", str(spec.measured or "none")), ("this machine", _machine()),
            ("written", time.strftime("%Y-%m-%d %H:%M:%S"))]
    info = pd.DataFrame(rows, columns=["", "value"])
    return "".join(kpis).join(['<div class="kpis">', "</div>"]) + best + table_html(info)


def _top_regions(top: pd.DataFrame, n: int) -> str:
    """One table per fidelity pair: its ``n`` regions whose disagreement moves the step time most."""
    if top.empty:
        return ""
    parts = [f'<p class="note">Per pair, the {n} regions whose disagreement moves the step time most: '
             "step_share_pct = executions × |a − b| over the slower fidelity's step time; a_s / b_s: one "
             "execution as each fidelity times it.</p>"]
    for (a, b), g in top.groupby(["source_a", "source_b"], sort=False):
        parts.append(f"<h3>{html.escape(a)} (a) vs {html.escape(b)} (b)</h3>")
        parts.append(table_html(g.drop(columns=["source_a", "source_b"]), wrap=("shape",), soft=("op_kinds",)))
    return "".join(parts)


def _workloads(spec: StudySpec) -> str:
    df = pd.DataFrame([{"workload": w.name, "program": w.program, "systems": ", ".join(w.systems)}
                       for w in spec.workloads])
    return table_html(df, wrap=("program",))


def _measurements(summary: dict[str, Any]) -> str:
    ms = summary["measurements"]
    if not ms:
        return ""
    machines = sorted({m["extra"].get("machine", "") for m in ms} - {""})
    df = pd.DataFrame([{"workload": m["workload"], "target": m["target"], "system": m["system"],
                        "runtime_s": m["runtime_s"], "iqr_s": float(m["extra"]["iqr_s"]) if "iqr_s" in m["extra"]
                        else math.nan, "repeats": m["extra"].get("repeats", ""), "date": m["extra"].get("date", ""),
                        "method": m["extra"].get("method", "")} for m in ms])
    where = f" on {html.escape(', '.join(machines))}" if machines else ""
    elsewhere = summary.get("measured_elsewhere") or []
    warning = (f'<p class="warn">The host-cpu step times were measured on {html.escape(", ".join(elsewhere))}, '
               f'not on the machine that predicted them ({html.escape(summary.get("machine", ""))}): their '
               "errors include the difference between the machines (run with --other-machine).</p>"
               if elsewhere else "")
    return (warning + f"<details><summary>{len(ms)} measured step times{where} (how: the method column)</summary>"
            + table_html(df, wrap=("method",)) + "</details>")


def render(spec: StudySpec, tables: dict[str, pd.DataFrame], summary: dict[str, Any]) -> str:
    """The report's HTML text."""
    from ..split.families import FAMILIES

    sources = [MEASURED] + spec.source_names()
    colors = _colors(sources)
    t = tables
    steps = t["step_times"]
    time_cols = {c: "time" for c in steps.columns if c not in ("workload", "system", "target")}
    configs = t["configs"]
    gone = set(summary["unavailable"])
    problems = configs[(configs["status"] != "ok") & ~configs["source"].isin(gone)][
        ["workload", "system", "target", "source", "status", "reason"]]
    noisy = configs[configs["label_noise"] > NOISY][["workload", "system", "target", "source", "step_time_s",
                                                     "label_noise"]]
    unavailable = pd.DataFrame(sorted(summary["unavailable"].items()), columns=["source", "why unavailable"])
    caveats = configs[(configs["status"] == "ok") & (configs["reason"].fillna("") != "")][
        ["source", "reason"]].drop_duplicates().rename(columns={"reason": "caveat"})
    sections = [
        f"<h1>Fidelity study: {html.escape(spec.name)}</h1>",
        '<p class="note">Every table is also written as CSV beside this file. Times are per training or '
        "inference step; errors compare each source with the configuration's reference.</p>",
        _overview(spec, t, summary),
        "<h2>Accuracy against the reference</h2>",
        '<p class="note">Absolute % error = 100 · |predicted / reference − 1|. The reference of a configuration '
        "is the first source of the reference chain that timed it.</p>",
        table_html(t["error_summary"]),
        ('<p class="note">Read these sources with their caveats:</p>' + table_html(caveats, soft=("caveat",)))
        if not caveats.empty else "",
        parity_plot(t["errors"], colors), error_bars(t["errors"], colors),
        "<details><summary>Every configuration's error (errors.csv)</summary>" + table_html(t["errors"]) + "</details>",
        "<h2>Speedups across target transitions</h2>",
        '<p class="note">Speedup of a transition A → B = t(A) / t(B); speedup error = |predicted speedup / reference '
        "speedup − 1| (the Hespas evaluation's metric).</p>",
        table_html(t["speedup_summary"]), speedup_plot(t["speedups"], colors, spec.reference),
        "<details><summary>Every speedup (speedups.csv)</summary>" + table_html(t["speedups"]) + "</details>",
        "<h2>Rank agreement</h2>",
        '<p class="note">Kendall τ-b between two sources\' step times: over the designs (target × system) of each '
        "workload, and over the workloads of each design. Same best: both pick the same fastest one.</p>",
        table_html(t["rank_summary"]),
        "<details><summary>Per group (rank_agreement.csv)</summary>" + table_html(t["rank_agreement"]) + "</details>",
        "<h2>Where fidelities disagree</h2>",
        '<p class="note">Per region, the log ratio of the two fidelities\' times; per op family the mean of its '
        "magnitude weighted by each region's share of its configuration's time, shown as a typical factor − 1 "
        "(10 % = one is 1.1× the other). ratio_a_over_b: the weighted geometric mean of a / b.</p>",
        heatmap(t["family_disagreement"], FAMILIES), table_html(t["family_disagreement"]),
        _top_regions(t["top_regions"], spec.top_regions),
        "<h2>Step times</h2>", table_html(steps, kinds=time_cols), _measurements(summary),
        (f"<details><summary>{len(noisy)} configurations whose labels are noisy (time-weighted IQR / median above "
         f"{NOISY:.0%})</summary>" + table_html(noisy, kinds={"label_noise": "ratio"}) + "</details>")
        if not noisy.empty else "",
        "<h2>Workloads</h2>", _workloads(spec),
        "<h2>Configurations not timed</h2>",
        (table_html(unavailable) + f'<p class="note">{int(configs["source"].isin(gone).sum())} configurations of '
         "these sources are not listed below.</p>") if not unavailable.empty else "",
        table_html(problems, wrap=("reason",)) if not problems.empty
        else '<p class="note">Every configuration was timed.</p>',
    ]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>Fidelity study {html.escape(spec.name)}</title><style>{CSS}</style></head><body>"
            + "\n".join(s for s in sections if s) + "</body></html>\n")


def write_report(path: Path, spec: StudySpec, tables: dict[str, pd.DataFrame], summary: dict[str, Any]) -> Path:
    """Render the report into ``path`` (written atomically) and return it."""
    path = Path(path)
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(render(spec, tables, summary), encoding="utf-8")
    tmp.replace(path)
    return path
