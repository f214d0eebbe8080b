"""Pipeline schedules as Chakra traces: each stage runs its microbatches' forwards and backwards in the
order its schedule gives, and hands activations on and gradients back with SEND/RECV nodes, so a replay
simulates the bubble instead of assuming it.

A step of ``stages`` (P) stages and ``microbatches`` (M) microbatches; with ``chunks`` (V) > 1 each stage
holds V model chunks, and chunk v of stage s is virtual stage v·P + s (Megatron's interleaving). A *unit*
is one microbatch through one chunk, forward (``F``) or backward (``B``). :func:`stage_order` gives a
stage's units in the order it runs them:

* ``gpipe``: every forward, then every backward;
* ``1f1b``: P - s - 1 forwards on stage s, then one forward and one backward in turn, then the backwards
  left (PipeDream's flush schedule): at most P - s microbatches in flight on stage s;
* ``interleaved`` (V chunks): the same in units, microbatches taken P at a time through chunk 0, then
  chunk 1, …, the warm-up 2·(P - s - 1) + (V - 1)·P units long (Megatron's interleaved 1F1B; M a
  multiple of P). Its bubble is V times shorter than 1F1B's, and it sends V times as many messages.

:func:`in_flight` is how many units' activations a stage holds at its peak (what its memory must keep);
:func:`schedule_traces` builds one trace per stage from the time of a unit on each virtual stage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from . import chakra as et
from .errors import TraceError

SCHEDULES = ("gpipe", "1f1b", "interleaved")

Unit = tuple[str, int, int]          # ("F" | "B", microbatch, chunk)


@dataclass(frozen=True)
class StageWork:
    """One stage's cost of one unit: ``forward_s`` / ``backward_s`` (seconds; backward 0 for inference)
    and ``message_bytes``, the activation a forward hands to the next stage (its gradient comes back the
    same size)."""

    forward_s: float
    backward_s: float = 0.0
    message_bytes: int = 1


def check_schedule(schedule: str, stages: int, microbatches: int, chunks: int = 1) -> None:
    """TraceError (one line) when the schedule cannot run ``microbatches`` through ``stages`` x ``chunks``."""
    if schedule not in SCHEDULES:
        raise TraceError(f"pipeline schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if stages < 1 or microbatches < 1 or chunks < 1:
        raise TraceError(f"a pipeline needs at least one stage, microbatch and chunk (got {stages}, "
                         f"{microbatches}, {chunks})")
    if chunks > 1 and schedule != "interleaved":
        raise TraceError(f"{schedule} runs one chunk per stage; {chunks} chunks need the interleaved schedule")
    if schedule == "interleaved" and microbatches % stages:
        raise TraceError(f"the interleaved schedule takes microbatches {stages} at a time: {microbatches} "
                         f"microbatches are not a multiple of {stages} stages")


def stage_order(schedule: str, stages: int, microbatches: int, stage: int, chunks: int = 1,
                train: bool = True) -> list[Unit]:
    """The units stage ``stage`` runs, in order (see the module docstring). ``train=False``: forwards only,
    in the order the schedule's forwards come."""
    check_schedule(schedule, stages, microbatches, chunks)
    if not 0 <= stage < stages:
        raise TraceError(f"stage {stage} of a {stages}-stage pipeline")
    forwards = [_unit("F", k, stages, microbatches, chunks) for k in range(microbatches * chunks)]
    if not train:
        return forwards
    backwards = [_unit("B", k, stages, microbatches, chunks) for k in range(microbatches * chunks)]
    if schedule == "gpipe":
        return forwards + backwards
    total = microbatches * chunks
    if schedule == "1f1b":
        warmup = min(stages - stage - 1, total)
    else:
        warmup = min(2 * (stages - stage - 1) + (chunks - 1) * stages, total)
    order = forwards[:warmup]
    for i in range(total - warmup):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[total - warmup:]


