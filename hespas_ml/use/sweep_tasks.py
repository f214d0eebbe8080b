"""What sweep workers run: preparing one program, and evaluating one chunk of configurations.

Both are plain module-level functions of picklable arguments, so the local process pool and a Dask
cluster run them alike. Neither writes files: results come back to the driver, which alone writes
the results folder (so a killed worker or driver never leaves half a file behind).
"""
from __future__ import annotations

import math
import time
from typing import Any

from .. import pipeline
from ..costs import graph_cost
from ..ingest.errors import HespasError
from ..split.memory import memory
from ..split.signature import signatures


def reason_of(exc: BaseException) -> str:
    """One line saying why something failed."""
    text = str(exc) if isinstance(exc, HespasError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:1000] or type(exc).__name__


# ------------------------------------------------------------------------------------------ programs

def prepare_program(source: str, split: str, devices: int) -> dict[str, Any]:
    """The pipeline's ingest and split stages for one program (exported first when it is a zoo spec), and
    its compute regions' signatures. A failure comes back as ``{"error": reason}`` (exceptions do not all
    survive the trip between processes)."""
    t0 = time.perf_counter()
    try:
        graph = pipeline.ingest(source, devices)
        rg = pipeline.split(graph, split)
        compute = rg.compute_regions()
        weights: dict[str, float] = {}
        for r in compute:
            for k in r.kernels:
                if k.matrix_flops:
                    dt = k.matrix_dtype or k.dtype
                    weights[dt] = weights.get(dt, 0.0) + k.matrix_flops * r.count
        comm_bytes = sum(r.collective.comm_bytes * r.count for r in rg.collectives())
        return {"rg": rg, "signatures": signatures(compute), "flops": float(graph_cost(graph)["flops"]),
                "dtype": max(weights, key=weights.get) if weights else "f32",
                "unit": "matrix" if weights else "vector", "comm_bytes": int(comm_bytes),
                "peak_memory": memory(rg).peak, "seconds": time.perf_counter() - t0}
    except Exception as exc:  # noqa: BLE001 - recorded as this program's failure
        return {"error": reason_of(exc), "seconds": time.perf_counter() - t0}


# ------------------------------------------------------------------------------------------ chunks

def run_chunk(task: dict[str, Any]) -> dict[str, Any]:
    """Evaluate every configuration of one chunk; returns its rows (as columns) and counters.

    ``task``: ``chunk``, ``first_config``, ``rg`` (RegionGraph or None), ``error`` (why the program
    failed, or None), ``info`` (program FLOPs, comm bytes, peak memory), ``variants`` (one dict per
    (target, fidelity, replay): the region times, the replay backend, the target's figures, …),
    ``systems`` (SystemSpecs) and ``configs`` ({(system name, local memory GB/s): SystemConfig}).
    The pipeline's trace stage runs once per variant, its replay stage once per system.
    """
    t0 = time.perf_counter()
    rg, error, info = task["rg"], task["error"], task["info"]
    systems = task["systems"]
    rows: dict[str, list[Any]] = {k: [] for k in RESULT_FIELDS}
    stats = {"trace_sets_built": 0, "replays_fast": 0, "replays_embedded": 0, "replays_other": 0,
             "configs_failed": 0}
    config_id = task["first_config"]
    for v in task["variants"]:
        traces = None
        v_error = error or v.get("error")
        if v_error is None:
            try:
                traces = pipeline.trace(rg, v["times"])
                stats["trace_sets_built"] += len(traces.sets)
            except Exception as exc:  # noqa: BLE001 - every configuration of this trace set fails
                v_error = reason_of(exc)
        counts = traces.point.node_counts(0) if traces else (0, 0)
        for system in systems:
            row = dict.fromkeys(RESULT_FIELDS)
            row.update(config_id=config_id, n_comp_nodes=counts[0], n_comm_nodes=counts[1],
                       unlabelled_regions=v.get("unlabelled", 0))
            config_id += 1
            if v_error is not None:
                row.update(status="failed", error=v_error)
            else:
                try:
                    row.update(_evaluate(traces, system, v, task["configs"], info, stats))
                except Exception as exc:  # noqa: BLE001 - recorded, never fatal
                    row.update(status="failed", error=reason_of(exc))
            if row["status"] != "ok":
                stats["configs_failed"] += 1
            for k in RESULT_FIELDS:
                rows[k].append(row[k])
    return {"chunk": task["chunk"], "rows": rows, "stats": stats, "seconds": time.perf_counter() - t0}


