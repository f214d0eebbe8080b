"""Measured datasets: labels timed on a real device, kept with their provenance (``datasets/measured/``).

:func:`import_run` turns a measurement plan (:mod:`hespas_ml.use.device_plan`) and the results folders of
its runs (:mod:`hespas_ml.label.device_run`) into a folder that is a dataset folder
(:func:`~hespas_ml.label.dataset_tables.load_dataset` reads it; the surrogates train on it like any other) plus:

* ``steps.csv`` — one row per whole program timed: its step time (median, minimum, IQR, samples, compile
  time), the sum of its measured region labels (executions counted; ``regions_covered``: the share of its
  region executions that have a label), the same sum less one dispatch overhead per region execution, and
  the roofline's sum on the target;
* ``provenance.json`` — every run: when, the budget, the device (name, driver, CUDA, clocks, jax and
  jaxlib versions) and the machine;
* ``raw/`` — the runs' results as the device wrote them (merged): copied into a device run's output
  folder, they let a later session continue the plan where these runs stopped;
* ``README.md`` — the same for people, with the commands that made it.

Labels whose module does not match the plan's (another plan's results) are refused, naming the file.

:class:`~hespas_ml.label.measured_fidelity.MeasuredFidelity` (``--fidelity measured``) answers from such
folders.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

from ..ingest.errors import HespasError
from .device_run import read_jsonl_gz, read_lines, read_runs
from .dataset_tables import LABEL_COLUMNS, load_dataset, write_manifest
from .measured_fidelity import in_program
from .profiling_worker import may_index

TABLES = ("regions.parquet", "graphs.parquet", "programs.parquet", "targets.parquet")
STEP_COLUMNS = ("id", "source", "family", "phase", "target", "status", "reason", "step_s", "min_s", "iqr_s",
                "repeats", "compile_s", "region_sum_s", "region_sum_less_overhead_s", "regions_covered",
                "roofline_s", "indices", "regions_few_indices", "device", "measured_at")


class MeasuredError(HespasError):
    pass


def _merge(results: Iterable[Path], name: str, key: str) -> dict[str, dict[str, Any]]:
    """Rows of ``name`` over every results folder, the last ok row of each key winning over failures."""
    rows: dict[str, dict[str, Any]] = {}
    for folder in results:
        for row in read_lines(folder / name):
            old = rows.get(row[key])
            if old is None or row.get("status") == "ok" or old.get("status") != "ok":
                rows[row[key]] = row
    return rows


def step_rows(programs: list[dict[str, Any]], steps: dict[str, dict[str, Any]],
              labels: dict[str, dict[str, Any]], texts: dict[str, str]) -> list[dict[str, Any]]:
    """``steps.csv``'s rows: each timed program against the sum of its measured region labels
    (``texts``: the regions' modules by hash)."""
    out = []
    for prog in programs:
        step = steps.get(prog["id"])
        if step is None:
            continue
        total = covered = less = 0.0
        few = 0
        executions = sum(n for _, n in prog["regions"]) or 1
        for digest, n in prog["regions"]:
            lab = labels.get(digest)
            if lab is not None and lab.get("status") == "ok":
                total += n * lab["seconds"]
                less += n * in_program(lab["seconds"], lab.get("meta"))
                covered += n
                few += "index_inputs" not in _meta(lab) and may_index(texts.get(digest, ""))
        meta = json.loads(step.get("meta") or "{}")
        out.append({"id": prog["id"], "source": prog["source"], "family": prog["family"], "phase": prog["phase"],
                    "target": step.get("target"), "status": step["status"], "reason": step.get("reason") or "",
                    "step_s": step.get("seconds"), "min_s": step.get("min_s"), "iqr_s": step.get("iqr_s"),
                    "repeats": step.get("repeats"), "compile_s": step.get("compile_s"),
                    "region_sum_s": total, "region_sum_less_overhead_s": less,
                    "regions_covered": covered / executions, "roofline_s": prog.get("roofline_s"),
                    "indices": _indices(step, prog["text"]), "regions_few_indices": few,
                    "device": meta.get("device", ""),
                    "measured_at": step.get("finished_at")})
    return out


def _indices(row: dict[str, Any], text: str) -> str:
    """How a timed module's gather and scatter indices were drawn: ``range`` (spread over their valid
    range), ``1-3`` (every integer input in [1, 4), as the worker drew them before), or empty (the module
    has neither)."""
    if not may_index(text):
        return ""
    return "range" if "index_inputs" in _meta(row) else "1-3"


def import_run(plan_dir: str | os.PathLike[str], results: list[str | os.PathLike[str]],
               out_dir: str | os.PathLike[str], *, command: str = "") -> dict[str, Any]:
    """Write the measured dataset of ``plan_dir``'s runs (``results`` folders, later ones winning) to
    ``out_dir`` (replaced). Returns counts."""
    plan_path = Path(plan_dir)
    try:
        plan = json.loads((plan_path / "plan.json").read_text())
        planned = {r["hash"]: r for r in read_jsonl_gz(plan_path / "regions.jsonl.gz")}
        programs = read_jsonl_gz(plan_path / "steps.jsonl.gz")
    except (OSError, ValueError, EOFError) as exc:
        raise MeasuredError(f"{plan_path}: not a readable measurement plan ({exc})") from None
    folders = [Path(r) for r in results]
    for folder in folders:
        if not (folder / "labels.jsonl").is_file() and not (folder / "steps.jsonl").is_file():
            raise MeasuredError(f"{folder}: no labels.jsonl or steps.jsonl (not a results folder of a device run)")
    labels = _merge(folders, "labels.jsonl", "hash")
    steps = _merge(folders, "steps.jsonl", "id")
    for row in [*labels.values(), *steps.values()]:
        if row.get("target") != plan["target"]:
            raise MeasuredError(f"{plan_path}: the results were measured on {row.get('target')}, the plan is for "
                                f"{plan['target']} (a rehearsal is not a measurement of the target)")
    wanted_flags = kernel_flags((plan.get("profiling") or {}).get("xla_flags"))
    for row in [*labels.values(), *steps.values()]:
        flags = kernel_flags(_meta(row).get("xla_flags"))
        if flags != wanted_flags:
            what = f"region {row['hash'][:12]}…" if "hash" in row else f"program {row.get('source')}"
            raise MeasuredError(f"{plan_path}: {what} was timed with XLA_FLAGS {flags or '(none)'}, the plan with "
                                f"{wanted_flags or '(none)'}: XLA flags change the kernels it compiles, so those "
                                "times are not this plan's measurement")
    for digest, row in labels.items():
        mine = planned.get(digest)
        if mine is None or mine["module_sha256"] != row.get("module_sha256"):
            raise MeasuredError(f"{plan_path}: the results hold region {digest[:12]}…, which this plan does not "
                               "time with that module (results of another plan?)")
    runs = list({str(r.get("started")): r for folder in folders for r in read_runs(folder / "runs.jsonl")}.values())
    rows = step_rows(programs, steps, labels, {h: r["text"] for h, r in planned.items()})
    raw = {f"raw/{name}": "".join(json.dumps(r, separators=(",", ":"), default=str) + "\n" for r in merged)
           for name, merged in (("labels.jsonl", labels.values()), ("steps.jsonl", steps.values()),
                                ("runs.jsonl", runs))}
    extra = {**raw, "steps.csv": csv_text(rows, STEP_COLUMNS),
             "provenance.json": json.dumps({"plan": plan, "runs": runs}, indent=1, default=str),
             "README.md": readme(plan, runs, labels, rows, command)}
    summary = {"plan": plan["name"], "target": plan["target"], "runs": len(runs), "labels": len(labels),
               "labels_ok": sum(1 for r in labels.values() if r["status"] == "ok"), "steps": len(rows)}
    write_measured(out_dir, plan_path, list(labels.values()), summary, extra)
    return summary


# XLA flags that say where XLA keeps its autotuning results, not which kernels it picks: a run that reuses
# an earlier run's results on the same device and XLA compiles what it would have compiled
NEUTRAL_XLA_FLAGS = ("--xla_gpu_per_fusion_autotune_cache_dir=", "--xla_gpu_experimental_autotune_cache_mode=")


def _meta(row: dict[str, Any]) -> dict[str, Any]:
    """A result row's ``meta`` (JSON text), or nothing where it does not read."""
    try:
        return json.loads(row.get("meta") or "{}")
    except ValueError:
        return {}


def kernel_flags(flags: str | None) -> str | None:
    """Those of ``flags`` (an XLA_FLAGS string) that change what XLA compiles (None: none)."""
    kept = [f for f in (flags or "").split() if not f.startswith(NEUTRAL_XLA_FLAGS)]
    return " ".join(kept) or None


def csv_text(rows: list[dict[str, Any]], columns) -> str:
    """``rows`` as CSV text with ``columns`` as the header (a file of a measured folder)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def write_measured(out_dir: str | os.PathLike[str], tables_dir: str | os.PathLike[str],
                   label_rows: list[dict[str, Any]], summary: dict[str, Any], files: dict[str, str]) -> None:
    """Write a measured dataset folder (replacing ``out_dir`` as a whole, through a temporary folder):
    the region tables of the dataset folder ``tables_dir`` (regions, graphs, programs, targets), its labels
    with ``label_rows`` (dataset label columns) added, its manifest with ``summary`` as ``measured``, and
    ``files`` (name -> text: provenance, README, step times …). The result is checked to read back with
    :func:`~hespas_ml.label.dataset_tables.load_dataset`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = Path(tables_dir)
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in TABLES:
        shutil.copyfile(source / name, tmp / name)
    before = pq.read_table(source / "labels.parquet").select(list(LABEL_COLUMNS))
    added = {c: [row.get(c) for row in label_rows] for c in LABEL_COLUMNS}
    for column in ("seconds", "noise", "label_s", "finished_at"):
        added[column] = [None if v is None else float(v) for v in added[column]]
    table = pa.concat_tables([before, pa.table(added, schema=before.schema)])
    pq.write_table(table, tmp / "labels.parquet", compression="zstd", compression_level=19)   # committed
    manifest = json.loads((source / "manifest.json").read_text())
    manifest["measured"] = summary
    write_manifest(tmp, manifest)
    for name, text in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(text)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    load_dataset(out)                      # what was written reads back as a dataset


def _fmt(value: Any, scale: float = 1e3, digits: int = 3) -> str:
    return "—" if value is None or (isinstance(value, float) and not math.isfinite(value)) else \
        f"{float(value) * scale:.{digits}f}"


def readme(plan: dict[str, Any], runs: list[dict[str, Any]], labels: dict[str, dict[str, Any]],
           steps: list[dict[str, Any]], command: str) -> str:
    """The folder's README: provenance first, then what it holds (figures computed from the files)."""
    lines = [f"# Measured on {plan['target']}: plan {plan['name']}", "",
             "Written by `hespas_ml.label.measured.import_run` from the plan and the results of its device runs. "
             "Each label's `meta` holds its own provenance; `provenance.json` holds every run's record.", ""]
    lines += ["## Runs", "", "| started (UTC) | device | driver / CUDA | jax / jaxlib | clocks SM / mem (MHz) | "
              "machine | budget | done |", "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        dev = run.get("device") or {}
        machine = dev.get("machine") or {}
        done = ", ".join(f"{k} {v}" for k, v in (run.get("done") or {}).items())
        if run.get("finished", "") is None:
            done = f"{done}; killed before it ended" if done else "killed before it ended (its rows say what it timed)"
        lines.append(f"| {run.get('started')} | {dev.get('device')} ({dev.get('backend')}) | "
                     f"{dev.get('gpu_driver_version', '—')} / {dev.get('gpu_cuda_version', '—')} | "
                     f"{dev.get('jax_version')} / {dev.get('jaxlib_version')} | "
                     f"{dev.get('gpu_clocks_sm', '—')} / {dev.get('gpu_clocks_mem', '—')} | "
                     f"{machine.get('hostname')} ({machine.get('cpu')}, {machine.get('cores')} cores) | "
                     f"{run.get('budget_s')} s | {done} |")
    ok = [r for r in labels.values() if r["status"] == "ok"]
    by_phase: dict[str, int] = {}
    for r in ok:
        by_phase[r["phase"]] = by_phase.get(r["phase"], 0) + 1
    lines += ["", "## What it holds", "",
              f"- {len(ok)} region labels ok, {len(labels) - len(ok)} failed "
              f"({', '.join(f'{k}: {v}' for k, v in sorted(by_phase.items()))}); `labels.parquet` also keeps the "
              f"roofline's labels on {plan['target']} for the same regions.",
              f"- {sum(1 for s in steps if s['status'] == 'ok')} whole programs timed (`steps.csv`).", ""]
    if steps:
        lines += ["| program | phase | step (ms) | region sum (ms) | less overhead (ms) | covered | roofline (ms) "
                  "| indices |", "|---|---|---|---|---|---|---|---|"]
        for s in steps:
            few = f", {s['regions_few_indices']} region(s) 1-3" if s["regions_few_indices"] else ""
            lines.append(f"| `{s['source']}` | {s['phase']} | {_fmt(s['step_s'])} | {_fmt(s['region_sum_s'])} | "
                         f"{_fmt(s['region_sum_less_overhead_s'])} | {s['regions_covered']:.0%} | "
                         f"{_fmt(s['roofline_s'])} | {s['indices'] or '—'}{few} |")
        if any(s["indices"] == "1-3" or s["regions_few_indices"] for s in steps):
            lines += ["", "`indices`: how the gather and scatter indices of a program (and of its regions) were "
                      "drawn: `range` spread over their valid range; `1-3` every integer input in [1, 4), which "
                      "piles a scatter's updates onto three rows (serialised atomic adds on a GPU). A result "
                      "marked `1-3` is timed again by the next device call."]
    if command:
        lines += ["", "## Commands", "", "```", command.strip(), "```"]
    return "\n".join(lines) + "\n"


__all__ = ["MeasuredError", "STEP_COLUMNS", "csv_text", "import_run", "step_rows", "write_measured"]
