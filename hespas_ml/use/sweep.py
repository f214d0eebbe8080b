"""Design sweeps: every configuration of a sweep spec simulated, one row each, resumably.

``run_sweep(spec, out)`` evaluates workloads × parallelism × targets × fidelities × replays × systems
(see :mod:`hespas_ml.use.sweep_spec`) with work shared, not repeated:

* each program goes through the pipeline's ingest and split stages once (a task on the engine:
  :func:`prepare_program`);
* the label stage runs in the driver with the labels of every program before it, so each unique compute
  region (by :func:`~hespas_ml.split.signature.region_signature`) is labelled once per (target, fidelity),
  whatever program it comes from;
* each system config is built once per (system, target memory bandwidth) — the local memory bandwidth
  of a system is its target's, as in :func:`hespas_ml.simulate`;
* the trace stage runs once per (program, target, fidelity) and the replay stage once per system
  (:func:`run_chunk`): the traces' compiled replay plan and each system's memoised collective times are
  reused, so the embedded replay's step times come by its fast path;
* a pipelined program simulated from its stages (``pipeline: stages``) skips all of that: each of its
  chunks runs :func:`~hespas_ml.pipeline_stages.simulate_stages` per configuration
  (:func:`run_staged_chunk`; no step-time interval, no node or byte counts).

Results folder ``DIR``: ``chunks/chunk-NNNNNN.parquet`` (one per chunk of configurations, written to a
temporary name and renamed, so a file is whole or absent), ``manifest.json`` (the spec's fingerprint,
counts, and the sharing counters and timings of the latest run; rewritten atomically every few
seconds) and, once every chunk is done,
``results.parquet``: one row per configuration, every input column plus the results. A killed sweep
loses at most the chunks in flight; run it again with the same ``--out`` and it carries on.

Columns: ``config_id``, the workload (``workload``, ``family``, ``program``, ``devices``, ``parallel``,
``pipeline`` — lockstep, or stages where the spec's ``pipeline: stages`` simulates a pipelined zoo step
from its stages' own programs —, ``param_<name>`` for each grid parameter), ``target``, ``fidelity``,
``replay``, ``split``, the system (``system``, ``topology``, ``npus_per_dim``, ``bandwidth_gbps`` — the
slowest link —, ``latency_ns`` — the slowest hop), ``cost_per_device_hour`` (when the spec has costs), then ``status`` (ok | failed),
``error``, ``step_time_s``, ``compute_time_s`` and ``exposed_comm_s`` (ASTRA-sim's split: compute =
step − exposed communication), ``step_time_lo_s`` / ``step_time_hi_s`` (when the fidelity gives
intervals: the replay with every region at the lower / upper end of its interval — min / max of those
and the point replay, as list scheduling need not be monotone), ``utilisation`` (model FLOPs /
(step time × devices × peak), where model FLOPs are the FLOPs the program executes on all devices —
replicated or recomputed work counts, as in hardware-FLOPs utilisation — and peak is the target's
matrix peak for the program's main matrix element type), ``model_flops``, ``peak_flops``,
``cost_per_step`` ($ for one step on all devices), ``n_comp_nodes``, ``n_comm_nodes`` (per device),
``comm_bytes`` (collective bytes per device), ``bubble`` (the share of the step a pipeline's busiest stage
has nothing to run: simulated from the stages, or the lock-step schedule's idle ticks),
``unlabelled_regions`` (regions the fidelity could not time, counted as 0 s as in ``simulate``) and
``replay_engine`` (fast | symmetric | full | astra-sim | none; a staged row: how its ranks were replayed).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from .. import pipeline
from ..ingest.errors import HespasError
from ..label.fidelity import Label
from .sweep_engines import make_engine
from .sweep_spec import SweepSpec, load_sweep_spec
from .sweep_tasks import RESULT_FIELDS, prepare_program, reason_of, run_chunk, run_staged_chunk

RESULTS, CHUNKS, MANIFEST = "results.parquet", "chunks", "manifest.json"
MANIFEST_EVERY_S = 10.0


class SweepError(HespasError):
    """A sweep cannot run or its results folder cannot be used: one line naming the folder."""


# ---------------------------------------------------------------------------------------- schema

def result_schema(spec: SweepSpec):
    """The pyarrow schema of the results table of ``spec`` (the same for every chunk)."""
    import pyarrow as pa
    kinds = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "str": pa.string()}
    fields = [("config_id", pa.int64()), ("workload", pa.string()), ("family", pa.string()),
              ("program", pa.string()), ("devices", pa.int64()), ("parallel", pa.string()), ("pipeline", pa.string())]
    fields += [(f"param_{k}", kinds[v]) for k, v in spec.param_columns.items()]
    fields += [("target", pa.string()), ("fidelity", pa.string()), ("replay", pa.string()), ("split", pa.string()),
               ("system", pa.string()), ("topology", pa.string()), ("npus_per_dim", pa.string()),
               ("bandwidth_gbps", pa.float64()), ("latency_ns", pa.float64())]
    if spec.costs:
        fields.append(("cost_per_device_hour", pa.float64()))
    fields += [("status", pa.string()), ("error", pa.string()), ("step_time_s", pa.float64()),
               ("compute_time_s", pa.float64()), ("exposed_comm_s", pa.float64()),
               ("step_time_lo_s", pa.float64()), ("step_time_hi_s", pa.float64()),
               ("utilisation", pa.float64()), ("model_flops", pa.float64()), ("peak_flops", pa.float64())]
    if spec.costs:
        fields.append(("cost_per_step", pa.float64()))
    fields += [("n_comp_nodes", pa.int64()), ("n_comm_nodes", pa.int64()), ("comm_bytes", pa.int64()),
               ("peak_memory_bytes", pa.int64()), ("fits", pa.bool_()), ("bubble", pa.float64()),
               ("unlabelled_regions", pa.int64()), ("replay_engine", pa.string())]
    return pa.schema(fields)


# ---------------------------------------------------------------------------------------- driver

def run_sweep(spec_path: str | Path, out: str | Path, *, engine: str = "local", workers: int | None = None,
              address: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Run (or resume) the sweep of ``spec_path`` into ``out``; returns the final manifest."""
    spec = load_sweep_spec(spec_path)
    return _Sweep(spec, Path(out), engine, workers, address, progress).run()


