"""The whole pipeline in one call: program -> op graph -> regions -> labels -> Chakra traces -> replay.

>>> from hespas_ml import simulate
>>> result = simulate("zoo:mlp", target="A100-40GB", system="ring:4x150")
>>> result.step_time_s
"""
from __future__ import annotations

import csv
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .ingest.errors import HespasError


class SimulationError(HespasError):
    pass


@dataclass(slots=True)
class RegionRow:
    """One region of the simulated program, for tables and the per-region CSV."""

    id: int
    kind: str
    name: str
    count: int
    flops: float            # per execution
    bytes: float            # per execution
    seconds: float          # per execution (compute regions; 0 for collectives)
    bound: str
    comm_bytes: int = 0

    @property
    def total_seconds(self) -> float:
        return self.seconds * self.count


@dataclass
class SimulationResult:
    program: str
    target: str
    fidelity: str
    split: str
    system: str
    replay: str
    n_devices: int
    step_time_s: float
    compute_time_s: float
    exposed_comm_s: float
    n_comp_nodes: int
    n_comm_nodes: int
    ranks: list[dict[str, Any]]
    regions: list[RegionRow]
    flops: float
    bytes: float                         # per device, op by op (XLA's cost analysis: before any fusion)
    unmodelled: dict[str, int]
    warnings: list[str]
    timings: dict[str, float] = field(default_factory=dict)
    out_dir: str | None = None
    step_time_interval_s: tuple[float, float] | None = None   # when the fidelity gives intervals (surrogates)
    seen_in_training: bool | None = None     # a surrogate learned this program's regions (None: not a surrogate)
    kernel_bytes: float = 0.0                # per device, moved by the split's kernels (what the times are of)

    def top_regions(self, k: int = 10) -> list[RegionRow]:
        comp = [r for r in self.regions if r.kind == "compute"]
        return sorted(comp, key=lambda r: -r.total_seconds)[:k]

    def to_dict(self, top: int = 10) -> dict[str, Any]:
        return {
            "program": self.program, "target": self.target, "fidelity": self.fidelity, "split": self.split,
            "system": self.system, "replay": self.replay, "n_devices": self.n_devices,
            "step_time_s": self.step_time_s,
            "step_time_interval_s": list(self.step_time_interval_s) if self.step_time_interval_s else None,
            "seen_in_training": self.seen_in_training,
            "compute_time_s": self.compute_time_s,
            "exposed_comm_s": self.exposed_comm_s, "n_comp_nodes": self.n_comp_nodes,
            "n_comm_nodes": self.n_comm_nodes, "flops": self.flops, "bytes": self.bytes,
            "kernel_bytes": self.kernel_bytes,
            "unmodelled": self.unmodelled, "warnings": self.warnings, "ranks": self.ranks,
            "top_regions": [{"id": r.id, "name": r.name, "count": r.count, "seconds": r.seconds,
                             "total_seconds": r.total_seconds, "flops": r.flops, "bytes": r.bytes,
                             "bound": r.bound} for r in self.top_regions(top)],
            "timings_s": self.timings, "out_dir": self.out_dir,
        }


SLOW = ("scalesim", "profiling")      # labellers that take seconds a region: shown with a progress bar