RESULT_FIELDS = ("config_id", "status", "error", "step_time_s", "compute_time_s", "exposed_comm_s",
                 "step_time_lo_s", "step_time_hi_s", "utilisation", "model_flops", "peak_flops", "cost_per_step",
                 "n_comp_nodes", "n_comm_nodes", "comm_bytes", "peak_memory_bytes", "fits", "bubble",
                 "unlabelled_regions", "replay_engine")


def _evaluate(traces: pipeline.StepTraces, system, v: dict[str, Any], configs, info, stats) -> dict[str, Any]:
    n = traces.point.n_ranks
    cfg = configs[(system.name, v["mem_bw_gbps"])] if system.n_npus > 1 else None
    step = pipeline.replay(traces, cfg, v["replay"])
    if step.engine != "none":
        stats["replays_fast" if step.engine == "fast" else "replays_embedded" if step.engine in
              ("symmetric", "full", "embedded") else "replays_other"] += len(traces.sets)
    out = {"status": "ok", "error": "", "step_time_s": step.step_time_s, "exposed_comm_s": step.exposed_comm_s,
           "compute_time_s": step.compute_time_s, "replay_engine": step.engine}
    if step.interval_s is not None:
        out["step_time_lo_s"], out["step_time_hi_s"] = step.interval_s
    flops = info["flops"] * n
    out["model_flops"] = flops
    peak = v["peak_flops"]
    out["peak_flops"] = peak
    out["comm_bytes"] = info["comm_bytes"]
    out["peak_memory_bytes"] = info["peak_memory"]
    out["fits"] = info["peak_memory"] <= v["mem_capacity"]
    out["bubble"] = info["bubble"]
    seconds = step.step_time_s
    out["utilisation"] = flops / (seconds * n * peak) if seconds > 0 and peak > 0 else math.nan
    cost = v.get("cost")
    if cost is not None:
        out["cost_per_step"] = seconds * n * cost / 3600.0
    return out


def run_staged_chunk(task: dict[str, Any]) -> dict[str, Any]:
    """Evaluate every configuration of one chunk of a pipelined zoo program from its stages' own programs
    (:func:`hespas_ml.pipeline_stages.simulate_stages`, once per variant and system; the role programs'
    exports are cached on disk, so the first configuration pays for them). ``task``: ``chunk``,
    ``first_config``, ``program``, ``split``, ``variants`` (target object, fidelity name, replay backend,
    cost, peak FLOP/s) and ``systems``. A configuration the stages cannot lay out fails with the reason."""
    from ..pipeline_stages import simulate_stages

    t0 = time.perf_counter()
    rows: dict[str, list[Any]] = {k: [] for k in RESULT_FIELDS}
    stats = {"replays_embedded": 0, "replays_other": 0, "configs_failed": 0}
    config_id = task["first_config"]
    for v in task["variants"]:
        for system in task["systems"]:
            row = dict.fromkeys(RESULT_FIELDS)
            row["config_id"] = config_id
            config_id += 1
            try:
                staged = simulate_stages(task["program"], v["target"], system.name, fidelity=v["fidelity"],
                                         split=task["split"], replay_backend=v["replay"])
            except Exception as exc:  # noqa: BLE001 - recorded, never fatal
                row.update(status="failed", error=reason_of(exc))
                stats["configs_failed"] += 1
            else:
                seconds, n, peak = staged.step_time_s, system.n_npus, v["peak_flops"]
                row.update(status="ok", error="", step_time_s=seconds, exposed_comm_s=staged.exposed_comm_s,
                           compute_time_s=seconds - staged.exposed_comm_s, model_flops=staged.model_flops,
                           peak_flops=peak, peak_memory_bytes=staged.peak_memory_bytes, fits=staged.fits,
                           bubble=staged.bubble, replay_engine=staged.replay_engine,
                           utilisation=staged.model_flops / (seconds * n * peak) if seconds > 0 and peak > 0
                           else math.nan)
                if v.get("cost") is not None:
                    row["cost_per_step"] = seconds * n * v["cost"] / 3600.0
                stats["replays_other" if v["replay"] == "astra-sim" else "replays_embedded"] += 1
            for k in RESULT_FIELDS:
                rows[k].append(row[k])
    return {"chunk": task["chunk"], "rows": rows, "stats": stats, "seconds": time.perf_counter() - t0}
