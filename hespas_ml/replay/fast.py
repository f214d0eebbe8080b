"""A replay specialised for sweeps: one trace set replayed on many systems, with the step times the
embedded replay (:func:`hespas_ml.replay.embedded.replay_embedded`) gives, exactly, in a fraction of
its time.

It applies where the embedded replay's symmetric engine applies (every rank runs the same COMP and
collective nodes; see :mod:`hespas_ml.replay.embedded.symmetric`) and otherwise hands over to
:func:`replay_embedded`. Two levels of reuse make it fast:

1. **A replay plan** (:func:`compile_plan`), compiled once per trace set: rank 0's nodes in id order,
   their children and parent counts, COMP runtimes, and one descriptor per distinct collective.
2. **Collective times** memoised per (collective kind, size, group, system) in a :class:`SystemContext`,
   by :mod:`hespas_ml.replay.fast_collectives`: a rank has at most one collective in flight, so its
   duration does not depend on what else runs; it comes from per-structure linear fits of the phase
   times, checked against exact one-phase runs of the full engine, composed over the collective's
   chunk streams. Besides the duration we keep the *lead*: how long before its end the collective's
   last event was registered, which decides the order of same-tick completions (below).

Rank 0's DAG is then list-scheduled as ASTRA-sim's workload layer does it: ready nodes issue in
ascending id, one at a time on the GPU slot (COMP) and on the COMM slot (collectives). When a COMP and
a collective finish at the same tick, the embedded replay runs their completions in the order their
final events were registered in that tick's event list (the COMP at its issue, the collective ``lead``
before its end); when those registrations coincide too, the order hangs on event sequence numbers, and
this replay declines (:func:`evaluate` returns None) so that :func:`replay_fast` uses the embedded
replay instead. ``tests/use/test_sweep.py`` checks equality with the embedded replay on real traces.
"""
from __future__ import annotations

import heapq
import json
from collections import OrderedDict
from dataclasses import astuple, dataclass
from types import SimpleNamespace
from typing import Sequence

from . import chakra as et
from .embedded import replay_embedded
from .embedded.config import IMPLEMENTATION_KEYS, ReplayConfig
from .embedded.network import Network
from .embedded.nodes import group_id
from .embedded.results import RankResult, ReplayResult
from .embedded.symmetric import Asymmetric, symmetric_plan
from .errors import ReplayError
from .system import SystemConfig, validate_dims, validate_system
from .fast_collectives import CollectiveTimer


# ---------------------------------------------------------------------------------------------- plan

@dataclass(slots=True)
class ReplayPlan:
    """Rank 0's trace of a rank-symmetric trace set, compiled for repeated list scheduling.

    Nodes are indexed in ascending id (the workload layer's issue order). ``runtime`` is the COMP (or
    BROADCAST) time in ns, -1 for a collective; ``coll`` the collective's index in ``collectives``,
    -1 otherwise. A collective is ``(comm_type, comm_size, involved_dim or None, group members or None,
    peer groups' members)``. SEND and RECV nodes (every rank sending and receiving alike, e.g. a pipeline's
    ring of stages) fill ``recv``, ``link``, ``tag`` and ``links``; None where the trace has none.
    """

    n_ranks: int
    comm: list[bool]
    children: list[tuple[int, ...]]
    n_parents: list[int]
    runtime: list[int]
    coll: list[int]
    collectives: list[tuple]
    roots: list[int]
    recv: list[bool] | None = None       # a RECV node (issued at once, any number in flight)
    link: list[int] | None = None        # a SEND's or RECV's index in ``links``, -1 otherwise
    tag: list[int] | None = None         # a SEND's or RECV's message tag
    links: list[tuple] | None = None     # (size, every rank's (src, dst)) of each distinct message

    @property
    def n_nodes(self) -> int:
        return len(self.comm)


