"""A pipelined step simulated from its stages' own programs (``simulate --pipeline stages``).

The default way through a pipelined zoo step (``mesh=pp:P,…``) is one SPMD program in which every stage
runs every tick in lock-step. Here instead each distinct stage role is exported on its own at one
microbatch, on one device or on the stage's tensor-parallel group (the zoo's ``role`` parameter: the first
stage's forward and backward embed the tokens, the last one's take the head and the loss, the ones between
neither; each stage's optimizer update), and every role program goes through ingest, split and label as
any program does. Their times become the units
of the schedule (:mod:`hespas_ml.replay.schedules`): each stage runs its microbatches' forwards and
backwards in the order GPipe, 1F1B or the interleaved schedule gives, hands activations on and gradients
back with SEND/RECV nodes, all-reduces its gradients over its data-parallel replicas and updates; the
replay runs every rank's trace, so the bubble, the messages and the exposed all-reduce are simulated.

A training stage keeps, for each microbatch in flight, what its backward needs under the step's ``remat``
(every layer's input under full recomputation, each layer made again in the backward; every intermediate
without): 1F1B keeps P - s microbatches on stage s, GPipe all of them. Ranks are placed as the mesh says
(pp outermost, tp innermost): rank = (stage · D + replica) · T + t for ``mesh=pp:P,dp:D,tp:T``. A unit on a
tp group is replayed on the system's first T NPUs (its tp all-reduces inside its time); the schedule's
messages go from each device to the same tp rank of the next stage, and the gradient all-reduce runs over
the replicas of each tp rank. Under sequence parallelism (``sp=true``) a stage sends and keeps its part of
the sequence. fsdp, cp and ep inside a stage are not laid out this way yet.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .ingest.errors import HespasError
from .ingest.zoo.checks import mesh_of, microbatch_count, schedule_chunks
from .ingest.zoo.specs import canonical_spec, is_zoo_spec, parse_zoo_spec
from .pipeline import Question, ingest, run
from .replay import chakra as et
from .replay import replay
from .replay.schedules import StageWork, in_flight, schedule_traces, stage_order
from .replay.errors import SystemConfigError
from .replay.system import leading_system, strided_system


ALIKE_TOPOLOGIES = ("Switch", "FullyConnected")
"""Dimensions on which a group's collectives and messages take the same time wherever its members sit."""


class StagedPipelineError(HespasError, ValueError):
    """A program ``--pipeline stages`` cannot lay out (one line)."""


@dataclass
class StagedResult:
    """One step of a pipeline from its stages' programs (see the module docstring). ``units``: each role
    program's time (one microbatch, or one update) by its spec; per stage its ``busy_s`` (units and update),
    its share of the step it has nothing to run (``idle``), the units it keeps in flight at its peak, and its
    memory (``memory``: parameters, gradients, optimizer state, what it keeps for the microbatches in flight,
    the working set of its largest unit, and their sum ``peak``)."""

    program: str
    target: str
    fidelity: str
    split: str
    system: str
    schedule: str
    stages: int
    chunks: int
    microbatches: int
    replicas: int
    tp: int
    step_time_s: float
    exposed_comm_s: float            # the last rank's time not computing: waiting for messages (the bubble too),
                                     # its replicas' all-reduce
    flops: float                     # per device on the busiest stage: its units' and its update's
    units: dict[str, float]
    busy_s: list[float]
    idle: list[float]
    in_flight: list[int]
    memory: list[dict[str, int]]
    memory_capacity_bytes: float
    replay_engine: str = ""
    warnings: list[str] = field(default_factory=list)

    @property
    def peak_memory_bytes(self) -> int:
        return max(m["peak"] for m in self.memory)

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.memory_capacity_bytes

    @property
    def bubble(self) -> float:
        """The share of the step the busiest stage has nothing to run."""
        return min(self.idle)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "pipeline": "stages", "peak_memory_bytes": self.peak_memory_bytes,
                "fits": self.fits, "bubble": self.bubble}


