"""The pipeline as plain stages, and :func:`simulate`, which runs them all for one question.

A :class:`Question` is resolved once, where a command or an API call enters: its target, fidelity and
system are objects from then on, and no stage looks a name up again. The stages can be called one by one:

>>> from hespas_ml.pipeline import Question, ingest, split, label, trace, replay
>>> q = Question.resolve("zoo:mlp?devices=4", target="A100-40GB", system="ring:4x150")
>>> graph = ingest(q.program, q.system)             # program -> op graph
>>> regions = split(graph, q.split)                 # op graph -> compute regions and collectives
>>> times = label(regions, q.fidelity, q.target)    # seconds of every compute region (and intervals)
>>> traces = trace(regions, times)                  # every device's Chakra trace
>>> step = replay(traces, q.system, q.replay)       # ASTRA-sim or the embedded replay
>>> step.step_time_s

``simulate(...)`` is ``run(Question.resolve(...))``; sweeps and studies call the same stages and keep
what they need of them.
"""
from __future__ import annotations

import csv
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .costs import graph_cost
from .fidelities import get_fidelity
from .ingest import check_program, load_program
from .ingest.errors import HespasError
from .ingest.graph import OpGraph
from .ingest.zoo import is_zoo_spec, parse_zoo_spec
from .ingest.zoo.checks import pipeline_bubble
from .label.fidelity import Fidelity, Label, label_caveats, label_in_chunks
from .label.targets import Target, load_target
from .replay import BACKENDS, ReplayError, ReplayResult
from .replay import replay as replay_traces
from .replay.chakra import EtNode, write_traces
from .replay.system import SystemConfig, load_system, write_comm_groups, write_system
from .replay.timeline import step_spans, write_timeline
from .replay.traces import TraceSet, build_traces
from .split.memory import memory
from .split.regions import SPLITS, RegionGraph, SplitError, split_program
from .split.signature import signatures

SLOW = ("scalesim", "profiling")      # labellers that take seconds a region: shown with a progress bar


class SimulationError(HespasError):
    pass


# ------------------------------------------------------------------------------------------ the question

@dataclass(frozen=True)
class Question:
    """What to simulate, resolved: the program (a source or an :class:`OpGraph`), the :class:`Target`, the
    fidelity object that times its regions, the :class:`SystemConfig` (None for one device), the split and
    the replay backend."""

    program: str | OpGraph | None          # None: a question asked of several programs (layouts)
    target: Target
    fidelity: Fidelity
    system: SystemConfig | None = None
    split: str = "fusion"
    replay: str = "auto"
    astra_sim_bin: str | None = None

    @classmethod
    def resolve(cls, program, target: Target | str = "H100", system: SystemConfig | str | Path | None = None, *,
                fidelity: Fidelity | str = "roofline", split: str = "fusion", replay: str = "auto",
                astra_sim_bin: str | None = None, fidelity_options: dict | None = None) -> "Question":
        """Check every choice and load what names name, once: a bad split, replay backend, target, fidelity
        or system is a one-line error before the program is read, and so is a fidelity that does not answer
        for the target, a program file that does not exist or a zoo spec with a bad parameter.
        ``fidelity_options`` go to the fidelity's constructor when it is given by name."""
        if split not in SPLITS:
            raise SplitError(f"unknown split '{split}' (choose from {', '.join(SPLITS)})")
        if replay not in BACKENDS:
            raise ReplayError(f"unknown replay backend {replay!r} (choose from {', '.join(BACKENDS)})")
        tgt = target if isinstance(target, Target) else load_target(target)
        fid = get_fidelity(fidelity, **(fidelity_options or {})) if isinstance(fidelity, str) else fidelity
        fid.check_target(tgt)
        if system is not None and not isinstance(system, SystemConfig):
            system = load_system(system, local_mem_bw_gbps=tgt.mem_bw / 1e9)
        if program is not None and not isinstance(program, OpGraph):
            if not str(program).strip():
                raise SimulationError("no program given (a .mlir path, a zoo: spec or an OpGraph)")
            check_program(str(program), system.n_npus if system is not None else None)
            program = str(program)
        return cls(program, tgt, fid, system, split, replay, astra_sim_bin)


# ------------------------------------------------------------------------------------------ the stages