def compile_plan(traces: Sequence[Sequence[et.EtNode]],
                 comm_groups: dict[int, list[int]] | None = None) -> ReplayPlan | str:
    """The plan of ``traces``, or a one-line reason why this replay does not apply to them (the caller
    then uses :func:`replay_embedded`)."""
    n = len(traces)
    if n == 0 or any(not t for t in ([traces.template] if isinstance(traces, et.RankTraces) else traces)):
        return "a rank has no node"
    groups = {int(k): list(v) for k, v in (comm_groups or {}).items()}
    try:
        peers = symmetric_plan(traces, SimpleNamespace(total=n, replay_only=False), groups, p2p=True)
    except Exception as exc:  # noqa: BLE001 - anything odd is left to the embedded replay to report
        return f"symmetry check failed ({type(exc).__name__})"
    if peers is None:
        return "ranks run different traces"
    messages = _messages(traces)
    if isinstance(messages, str):
        return messages
    nodes = sorted(traces[0], key=lambda nd: nd.id)
    index: dict[int, int] = {}
    for i, node in enumerate(nodes):
        if node.id in index:
            return f"node id {node.id} appears twice"
        index[node.id] = i
    comm: list[bool] = []
    runtime: list[int] = []
    coll: list[int] = []
    keys: dict[tuple, int] = {}
    children: list[list[int]] = [[] for _ in nodes]
    n_parents: list[int] = []
    p2p_nodes: dict[int, tuple[bool, int, tuple]] = {}
    for i, node in enumerate(nodes):
        attrs = node.attrs
        if attrs.get("is_cpu_op", False):
            return "CPU nodes"
        parents = set(node.data_deps) | set(node.ctrl_deps)
        if any(p not in index for p in parents):
            return f"node {node.id} depends on a node that is not in the trace"
        for p in parents:
            children[index[p]].append(i)
        n_parents.append(len(parents))
        ns = node.duration_micros * 1000 if node.duration_micros else 1
        if node.type == et.COMP_NODE:
            comm.append(False)
            runtime.append(ns)
            coll.append(-1)
            continue
        if node.type in (et.COMM_SEND_NODE, et.COMM_RECV_NODE):
            comm.append(node.type == et.COMM_SEND_NODE)
            runtime.append(-1)
            coll.append(-1)
            p2p_nodes[i] = messages[node.id]
            continue
        if node.type != et.COMM_COLL_NODE:
            return f"node type {et.NODE_TYPE_NAMES.get(node.type, node.type)}"
        comm.append(True)
        comm_type, size = attrs.get("comm_type"), attrs.get("comm_size")
        if comm_type == et.BROADCAST:
            runtime.append(ns)
            coll.append(-1)
            continue
        if comm_type not in IMPLEMENTATION_KEYS or not isinstance(size, int) or isinstance(size, bool):
            return f"collective node {node.id} has unusual attributes"
        involved = attrs.get("involved_dim")
        try:
            gid = group_id(attrs.get("pg_name", ""))
        except (ValueError, TypeError, AttributeError):
            return f"collective node {node.id} names no valid group"
        members = peer_members = None
        if gid is not None:
            if gid not in groups:
                return f"collective node {node.id} names an unknown group"
            if len(groups[gid]) == n:
                involved = [True] * 10     # ASTRA-sim ignores involved_dim for a communicator group
            else:
                members = tuple(groups[gid])
                peer_members = tuple(sorted(tuple(groups[g]) for g in peers.get(gid, {gid})))
        key = (comm_type, size, tuple(involved) if isinstance(involved, list) else None, members, peer_members)
        runtime.append(-1)
        coll.append(keys.setdefault(key, len(keys)))
    roots = [i for i, k in enumerate(n_parents) if k == 0]
    plan = ReplayPlan(n, comm, [tuple(c) for c in children], n_parents, runtime, coll, list(keys), roots)
    if p2p_nodes:
        link_ids: dict[tuple, int] = {}
        plan.recv, plan.link, plan.tag = [False] * len(nodes), [-1] * len(nodes), [0] * len(nodes)
        for i, (is_recv, tag, link) in p2p_nodes.items():
            plan.recv[i], plan.tag[i], plan.link[i] = is_recv, tag, link_ids.setdefault(link, len(link_ids))
        plan.links = list(link_ids)
    return plan