def simulate_stages(program: str, target="H100", system=None, *, fidelity="roofline", split: str = "fusion",
                    replay_backend: str = "auto", every_rank: bool = False) -> StagedResult:
    """Simulate one step of the pipelined zoo ``program`` from its stages' programs on ``system`` of
    ``target`` devices, timing their regions with ``fidelity`` (see the module docstring). The ranks of a
    stage run alike, so one rank per stage is replayed on the part of the system the stages span, each
    stage's gradient all-reduce timed on the part its replicas span: on switch and fully connected
    dimensions the same step as replaying every rank, to within the microsecond the all-reduce's wait is
    rounded up to. ``every_rank``, a ring dimension or a system that cannot be cut so replays every rank."""
    family, p, stages, replicas, tp, chunks, micro = _layout(program)
    question = Question.resolve(None, target, system, fidelity=fidelity, split=split, replay=replay_backend)
    if question.system is None or question.system.n_npus != stages * replicas * tp:
        raise StagedPipelineError(f"{program}: the system must have the {stages * replicas * tp} devices of the "
                                  f"mesh (give --system)")
    group = leading_system(question.system, tp)
    train = p["step"] == "train"
    schedule = p["schedule"].split(":")[0]
    virtual = stages * chunks
    unit = {**p, "mesh": f"tp:{tp}" if tp > 1 else "", "devices": tp, "microbatch": 0, "schedule": "gpipe",
            "batch": p["batch"] // replicas // micro, "layers": p["layers"] // virtual}
    place = ["first"] + ["middle"] * (virtual - 2) + ["last"]
    stage_place = ["first"] + ["middle"] * (stages - 2) + ["last"]
    runs: dict[str, Any] = {}

    def timed(role: str, layers: int) -> Any:
        spec = canonical_spec(family, {**unit, "role": role, "layers": layers})
        if spec not in runs:
            runs[spec] = run(Question(spec, question.target, question.fidelity, group, question.split,
                                      question.replay))
        return runs[spec]

    forward = [timed(f"forward:{place[v]}", unit["layers"]) for v in range(virtual)]
    backward = [timed(f"backward:{place[v]}", unit["layers"]) if train else None for v in range(virtual)]
    updates = [timed(f"update:{stage_place[s]}", p["layers"] // stages) if train else None for s in range(stages)]
    message = int(backward[0].memory.get("incoming", 0)) if train else _output_bytes(next(iter(runs)))
    work = [StageWork(f.step_time_s, b.step_time_s if b else 0.0, message) for f, b in zip(forward, backward)]
    step, engine, note, waits = _replay(work, updates, schedule, stages, replicas, tp, micro, chunks, train,
                                        question, every_rank)
    orders = [stage_order(schedule, stages, micro, s, chunks, train) for s in range(stages)]
    busy, flops = [], []
    for s in range(stages):
        runs_of = [r for c in range(chunks) for r in (forward[c * stages + s], backward[c * stages + s]) if r]
        busy.append(micro * sum(r.step_time_s for r in runs_of) + (updates[s].step_time_s if train else 0.0))
        flops.append(micro * sum(r.flops for r in runs_of) + (updates[s].flops if train else 0.0))
    last = max(step.ranks, key=lambda r: (r.finish_ns, -r.rank)).rank
    exposed = step.exposed_comm_s + (waits[last] if waits else 0.0)
    flight = [in_flight(order) if train else 0 for order in orders]
    memory = [_stage_memory(s, stages, chunks, forward, backward, updates, flight[s]) for s in range(stages)]
    warnings = sorted({w for r in runs.values() for w in r.warnings} | ({note} if note else set()))
    capacity = float(question.target.mem_capacity)
    return StagedResult(program, question.target.name, question.fidelity.name, question.split,
                        question.system.source, p["schedule"], stages, chunks, micro, replicas, tp, step.step_time_s,
                        exposed, flops[busy.index(max(busy))],
                        {spec: r.step_time_s for spec, r in runs.items()}, busy,
                        [max(0.0, 1.0 - b / step.step_time_s) for b in busy], flight, memory, capacity,
                        engine, warnings)


def _layout(program: str) -> tuple[str, dict[str, Any], int, int, int, int, int]:
    """(family, parameters, stages, data-parallel replicas, tp group size, chunks per stage, microbatches) of
    a zoo program this module can lay out, else a one-line StagedPipelineError."""
    if not is_zoo_spec(program):
        raise StagedPipelineError(f"{program}: --pipeline stages lays out zoo programs (a .mlir file is one "
                                  f"program already)")
    try:
        family, p = parse_zoo_spec(program)
    except ValueError as exc:
        raise StagedPipelineError(str(exc)) from None
    if "role" not in p:
        raise StagedPipelineError(f"{program}: the {family} family has no pipeline stages")
    if p["role"]:
        raise StagedPipelineError(f"{program}: give the whole step (leave role out)")
    mesh = mesh_of(p)
    stages = mesh.get("pp", 1)
    if stages < 2:
        raise StagedPipelineError(f"{program}: --pipeline stages needs a pipeline (mesh=pp:P with P ≥ 2)")
    inside = sorted(a for a, n in mesh.items() if n > 1 and a not in ("pp", "dp", "tp"))
    if inside:
        raise StagedPipelineError(f"{program}: --pipeline stages lays out pp, dp and tp; {', '.join(inside)} "
                                  f"inside a stage is not handled (use the default lock-step pipeline)")
    try:
        chunks = schedule_chunks(p.get("schedule", "gpipe"))
    except ValueError as exc:
        raise StagedPipelineError(f"{program}: {exc}") from None
    replicas = mesh.get("dp", 1)
    micro = microbatch_count(p, mesh)
    if p["layers"] % (stages * chunks):
        raise StagedPipelineError(f"{program}: {stages} stages of {chunks} chunks do not divide layers "
                                  f"{p['layers']}")
    if chunks > 1 and micro % stages:
        raise StagedPipelineError(f"{program}: the interleaved schedule takes microbatches {stages} at a time: "
                                  f"{micro} microbatches are not a multiple of {stages} stages")
    return family, p, stages, replicas, mesh.get("tp", 1), chunks, micro


def _output_bytes(spec: str) -> int:
    """The activation a forward role program hands on (what it returns), per microbatch."""
    graph = ingest(spec)
    return sum(t.nbytes for op in graph.outputs for t in graph.ops[op].result_types) or 1


def _replay(work, updates, schedule, stages, replicas, tp, micro, chunks, train, question, every_rank):
    """(the replayed step, which ranks were replayed, a note when every rank had to be, each replayed rank's
    all-reduce wait where it stands in for the all-reduce): one rank per stage where its peers in the other
    stages and its replicas each lie along one switch or fully connected dimension (:func:`_alike_parts`),
    else every rank."""
    system, backend = question.system, question.replay
    note = None
    if not every_rank and replicas * tp > 1:
        parts = _alike_parts(system, stages, replicas, tp)
        if isinstance(parts, str):
            note = f"every rank replayed: {parts}"
        else:
            along, across = parts
            delays = [_all_reduce_s(int(u.memory.get("gradients", 0)), across, backend) if train else 0.0
                      for u in updates]
            traces = []
            for s, nodes in enumerate(schedule_traces(work, schedule, micro, chunks, train=train)):
                if train:
                    nodes = nodes + _update_nodes(nodes, updates[s], s, None, delays[s])
                traces.append(nodes)
            return replay(traces, along, None, backend=backend), "one rank per stage", None, delays
    traces, groups = _traces(work, updates, schedule, stages, replicas, tp, micro, chunks, train)
    return replay(traces, system, groups or None, backend=backend), "every rank", note, None


def _alike_parts(system, stages: int, replicas: int, tp: int):
    """(the system rank 0's peers in the other stages make up, the one its replicas make up, or None) when
    each lies along one switch or fully connected dimension, where a group's messages and collectives take
    the same time wherever its members sit; else why not (one line)."""
    rings = [d for d in system.dims if d.topology not in ALIKE_TOPOLOGIES]
    if rings:
        return f"a {rings[0].topology} dimension times a group by where its members sit"
    try:
        along = strided_system(system, replicas * tp, stages)
        across = strided_system(system, tp, replicas) if replicas > 1 else None
    except SystemConfigError as exc:
        return str(exc)
    for part, who in ((along, "the stages"), (across, "a stage's replicas")):
        if part is not None and len(part.dims) > 1:
            return f"{who} span {len(part.dims)} network dimensions ({part.source})"
    return along, across


def _all_reduce_s(size: int, system, backend: str) -> float:
    """How long an all-reduce of ``size`` bytes over every rank of ``system`` takes alone (0 without one)."""
    if system is None or size <= 0:
        return 0.0
    node = et.EtNode(0, "grads", et.COMM_COLL_NODE, [], [], 0, {"comm_type": et.ALL_REDUCE, "comm_size": size})
    return replay([[node]] * system.n_npus, system, None, backend=backend).step_time_s


def _traces(work, updates, schedule, stages, replicas, tp, micro, chunks, train):
    """Every rank's trace (rank = (stage · replicas + replica) · tp + t) and the data-parallel groups (one
    per stage and tp rank)."""
    per_stage = schedule_traces(work, schedule, micro, chunks, train=train)

    def rank(s: int, d: int, t: int) -> int:
        return (s * replicas + d) * tp + t

    groups = {s * tp + t + 1: [rank(s, d, t) for d in range(replicas)] for s in range(stages) for t in range(tp)} \
        if replicas > 1 else {}
    traces = []
    for s, nodes in enumerate(per_stage):
        for d, t in ((d, t) for d in range(replicas) for t in range(tp)):
            mine = []
            for n in nodes:
                attrs = dict(n.attrs)
                if "comm_src" in attrs:
                    attrs["comm_src"] = rank(attrs["comm_src"], d, t)
                    attrs["comm_dst"] = rank(attrs["comm_dst"], d, t)
                mine.append(et.EtNode(n.id, n.name, n.type, list(n.data_deps), list(n.ctrl_deps), n.duration_micros,
                                      attrs))
            if train:
                mine += _update_nodes(mine, updates[s], s, str(s * tp + t + 1) if replicas > 1 else None)
            traces.append(mine)
    return traces, groups


def _update_nodes(nodes: list[et.EtNode], update, stage: int, group: str | None,
                  all_reduce_s: float = 0.0) -> list[et.EtNode]:
    """After a stage's last unit: its gradients all-reduced over ``group`` (its replicas; None: none) or, for
    a stage replayed alone, a wait of ``all_reduce_s`` (what that all-reduce takes), then its optimizer
    update."""
    last = max(n.id for n in nodes if n.type == et.COMP_NODE)
    nid = len(nodes)
    grads = int(update.memory.get("gradients", 0))
    out = []
    if group is not None and grads:
        out.append(et.EtNode(nid, f"grads_stage{stage}", et.COMM_COLL_NODE, [last], [], 0,
                             {"comm_type": et.ALL_REDUCE, "comm_size": grads, "pg_name": group}))
        last, nid = nid, nid + 1
    elif all_reduce_s > 0:
        out.append(et.EtNode(nid, f"grads_stage{stage}", et.COMP_NODE, [last], [], math.ceil(all_reduce_s * 1e6),
                             {"num_ops": 1, "tensor_size": grads or 1}))
        last, nid = nid, nid + 1
    out.append(et.EtNode(nid, f"update_stage{stage}", et.COMP_NODE, [last], [], int(round(update.step_time_s * 1e6)),
                         {"num_ops": 1, "tensor_size": grads or 1}))
    return out


def _stage_memory(s, stages, chunks, forward, backward, updates, flight) -> dict[str, int]:
    """Stage ``s``'s memory at its peak: its parameters, gradients and optimizer state (its update program's
    arguments, and the copy its units compute with beside f32 master weights; inference: its forwards'
    parameters), what it keeps for the units in flight (a backward program's ``kept`` arguments each), and the
    largest working set among its units (a unit program's peak less its parameters and what it keeps)."""
    units = [r for c in range(chunks) for r in (forward[c * stages + s], backward[c * stages + s]) if r is not None]
    working = max(r.memory.get("peak", 0) - r.memory.get("parameters", 0) - r.memory.get("kept", 0) for r in units)
    if updates[s] is not None:
        fixed = {k: int(updates[s].memory.get(k, 0)) for k in ("parameters", "gradients", "optimizer_state")}
        copy = sum(int(forward[c * stages + s].memory.get("parameters", 0)) for c in range(chunks))
        if copy != fixed["parameters"]:        # master weights beside the copy the units compute with
            fixed["compute_copy"] = copy
        per_unit = max(int(backward[c * stages + s].memory.get("kept", 0)) for c in range(chunks))
    else:
        fixed = {"parameters": sum(int(forward[c * stages + s].memory.get("parameters", 0)) for c in range(chunks)),
                 "gradients": 0, "optimizer_state": 0}
        per_unit = 0
    kept = flight * per_unit
    return {**fixed, "kept": kept, "working": working, "peak": sum(fixed.values()) + kept + working}


__all__ = ["StagedPipelineError", "StagedResult", "simulate_stages"]
