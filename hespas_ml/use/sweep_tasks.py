"""What sweep workers run: preparing one program, and evaluating one chunk of configurations.

Both are plain module-level functions of picklable arguments, so the local process pool and a Dask
cluster run them alike. Neither writes files: results come back to the driver, which alone writes
the results folder (so a killed worker or driver never leaves half a file behind).
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Any

from ..ingest.errors import HespasError

CONTEXT_CACHE = 4096        # SystemContexts a worker keeps (one per system × local memory bandwidth)
_contexts: "OrderedDict[tuple[str, float], Any]" = OrderedDict()


def reason_of(exc: BaseException) -> str:
    """One line saying why something failed."""
    text = str(exc) if isinstance(exc, HespasError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:1000] or type(exc).__name__


# ------------------------------------------------------------------------------------------ programs

def prepare_program(source: str, split: str, devices: int) -> dict[str, Any]:
    """Export (zoo) / read, ingest and split a program; sign its compute regions. A failure comes back as
    ``{"error": reason}`` (exceptions do not all survive the trip between processes)."""
    t0 = time.perf_counter()
    try:
        from ..ingest import load_program
        from ..costs import graph_cost
        from ..split.memory import memory
        from ..split.regions import split_program
        from ..split.signature import signatures

        graph = load_program(source)
        if graph.n_devices != devices:
            return {"error": f"{source}: runs on {graph.n_devices} device(s), not the {devices} the sweep "
                             "expects", "seconds": time.perf_counter() - t0}
        rg = split_program(graph, split)
        compute = rg.compute_regions()
        sigs = signatures(compute)
        weights: dict[str, float] = {}
        for r in compute:
            for k in r.kernels:
                if k.matrix_flops:
                    dt = k.matrix_dtype or k.dtype
                    weights[dt] = weights.get(dt, 0.0) + k.matrix_flops * r.count
        comm_bytes = sum(r.collective.comm_bytes * r.count for r in rg.collectives())
        return {"rg": rg, "signatures": sigs, "flops": float(graph_cost(graph)["flops"]),
                "dtype": max(weights, key=weights.get) if weights else "f32",
                "unit": "matrix" if weights else "vector", "comm_bytes": int(comm_bytes),
                "peak_memory": memory(rg).peak, "seconds": time.perf_counter() - t0}
    except Exception as exc:  # noqa: BLE001 - recorded as this program's failure
        return {"error": reason_of(exc), "seconds": time.perf_counter() - t0}


# ------------------------------------------------------------------------------------------ chunks

def _context(system_cfg, key: tuple[str, float]):
    from ..replay.fast import SystemContext
    ctx = _contexts.get(key)
    if ctx is None:
        ctx = SystemContext(system_cfg)
        _contexts[key] = ctx
        if len(_contexts) > CONTEXT_CACHE:
            _contexts.popitem(last=False)
    else:
        _contexts.move_to_end(key)
    return ctx


def _replay(traces, plan, system_cfg, key, replay: str) -> tuple[int, int, str]:
    """(finish ns, exposed ns, engine) of one trace set on one system: the fast replay (which hands over
    to the embedded replay where it does not apply), or the real ASTRA-sim binary."""
    from ..replay import replay as run_replay
    from ..replay.fast import replay_fast

    if replay == "astra-sim":
        res = run_replay(traces.traces, system_cfg, traces.comm_groups or None, backend="astra-sim")
        engine = "astra-sim"
    else:
        res = replay_fast(traces.traces, _context(system_cfg, key), traces.comm_groups or None, plan=plan)
        engine = str(res.details.get("engine", "embedded"))
    last = max(res.ranks, key=lambda r: (r.finish_ns, -r.rank))
    return last.finish_ns, last.exposed_comm_ns, engine


def run_chunk(task: dict[str, Any]) -> dict[str, Any]:
    """Evaluate every configuration of one chunk; returns its rows (as columns) and counters.

    ``task``: ``chunk``, ``first_config``, ``rg`` (RegionGraph or None), ``error`` (why the program
    failed, or None), ``info`` (program FLOPs, comm bytes), ``variants`` (one dict per trace set: target,
    fidelity, replay, region seconds and their interval, …), ``systems`` (SystemSpecs) and
    ``configs`` ({(system name, local memory GB/s): SystemConfig}).
    """
    from ..replay.traces import build_traces
    from ..replay.fast import compile_plan

    t0 = time.perf_counter()
    rg, error, info = task["rg"], task["error"], task["info"]
    systems = task["systems"]
    rows: dict[str, list[Any]] = {k: [] for k in RESULT_FIELDS}
    stats = {"trace_sets_built": 0, "replays_fast": 0, "replays_embedded": 0, "replays_other": 0,
             "configs_failed": 0}
    config_id = task["first_config"]
    for v in task["variants"]:
        traces = plans = None
        v_error = error or v.get("error")
        if v_error is None:
            try:
                n = rg.n_devices
                sets = [build_traces(rg, v["seconds"], n)]
                if v.get("lower") is not None:
                    sets += [build_traces(rg, v["lower"], n), build_traces(rg, v["upper"], n)]
                stats["trace_sets_built"] += len(sets)
                plans = [compile_plan(s.traces, s.comm_groups) if n > 1 else None for s in sets]
                traces = sets
            except Exception as exc:  # noqa: BLE001 - every configuration of this trace set fails
                v_error = reason_of(exc)
        counts = traces[0].node_counts(0) if traces else (0, 0)
        for system in systems:
            row = dict.fromkeys(RESULT_FIELDS)
            row.update(config_id=config_id, n_comp_nodes=counts[0], n_comm_nodes=counts[1],
                       unlabelled_regions=v.get("unlabelled", 0))
            config_id += 1
            if v_error is not None:
                row.update(status="failed", error=v_error)
            else:
                try:
                    row.update(_evaluate(traces, plans, system, v, task["configs"], info, stats))
                except Exception as exc:  # noqa: BLE001 - recorded, never fatal
                    row.update(status="failed", error=reason_of(exc))
            if row["status"] != "ok":
                stats["configs_failed"] += 1
            for k in RESULT_FIELDS:
                rows[k].append(row[k])
    return {"chunk": task["chunk"], "rows": rows, "stats": stats, "seconds": time.perf_counter() - t0}


RESULT_FIELDS = ("config_id", "status", "error", "step_time_s", "compute_time_s", "exposed_comm_s",
                 "step_time_lo_s", "step_time_hi_s", "utilisation", "model_flops", "peak_flops", "cost_per_step",
                 "n_comp_nodes", "n_comm_nodes", "comm_bytes", "peak_memory_bytes", "fits", "unlabelled_regions",
                 "replay_engine")


def _evaluate(traces, plans, system, v: dict[str, Any], configs, info, stats) -> dict[str, Any]:
    n = traces[0].n_ranks
    if system.n_npus == 1:
        steps = [(s.compute_time_s, 0.0) for s in traces]    # one device: no replay, the exact sum
        engine = "none"
    else:
        key = (system.name, v["mem_bw_gbps"])
        cfg = configs[key]
        steps = []
        engine = ""
        for s, plan in zip(traces, plans):
            finish, exposed, engine_i = _replay(s, plan, cfg, key, v["replay"])
            steps.append((finish / 1e9, exposed / 1e9))   # as ReplayResult does
            engine = engine or engine_i
        stats["replays_fast" if engine == "fast" else
              "replays_embedded" if engine in ("symmetric", "full", "embedded") else "replays_other"] += len(traces)
    step, exposed = steps[0]
    out = {"status": "ok", "error": "", "step_time_s": step, "exposed_comm_s": exposed,
           "compute_time_s": step - exposed, "replay_engine": engine}
    if len(steps) == 3:
        all_steps = [x[0] for x in steps]
        out["step_time_lo_s"], out["step_time_hi_s"] = min(all_steps), max(all_steps)
    flops = info["flops"] * n
    out["model_flops"] = flops
    peak = v["peak_flops"]
    out["peak_flops"] = peak
    out["comm_bytes"] = info["comm_bytes"]
    out["peak_memory_bytes"] = info["peak_memory"]
    out["fits"] = info["peak_memory"] <= v["mem_capacity"]
    out["utilisation"] = flops / (step * n * peak) if step > 0 and peak > 0 else math.nan
    cost = v.get("cost")
    if cost is not None:
        out["cost_per_step"] = step * n * cost / 3600.0
    return out