def _messages(traces: Sequence[Sequence[et.EtNode]]) -> dict[int, tuple[bool, int, tuple]] | str:
    """For each SEND and RECV node of rank 0 (by id): (is a RECV, its tag, (size, every rank's (src, dst))),
    when every rank sends and receives at that position and each tag's sends and receives are the same
    messages; else a reason."""
    first = traces.template if isinstance(traces, et.RankTraces) else traces[0]
    columns = dict(traces.variants) if isinstance(traces, et.RankTraces) else None
    out: dict[int, tuple[bool, int, tuple]] = {}
    by_tag: dict[int, list[tuple]] = {}
    for pos, node in enumerate(first):
        if node.type not in (et.COMM_SEND_NODE, et.COMM_RECV_NODE):
            continue
        column = columns.get(pos, [node] * len(traces)) if columns is not None else [t[pos] for t in traces]
        is_recv = node.type == et.COMM_RECV_NODE
        try:
            pairs = tuple((int(nd.attrs["comm_src"]), int(nd.attrs["comm_dst"])) for nd in column)
            size, tag = int(node.attrs["comm_size"]), int(node.attrs.get("comm_tag", 0))
        except (KeyError, TypeError, ValueError):
            return f"SEND/RECV node {node.id} has unusual attributes"
        if any((dst if is_recv else src) != rank for rank, (src, dst) in enumerate(pairs)):
            return f"{'RECV' if is_recv else 'SEND'} node {node.id} is not every rank's own"
        out[node.id] = (is_recv, tag, (size, pairs))
        by_tag.setdefault(tag, []).append((is_recv, size, frozenset(pairs)))
    for tag, ends in by_tag.items():
        if len(ends) != 2 or {e[0] for e in ends} != {False, True} or ends[0][1:] != ends[1][1:]:
            return f"messages of tag {tag} are not one send and one receive per rank"
    return out


# ---------------------------------------------------------------------------------------------- systems

class SystemContext:
    """One system as the fast replay sees it, with its memoised collective times
    (:class:`~hespas_ml.replay.fast_collectives.CollectiveTimer`)."""

    def __init__(self, system: SystemConfig):
        validate_dims(system.dims, system.source)
        validate_system(system.system, len(system.dims), system.source)
        self.system = system
        self.cfg = ReplayConfig(system)
        self.network = Network(system)
        self.applicable = not (self.cfg.roofline or self.cfg.replay_only)
        self.timer = CollectiveTimer(system, self.cfg, self.network)

    def collective_time(self, key: tuple) -> tuple[int, int]:
        """(duration, lead) in ns of collective ``key`` (see :class:`ReplayPlan`) run alone by rank 0."""
        return self.timer.time(key)

    def message_time(self, link: tuple) -> int:
        """The delay in ns of every message of ``link`` (size, every rank's (src, dst)); raises Asymmetric
        when they differ (ranks would then not run alike)."""
        size, pairs = link
        delays = {self.network.delay(src, dst, size) for src, dst in pairs}
        if len(delays) != 1:
            raise Asymmetric(f"messages of {size} bytes take {min(delays)}-{max(delays)} ns between ranks")
        return delays.pop()


CONTEXTS_KEPT = 4096
_contexts: "OrderedDict[str, SystemContext]" = OrderedDict()


def system_context(system: SystemConfig) -> SystemContext:
    """The :class:`SystemContext` of ``system``, shared by every replay on a system of the same content (the
    last :data:`CONTEXTS_KEPT` systems are kept), so that their collective times are timed once."""
    key = json.dumps([[astuple(d) for d in system.dims], system.system, system.remote_memory], sort_keys=True,
                     default=str)
    ctx = _contexts.get(key)
    if ctx is None:
        ctx = _contexts[key] = SystemContext(system)
        if len(_contexts) > CONTEXTS_KEPT:
            _contexts.popitem(last=False)
    else:
        _contexts.move_to_end(key)
    return ctx


# ---------------------------------------------------------------------------------------------- replay

@dataclass(slots=True)
class FastResult:
    finish_ns: int
    gpu_ns: int            # COMP time issued (ASTRA-sim's GPU ticks)
    comm_ns: int           # collective busy time

    @property
    def exposed_ns(self) -> int:
        return self.finish_ns - self.gpu_ns


