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
the sequence. Under Megatron-LM's distributed optimizer (``dist_opt=true``) each device updates its shard of
the stage's optimizer state and master weights (the update role exported on that shard): the replicas
reduce-scatter the gradients before it and all-gather the parameters after it. ``fsdp`` inside a stage
shards the same way over its fsdp group, as PyTorch's pipeline schedules run FSDP: parameters gathered once
a step and kept for every microbatch, gradients accumulated whole and reduce-scattered after the last
backward; the stage's ``dp`` replicas (``mesh=pp:P,dp:D,fsdp:F,tp:T``, fsdp inside dp) all-reduce their
shards (with ``dist_opt=true`` the shards span dp too). cp and ep inside a stage are not laid out this way
yet.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .ingest.errors import HespasError
from .ingest.zoo.checks import mesh_of, microbatch_count, schedule_chunks
from .ingest.zoo.specs import canonical_spec, is_zoo_spec, parse_zoo_spec
from .pipeline import Question, ingest, run, write_replay_inputs
from .replay import chakra as et
from .replay import replay
from .replay.schedules import StageWork, in_flight, schedule_traces, stage_order
from .replay.errors import SystemConfigError
from .replay.system import leading_system, strided_system
from .replay.timeline import step_spans, write_timeline
from .units import progress_bar


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
    optimizer_shards: int = 1        # replicas the optimizer state is sharded over (dist_opt, fsdp), 1: whole
    model_flops: float = 0.0         # every device's: each stage's units and update on its replicas × tp
    fsdp: int = 1                    # replicas in a stage's fsdp group (of ``replicas``: dp × fsdp)
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
                    replay_backend: str = "auto", every_rank: bool = False,
                    out: str | Path | None = None, progress: bool = False) -> StagedResult:
    """Simulate one step of the pipelined zoo ``program`` from its stages' programs on ``system`` of
    ``target`` devices, timing their regions with ``fidelity`` (see the module docstring). The ranks of a
    stage run alike, so one rank per stage is replayed on the part of the system the stages span, each
    stage's gradient all-reduce timed on the part its replicas span: on switch and fully connected
    dimensions the same step as replaying every rank, to within the microsecond the all-reduce's wait is
    rounded to. ``every_rank``, a ring dimension or a system that cannot be cut so replays every rank.
    ``out``: a folder for the replayed ranks' Chakra traces (one per stage, or every rank's),
    ``comm_group.json``, the system they ran on, ``result.json`` and ``timeline.png``. ``progress``: a bar
    with an ETA over the stage programs on stderr (exporting a large model's takes minutes)."""
    family, p, stages, replicas, tp, chunks, micro, fsdp = _layout(program)
    question = Question.resolve(None, target, system, fidelity=fidelity, split=split, replay=replay_backend)
    if question.system is None or question.system.n_npus != stages * replicas * tp:
        raise StagedPipelineError(f"{program}: the system must have the {stages * replicas * tp} devices of the "
                                  f"mesh (give --system)")
    group = leading_system(question.system, tp)
    train = p["step"] == "train"
    schedule = p["schedule"].split(":")[0]
    virtual = stages * chunks
    shards = (replicas if p.get("dist_opt") else fsdp) if train else 1   # replicas sharing a stage's state
    sharded = shards > 1
    unit = {**p, "mesh": f"tp:{tp}" if tp > 1 else "", "devices": tp, "microbatch": 0, "schedule": "gpipe",
            "batch": p["batch"] // replicas // micro, "layers": p["layers"] // virtual, "dist_opt": False}
    place = ["first"] + ["middle"] * (virtual - 2) + ["last"]
    stage_place = ["first"] + ["middle"] * (stages - 2) + ["last"]
    update_unit = {**unit, "dist_opt": True, "mesh": f"dp:{shards},tp:{tp}" if tp > 1 else f"dp:{shards}",
                   "devices": shards * tp} if sharded else unit    # the update on this device's shard

    def spec_of(role: str, layers: int, of: dict[str, Any] = unit) -> str:
        return canonical_spec(family, {**of, "role": role, "layers": layers})

    specs = {"forward": [spec_of(f"forward:{place[v]}", unit["layers"]) for v in range(virtual)],
             "backward": [spec_of(f"backward:{place[v]}", unit["layers"]) if train else None
                          for v in range(virtual)],
             "update": [spec_of(f"update:{stage_place[s]}", p["layers"] // stages, update_unit) if train else None
                        for s in range(stages)]}
    runs: dict[str, Any] = {}
    distinct = list(dict.fromkeys(x for kind in specs.values() for x in kind if x))
    with progress_bar(len(distinct), "stage programs", "program", progress) as bar:
        for spec in distinct:                  # exported (or read from the cache), split, labelled, replayed
            bar.set_postfix_str(spec.rsplit("role=", 1)[-1].split("&")[0], refresh=False)
            runs[spec] = run(Question(spec, question.target, question.fidelity, group, question.split,
                                      question.replay))
            bar.update()
    forward = [runs[x] for x in specs["forward"]]
    backward = [runs[x] if x else None for x in specs["backward"]]
    updates = [runs[x] if x else None for x in specs["update"]]
    message = int(backward[0].memory.get("incoming", 0)) if train else _output_bytes(next(iter(runs)))
    work = [StageWork(f.step_time_s, b.step_time_s if b else 0.0, message) for f, b in zip(forward, backward)]
    syncs = [_syncs(updates[s], [forward[c * stages + s] for c in range(chunks)], replicas, shards) if train
             else [] for s in range(stages)]
    traces, replayed_on, groups, engine, note, waits = _rank_traces(
        work, updates, syncs, schedule, stages, replicas, tp, micro, chunks, train, question, every_rank)
    name = f"{family}_stages"
    written = write_replay_inputs(Path(out), name, traces, groups, replayed_on) if out is not None else []
    drawn = out is not None and len(traces) <= MAX_TIMELINE_RANKS      # the timeline reads the nodes' ticks
    step = replay(traces, replayed_on, groups or None, backend=question.replay, record_nodes=drawn)
    orders = [stage_order(schedule, stages, micro, s, chunks, train) for s in range(stages)]
    busy, flops = [], []
    for s in range(stages):
        runs_of = [r for c in range(chunks) for r in (forward[c * stages + s], backward[c * stages + s]) if r]
        busy.append(micro * sum(r.step_time_s for r in runs_of) + (updates[s].step_time_s if train else 0.0))
        flops.append(micro * sum(r.flops for r in runs_of) + (updates[s].flops if train else 0.0))
    last = max(step.ranks, key=lambda r: (r.finish_ns, -r.rank)).rank
    exposed = step.exposed_comm_s + (waits[last] if waits else 0.0)
    flight = [in_flight(order) if train else 0 for order in orders]
    master = p.get("master", "none") == "f32"
    memory = [_stage_memory(s, stages, chunks, forward, backward, updates, flight[s], master,
                            shards) for s in range(stages)]
    warnings = sorted({w for r in runs.values() for w in r.warnings} | ({note} if note else set()) | set(written))
    capacity = float(question.target.mem_capacity)
    result = StagedResult(program, question.target.name, question.fidelity.name, question.split,
                        question.system.source, p["schedule"], stages, chunks, micro, replicas, tp, step.step_time_s,
                        exposed, flops[busy.index(max(busy))],
                        {spec: r.step_time_s for spec, r in runs.items()}, busy,
                        [max(0.0, 1.0 - b / step.step_time_s) for b in busy], flight, memory, capacity,
                        shards, sum(flops) * replicas * tp, fsdp, engine, warnings)
    if out is not None:
        _write_result(Path(out), name, traces, replayed_on, groups, result, step.details.get("nodes"))
    return result


def _layout(program: str) -> tuple[str, dict[str, Any], int, int, int, int, int, int]:
    """(family, parameters, stages, replicas of a stage (dp × fsdp), tp group size, chunks per stage,
    microbatches, fsdp group size) of a zoo program this module can lay out, else a one-line
    StagedPipelineError."""
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
    inside = sorted(a for a, n in mesh.items() if n > 1 and a not in ("pp", "dp", "fsdp", "tp"))
    if inside:
        raise StagedPipelineError(f"{program}: --pipeline stages lays out pp, dp, fsdp and tp; {', '.join(inside)} "
                                  f"inside a stage is not handled (use the default lock-step pipeline)")
    fsdp = mesh.get("fsdp", 1)
    if fsdp > 1 and p["step"] != "train":
        raise StagedPipelineError(f"{program}: fsdp inside a stage shards a training step's optimizer state and "
                                  f"master weights; an inference step has none (use dp)")
    try:
        chunks = schedule_chunks(p.get("schedule", "gpipe"))
    except ValueError as exc:
        raise StagedPipelineError(f"{program}: {exc}") from None
    replicas = mesh.get("dp", 1) * fsdp
    micro = microbatch_count(p, mesh)
    if p["layers"] % (stages * chunks):
        raise StagedPipelineError(f"{program}: {stages} stages of {chunks} chunks do not divide layers "
                                  f"{p['layers']}")
    if chunks > 1 and micro % stages:
        raise StagedPipelineError(f"{program}: the interleaved schedule takes microbatches {stages} at a time: "
                                  f"{micro} microbatches are not a multiple of {stages} stages")
    return family, p, stages, replicas, mesh.get("tp", 1), chunks, micro, fsdp


def _output_bytes(spec: str) -> int:
    """The activation a forward role program hands on (what it returns), per microbatch."""
    graph = ingest(spec)
    return sum(t.nbytes for op in graph.outputs for t in graph.ops[op].result_types) or 1


Span = tuple[int, int]
"""A group of a stage's replicas: (stride, count) in replica index (replica = d · fsdp + f): (1, shards) the
replicas that share the stage's state, (shards, replicas / shards) those holding the same shard."""


def _syncs(update, forwards, replicas: int, shards: int) -> list[tuple[str, int, int, bool, Span]]:
    """What a stage's replicas exchange around its update, in order: (name, Chakra collective, comm_size,
    before the update, the replicas it spans). Its gradients all-reduced; with its state sharded over
    ``shards`` replicas (distributed optimizer, fsdp) reduce-scattered over them (the whole gradient buffer in,
    this device's shard out), the shard all-reduced over the replicas that hold the same one, and the updated
    parameters all-gathered (each device's shard of the copy the units compute with)."""
    grads = int(update.memory.get("gradients", 0))
    if shards == 1:
        return [("grads", et.ALL_REDUCE, grads, True, (1, replicas))] if replicas > 1 and grads else []
    copy = sum(int(f.memory.get("parameters", 0)) for f in forwards)
    outer = replicas // shards
    return ([("grads", et.REDUCE_SCATTER, grads * shards, True, (1, shards))]
            + ([("shard", et.ALL_REDUCE, grads, True, (shards, outer))] if outer > 1 else [])
            + [("params", et.ALL_GATHER, math.ceil(copy / shards), False, (1, shards))])


def _rank_traces(work, updates, syncs, schedule, stages, replicas, tp, micro, chunks, train, question, every_rank):
    """(the traces to replay, the system they run on, their communicator groups, which ranks they are, a note
    when every rank had to be, each replayed rank's wait for its replicas' collectives where it stands in
    for them): one rank per stage where its peers in the other stages and its replicas each lie along one
    switch or fully connected dimension (:func:`_alike_parts`), else every rank."""
    system, backend = question.system, question.replay
    note = None
    if not every_rank and replicas * tp > 1:
        spans = sorted({x[4] for sync in syncs for x in sync})
        parts = _alike_parts(system, stages, replicas, tp, spans)
        if isinstance(parts, str):
            note = f"every rank replayed: {parts}"
        else:
            along, across = parts
            delays = [[_collective_s(kind, size, across[span], backend) for _, kind, size, _, span in sync]
                      for sync in syncs]
            traces = []
            for s, nodes in enumerate(schedule_traces(work, schedule, micro, chunks, train=train)):
                if train:
                    nodes = nodes + _update_nodes(nodes, updates[s], s, syncs[s], None, delays[s])
                traces.append(nodes)
            return traces, along, {}, "one rank per stage", None, [sum(d) for d in delays]
    traces, groups = _traces(work, updates, syncs, schedule, stages, replicas, tp, micro, chunks, train)
    return traces, system, groups, "every rank", note, None


MAX_TIMELINE_RANKS = 64
"""``--out`` draws the timeline of a replay of at most this many ranks (its every node's ticks)."""


def _write_result(out: Path, name: str, traces, system, groups, result: StagedResult, ticks=None) -> None:
    """``result.json`` and the timeline of the replayed ranks in ``out`` from the replay's node ``ticks``
    (replayed again where it kept none: the ASTRA-sim binary's); a warning in the result where there are
    too many ranks to draw."""
    if len(traces) <= MAX_TIMELINE_RANKS:
        write_timeline(out / "timeline.png", step_spans(traces, system, groups or None, ticks),
                       f"{name}: {result.stages} stages, {result.schedule}, {result.microbatches} microbatches; "
                       f"{result.target}, {result.fidelity}: step {result.step_time_s * 1e3:.3f} ms")
    else:
        result.warnings.append(f"{out / 'timeline.png'} not drawn: {len(traces)} ranks replayed (at most "
                               f"{MAX_TIMELINE_RANKS})")
    (out / "result.json").write_text(json.dumps(result.to_dict(), indent=2))


def _alike_parts(system, stages: int, replicas: int, tp: int, spans: list[Span]):
    """(the system rank 0's peers in the other stages make up, the one each group of its replicas ``spans``
    makes up, by span) when each lies along one switch or fully connected dimension, where a group's messages
    and collectives take the same time wherever its members sit; else why not (one line)."""
    rings = [d for d in system.dims if d.topology not in ALIKE_TOPOLOGIES]
    if rings:
        return f"a {rings[0].topology} dimension times a group by where its members sit"
    try:
        along = strided_system(system, replicas * tp, stages)
        across = {span: strided_system(system, tp * span[0], span[1]) for span in spans}
    except SystemConfigError as exc:
        return str(exc)
    for part, who in ((along, "the stages"), *((q, "a stage's replicas") for q in across.values())):
        if len(part.dims) > 1:
            return f"{who} span {len(part.dims)} network dimensions ({part.source})"
    return along, across


def _collective_s(kind: int, size: int, system, backend: str) -> float:
    """How long a Chakra collective ``kind`` of ``comm_size`` ``size`` over every rank of ``system`` takes
    alone (0 without one)."""
    if system is None or size <= 0:
        return 0.0
    node = et.EtNode(0, "sync", et.COMM_COLL_NODE, [], [], 0, {"comm_type": kind, "comm_size": size})
    return replay([[node]] * system.n_npus, system, None, backend=backend).step_time_s


def _traces(work, updates, syncs, schedule, stages, replicas, tp, micro, chunks, train):
    """Every rank's trace (rank = (stage · replicas + replica) · tp + t) and the communicator groups of its
    replicas' collectives (one per stage, tp rank and group of replicas a collective spans)."""
    per_stage = schedule_traces(work, schedule, micro, chunks, train=train)

    def rank(s: int, d: int, t: int) -> int:
        return (s * replicas + d) * tp + t

    groups: dict[int, list[int]] = {}
    named: dict[tuple[int, ...], str] = {}

    def group_of(s: int, d: int, t: int, span: Span) -> str:
        stride, count = span
        base = d % stride + (d // (stride * count)) * stride * count
        members = tuple(rank(s, base + i * stride, t) for i in range(count))
        if members not in named:
            named[members] = str(len(groups) + 1)
            groups[len(groups) + 1] = list(members)
        return named[members]

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
                mine += _update_nodes(mine, updates[s], s, syncs[s], [group_of(s, d, t, x[4]) for x in syncs[s]])
            traces.append(mine)
    return traces, groups


def _update_nodes(nodes: list[et.EtNode], update, stage: int, syncs, groups: list[str] | None,
                  waits: list[float] | None = None) -> list[et.EtNode]:
    """After a stage's last unit: its optimizer update and the collectives ``syncs`` (:func:`_syncs`)
    before and after it, each over its communicator of ``groups`` or, for a stage replayed alone, as
    waits of ``waits`` seconds (what each collective takes)."""
    last = max(n.id for n in nodes if n.type == et.COMP_NODE)
    out: list[et.EtNode] = []
    carried = 0.0                              # the waits' rounding to whole µs, carried from one to the next

    def then(name: str, kind: int, duration: int, attrs: dict) -> None:
        nonlocal last
        nid = len(nodes) + len(out)
        out.append(et.EtNode(nid, f"{name}_stage{stage}", kind, [last], [], duration, attrs))
        last = nid

    def sync(i: int) -> None:
        nonlocal carried
        name, kind, size, _, _ = syncs[i]
        if groups is not None:
            then(name, et.COMM_COLL_NODE, 0, {"comm_type": kind, "comm_size": size, "pg_name": groups[i]})
        elif waits and waits[i] > 0:
            exact = waits[i] * 1e6 + carried
            micros = max(1, round(exact))
            carried = exact - micros
            then(name, et.COMP_NODE, micros, {"num_ops": 1, "tensor_size": size})

    for i in (i for i, x in enumerate(syncs) if x[3]):
        sync(i)
    size = int(update.memory.get("gradients", 0)) or 1
    then("update", et.COMP_NODE, int(round(update.step_time_s * 1e6)), {"num_ops": 1, "tensor_size": size})
    for i in (i for i, x in enumerate(syncs) if not x[3]):
        sync(i)
    return out


def _stage_memory(s, stages, chunks, forward, backward, updates, flight, master: bool,
                  shards: int = 1) -> dict[str, int]:
    """Stage ``s``'s memory at its peak: its parameters, gradients and optimizer state (its update program's
    arguments, and the copy its units compute with beside f32 master weights; inference: its forwards'
    parameters), what it keeps for the units in flight (a backward program's ``kept`` arguments each), and the
    largest working set among its units (a unit program's peak less its parameters and what it keeps). Under
    the distributed optimizer (``shards`` replicas) the update's arguments are this device's shard, but the
    gradient buffer is whole until it is reduce-scattered, and without master weights the shard is part of
    the parameters the units compute with; so under fsdp (``shards`` its group)."""
    units = [r for c in range(chunks) for r in (forward[c * stages + s], backward[c * stages + s]) if r is not None]
    working = max(r.memory.get("peak", 0) - r.memory.get("parameters", 0) - r.memory.get("kept", 0) for r in units)
    if updates[s] is not None:
        fixed = {k: int(updates[s].memory.get(k, 0)) for k in ("parameters", "gradients", "optimizer_state")}
        fixed["gradients"] *= shards
        copy = sum(int(forward[c * stages + s].memory.get("parameters", 0)) for c in range(chunks))
        if master:                             # master weights beside the copy the units compute with
            fixed["compute_copy"] = copy
        else:
            fixed["parameters"] = copy
        per_unit = max(int(backward[c * stages + s].memory.get("kept", 0)) for c in range(chunks))
    else:
        fixed = {"parameters": sum(int(forward[c * stages + s].memory.get("parameters", 0)) for c in range(chunks)),
                 "gradients": 0, "optimizer_state": 0}
        per_unit = 0
    kept = flight * per_unit
    return {**fixed, "kept": kept, "working": working, "peak": sum(fixed.values()) + kept + working}


__all__ = ["StagedPipelineError", "StagedResult", "simulate_stages"]