def ingest(program: str | Path | OpGraph, system: SystemConfig | int | None = None) -> OpGraph:
    """The op graph of ``program``; for ``system`` when one is given (a :class:`SystemConfig`, or only its
    device count): a zoo spec that names no device count is generated for it, and a program that runs on
    another number of devices is refused. Without ``system`` the program runs on the devices it names."""
    devices = system.n_npus if isinstance(system, SystemConfig) else system
    graph = program if isinstance(program, OpGraph) else load_program(program, devices=devices)
    n, name = graph.n_devices, graph.source or graph.name
    if devices is None or n == devices:
        return graph
    if devices == 1:
        raise SimulationError(f"{name}: runs on {n} devices; give a system of {n} "
                              f"(an ASTRA-sim folder or a spec such as ring:{n}x100)")
    where = f"system {system.source} has {devices} NPUs" if isinstance(system, SystemConfig) else f"{devices} expected"
    raise SimulationError(f"{name}: runs on {n} device(s) but {where}")


def split(graph: OpGraph, how: str = "fusion") -> RegionGraph:
    """``graph`` cut into compute regions and collectives (``how``: one of :data:`SPLITS`)."""
    return split_program(graph, how)


@dataclass
class RegionTimes:
    """The labels of a program's compute regions: one label per distinct region (by signature), shared by
    its repeats; ``seconds`` (and ``lower``/``upper`` when every ok label has an interval) by region id,
    0 for collectives and for regions that could not be labelled."""

    fidelity: str
    signatures: list[str]                 # of rg.compute_regions(), in order
    distinct: dict[str, Label]            # signature -> its label
    seconds: list[float]
    lower: list[float] | None = None
    upper: list[float] | None = None

    @property
    def labels(self) -> list[Label]:
        """One label per compute region, in order."""
        return [self.distinct[s] for s in self.signatures]

    def ok(self, signature: str) -> bool:
        lab = self.distinct[signature]
        return lab.status == "ok" and math.isfinite(lab.seconds)

    @property
    def failed(self) -> int:
        """Compute regions that could not be labelled."""
        return sum(not self.ok(s) for s in self.signatures)

    @property
    def caveats(self) -> list[str]:
        return label_caveats(self.distinct.values())


def label(regions: RegionGraph, fidelity: Fidelity, target: Target, *, progress: bool = False,
          region_signatures: list[str] | None = None, known: dict[str, Label] | None = None) -> RegionTimes:
    """Time every distinct compute region of ``regions`` once with ``fidelity`` on ``target``.
    ``progress``: a bar with an ETA on stderr while a slow labeller (SCALE-Sim, profiling) works.
    ``region_signatures``: those of ``regions.compute_regions()``, when the caller has them.
    ``known``: labels by signature that ``fidelity`` gave on ``target`` already (e.g. for other programs),
    used instead of labelling those regions again; the new labels are added to it."""
    compute = regions.compute_regions()
    sigs = region_signatures if region_signatures is not None else signatures(compute)
    known = {} if known is None else known
    first: dict[str, Any] = {}
    for r, s in zip(compute, sigs):
        if s not in known:
            first.setdefault(s, r)
    labels = label_in_chunks(fidelity, list(first.values()), target, desc=f"{fidelity.name} labels",
                             progress=progress and fidelity.name in SLOW) if first else []
    known.update(zip(first, labels))
    times = RegionTimes(fidelity.name, sigs, {s: known[s] for s in sigs}, [0.0] * len(regions.regions))
    bounds = [[0.0] * len(regions.regions), [0.0] * len(regions.regions)]
    with_interval = False
    for r, s in zip(compute, sigs):
        if not times.ok(s):
            continue
        lab = times.distinct[s]
        times.seconds[r.id] = float(lab.seconds)
        iv = lab.meta.get("interval")
        if iv is None:
            bounds = None
        elif bounds is not None:
            bounds[0][r.id], bounds[1][r.id] = float(iv[0]), float(iv[1])
            with_interval = True
    if bounds is not None and with_interval:
        times.lower, times.upper = bounds
    return times


@dataclass
class StepTraces:
    """The Chakra traces of a labelled program: one :class:`TraceSet` at its regions' times, and one at
    each end of their intervals when the labels have them. Each keeps the fast replay's compiled plan, so
    replaying them on many systems compiles it once."""

    point: TraceSet
    lower: TraceSet | None = None
    upper: TraceSet | None = None

    @property
    def sets(self) -> list[TraceSet]:
        return [self.point] + ([self.lower, self.upper] if self.lower is not None else [])


def trace(regions: RegionGraph, times: RegionTimes | list[float], *, interval: bool = True) -> StepTraces:
    """Every device's Chakra trace of ``regions`` with ``times`` (region seconds by id); ``interval``: also
    at the lower and upper ends of the labels' intervals, when ``times`` has them."""
    seconds = times.seconds if isinstance(times, RegionTimes) else list(times)
    n = regions.n_devices
    out = StepTraces(build_traces(regions, seconds, n))
    if interval and isinstance(times, RegionTimes) and times.lower is not None:
        out.lower, out.upper = build_traces(regions, times.lower, n), build_traces(regions, times.upper, n)
    return out