def evaluate(plan: ReplayPlan, ctx: SystemContext, runtime: Sequence[int] | None = None) -> FastResult | None:
    """List-schedule rank 0's plan on ``ctx``'s system (``runtime`` overrides the plan's COMP times,
    index by index). None when two completions tie so closely that only the embedded replay can order
    them. Raises Asymmetric / ReplayError when a collective cannot be timed here."""
    if not ctx.applicable:
        return None
    if plan.links:
        return _evaluate_p2p(plan, ctx, plan.runtime if runtime is None else runtime)
    runtime = plan.runtime if runtime is None else runtime
    times = [ctx.collective_time(k) for k in plan.collectives]
    coll, comm, children = plan.coll, plan.comm, plan.children
    waiting = list(plan.n_parents)
    ready_g: list[int] = []
    ready_c: list[int] = []
    for i in plan.roots:
        (ready_c if comm[i] else ready_g).append(i)
    heapq.heapify(ready_g)
    heapq.heapify(ready_c)
    pop, push = heapq.heappop, heapq.heappush
    g_node = c_node = -1
    g_end = g_reg = c_end = c_reg = 0
    gpu = busy_comm = now = 0
    while True:
        if g_node < 0 and ready_g:                      # issue (GPU slot first, as ASTRA-sim)
            g_node = pop(ready_g)
            g_end = now + runtime[g_node]
            g_reg = now
            gpu += runtime[g_node]
        if c_node < 0 and ready_c:
            c_node = pop(ready_c)
            k = coll[c_node]
            if k < 0:
                c_end, c_reg = now + runtime[c_node], now
            else:
                duration, lead = times[k]
                c_end, c_reg = now + duration, now + duration - lead
            busy_comm += c_end - now
        if g_node >= 0 and (c_node < 0 or g_end < c_end or (g_end == c_end and g_reg < c_reg)):
            node, now, g_node = g_node, g_end, -1
        elif c_node >= 0 and (g_node < 0 or c_end < g_end or (c_end == g_end and c_reg < g_reg)):
            node, now, c_node = c_node, c_end, -1
        elif g_node < 0 and c_node < 0:
            break
        else:
            return None                                  # same tick, same registration time
        for child in children[node]:
            waiting[child] -= 1
            if waiting[child] == 0:
                push(ready_c if comm[child] else ready_g, child)
    if any(waiting):
        return None                                      # a stalled DAG: the embedded replay reports it
    return FastResult(now, gpu, busy_comm)


