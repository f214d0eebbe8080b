"""Timing a measurement plan (:mod:`hespas_ml.use.device_plan`) on the device this process runs on.

:func:`run_plan` times the plan's regions with the profiling fidelity (compiled ahead in batches on a GPU)
and its whole programs with the same machinery (:meth:`ProfilingFidelity.time_module`: compile the whole
single-device program, warm up, samples until the spread settles, median and spread), writing every
result as one JSON line the moment it is known:

* ``labels.jsonl`` — one line per region: the dataset label columns (``hash``, ``target``, ``fidelity``,
  ``seconds``, ``noise``, ``status``, ``reason``, ``meta`` with the label's provenance, ``label_s``,
  ``finished_at``) and ``phase``, ``family``, ``module_sha256``;
* ``steps.jsonl`` — one line per whole program: ``id``, ``source``, ``family``, ``phase``, ``status``,
  ``seconds`` (median of the samples), ``min_s``, ``iqr_s``, ``repeats``, ``compile_s``, ``meta``;
* ``runs.jsonl`` — the call's record: when, the budget, the device and machine, written when it starts
  (``finished`` null) and again when it ends with what it did (readers keep the last line of a ``started``);
* ``log.txt`` — what was printed.

Everything already in the output folder is kept and skipped, so a second call continues where the first
stopped, on this machine or (with the folder carried over) on another one of the same kind. A call that
is killed loses at most the chunk of regions it was timing.

The budget is shared out between the phases (``regions``, ``steps``, ``held_out``) by the plan's shares;
a phase that finishes early hands its time on, and time left at the end goes back to phases with work
left, in order. The call keeps its deadline: a whole program starts only while the call has the profiling
``budget_s`` left (the most its compile and timing may take), a chunk of regions only while it has as long
as the longest chunk so far. A run that finds a device other than the plan's target refuses at once (one
line).
"""
from __future__ import annotations

import gzip
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, TextIO

from ..host import package_version
from ..ingest.errors import HespasError
from .fidelity import FidelityError
from .profiling import GPU_BACKENDS, ProfilingFidelity
from .profiling_worker import may_index
from .targets import load_target

FILES = ("labels.jsonl", "steps.jsonl", "runs.jsonl", "log.txt")
PHASES = ("regions", "steps", "held_out")       # what a plan measures, in the order it measures them


class RunError(HespasError):
    pass


