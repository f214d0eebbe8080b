"""Reports on sweep results: Pareto fronts, the best configurations per workload, and plots.

A configuration is on the Pareto front of its workload when no other configuration of that workload
is at least as good on both axes — step time and ``x`` (devices by default, or a cost column such as
``cost_per_step``) — and strictly better on one; of configurations equal on both axes the lowest
``config_id`` stands for them. Only rows with status ``ok`` and a finite step time take part, and of those
only the ones whose peak memory fits the target's (``fits``; rows that do not are counted apart).

Plots (PNG, with ``write_plots``): ``pareto.png`` (every configuration of each workload, the front
highlighted), ``step_vs_bandwidth.png`` and ``step_vs_devices.png`` (the best step time at each
link bandwidth / device count, one line per target), ``breakdown.png`` (compute and exposed
communication of each workload's best configuration, stacked).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, TextIO

from ..ingest.errors import HespasError
from ..units import format_bytes, format_seconds

REQUIRED = ("config_id", "workload", "devices", "target", "system", "status", "step_time_s", "compute_time_s",
            "exposed_comm_s")
SHOWN = ("config_id", "workload", "devices", "parallel", "pipeline", "target", "fidelity", "system", "step_time_s",
         "compute_time_s", "exposed_comm_s", "utilisation", "bubble", "cost_per_step")
PANELS = 12          # workloads per figure


class ReportError(HespasError):
    """Sweep results cannot be read: one line naming the file."""


def load_results(path: str | Path):
    """Sweep rows from a sweep folder (its results.parquet, else its chunk files) or a parquet file."""
    import pandas as pd
    import pyarrow.parquet as pq

    p = Path(path)
    if p.is_dir():
        results = p / "results.parquet"
        files = [results] if results.is_file() else sorted((p / "chunks").glob("chunk-*.parquet"))
        if not files:
            raise ReportError(f"{p}: holds no sweep results (no results.parquet, no chunks/chunk-*.parquet)")
    elif p.is_file():
        files = [p]
    else:
        raise ReportError(f"{p}: does not exist")
    frames = []
    for f in files:
        try:
            frames.append(pq.read_table(f).to_pandas())
        except Exception as exc:  # noqa: BLE001 - any unreadable file is a one-line error
            raise ReportError(f"{f}: not a readable parquet file ({' '.join(str(exc).split())[:160]})") from None
        missing = [c for c in REQUIRED if c not in frames[-1].columns]
        if missing:
            raise ReportError(f"{f}: not sweep results (missing column {missing[0]})")
    df = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    return df.sort_values("config_id", kind="stable").reset_index(drop=True)


def pareto_front(xs, ys, ids=None) -> list[int]:
    """Positions of the non-dominated points when both ``xs`` and ``ys`` are minimised (see the module
    docstring for ties), in increasing x."""
    ids = list(range(len(xs))) if ids is None else list(ids)
    order = sorted(range(len(xs)), key=lambda i: (xs[i], ys[i], ids[i]))
    front: list[int] = []
    best_y = math.inf
    for i in order:             # a point is kept when it beats every point of smaller (or equal) x
        if ys[i] < best_y:
            front.append(i)
            best_y = ys[i]
    return front


def _x_column(df, x: str | None) -> str:
    if x is None:
        return "devices"
    if x not in df.columns:
        choices = [c for c in ("devices", "cost_per_step", "cost_per_device_hour") if c in df.columns]
        raise ReportError(f"results have no column '{x}' (use one of {', '.join(choices)})")
    if not df[x].notna().any():
        raise ReportError(f"column '{x}' is empty in these results (give costs in the sweep spec)")
    return x


def _row(r, xcol: str = "devices") -> dict[str, Any]:
    out = {}
    for k in (*SHOWN, xcol):
        if k in r.index:
            v = r[k]
            out[k] = (None if isinstance(v, float) and math.isnan(v) else
                      v.item() if hasattr(v, "item") else v)
    return out


def _timed(df):
    """The rows that take part (ok, a finite step time, fitting the target's memory) and the ok rows that
    do not fit."""
    ok = df[(df["status"] == "ok") & df["step_time_s"].notna()]
    ok = ok[ok["step_time_s"].map(math.isfinite)]
    too_big = ok[ok["fits"] == False] if "fits" in ok.columns else ok.iloc[:0]   # noqa: E712 - a column
    return ok.drop(too_big.index), too_big


def make_report(df, x: str | None = None, top: int = 3) -> dict[str, Any]:
    """Counts, failures, and per workload its Pareto front (``x`` vs step time) and ``top`` best rows."""
    xcol = _x_column(df, x)
    ok, too_big = _timed(df)
    if xcol != "devices":
        ok = ok[ok[xcol].notna()]
    failed = df[df["status"] != "ok"]
    errors = failed["error"].fillna("").value_counts().head(5) if "error" in df.columns else []
    workloads = []
    for name, g in ok.groupby("workload", sort=False):
        pos = pareto_front(g[xcol].tolist(), g["step_time_s"].tolist(), g["config_id"].tolist())
        front = g.iloc[pos]
        best = g.nsmallest(top, "step_time_s") if top > 0 else g.iloc[:0]
        workloads.append({"workload": name, "configs": int(len(g)),
                          "front": [_row(r, xcol) for _, r in front.iterrows()],
                          "best": [_row(r, xcol) for _, r in best.iterrows()]})
    return {"configs": int(len(df)), "ok": int(len(ok)), "not_fitting": int(len(too_big)),
            "failed": int(len(failed)), "x": xcol,
            "failures": [{"error": k, "configs": int(v)} for k, v in (errors.items() if len(failed) else [])],
            "workloads": workloads}


def _fmt_x(v: Any, xcol: str) -> str:
    if v is None:
        return "-"
    if xcol.startswith("cost"):
        return f"${v:.4g}"
    return format_bytes(v) if xcol.endswith("_bytes") else str(v)


def print_report(rep: dict[str, Any], out: TextIO) -> None:
    """The report as text tables."""
    w = out.write
    xcol = rep["x"]
    too_big = rep.get("not_fitting", 0)
    w(f"{rep['configs']} configurations: {rep['ok']} ok, "
      + (f"{too_big} timed but do not fit the target's memory (left out below), " if too_big else "")
      + f"{rep['failed']} failed\n")
    for f in rep["failures"]:
        w(f"  failed x{f['configs']}: {f['error'][:150]}\n")
    head = (f"  {'config':>7}  {xcol:>12}  {'step':>10}  {'compute':>10}  {'exposed':>10}  {'util':>6}  "
            f"{'bubble':>6}  {'parallel':<8} {'target':<10} system\n")
    for wl in rep["workloads"]:
        w(f"\n{wl['workload']}  ({wl['configs']} configurations)\n")
        for title, rows in (("Pareto front (" + xcol + " vs step time)", wl["front"]), ("best", wl["best"])):
            w(f" {title}:\n" + head)
            for r in rows:
                util, bubble = r.get("utilisation"), r.get("bubble")
                w(f"  {r['config_id']:>7}  {_fmt_x(r.get(xcol, r.get('devices')), xcol):>12}  "
                  f"{format_seconds(r['step_time_s']):>10}  {format_seconds(r['compute_time_s']):>10}  "
                  f"{format_seconds(r['exposed_comm_s']):>10}  {'-' if util is None else f'{util:.1%}':>6}  "
                  f"{'-' if not bubble else f'{bubble:.0%}':>6}  "
                  f"{str(r.get('parallel') or '-'):<8} {str(r['target']):<10} {r['system']}\n")


# --------------------------------------------------------------------------------------------- plots

def write_plots(df, rep: dict[str, Any], out_dir: str | Path) -> list[str]:
    """Write the report's PNG plots and report.json into ``out_dir``; returns the files written."""
    import matplotlib
    matplotlib.use("Agg")

    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReportError(f"{out}: cannot create the report folder ({exc.strerror or exc})") from None
    ok, _ = _timed(df)
    names = [w["workload"] for w in rep["workloads"]]
    files: list[str] = []
    for page in range(0, max(1, len(names)), PANELS):
        group = names[page:page + PANELS]
        suffix = "" if page == 0 else f"-{page // PANELS + 1}"
        if not group:
            break
        files.append(_pareto_plot(ok, rep, group, out / f"pareto{suffix}.png"))
        files.append(_best_by(ok, group, "bandwidth_gbps", "link bandwidth (GB/s, slowest link)",
                              out / f"step_vs_bandwidth{suffix}.png", log_x=True))
        files.append(_best_by(ok, group, "devices", "devices", out / f"step_vs_devices{suffix}.png", log_x=False))
    files.append(_breakdown(rep, out / "breakdown.png"))
    path = out / "report.json"
    path.write_text(json.dumps(rep, indent=1, default=str) + "\n")
    files.append(str(path))
    return [f for f in files if f]


def _grid(n: int):
    import matplotlib.pyplot as plt
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt
    if not fig.legends:
        fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return str(path)


def _short(name: str, limit: int = 48) -> str:
    return name if len(name) <= limit else name[:limit - 1] + "…"


def short_names(names: list[str]) -> dict[str, str]:
    """Workload labels cut to what tells them apart: ``family?a=1&b=2`` becomes ``family a=1`` when only
    ``a`` differs among the workloads of that family."""
    parsed = {}
    for n in names:
        family, _, query = n.partition("?")
        parsed[n] = (family, dict(item.partition("=")[::2] for item in query.split("&") if item))
    out = {}
    for n, (family, params) in parsed.items():
        peers = [p for f, p in parsed.values() if f == family]
        varying = [k for k in params if len({p.get(k) for p in peers}) > 1]
        out[n] = _short(" ".join([family] + [f"{k}={params[k]}" for k in varying]), 60)
    return out


def _time_unit(seconds: list[float]) -> tuple[float, str]:
    top = max(seconds, default=0.0)
    return (1.0, "s") if top >= 1 else (1e3, "ms") if top >= 1e-3 else (1e6, "µs")


def _value_ticks(ax, values, log: bool) -> None:
    """Tick marks at the values plotted (a few of them), written plainly."""
    from matplotlib.ticker import NullFormatter, NullLocator
    vals = sorted({float(v) for v in values if v == v})
    if not vals:
        return
    if len(vals) > 8:
        step = math.ceil(len(vals) / 8)
        vals = vals[::step]
    ax.set_xticks(vals, [f"{v:g}" for v in vals])
    if log:
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())