def simulate(program, target: str = "H100", system: str | Path | None = None, *, fidelity: str = "roofline",
             split: str = "fusion", replay: str = "auto", astra_sim_bin: str | None = None,
             out: str | Path | None = None, fidelity_options: dict | None = None,
             progress: bool = False) -> SimulationResult:
    """Simulate one step of ``program`` (a .mlir path, a ``zoo:`` spec, or an :class:`OpGraph`) on
    ``system`` (an ASTRA-sim folder or a spec such as ``ring:4x150``; None for one device) built from
    ``target`` accelerators, timing compute regions with ``fidelity``. When the fidelity's labels carry
    an interval (``meta["interval"]``: the learned surrogates), the traces are replayed with the lower and
    upper times too, giving ``step_time_interval_s``. ``fidelity_options`` are passed to the fidelity's
    constructor (e.g. ``{"budget": Budget(seconds=2), "mode": "auto"}`` for ``scalesim``). ``progress``: a
    progress bar with an ETA on stderr while a slow labeller (SCALE-Sim, profiling) times the regions."""
    from .ingest import load_program
    from .ingest.graph import OpGraph
    from .label.fidelity import label_caveats, label_in_chunks
    from .fidelities import get_fidelity
    from .label.targets import load_target
    from .replay import replay as run_replay
    from .replay.system import load_system
    from .replay.traces import build_traces
    from .split.regions import split_program

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    tgt = load_target(target)
    fid = get_fidelity(fidelity, **(fidelity_options or {}))
    fid.check_target(tgt)                 # refuse before the program is read, not after
    sys_cfg = None
    if system is not None:
        sys_cfg = load_system(system, local_mem_bw_gbps=tgt.mem_bw / 1e9)
    if isinstance(program, OpGraph):
        graph = program
    else:
        graph = load_program(program, devices=sys_cfg.n_npus if sys_cfg else None)
    timings["ingest"] = time.perf_counter() - t0

    n = graph.n_devices
    if sys_cfg is None and n > 1:
        raise SimulationError(f"{graph.source or graph.name}: runs on {n} devices; give --system "
                              f"(an ASTRA-sim folder or a spec such as ring:{n}x100)")
    if sys_cfg is not None and sys_cfg.n_npus != n:
        raise SimulationError(f"{graph.source or graph.name}: runs on {n} device(s) but system "
                              f"{sys_cfg.source} has {sys_cfg.n_npus} NPUs")

    t = time.perf_counter()
    rg = split_program(graph, split)
    timings["split"] = time.perf_counter() - t

    t = time.perf_counter()
    compute = rg.compute_regions()
    labels = label_in_chunks(fid, compute, tgt, desc=f"{fid.name} labels", progress=progress and fid.name in SLOW)
    seconds = [0.0] * len(rg.regions)
    rows: list[RegionRow] = []
    failed = 0
    for r, lab in zip(compute, labels):
        if lab.status != "ok":
            failed += 1
        seconds[r.id] = lab.seconds if lab.status == "ok" else 0.0
    by_id = {r.id: lab for r, lab in zip(compute, labels)}
    bounds = _interval_seconds(compute, labels, len(rg.regions))
    for r in rg.regions:
        if r.kind == "compute":
            lab = by_id[r.id]
            rows.append(RegionRow(r.id, "compute", rg.describe(r), r.count, r.flops, r.bytes, seconds[r.id],
                                  lab.meta.get("bound", "")))
        else:
            rows.append(RegionRow(r.id, "collective", rg.describe(r), r.count, 0.0, 0.0, 0.0, "network",
                                  r.collective.comm_bytes))
    if failed:
        graph.warnings.append(f"{failed} region(s) could not be labelled by {fid.name}; counted as 0 s")
    graph.warnings.extend(label_caveats(labels))
    timings["label"] = time.perf_counter() - t

    t = time.perf_counter()
    traces = build_traces(rg, seconds, n)
    timings["traces"] = time.perf_counter() - t

    t = time.perf_counter()
    out_dir = Path(out) if out is not None else None
    if out_dir is not None:
        _write_outputs(out_dir, graph.name, traces, sys_cfg, rows)
    if sys_cfg is None:
        backend = "none (single device)"
        step = compute_s = traces.encoded_compute_s
        exposed = 0.0
        ranks = [{"rank": 0, "finish_s": step, "exposed_comm_s": 0.0}]
    else:
        res = run_replay(traces.traces, sys_cfg, traces.comm_groups or None, backend=replay,
                         binary=astra_sim_bin, workdir=(out_dir / "astra-sim") if out_dir else None)
        backend = res.backend
        step = res.step_time_s
        exposed = res.exposed_comm_s
        compute_s = step - exposed        # ASTRA-sim's split: finish = compute on the last rank + exposed
        ranks = [{"rank": rr.rank, "finish_s": rr.finish_ns * 1e-9, "exposed_comm_s": rr.exposed_comm_ns * 1e-9}
                 for rr in res.ranks]
    timings["replay"] = time.perf_counter() - t

    interval = None
    if bounds is not None:
        t = time.perf_counter()
        ends = []
        for secs in bounds:
            tr = build_traces(rg, secs, n)
            if sys_cfg is None:
                ends.append(tr.encoded_compute_s)
            else:
                ends.append(run_replay(tr.traces, sys_cfg, tr.comm_groups or None, backend=replay,
                                       binary=astra_sim_bin).step_time_s)
        interval = (min(ends[0], step), max(ends[1], step))
        timings["replay_interval"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - t0

    from .costs import graph_cost
    totals = graph_cost(graph)
    n_comp, n_comm = traces.node_counts(0)
    result = SimulationResult(
        program=str(graph.source or graph.name), target=tgt.name, fidelity=fid.name, split=split,
        system=sys_cfg.source if sys_cfg else "single device", replay=backend, n_devices=n,
        step_time_s=step, compute_time_s=compute_s, exposed_comm_s=exposed,
        n_comp_nodes=n_comp, n_comm_nodes=n_comm, ranks=ranks, regions=rows,
        flops=totals["flops"], bytes=totals["bytes"], unmodelled=totals["unmodelled"],
        warnings=list(graph.warnings), timings=timings, out_dir=str(out_dir) if out_dir else None,
        step_time_interval_s=interval, seen_in_training=_seen_in_training(labels),
        kernel_bytes=sum(r.bytes * r.count for r in rows if r.kind == "compute"))
    if out_dir is not None:
        (out_dir / "result.json").write_text(json.dumps(result.to_dict(), indent=2))
    return result


def _seen_in_training(labels) -> bool | None:
    """Whether the learned model that labelled the program learned its regions (its labels'
    ``program_seen_in_training``), or None when the labels do not say."""
    said = {lab.meta.get("program_seen_in_training") for lab in labels} - {None}
    return said.pop() if len(said) == 1 else None


def _interval_seconds(compute, labels, n_regions: int) -> tuple[list[float], list[float]] | None:
    """Per-region lower and upper seconds when every ok label carries ``meta["interval"]``, else None."""
    lower, upper = [0.0] * n_regions, [0.0] * n_regions
    seen = False
    for r, lab in zip(compute, labels):
        if lab.status != "ok":
            continue
        iv = lab.meta.get("interval")
        if iv is None:
            return None
        lower[r.id], upper[r.id] = float(iv[0]), float(iv[1])
        seen = True
    return (lower, upper) if seen else None


def _write_outputs(out_dir: Path, name: str, traces, sys_cfg, rows: list[RegionRow]) -> Path:
    from .replay.chakra import write_traces
    from .replay.system import write_comm_groups, write_system

    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = out_dir / "et" / name
    prefix.parent.mkdir(parents=True, exist_ok=True)
    write_traces(prefix, traces.traces)
    write_comm_groups(traces.comm_groups, out_dir / "comm_group.json")
    if sys_cfg is not None:
        write_system(sys_cfg, out_dir / "system")
    with open(out_dir / "regions.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["region", "kind", "name", "count", "flops", "bytes", "comm_bytes", "seconds",
                    "total_seconds", "bound"])
        for r in rows:
            w.writerow([r.id, r.kind, r.name, r.count, f"{r.flops:.6g}", f"{r.bytes:.6g}", r.comm_bytes,
                        f"{r.seconds:.6g}", f"{r.total_seconds:.6g}", r.bound])
    return prefix
