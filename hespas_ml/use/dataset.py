"""The dataset builder: programs × targets × fidelities → labelled unique regions.

:func:`build_dataset` runs three phases, each with a progress bar:

1. **programs** — every program of the spec goes through the pipeline's ingest and split stages in worker
   processes (:func:`~hespas_ml.label.region_records.program_records`); its compute regions are grouped by
   :func:`~hespas_ml.split.signature.region_signature` and committed to the cache with their occurrence
   counts. A program that cannot be read is recorded as failed with its reason.
2. **labels** — each (unique region, target, fidelity) is labelled once, fidelity after fidelity (so
   profiling never runs beside SCALE-Sim or itself), chunk by chunk; every chunk is committed as soon as
   it is done. A label that fails (XLA refuses to compile, SCALE-Sim overruns its budget …) is stored with
   status ``failed`` and its reason.
3. **tables** — ``regions.parquet``, ``labels.parquet``, ``graphs.parquet``, ``programs.parquet``,
   ``targets.parquet`` and ``manifest.json`` are written from the cache (temp file + rename each).

Killed at any point and run again, a build skips finished programs and labels (and failed ones, unless
``retry_failed``) and finishes. See :mod:`hespas_ml.label.dataset_tables` for the tables and
:func:`load_dataset`.
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import shutil
import time
from collections import deque
from pathlib import Path
from typing import Any

from .. import pipeline
from ..label.dataset_cache import BuildCache, DatasetError
from ..units import progress_bar
from .dataset_labels import build_labels, reason_of
from ..label.dataset_spec import DatasetSpec, load_spec
from ..label.dataset_tables import Dataset, load_dataset, write_manifest, write_tables
from ..label.region_records import program_records


def default_workers() -> int:
    """Worker processes when none are asked for: half the cores, at least one."""
    return max(1, (os.cpu_count() or 2) // 2)


# ------------------------------------------------------------------------------------------ phase 1

def _program_task(source: str, split: str, caps: dict[str, Any]) -> dict[str, Any]:
    """Worker entry point (module level, so a spawned worker can import it): the pipeline's ingest and split
    stages, then the program's regions grouped by signature. A failure comes back as
    ``{"error": reason, "seconds": …}`` (exceptions do not all survive the trip between processes)."""
    t0 = time.perf_counter()
    try:
        records = program_records(pipeline.split(pipeline.ingest(source), split), caps)
        return {**records, "seconds": time.perf_counter() - t0}
    except Exception as exc:  # noqa: BLE001 - recorded as this program's failure
        return {"error": reason_of(exc), "seconds": time.perf_counter() - t0}


def _run_pool(queue: "deque", width: int, spec: DatasetSpec, cache: BuildCache, stats: dict[str, int],
              bar) -> list[Any]:
    """Split programs from ``queue`` in a pool of ``width`` spawned workers, storing each result as it
    comes. Returns the programs that were in flight when a worker died (the pool is then given up)."""
    context = multiprocessing.get_context("spawn")
    inflight: dict[cf.Future, Any] = {}
    pool = cf.ProcessPoolExecutor(max_workers=width, mp_context=context)
    try:
        while queue or inflight:
            while queue and len(inflight) < 2 * width:
                prog = queue.popleft()
                inflight[pool.submit(_program_task, prog.source, spec.split, spec.caps)] = prog
            finished, _ = cf.wait(inflight, return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                prog = inflight[fut]
                try:
                    result = fut.result()
                except cf.process.BrokenProcessPool:
                    lost = list(inflight.values())
                    pool.shutdown(wait=False, cancel_futures=True)
                    return lost
                except Exception as exc:  # noqa: BLE001 - recorded as this program's failure
                    cache.add_failed_program(prog.source, spec.split, prog.family, reason_of(exc), 0.0)
                    stats["programs_failed_new"] += 1
                else:
                    if "error" in result:
                        cache.add_failed_program(prog.source, spec.split, prog.family, result["error"],
                                                 result["seconds"])
                        stats["programs_failed_new"] += 1
                    else:
                        cache.add_program(prog.source, spec.split, prog.family, result)
                        stats["programs_new"] += 1
                del inflight[fut]
                bar.update(1)
    except BaseException:                 # interrupted: do not wait for the programs still exporting
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return []


def build_programs(spec: DatasetSpec, cache: BuildCache, workers: int, progress: bool = True) -> dict[str, int]:
    """Phase 1: export, ingest and split every program not yet in the cache, ``workers`` at a time.

    When a worker process dies (out of memory, killed), the programs it may have been running are retried
    one at a time in a fresh worker; one that kills its worker alone is recorded as failed.
    """
    done = cache.program_status()
    queue = deque(p for p in spec.programs if (p.source, spec.split) not in done)
    stats = {"programs_new": 0, "programs_failed_new": 0}
    if not queue:
        return stats
    suspects: deque = deque()
    bar = progress_bar(len(queue), "programs", "prog", progress)
    try:
        while queue or suspects:
            if queue:
                suspects.extend(_run_pool(queue, max(1, min(workers, len(queue))), spec, cache, stats, bar))
                continue
            one = deque([suspects.popleft()])
            for prog in _run_pool(one, 1, spec, cache, stats, bar):
                cache.add_failed_program(prog.source, spec.split, prog.family,
                                         "the worker process died (out of memory or killed)", 0.0)
                stats["programs_failed_new"] += 1
                bar.update(1)
    finally:
        bar.close()
    return stats


# ------------------------------------------------------------------------------------------ entry point

def scope_hashes(spec: DatasetSpec, cache: BuildCache) -> list[str]:
    """Unique regions of the spec's successfully split programs, in hash order."""
    wanted = {(p.source, spec.split) for p in spec.programs}
    ok = {k for k, status in cache.program_status().items() if status == "ok" and k in wanted}
    return sorted({h for s, sp, h, _, _ in cache.occurrences() if (s, sp) in ok})