def _log_y(ax, values) -> None:
    """A log y axis labelled plainly (0.2, 0.5, 1, 2 …), minor ticks labelled when it spans under a decade."""
    from matplotlib.ticker import FuncFormatter
    ax.set_yscale("log")
    vals = [v for v in values if v > 0 and math.isfinite(v)]
    narrow = bool(vals) and max(vals) / min(vals) < 10
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: f"{v:g}" if narrow else ""))


def _figure_legend(fig, axes) -> None:
    handles, labels = {}, []
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in handles:
                handles[label] = h
                labels.append(label)
    if labels:
        fig.legend([handles[k] for k in labels], labels, loc="lower center", ncol=min(len(labels), 8), fontsize=8,
                   frameon=False)
        fig.tight_layout(rect=(0, 0.06 if len(axes) > 4 else 0.1, 1, 1))


def _pareto_plot(ok, rep, group: list[str], path: Path) -> str:
    xcol = rep["x"]
    fronts = {w["workload"]: w["front"] for w in rep["workloads"]}
    labels = short_names(list(fronts))
    fig, axes = _grid(len(group))
    for ax, name in zip(axes, group):
        g = ok[ok["workload"] == name]
        if xcol != "devices":
            g = g[g[xcol].notna()]
        scale, unit = _time_unit(g["step_time_s"].tolist())
        ax.scatter(g[xcol], g["step_time_s"] * scale, s=8, alpha=0.35, color="0.55", label="configurations")
        f = fronts.get(name, [])
        fx = [r.get(xcol, r.get("devices")) for r in f]
        fy = [r["step_time_s"] * scale for r in f]
        ax.step(fx, fy, where="post", color="tab:red", lw=1.5)
        ax.scatter(fx, fy, s=36, color="tab:red", zorder=3, label="Pareto front")
        _log_y(ax, (g["step_time_s"] * scale).tolist())
        if xcol != "devices":
            ax.set_xscale("log")
        else:
            _value_ticks(ax, g[xcol], log=False)
        ax.set_title(labels.get(name, _short(name)), fontsize=9)
        ax.set_xlabel("$ per step" if xcol == "cost_per_step" else xcol)
        ax.set_ylabel(f"step time ({unit})")
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(f"Pareto fronts: step time vs {xcol}", fontsize=11)
    fig.tight_layout()
    _figure_legend(fig, axes[:len(group)])
    return _save(fig, path)