class _Sweep:
    def __init__(self, spec: SweepSpec, out: Path, engine: str, workers: int | None, address: str | None,
                 progress: bool):
        self.spec, self.out = spec, out
        self.engine_name, self.workers, self.address, self.progress = engine, workers, address, progress
        self.chunks = spec.chunks()
        self.variants = spec.variants
        self.schema = result_schema(spec)
        self.stats: dict[str, int] = {k: 0 for k in (
            "programs_prepared", "programs_staged", "programs_failed", "regions_seen", "regions_unique",
            "labels_computed",
            "systems_built", "trace_sets_built", "replays_fast", "replays_embedded", "replays_other",
            "configs_evaluated", "configs_failed", "chunks_written")}
        self.timings: dict[str, float] = {"prepare_s": 0.0, "label_s": 0.0, "chunks_s": 0.0}
        self.labels: dict[tuple[str, str], dict[str, Label]] = {}    # (target, fidelity) -> by signature
        self.signatures: set[str] = set()
        self.system_cfgs: dict[tuple[str, float], Any] = {}

    # -- folder ---------------------------------------------------------------------------------
    def chunk_path(self, cid: int) -> Path:
        return self.out / CHUNKS / f"chunk-{cid:06d}.parquet"

    def open_folder(self) -> set[int]:
        """Check (or create) the results folder; the ids of chunks already written."""
        import pyarrow.parquet as pq
        if self.out.exists() and not self.out.is_dir():
            raise SweepError(f"{self.out}: exists and is not a folder")
        manifest = self.out / MANIFEST
        if manifest.exists():
            try:
                old = json.loads(manifest.read_text())
                fingerprint = old["fingerprint"]
            except (OSError, ValueError, KeyError, TypeError):
                raise SweepError(f"{manifest}: not a sweep manifest (unreadable or damaged); "
                                 "use another --out") from None
            if fingerprint != self.spec.fingerprint():
                raise SweepError(f"{self.out}: holds a sweep of another spec ({old.get('spec', '?')}, fingerprint "
                                 f"{fingerprint}); use another --out")
        elif self.out.is_dir() and any(self.out.iterdir()):
            raise SweepError(f"{self.out}: folder is not empty and holds no sweep manifest; use another --out")
        (self.out / CHUNKS).mkdir(parents=True, exist_ok=True)
        for tmp in (self.out / CHUNKS).glob(".*.tmp"):
            tmp.unlink(missing_ok=True)
        done: set[int] = set()
        for chunk in self.chunks:
            path = self.chunk_path(chunk.id)
            if not path.exists():
                continue
            try:
                ok = pq.read_metadata(path).num_rows == chunk.n_configs()
            except Exception:  # noqa: BLE001 - an unreadable chunk is computed again
                ok = False
            if ok:
                done.add(chunk.id)
            else:
                print(f"hespas-ml: warning: {path}: damaged chunk, computing it again", file=sys.stderr)
                path.unlink()
        return done

    def write_manifest(self, status: str, done_configs: int) -> dict[str, Any]:
        s = self.spec
        data = {"kind": "hespas-ml-sweep", "format": 1, "spec": s.path, "name": s.name,
                "fingerprint": s.fingerprint(), "status": status, "engine": self.engine_name,
                "configs": s.n_configs(), "configs_done": done_configs, "chunks": len(self.chunks),
                "programs": len(s.programs), "targets": s.targets, "fidelities": s.fidelities,
                "replays": s.replays, "systems": {str(k): len(v) for k, v in s.systems.items()},
                "notes": s.notes, "stats": self.stats, "timings_s": self.timings,
                "results": RESULTS if status == "done" else None}
        _atomic_write(self.out / MANIFEST, (json.dumps(data, indent=1) + "\n").encode())
        return data

    # -- run ------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        done = self.open_folder()
        pending = [c for c in self.chunks if c.id not in done]
        done_configs = sum(c.n_configs() for c in self.chunks if c.id in done)
        self.write_manifest("running", done_configs)
        if pending:
            done_configs = self.evaluate(pending, done_configs)
        self.merge()
        self.timings["total_s"] = time.perf_counter() - t0
        return self.write_manifest("done", done_configs)

    def evaluate(self, pending: list, done_configs: int) -> int:
        from tqdm import tqdm

        by_program: dict[int, list] = {}
        for c in pending:
            by_program.setdefault(c.program, []).append(c)
        programs = deque(by_program)
        chunk_queue: deque = deque()
        engine = make_engine(self.engine_name, self.workers, self.address)
        limit = 2 * engine.workers
        inflight: dict[Any, tuple[str, Any]] = {}
        bar = tqdm(total=self.spec.n_configs(), initial=done_configs, desc="sweep", unit="cfg", dynamic_ncols=True,
                   mininterval=0.5, smoothing=0.05, disable=not self.progress)
        n_prog, n_prog_done = len(programs), 0
        last_manifest = time.perf_counter()
        try:
            while programs or chunk_queue or inflight:
                while len(inflight) < limit and (chunk_queue or programs):
                    if chunk_queue:
                        chunk, task, payload = chunk_queue.popleft()
                        inflight[engine.submit(task, payload)] = ("chunk", chunk)
                        continue
                    p = self.spec.programs[programs.popleft()]
                    if p.error is not None:
                        self.stats["programs_failed"] += 1
                        n_prog_done += 1
                        chunk_queue.extend((c, run_chunk, t) for c, t in self.payloads(p, {"error": p.error},
                                                                                         by_program[p.index]))
                    elif p.pipeline == "stages":         # each chunk simulates the stages' programs itself
                        self.stats["programs_staged"] += 1
                        n_prog_done += 1
                        chunk_queue.extend((c, run_staged_chunk, self.staged_payload(p, c))
                                           for c in by_program[p.index])
                    else:
                        fut = engine.submit(prepare_program, p.source, self.spec.split, p.devices)
                        inflight[fut] = ("program", p)
                for fut in engine.wait(inflight, timeout=1.0):
                    kind, what = inflight.pop(fut)
                    try:
                        result = fut.result()
                    except Exception as exc:  # noqa: BLE001 - a task that raised is recorded as failed
                        if _lost_worker(exc):
                            raise SweepError(f"{self.out}: a worker process died ({reason_of(exc)[:200]}); the "
                                             "finished chunks are kept: run the sweep again to resume") from None
                        result = {"error": f"worker failed: {reason_of(exc)}"}
                    if kind == "program":
                        n_prog_done += 1
                        chunk_queue.extend((c, run_chunk, t) for c, t in self.on_program(what, result,
                                                                                         by_program[what.index]))
                    else:
                        if "error" in result:
                            result = self.failed_chunk(what, result["error"])
                        self.write_chunk(what, result)
                        self.stats["configs_evaluated"] += what.n_configs()
                        done_configs += what.n_configs()
                        bar.update(what.n_configs())
                bar.set_postfix_str(f"programs {n_prog_done}/{n_prog}", refresh=False)
                if time.perf_counter() - last_manifest > MANIFEST_EVERY_S:
                    self.write_manifest("running", done_configs)
                    last_manifest = time.perf_counter()
        except BaseException:
            bar.close()
            self.write_manifest("running", done_configs)
            engine.close(wait=False)          # interrupted: do not wait for the tasks in flight
            raise
        bar.close()
        engine.close()
        return done_configs

    # -- programs and labels ----------------------------------------------------------------------
    def on_program(self, p, result: dict[str, Any], chunks: list) -> list:
        self.timings["prepare_s"] += float(result.get("seconds", 0.0))
        if "error" in result:
            self.stats["programs_failed"] += 1
            return self.payloads(p, {"error": result["error"]}, chunks)
        self.stats["programs_prepared"] += 1
        t = time.perf_counter()
        rg, sigs = result["rg"], result["signatures"]
        self.stats["regions_seen"] += len(sigs)
        self.signatures.update(sigs)
        self.stats["regions_unique"] = len(self.signatures)
        needed = {(self.variants[v].target, self.variants[v].fidelity) for c in chunks for v in c.variants}
        times = {pair: self.label(rg, sigs, *pair) for pair in sorted(needed)}
        self.timings["label_s"] += time.perf_counter() - t
        return self.payloads(p, result, chunks, times)

    def target(self, name: str):
        return self.spec.target_objects[name]

    def fidelity(self, name: str):
        return self.spec.fidelity_objects[name]

    def label(self, rg, sigs: list[str], target: str, fidelity: str) -> pipeline.RegionTimes:
        """The pipeline's label stage, with the labels this sweep took for other programs: only regions no
        program has shown yet are labelled. When the fidelity fails on them, each is unlabelled, with why."""
        known = self.labels.setdefault((target, fidelity), {})
        before = len(known)
        try:
            times = pipeline.label(rg, self.fidelity(fidelity), self.target(target), region_signatures=sigs,
                                   known=known)
        except Exception as exc:  # noqa: BLE001 - every new region of this program is unlabelled
            failed = Label(math.nan, "failed", {"reason": reason_of(exc)})
            known.update((s, failed) for s in sigs if s not in known)
            return pipeline.label(rg, self.fidelity(fidelity), self.target(target), region_signatures=sigs,
                                  known=known)
        self.stats["labels_computed"] += len(known) - before
        return times

    def payloads(self, p, result: dict[str, Any], chunks: list, times=None) -> list:
        """(chunk, task) pairs of a prepared (or failed) program."""
        error = result.get("error")
        rg = result.get("rg")
        per_variant: dict[int, dict[str, Any]] = {}
        out = []
        systems = self.spec.systems_for(p)
        for chunk in chunks:
            variants = []
            for vi in chunk.variants:
                if vi not in per_variant:
                    per_variant[vi] = self.variant_task(vi, times, result, error)
                variants.append(per_variant[vi])
            sl = systems[chunk.systems[0]:chunk.systems[1]]
            configs = {}
            if error is None:
                for v in variants:
                    for s in sl:
                        if s.n_npus > 1:
                            configs[(s.name, v["mem_bw_gbps"])] = self.system_config(s.name, v["mem_bw_gbps"])
            info = {"flops": result.get("flops", 0.0), "comm_bytes": result.get("comm_bytes", 0),
                    "peak_memory": result.get("peak_memory", 0), "bubble": _lockstep_bubble(p)}
            task = {"chunk": chunk.id, "first_config": chunk.first_config, "rg": rg, "error": error,
                    "info": info, "variants": variants, "systems": sl, "configs": configs}
            out.append((chunk, task))
        return out

    def staged_payload(self, p, chunk) -> dict[str, Any]:
        """The task of a chunk of a pipelined program simulated from its stages' programs."""
        from ..ingest.zoo import parse_zoo_spec
        dtype = str(parse_zoo_spec(p.source)[1].get("dtype", "f32"))
        variants = []
        for vi in chunk.variants:
            v = self.variants[vi]
            tgt = self.target(v.target)
            variants.append({"target": tgt, "fidelity": v.fidelity, "replay": v.replay,
                             "cost": self.spec.costs.get(v.target), "peak_flops": tgt.peak_flops(dtype, "matrix")})
        return {"chunk": chunk.id, "first_config": chunk.first_config, "program": p.source, "split": self.spec.split,
                "variants": variants, "systems": self.spec.systems_for(p)[chunk.systems[0]:chunk.systems[1]]}

    def variant_task(self, vi: int, times, result, error) -> dict[str, Any]:
        v = self.variants[vi]
        tgt = self.target(v.target)
        task: dict[str, Any] = {"index": vi, "target": v.target, "fidelity": v.fidelity, "replay": v.replay,
                                "mem_bw_gbps": tgt.mem_bw / 1e9, "mem_capacity": tgt.mem_capacity,
                                "cost": self.spec.costs.get(v.target),
                                "peak_flops": tgt.peak_flops(result.get("dtype", "f32"), result.get("unit", "matrix")),
                                "unlabelled": 0}
        if error is None:
            task["times"] = times[(v.target, v.fidelity)]
            task["unlabelled"] = task["times"].failed
        return task

    def system_config(self, name: str, mem_bw_gbps: float):
        key = (name, mem_bw_gbps)
        cfg = self.system_cfgs.get(key)
        if cfg is None:
            from ..replay.system import load_system
            cfg = self.system_cfgs[key] = load_system(name, local_mem_bw_gbps=mem_bw_gbps)
            self.stats["systems_built"] += 1
        return cfg

    # -- results --------------------------------------------------------------------------------
    def failed_chunk(self, chunk, why: str) -> dict[str, Any]:
        n = chunk.n_configs()
        rows = {k: [None] * n for k in RESULT_FIELDS}
        rows["config_id"] = list(range(chunk.first_config, chunk.first_config + n))
        rows["status"] = ["failed"] * n
        rows["error"] = [why] * n
        return {"rows": rows, "stats": {"configs_failed": n}}

    def write_chunk(self, chunk, result: dict[str, Any]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        for k, v in result.get("stats", {}).items():
            self.stats[k] = self.stats.get(k, 0) + v
        self.timings["chunks_s"] += float(result.get("seconds", 0.0))
        rows = result["rows"]
        p = self.spec.programs[chunk.program]
        systems = self.spec.systems_for(p)[chunk.systems[0]:chunk.systems[1]]
        ns = len(systems)
        n = ns * len(chunk.variants)
        cols: dict[str, list[Any]] = {}
        cols["config_id"] = rows["config_id"]
        for k, v in (("workload", p.workload), ("family", p.family), ("program", p.source),
                     ("devices", p.devices), ("parallel", p.parallel), ("pipeline", p.pipeline),
                     ("split", self.spec.split)):
            cols[k] = [v] * n
        for k in self.spec.param_columns:
            value = p.params.get(k)
            if value is not None and self.spec.param_columns[k] == "str":
                value = str(value)
            cols[f"param_{k}"] = [value] * n
        for k in ("target", "fidelity", "replay"):
            cols[k] = [getattr(self.variants[vi], k) for vi in chunk.variants for _ in range(ns)]
        for k in ("system", "topology", "npus_per_dim", "bandwidth_gbps", "latency_ns"):
            attr = "name" if k == "system" else k
            cols[k] = [getattr(s, attr) for _ in chunk.variants for s in systems]
        if self.spec.costs:
            cols["cost_per_device_hour"] = [self.spec.costs.get(self.variants[vi].target)
                                            for vi in chunk.variants for _ in range(ns)]
        for k in RESULT_FIELDS[1:]:
            if k != "cost_per_step" or self.spec.costs:
                cols[k] = rows[k]
        table = pa.table({f.name: pa.array(cols[f.name], type=f.type) for f in self.schema}, schema=self.schema)
        path = self.chunk_path(chunk.id)
        tmp = path.with_name(f".{path.name}.tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, path)
        self.stats["chunks_written"] += 1

    def merge(self) -> None:
        """Concatenate every chunk into results.parquet (temporary file + rename)."""
        import pyarrow as pa
        import pyarrow.parquet as pq
        tables = [pq.read_table(self.chunk_path(c.id), schema=self.schema) for c in self.chunks
                  if self.chunk_path(c.id).exists()]
        table = pa.concat_tables(tables) if tables else self.schema.empty_table()
        path = self.out / RESULTS
        tmp = path.with_name(f".{path.name}.tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, path)


def _lockstep_bubble(p) -> float:
    """The share of a lock-step pipeline's ticks in which a stage has no microbatch (0 without one)."""
    if p.family == "mlir" or p.error is not None:
        return 0.0
    from ..ingest.zoo import parse_zoo_spec
    from ..ingest.zoo.checks import pipeline_bubble
    try:
        return pipeline_bubble(parse_zoo_spec(p.source)[1])
    except (HespasError, ValueError):
        return 0.0


def _lost_worker(exc: BaseException) -> bool:
    """Whether a task failed because its worker process went away (not because of its input)."""
    import concurrent.futures.process as cfp
    return isinstance(exc, cfp.BrokenProcessPool) or type(exc).__name__ in ("KilledWorker", "CommClosedError")


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)