def _unit(kind: str, k: int, stages: int, microbatches: int, chunks: int) -> Unit:
    """The k-th forward or backward unit of a stage: microbatches P at a time through each chunk in turn
    (forwards from chunk 0 up, backwards from the last chunk down); one chunk: microbatch k."""
    if chunks == 1:
        return kind, k, 0
    group, within = divmod(k, stages * chunks)
    chunk = within // stages
    return kind, group * stages + within % stages, chunk if kind == "F" else chunks - 1 - chunk


def in_flight(order: Sequence[Unit]) -> int:
    """The most units whose forward a stage has run and whose backward it has not, at any point of
    ``order``: how many chunks' activations it holds at its peak."""
    held = peak = 0
    for kind, _, _ in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def schedule_traces(work: Sequence[StageWork], schedule: str, microbatches: int, chunks: int = 1,
                    train: bool = True, tag_base: int = 1) -> list[list[et.EtNode]]:
    """One Chakra trace per stage (rank s runs stage s) from ``work``, the cost of a unit on each virtual
    stage (``stages x chunks`` of them, virtual stage v·P + s being chunk v of stage s): per unit a RECV of
    its input from the stage before it (its gradient from the stage after it, backward), a COMP node of the
    unit's time and a SEND of its output, chained in the stage's :func:`stage_order`. The first virtual
    stage's forwards and the last one's backwards take nothing from another stage. Durations are whole
    microseconds, each stage's remainder carried to its next unit so that no time is lost. ``tag_base``: the
    first message tag."""
    if not work or len(work) % chunks:
        raise TraceError(f"{len(work)} virtual stages' costs given for {chunks} chunks per stage")
    stages = len(work) // chunks
    check_schedule(schedule, stages, microbatches, chunks)
    virtual = stages * chunks
    traces: list[list[et.EtNode]] = []
    for stage in range(stages):
        nodes: list[et.EtNode] = []
        carried = 0.0
        prev: int | None = None
        for kind, mb, chunk in stage_order(schedule, stages, microbatches, stage, chunks, train):
            vs = chunk * stages + stage
            cost = work[vs]
            seconds = cost.forward_s if kind == "F" else cost.backward_s
            exact = seconds * 1e6 + carried
            micros = int(exact)
            carried = exact - micros
            size = max(1, int(cost.message_bytes))
            source = vs - 1 if kind == "F" else vs + 1
            deps = [] if prev is None else [prev]
            if 0 <= source < virtual:
                rid = len(nodes)
                tag = _tag(tag_base, kind, source, mb, virtual, microbatches)
                attrs = {"comm_src": source % stages, "comm_dst": stage, "comm_size": size, "comm_tag": tag}
                nodes.append(et.EtNode(rid, f"recv_{kind}{mb}_v{source}", et.COMM_RECV_NODE, [], [], 0, attrs))
                deps = deps + [rid]
            cid = len(nodes)
            nodes.append(et.EtNode(cid, f"{kind}{mb}_v{vs}", et.COMP_NODE, deps, [], micros,
                                   {"num_ops": 1, "tensor_size": size}))
            prev = cid
            target = vs + 1 if kind == "F" else vs - 1
            if 0 <= target < virtual:
                tag = _tag(tag_base, kind, vs, mb, virtual, microbatches)
                attrs = {"comm_src": stage, "comm_dst": target % stages, "comm_size": size, "comm_tag": tag}
                nodes.append(et.EtNode(len(nodes), f"send_{kind}{mb}_v{vs}", et.COMM_SEND_NODE, [cid], [], 0, attrs))
        traces.append(nodes)
    return traces


def _tag(base: int, kind: str, sender: int, mb: int, virtual: int, microbatches: int) -> int:
    """The tag of the message virtual stage ``sender`` sends for microbatch ``mb`` (forward or backward)."""
    return base + ((0 if kind == "F" else 1) * virtual + sender) * microbatches + mb


__all__ = ["SCHEDULES", "StageWork", "check_schedule", "in_flight", "schedule_traces", "stage_order"]