@dataclass
class Step:
    """One replayed step: its time, split into compute and exposed communication, per rank."""

    step_time_s: float
    compute_time_s: float
    exposed_comm_s: float
    backend: str
    engine: str                          # how it was replayed: none | fast | symmetric | full | astra-sim
    traces: StepTraces
    result: ReplayResult | None = None   # every rank's outcome (None for one device)
    interval_s: tuple[float, float] | None = None
    node_ticks: dict[int, dict[int, tuple[int, int]]] | None = None   # by rank, node id: (issue, finish) ns

    @property
    def ranks(self) -> list[dict[str, float]]:
        if self.result is None:
            return [{"rank": 0, "finish_s": self.step_time_s, "exposed_comm_s": 0.0}]
        return [{"rank": r.rank, "finish_s": r.finish_ns * 1e-9, "exposed_comm_s": r.exposed_comm_ns * 1e-9}
                for r in self.result.ranks]


def replay(traces: StepTraces, system: SystemConfig | None, backend: str = "auto", *, binary: str | None = None,
           workdir: str | Path | None = None, record_nodes: bool = False) -> Step:
    """The step time of ``traces`` on ``system``, replayed by ASTRA-sim or the embedded replay; with one
    device (``system`` None or of one NPU), the compute time itself. When ``traces`` has interval ends they
    are replayed too, and ``interval_s`` spans the three step times. ``record_nodes``: keep each node's
    issue and finish ns in ``node_ticks`` (the embedded replay only)."""
    step = _replay_one(traces.point, system, backend, binary, workdir, record_nodes)
    step.traces = traces
    ends = [step.step_time_s] + [_replay_one(ts, system, backend, binary, None, False).step_time_s
                                 for ts in traces.sets[1:]]
    if len(ends) > 1:
        step.interval_s = (min(ends), max(ends))        # list scheduling need not be monotone in the times
    return step


def _replay_one(ts: TraceSet, system: SystemConfig | None, backend: str, binary, workdir, record_nodes) -> Step:
    if system is None or system.n_npus == 1:          # no replay: the exact sum of the regions' times
        return Step(ts.compute_time_s, ts.compute_time_s, 0.0, "none (single device)", "none", None)
    res = replay_traces(ts, system, backend=backend, binary=binary, workdir=workdir, record_nodes=record_nodes)
    # ASTRA-sim's split: finish = compute on the last rank + exposed communication
    engine = "astra-sim" if res.backend == "astra-sim" else str(res.details.get("engine", res.backend))
    return Step(res.step_time_s, res.step_time_s - res.exposed_comm_s, res.exposed_comm_s, res.backend, engine,
                None, res, node_ticks=res.details.get("nodes"))


# ------------------------------------------------------------------------------------------ simulate

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
    memory: dict[str, int] = field(default_factory=dict)   # per device at the peak (split.memory.Memory)
    memory_capacity_bytes: float = 0.0       # the target's device memory
    replay_engine: str = ""                  # none | fast | symmetric (ranks alike: one simulated) | full | astra-sim
    pipeline_bubble: float = 0.0             # share of a pipelined zoo step's ticks in which a stage has no microbatch
    calibration: dict[str, Any] | None = None   # the efficiencies a calibrated roofline charged (its basis)

    @property
    def peak_memory_bytes(self) -> int:
        return self.memory.get("peak", 0)

    @property
    def fits(self) -> bool:
        """Whether the peak per-device memory fits in the target's."""
        return self.peak_memory_bytes <= self.memory_capacity_bytes

    def top_regions(self, k: int = 10) -> list[RegionRow]:
        comp = [r for r in self.regions if r.kind == "compute"]
        return sorted(comp, key=lambda r: -r.total_seconds)[:k]

    def to_dict(self, top: int = 10) -> dict[str, Any]:
        return {
            "program": self.program, "target": self.target, "fidelity": self.fidelity, "split": self.split,
            "system": self.system, "replay": self.replay, "replay_engine": self.replay_engine,
            "n_devices": self.n_devices,
            "step_time_s": self.step_time_s,
            "step_time_interval_s": list(self.step_time_interval_s) if self.step_time_interval_s else None,
            "seen_in_training": self.seen_in_training,
            "compute_time_s": self.compute_time_s,
            "exposed_comm_s": self.exposed_comm_s, "n_comp_nodes": self.n_comp_nodes,
            "n_comm_nodes": self.n_comm_nodes, "flops": self.flops, "bytes": self.bytes,
            "kernel_bytes": self.kernel_bytes,
            "peak_memory_bytes": self.peak_memory_bytes, "memory": self.memory,
            "memory_capacity_bytes": self.memory_capacity_bytes, "fits": self.fits,
            "pipeline_bubble": self.pipeline_bubble,
            "calibration": self.calibration,
            "unmodelled": self.unmodelled, "warnings": self.warnings, "ranks": self.ranks,
            "top_regions": [{"id": r.id, "name": r.name, "count": r.count, "seconds": r.seconds,
                             "total_seconds": r.total_seconds, "flops": r.flops, "bytes": r.bytes,
                             "bound": r.bound} for r in self.top_regions(top)],
            "timings_s": self.timings, "out_dir": self.out_dir,
        }