def read_jsonl_gz(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The JSON lines of a plan's gzipped file."""
    with gzip.open(path, "rt") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of ``path`` (a line cut short by a kill is dropped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


class _Appender:
    """Appends JSON lines to a file, each flushed and synced before the next."""

    def __init__(self, path: Path):
        self.handle = open(path, "a")

    def write(self, row: dict[str, Any]) -> None:
        self.handle.write(json.dumps(row, separators=(",", ":"), default=str) + "\n")
        self.handle.flush()
        os.fsync(self.handle.fileno())

    def close(self) -> None:
        self.handle.close()


class _Log:
    def __init__(self, path: Path, echo: TextIO | None):
        self.handle = open(path, "a")
        self.echo = echo

    def __call__(self, text: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {text}"
        self.handle.write(line + "\n")
        self.handle.flush()
        if self.echo is not None:
            print(line, file=self.echo, flush=True)

    def close(self) -> None:
        self.handle.close()


def _done(row: dict[str, Any]) -> tuple[str, bool, bool]:
    """A result row's status, whether it says how its index inputs were drawn (rows written before
    gathers and scatters got their indices spread over their range do not: such a row is timed again), and
    whether it was timed in a loop."""
    meta = row.get("meta")
    try:
        meta = json.loads(meta) if isinstance(meta, str) else (meta or {})
    except ValueError:
        meta = {}
    return row["status"], "index_inputs" in meta or row["status"] != "ok", bool(meta.get("loop"))


def _label_row(item: dict[str, Any], label, target: str, seconds: float) -> dict[str, Any]:
    ok = label.status == "ok"
    meta = {**label.meta, "phase": item["phase"]}
    noise = meta.get("rel_iqr") if ok else None
    return {"hash": item["hash"], "phase": item["phase"], "family": item["family"],
            "module_sha256": item["module_sha256"], "target": target, "fidelity": "profiling",
            "seconds": label.seconds if ok else None,
            "noise": noise if noise is None or math.isfinite(noise) else None, "status": label.status,
            "reason": None if ok else str(meta.get("reason"))[:2000], "meta": json.dumps(meta, default=str),
            "label_s": seconds, "finished_at": time.time()}


def run_plan(plan_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, budget_s: float = 450.0,
             phases: tuple[str, ...] = PHASES, retry_failed: bool = False, chunk: int | None = None,
             target: str | None = None, retime_unlooped: int = 0,
             options: dict[str, Any] | None = None, echo: TextIO | None = sys.stderr,
             clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Time what is left of the plan in ``plan_dir`` within ``budget_s`` seconds, results in ``out_dir``
    (see the module docstring). ``options`` override the plan's profiling options; ``chunk``: regions
    timed between two checks of the clock (default 4 × the compile threads); ``target``: time on this
    target instead of the plan's (a rehearsal on another machine, e.g. ``host-cpu``: the results say what
    they were measured on, and collecting them for the plan's target refuses them); ``retime_unlooped``:
    with a ``loop`` option, time again the first that many regions of the ``regions`` phase (the step
    programs' regions come first) whose labels were timed one execution at a time. Returns the run's
    record."""
    plan_path = Path(plan_dir)
    try:
        plan = json.loads((plan_path / "plan.json").read_text())
        regions = read_jsonl_gz(plan_path / "regions.jsonl.gz")
        programs = read_jsonl_gz(plan_path / "steps.jsonl.gz")
    except (OSError, ValueError, EOFError) as exc:
        raise RunError(f"{plan_path}: not a readable measurement plan ({exc})") from None
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise RunError(f"unknown phase {unknown[0]} (phases: {', '.join(PHASES)})")
    if not budget_s > 0:
        raise RunError(f"the budget must be a positive number of seconds, got {budget_s!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = clock()
    deadline = start + budget_s
    log = _Log(out / "log.txt", echo)
    target = load_target(target or plan["target"])
    fid = ProfilingFidelity(**{**plan.get("profiling", {}), "cache": False, **(options or {})})
    labels_out = _Appender(out / "labels.jsonl")
    steps_out = _Appender(out / "steps.jsonl")
    record: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "plan": plan["name"],
                              "target": target.name, "budget_s": budget_s, "hespas_ml": package_version("hespas-ml"),
                              "done": {}}
    try:
        try:
            record["device"] = fid.provenance(target)
        except FidelityError as exc:
            raise RunError(f"{plan_path}: {exc}") from None
        gpu = record["device"].get("backend") in GPU_BACKENDS
        _append_line(out / "runs.jsonl", {**record, "finished": None})   # a killed call keeps its provenance
        log(f"plan {plan['name']} on {record['device'].get('device')} ({record['device'].get('backend')}, "
            f"jax {record['device'].get('jax_version')}), budget {budget_s:.0f} s")
        done_labels = {r["hash"]: _done(r) for r in read_lines(out / "labels.jsonl")}
        done_steps = {r["id"]: _done(r) for r in read_lines(out / "steps.jsonl")}

        def todo(done: tuple[str, bool, bool] | None, text: str) -> bool:
            if done is None:
                return True
            status, index_inputs, _ = done
            return (retry_failed and status != "ok") or (not index_inputs and may_index(text))

        retime: set[str] = set()
        if retime_unlooped and (options or {}).get("loop"):
            unlooped = [it["hash"] for it in regions if it["phase"] == "regions"
                        and (seen := done_labels.get(it["hash"])) and seen[0] == "ok" and not seen[2]]
            retime = set(unlooped[:retime_unlooped])
            log(f"regions: {len(retime)} timed one execution at a time are timed again in a loop first")

        def todo_label(item: dict[str, Any]) -> bool:
            return item["hash"] in retime or todo(done_labels.get(item["hash"]), item["text"])

        def todo_step(item: dict[str, Any]) -> bool:
            return todo(done_steps.get(item["id"]), item["text"])

        size = chunk or max(4, fid.batch_size(target))

        longest_chunk = 0.0

        def time_regions(items: list[dict[str, Any]], until: float, phase: str) -> int:
            nonlocal longest_chunk
            n, began = 0, clock()
            todo = [it for it in items if todo_label(it)]
            while todo and clock() < until:
                if deadline - clock() < longest_chunk:
                    log(f"{phase}: {deadline - clock():.0f} s left of the call, the longest chunk took "
                        f"{longest_chunk:.0f} s: no more regions this call")
                    break
                part, todo = todo[:size], todo[size:]
                t0 = time.perf_counter()
                got = fid.label_modules([it["text"] for it in part], target)
                took = time.perf_counter() - t0
                longest_chunk = max(longest_chunk, took)
                each = took / max(1, len(part))
                for item, label in zip(part, got):
                    labels_out.write(_label_row(item, label, target.name, each))
                    done_labels[item["hash"]] = (label.status, True, bool(label.meta.get("loop")))
                    retime.discard(item["hash"])
                n += len(part)
                rate = n / max(1e-9, clock() - began)
                log(f"{phase}: {n} regions timed this call, {len(todo)} left ({rate:.1f}/s)")
            return n

        def time_programs(items: list[dict[str, Any]], until: float, phase: str) -> int:
            n = 0
            for item in items:
                if clock() >= until:
                    break
                if not todo_step(item):
                    continue
                if deadline - clock() < fid.budget_s:
                    log(f"{phase}: {deadline - clock():.0f} s left of the call, a program may take "
                        f"{fid.budget_s:.0f} s: no more programs this call")
                    break
                row = {"id": item["id"], "source": item["source"], "family": item["family"],
                       "phase": item["phase"], "target": target.name}
                t0 = time.perf_counter()
                try:
                    result = fid.time_module(item["text"], target, measure_s=plan.get("step_measure_s", 2.0))
                except FidelityError as exc:
                    row.update(status="failed", reason=str(exc)[:2000], seconds=None)
                else:
                    row.update(status="ok", reason=None, seconds=result["median_s"], min_s=result["min_s"],
                               iqr_s=result["iqr_s"], repeats=result["repeats"], compile_s=result["compile_s"],
                               meta=json.dumps({k: v for k, v in result.items() if k not in ("event", "id")},
                                               default=str))
                row.update(wall_s=time.perf_counter() - t0, finished_at=time.time())
                steps_out.write(row)
                done_steps[item["id"]] = (row["status"], True, False)
                n += 1
                shown = f"{row['seconds'] * 1e3:.3f} ms" if row["status"] == "ok" else row["reason"]
                log(f"{phase}: {item['source']}: {shown}")
            return n

        # a phase's whole programs first (a held-out program's step time before its regions), then its regions
        phase_programs = {p: [q for q in programs if q["phase"] == p] for p in PHASES}
        phase_regions = {p: [r for r in regions if r["phase"] == p] for p in PHASES}

        def work(phase: str, until: float) -> int:
            n = time_programs(phase_programs[phase], until, phase)
            return n + time_regions(phase_regions[phase], until, phase)

        def left(phase: str) -> int:
            return (sum(1 for q in phase_programs[phase] if todo_step(q))
                    + sum(1 for r in phase_regions[phase] if todo_label(r)))

        shares = plan.get("shares") or {p: 1 / len(PHASES) for p in PHASES}
        carried = 0.0
        for phase in phases:
            until = min(deadline, clock() + shares.get(phase, 0.0) * budget_s + carried)
            if left(phase):
                record["done"][phase] = record["done"].get(phase, 0) + work(phase, until)
            carried = max(0.0, until - clock())
        for phase in phases:                     # time left over: back to what is not finished, in order
            if clock() < deadline and left(phase):
                record["done"][phase] = record["done"].get(phase, 0) + work(phase, deadline)
        record["left"] = {p: left(p) for p in PHASES}
        record["wall_s"] = clock() - start
        record["gpu"] = gpu
        summary = _summary(out, regions, programs)
        record["summary"] = summary
        for line in _summary_lines(summary):
            log(line)
        return record
    finally:
        fid.close()
        labels_out.close()
        steps_out.close()
        record.setdefault("wall_s", clock() - start)
        record["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        _append_line(out / "runs.jsonl", record)
        log.close()


def _append_line(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(row, default=str) + "\n")


def read_runs(path: Path) -> list[dict[str, Any]]:
    """The call records of a ``runs.jsonl``, one per call: the last line written for each ``started``
    (a call killed before its end keeps the line it wrote when it started)."""
    runs: dict[str, dict[str, Any]] = {}
    for row in read_lines(path):
        runs[str(row.get("started"))] = row
    return list(runs.values())


def _summary(out: Path, regions: list[dict[str, Any]], programs: list[dict[str, Any]]) -> dict[str, Any]:
    labels = {r["hash"]: r for r in read_lines(out / "labels.jsonl")}
    steps = {r["id"]: r for r in read_lines(out / "steps.jsonl")}
    summary: dict[str, Any] = {}
    for phase in PHASES:
        mine = [r for r in regions if r["phase"] == phase]
        progs = [p for p in programs if p["phase"] == phase]
        summary[phase] = {"regions": len(mine), "regions_ok": sum(1 for r in mine if labels.get(r["hash"], {}).get("status") == "ok"),
                          "regions_failed": sum(1 for r in mine if labels.get(r["hash"], {}).get("status") == "failed"),
                          "programs": len(progs), "programs_ok": sum(1 for p in progs if steps.get(p["id"], {}).get("status") == "ok"),
                          "programs_failed": sum(1 for p in progs if steps.get(p["id"], {}).get("status") == "failed")}
    return summary


def _summary_lines(summary: dict[str, Any]) -> list[str]:
    lines = [f"{'phase':<10} {'regions ok/failed/planned':>26} {'programs ok/failed/planned':>28}"]
    for phase, s in summary.items():
        lines.append(f"{phase:<10} {s['regions_ok']:>10} / {s['regions_failed']:>5} / {s['regions']:>5} "
                     f"{s['programs_ok']:>12} / {s['programs_failed']:>5} / {s['programs']:>5}")
    return lines


__all__ = ["FILES", "RunError", "read_lines", "run_plan"]