def _best_by(ok, group: list[str], col: str, label: str, path: Path, log_x: bool) -> str:
    labels = short_names(sorted(set(ok["workload"])))
    fig, axes = _grid(len(group))
    for ax, name in zip(axes, group):
        g = ok[(ok["workload"] == name) & ok[col].notna()]
        scale, unit = _time_unit(g["step_time_s"].tolist())
        for target, t in g.groupby("target", sort=True):
            best = t.groupby(col)["step_time_s"].min().sort_index()
            ax.plot(best.index, best.values * scale, marker="o", ms=3, label=str(target))
        _log_y(ax, [y for line in ax.get_lines() for y in line.get_ydata()])
        if log_x:
            ax.set_xscale("log")
        _value_ticks(ax, g[col], log=log_x)
        ax.set_title(labels.get(name, _short(name)), fontsize=9)
        ax.set_xlabel(label)
        ax.set_ylabel(f"best step time ({unit})")
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(f"Best step time vs {label}, per target", fontsize=11)
    fig.tight_layout()
    _figure_legend(fig, axes[:len(group)])
    return _save(fig, path)


def _breakdown(rep: dict[str, Any], path: Path) -> str | None:
    import matplotlib.pyplot as plt
    best = [(w["workload"], w["best"][0]) for w in rep["workloads"] if w["best"]]
    if not best:
        return None
    best = best[:40]
    names = short_names([n for n, _ in best])
    scale, unit = _time_unit([r["step_time_s"] for _, r in best])
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(best) + 1.5))
    labels = [f"{names[n]}\n{r['target']} · {r.get('parallel') or '-'} · {r.get('devices')} dev · "
              f"{_short(str(r['system']), 30)}" for n, r in best]
    comp = [max(0.0, r["compute_time_s"] or 0.0) * scale for _, r in best]
    comm = [max(0.0, r["exposed_comm_s"] or 0.0) * scale for _, r in best]
    y = range(len(best))
    ax.barh(y, comp, color="tab:blue", label="compute")
    ax.barh(y, comm, left=comp, color="tab:orange", label="exposed communication")
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"time per step ({unit})")
    ax.set_title("Best configuration per workload: where the step time goes", fontsize=11)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="x")
    return _save(fig, path)