def simulate(program, target: Target | str = "H100", system: SystemConfig | str | Path | None = None, *,
             fidelity: Fidelity | str = "roofline", split: str = "fusion", replay: str = "auto",
             astra_sim_bin: str | None = None, out: str | Path | None = None, fidelity_options: dict | None = None,
             progress: bool = False) -> SimulationResult:
    """Simulate one step of ``program`` (a .mlir path, a ``zoo:`` spec, or an :class:`OpGraph`) on
    ``system`` (an ASTRA-sim folder or a spec such as ``ring:4x150``; None for one device) built from
    ``target`` accelerators, timing compute regions with ``fidelity``: ``run(Question.resolve(...))``."""
    question = Question.resolve(program, target, system, fidelity=fidelity, split=split, replay=replay,
                                astra_sim_bin=astra_sim_bin, fidelity_options=fidelity_options)
    return run(question, out=out, progress=progress)


def run(question: Question, *, out: str | Path | None = None, progress: bool = False) -> SimulationResult:
    """Run every stage for ``question``. When the fidelity's labels carry an interval (the learned
    surrogates), the lower and upper times are replayed too, giving ``step_time_interval_s``. ``out``: keep
    the Chakra traces, comm_group.json, the system files, regions.csv, result.json and timeline.png (compute,
    communication and exposed communication of each rank) there."""
    q = question
    if q.program is None:
        raise SimulationError("the question names no program to simulate")
    timings: dict[str, float] = {}
    t0 = t = time.perf_counter()
    graph = ingest(q.program, q.system or 1)
    timings["ingest"] = time.perf_counter() - t
    t = time.perf_counter()
    rg = split(graph, q.split)
    timings["split"] = time.perf_counter() - t
    t = time.perf_counter()
    times = label(rg, q.fidelity, q.target, progress=progress)
    timings["label"] = time.perf_counter() - t
    if times.failed:
        graph.warnings.append(f"{times.failed} region(s) could not be labelled by {q.fidelity.name}; counted as 0 s")
    graph.warnings.extend(times.caveats)
    rows = _region_rows(rg, times)
    out_dir = Path(out) if out is not None else None
    t = time.perf_counter()
    traces = trace(rg, times)
    if out_dir is not None:                 # before the replay, so that a failing replay leaves its inputs
        graph.warnings += _write_outputs(out_dir, graph.name, traces.point, q.system, rows)
    step = replay(traces, q.system, q.replay, binary=q.astra_sim_bin,
                  workdir=(out_dir / "astra-sim") if out_dir and q.system else None, record_nodes=out_dir is not None)
    timings["replay"] = time.perf_counter() - t
    bubble = _pipeline_bubble(graph.source)
    if out_dir is not None:
        spans = step_spans(traces.point.traces, q.system, traces.point.comm_groups or None, step.node_ticks)
        write_timeline(out_dir / "timeline.png", spans,
                       f"{graph.name} on {q.system.source if q.system else 'one device'}, {q.target.name}, "
                       f"{q.fidelity.name} ({q.split} split): step {step.step_time_s * 1e3:.3f} ms"
                       + (f", pipeline bubble {bubble:.0%} of the ticks" if bubble else ""))
    timings["total"] = time.perf_counter() - t0
    totals = graph_cost(graph)
    n_comp, n_comm = traces.point.node_counts(0)
    footprint = memory(rg)
    too_big = footprint.shortfall(q.target.mem_capacity, q.target.name)
    if too_big:
        graph.warnings.append(f"does not fit: {too_big} (timed anyway)")
    result = SimulationResult(
        program=str(graph.source or graph.name), target=q.target.name, fidelity=q.fidelity.name, split=q.split,
        system=q.system.source if q.system else "single device", replay=step.backend, n_devices=graph.n_devices,
        step_time_s=step.step_time_s, compute_time_s=step.compute_time_s, exposed_comm_s=step.exposed_comm_s,
        n_comp_nodes=n_comp, n_comm_nodes=n_comm, ranks=step.ranks, regions=rows,
        flops=totals["flops"], bytes=totals["bytes"], unmodelled=totals["unmodelled"],
        warnings=list(graph.warnings), timings=timings, out_dir=str(out_dir) if out_dir else None,
        step_time_interval_s=step.interval_s, seen_in_training=_seen_in_training(times.distinct.values()),
        kernel_bytes=sum(r.bytes * r.count for r in rows if r.kind == "compute"),
        memory=footprint.to_dict(), memory_capacity_bytes=float(q.target.mem_capacity), replay_engine=step.engine,
        pipeline_bubble=bubble,
        calibration=q.target.calibration.to_mapping() if q.fidelity.name == "calibrated-roofline" else None)
    if out_dir is not None:
        (out_dir / "result.json").write_text(json.dumps(result.to_dict(), indent=2))
    return result