def build_dataset(spec_path: str | os.PathLike[str] | DatasetSpec, out_dir: str | os.PathLike[str], *,
                  workers: int | None = None, retry_failed: bool = False, progress: bool = True) -> dict[str, Any]:
    """Build (or resume) the dataset of ``spec_path`` (a spec file, or a spec already read) in ``out_dir``;
    returns the manifest's summary.

    ``workers``: processes for exporting/splitting programs and SCALE-Sim calls (default: half the cores).
    ``retry_failed``: label (and split) again what failed before; otherwise failures are kept and skipped.
    """
    spec = spec_path if isinstance(spec_path, DatasetSpec) else load_spec(spec_path)
    workers = workers or default_workers()
    if workers < 1:
        raise DatasetError(f"{out_dir}: workers must be at least 1, got {workers}")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    with BuildCache(out_dir) as cache:
        if retry_failed:
            cache.forget_failed_programs()
            cache.forget_failed_labels()
        prog_stats = build_programs(spec, cache, workers, progress)
        timings["programs_s"] = time.perf_counter() - t0
        hashes = scope_hashes(spec, cache)
        t1 = time.perf_counter()
        label_stats = build_labels(spec, cache, hashes, workers, progress)
        timings["labels_s"] = time.perf_counter() - t1
        timings.update({f"label_{k}_s": v["seconds"] for k, v in label_stats.items()})
        t2 = time.perf_counter()
        run = {"timings": timings, "new": {**prog_stats,
                                           **{f"labels_new_{k}": v["labels_new"] for k, v in label_stats.items()},
                                           **{f"{k}_steadiness": v["steadiness"] for k, v in label_stats.items()
                                              if v.get("steadiness")}}}
        summary = write_tables(spec, cache, hashes, run, progress=progress)
        summary["timings"]["tables_s"] = time.perf_counter() - t2
        summary["timings"]["total_s"] = time.perf_counter() - t0
        write_manifest(cache.dir, summary)
    return summary


def snapshot_dataset(spec_path: str | os.PathLike[str], build_dir: str | os.PathLike[str],
                     out_dir: str | os.PathLike[str], *, progress: bool = True) -> dict[str, Any]:
    """Tables of everything a build (finished, killed, or still running) has labelled so far, written to
    ``out_dir``: the build's cache database is copied with SQLite's online backup (a consistent snapshot
    that never blocks the build), then written out like a finished build."""
    import sqlite3

    from ..label.dataset_cache import CACHE_FILE
    from ..label.steadiness import LOG_FILE

    spec = load_spec(spec_path)
    source = Path(build_dir) / CACHE_FILE
    if not source.is_file():
        raise DatasetError(f"{build_dir}: no dataset build here ({CACHE_FILE} is missing)")
    out = Path(out_dir)
    if out.resolve() == Path(build_dir).resolve():
        raise DatasetError(f"{out_dir}: a snapshot must go to another folder than the build")
    out.mkdir(parents=True, exist_ok=True)
    try:
        src = sqlite3.connect(f"file:{source}?mode=ro", uri=True, timeout=30)
        dst = sqlite3.connect(out / CACHE_FILE)
        with dst:
            src.backup(dst)
        src.close()
        dst.close()
    except sqlite3.Error as exc:
        raise DatasetError(f"{source}: cannot snapshot the cache database ({exc})") from None
    log = Path(build_dir) / LOG_FILE                 # the checks of the machine the labels were taken on
    if log.is_file():
        shutil.copyfile(log, out / LOG_FILE)
    with BuildCache(out) as cache:
        hashes = scope_hashes(spec, cache)
        summary = write_tables(spec, cache, hashes, {"timings": {}, "new": {}, "snapshot_of": str(build_dir)},
                               progress=progress)
        write_manifest(cache.dir, summary)
    return summary


__all__ = ["Dataset", "DatasetError", "build_dataset", "default_workers", "load_dataset", "snapshot_dataset"]