def _evaluate_p2p(plan: ReplayPlan, ctx: SystemContext, runtime: Sequence[int]) -> FastResult | None:
    """:func:`evaluate` for a plan with SEND and RECV nodes. Every rank runs alike, so rank 0's peer posts
    each send when rank 0 posts its own of the same tag: a RECV finishes a message's delay after rank 0's
    SEND of its tag, or at once when posted later; a SEND holds the COMM slot for its delay. RECVs issue as
    soon as they are ready. Completions are taken in (tick, registration tick) order; where a SEND and the
    RECV of its tag tie, the SEND first (ranks that run alike register their events in rank order, and
    every peer's rank is above 0); None on any other tie. Its issue rules are :func:`evaluate`'s; that loop
    stays apart, as lean as it is, for the sweeps that run it once per configuration."""
    times = [ctx.collective_time(k) for k in plan.collectives]
    delays = [ctx.message_time(link) for link in plan.links]
    coll, comm, children, recv, link, tag = plan.coll, plan.comm, plan.children, plan.recv, plan.link, plan.tag
    waiting = list(plan.n_parents)
    ready_g: list[int] = []
    ready_c: list[int] = []
    recvs: list[tuple[int, int, int]] = []          # RECVs in flight: (end, registration, node)
    sent: dict[int, int] = {}                       # tag -> when rank 0 posted its SEND
    posted: dict[int, list[int]] = {}               # tag -> RECVs posted before that SEND
    spans: list[tuple[int, int]] = []               # COMM slot and RECV (start, end), for the comm time
    starts: dict[int, int] = {}
    pop, push = heapq.heappop, heapq.heappush

    def post(i: int, now: int) -> bool:
        starts[i] = now
        t = tag[i]
        if t not in sent:
            posted.setdefault(t, []).append(i)
            return True
        arrival = sent[t] + delays[link[i]]
        if arrival == now:
            return False                            # arrives in the tick it is posted: order unknown here
        push(recvs, (arrival, sent[t], i) if arrival > now else (now, now, i))
        return True

    for i in plan.roots:
        if recv[i]:
            if not post(i, 0):
                return None
        else:
            (ready_c if comm[i] else ready_g).append(i)
    heapq.heapify(ready_g)
    heapq.heapify(ready_c)
    g_node = c_node = -1
    g_end = g_reg = c_end = c_reg = c_start = 0
    gpu = now = 0
    while True:
        if g_node < 0 and ready_g:
            g_node = pop(ready_g)
            g_end = now + runtime[g_node]
            g_reg = now
            gpu += runtime[g_node]
        if c_node < 0 and ready_c:
            c_node = pop(ready_c)
            c_start = now
            k = coll[c_node]
            if recv is not None and link[c_node] >= 0:          # a SEND
                t = tag[c_node]
                sent[t] = now
                c_end, c_reg = now + delays[link[c_node]], now
                for r in posted.pop(t, ()):
                    push(recvs, (now + delays[link[r]], now, r))
            elif k < 0:
                c_end, c_reg = now + runtime[c_node], now
            else:
                duration, lead = times[k]
                c_end, c_reg = now + duration, now + duration - lead
        best = None
        for cand in ((g_end, g_reg, 0) if g_node >= 0 else None, (c_end, c_reg, 1) if c_node >= 0 else None,
                     (recvs[0][0], recvs[0][1], 2) if recvs else None):
            if cand is None:
                continue
            if best is None or cand[:2] < best[:2]:
                best = cand
            elif cand[:2] == best[:2]:
                if best[2] == 1 and cand[2] == 2 and link[c_node] >= 0 and tag[c_node] == tag[recvs[0][2]]:
                    continue     # rank 0's SEND and its peer's of the same tag: rank 0's event is the older
                return None                                      # same tick, same registration time
        if best is None:
            break
        if recvs and best[2] == 2 and len(recvs) > 1 and recvs[1][:2] == recvs[0][:2]:
            return None
        now = best[0]
        if best[2] == 0:
            node, g_node = g_node, -1
        elif best[2] == 1:
            node, c_node = c_node, -1
            spans.append((c_start, now))
        else:
            node = pop(recvs)[2]
            spans.append((starts[node], now))
        for child in children[node]:
            waiting[child] -= 1
            if waiting[child] == 0:
                if recv[child]:
                    if not post(child, now):
                        return None
                else:
                    push(ready_c if comm[child] else ready_g, child)
    if any(waiting) or posted:
        return None                                      # a stalled DAG: the embedded replay reports it
    return FastResult(now, gpu, _union(spans))


def _union(spans: list[tuple[int, int]]) -> int:
    """Total length covered by ``spans`` ((start, end) pairs)."""
    total, end = 0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def replay_fast(traces: Sequence[Sequence[et.EtNode]], system: SystemConfig | SystemContext,
                comm_groups: dict[int, list[int]] | None = None, plan: ReplayPlan | str | None = None,
                ) -> ReplayResult:
    """:func:`replay_embedded`'s result for ``traces`` on ``system``, by the fast path when it applies
    (``details["engine"]`` is then ``"fast"``)."""
    ctx = system if isinstance(system, SystemContext) else system_context(system)
    if plan is None:
        plan = compile_plan(traces, comm_groups)
    res = None
    if isinstance(plan, ReplayPlan) and plan.n_ranks == ctx.cfg.total:
        try:
            res = evaluate(plan, ctx)
        except (Asymmetric, ReplayError):
            res = None
    if res is None:
        return replay_embedded(traces, ctx.system, comm_groups)
    overlap = res.gpu_ns + res.comm_ns - res.finish_ns if res.gpu_ns and res.comm_ns else 0
    ranks = [RankResult(r, res.finish_ns, res.exposed_ns, res.gpu_ns, res.comm_ns, overlap)
             for r in range(plan.n_ranks)]
    return ReplayResult(ranks, "embedded", {"engine": "fast"})