def _pipeline_bubble(source) -> float:
    """The pipeline bubble of a zoo program (its canonical spec, as ingested) laid out with stages
    (:func:`pipeline_bubble`); 0 for any other program."""
    if not isinstance(source, str) or not is_zoo_spec(source):
        return 0.0
    params = parse_zoo_spec(source)[1]
    return pipeline_bubble(params) if params.get("mesh") else 0.0


def _region_rows(rg: RegionGraph, times: RegionTimes) -> list[RegionRow]:
    by_id = {r.id: s for r, s in zip(rg.compute_regions(), times.signatures)}
    rows = []
    for r in rg.regions:
        if r.kind == "compute":
            lab = times.distinct[by_id[r.id]]
            rows.append(RegionRow(r.id, "compute", rg.describe(r), r.count, r.flops, r.bytes, times.seconds[r.id],
                                  lab.meta.get("bound", "")))
        else:
            rows.append(RegionRow(r.id, "collective", rg.describe(r), r.count, 0.0, 0.0, 0.0, "network",
                                  r.collective.comm_bytes))
    return rows


def _seen_in_training(labels) -> bool | None:
    """Whether the learned model that labelled the program learned its regions (its labels'
    ``program_seen_in_training``), or None when the labels do not say."""
    said = {lab.meta.get("program_seen_in_training") for lab in labels} - {None}
    return said.pop() if len(said) == 1 else None


MAX_TRACE_FILES = 1024
"""``simulate --out`` writes every rank's trace up to this many ranks, above it rank 0's alone (a 70B step's
trace is megabytes: thousands of them would fill a disk)."""


def write_replay_inputs(out_dir: Path, name: str, traces: Sequence[Sequence[EtNode]],
                        comm_groups: dict[int, list[int]], system: SystemConfig | None) -> list[str]:
    """What a replay reads, in ``out_dir``: the Chakra traces ``et/<name>.<rank>.et`` (rank 0's alone above
    :data:`MAX_TRACE_FILES` ranks), ``comm_group.json`` and the system's files. Returns warnings."""
    prefix = out_dir / "et" / name
    prefix.parent.mkdir(parents=True, exist_ok=True)
    write_traces(prefix, traces if len(traces) <= MAX_TRACE_FILES else [traces[0]])
    write_comm_groups(comm_groups, out_dir / "comm_group.json")
    if system is not None:
        write_system(system, out_dir / "system")
    return [f"{out_dir / 'et'}: rank 0's trace written, not all {len(traces)} (more than {MAX_TRACE_FILES:,} "
            f"ranks)"] if len(traces) > MAX_TRACE_FILES else []


def _write_outputs(out_dir: Path, name: str, traces, sys_cfg, rows: list[RegionRow]) -> list[str]:
    """The replay's inputs (:func:`write_replay_inputs`) and ``regions.csv``. Returns warnings."""
    warnings = write_replay_inputs(out_dir, name, traces.traces, traces.comm_groups, sys_cfg)
    with open(out_dir / "regions.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["region", "kind", "name", "count", "flops", "bytes", "comm_bytes", "seconds",
                    "total_seconds", "bound"])
        for r in rows:
            w.writerow([r.id, r.kind, r.name, r.count, f"{r.flops:.6g}", f"{r.bytes:.6g}", r.comm_bytes,
                        f"{r.seconds:.6g}", f"{r.total_seconds:.6g}", r.bound])
    return warnings


__all__ = ["Question", "RegionRow", "RegionTimes", "SimulationError", "SimulationResult", "Step", "StepTraces",
           "ingest", "label", "replay", "run", "simulate", "split", "trace", "write_replay_inputs"]
