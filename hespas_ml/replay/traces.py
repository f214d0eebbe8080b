"""Chakra execution traces from a split program: one node list per device, plus the comm groups.

* Each compute region becomes a COMP node whose ``duration_micros`` is the region's time times its
  count. ASTRA-sim reads whole microseconds only, so durations are rounded **with the remainder carried**
  from node to node (in node order, which is the order of the device's single compute stream): the sum of
  the rounded durations stays within half a microsecond of the exact total, and no region's time is lost,
  however small. COMP nodes also carry ``num_ops`` (FLOPs) and ``tensor_size`` (bytes), which ASTRA-sim's
  own roofline mode reads.
* all_reduce / all_gather / reduce_scatter / all_to_all become COMM_COLL nodes with ASTRA-sim's
  ``comm_size`` meaning (see :class:`~hespas_ml.split.regions.Collective`). Replica groups other than
  "every device" become communicator groups: ``comm_group.json`` ids and a ``pg_name`` per node; a device
  outside every group of a collective gets no node for it (its dependants wait on what it waited on).
* collective_permute becomes COMM_SEND / COMM_RECV pairs matched by a tag unique to that permute.
* Each device issues its collectives and sends in program order (ctrl_deps chain them), as devices do;
  ASTRA-sim would otherwise hang when ranks find two collectives ready in different orders.
* Loop bodies that hold a collective are unrolled (see :func:`schedule`): each trip gets its own nodes, so
  compute and communication interleave as on the device, and trip k+1 waits for trip k where the loop
  carries values. Loops without collectives stay rolled up: one COMP node for all trips.
* Compute regions with nothing to do (only free ops: reshapes, constants) get no node.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..split.regions import COLLECTIVE_TO_COMM, RegionGraph
from . import chakra
from .chakra import EtNode
from .fast import ReplayPlan, compile_plan

MIN_COMM_BYTES = 64   # ASTRA-sim loops forever on an ALL_GATHER smaller than its chunk count


@dataclass(slots=True)
class TraceSet:
    traces: Sequence[list[EtNode]]              # one node list per device (rank): a list, or a RankTraces
    comm_groups: dict[int, list[int]] = field(default_factory=dict)
    compute_time_s: float = 0.0                 # exact per-device compute time before rounding
    encoded_compute_s: float = 0.0              # the same after rounding to whole microseconds
    region_of_node: dict[int, int] = field(default_factory=dict)   # COMP node id -> region id
    compiled: ReplayPlan | str | None = None    # the fast replay's plan, compiled on first use

    @property
    def n_ranks(self) -> int:
        return len(self.traces)

    def replay_plan(self) -> ReplayPlan | str:
        """The fast replay's plan of these traces (or why it does not apply), compiled once."""
        if self.compiled is None:
            self.compiled = compile_plan(self.traces, self.comm_groups)
        return self.compiled

    def node_counts(self, rank: int = 0) -> tuple[int, int]:
        """(compute nodes, communication nodes) of one device."""
        comp = sum(1 for n in self.traces[rank] if n.type == chakra.COMP_NODE)
        return comp, len(self.traces[rank]) - comp


MAX_UNROLLED_INSTANCES = 500_000   # region instances per device beyond which loops stay rolled up


@dataclass(slots=True)
class _Instance:
    """One execution slot of a region in the schedule: loop bodies with collectives are unrolled."""

    region: object
    key: tuple[tuple[int, int], ...]     # ((loop id, iteration), …) of the unrolled loops around it
    times: int                           # executions this slot stands for (rolled-up inner loops)


def schedule(rg: RegionGraph) -> tuple[list[_Instance], list[str]]:
    """Region instances in execution order. A loop whose body holds a collective is unrolled (its body's
    regions appear once per trip, so compute and communication interleave as they do on the device);
    other loops stay rolled up (one instance whose time is multiplied by the trip count)."""
    loops = rg.graph.loops
    comm_loops: set[int] = set()
    for r in rg.collectives():
        lp = r.loop
        while lp is not None:
            comm_loops.add(lp)
            lp = loops[lp].parent
    chains: dict[int | None, tuple[int, ...]] = {}

    def unrolled_chain(loop: int | None) -> tuple[int, ...]:
        hit = chains.get(loop)
        if hit is None:
            out: list[int] = []
            lp = loop
            while lp is not None:
                if lp in comm_loops:
                    out.append(lp)
                lp = loops[lp].parent
            hit = chains[loop] = tuple(reversed(out))
        return hit

    regions = rg.regions
    warnings: list[str] = []
    total = 0
    for r in regions:
        n = 1
        for lp in unrolled_chain(r.loop):
            n *= max(1, loops[lp].trip_count)
        total += n
    if total > MAX_UNROLLED_INSTANCES:
        warnings.append(f"loops with collectives would unroll to {total} region instances; kept rolled up "
                        "(each collective repeated back to back)")
        return [_Instance(r, (), max(1, r.count)) for r in regions], warnings

    out: list[_Instance] = []

    def expand(lo: int, hi: int, depth: int, key: tuple[tuple[int, int], ...]) -> None:
        i = lo
        while i < hi:
            chain = unrolled_chain(regions[i].loop)
            if len(chain) <= depth:
                r = regions[i]
                unrolled = 1
                for lp, _ in key:
                    unrolled *= max(1, loops[lp].trip_count)
                out.append(_Instance(r, key, max(1, r.count // unrolled)))
                i += 1
                continue
            loop = chain[depth]
            j = i
            while j < hi and len(unrolled_chain(regions[j].loop)) > depth and \
                    unrolled_chain(regions[j].loop)[depth] == loop:
                j += 1
            for k in range(max(1, loops[loop].trip_count)):
                expand(i, j, depth + 1, key + ((loop, k),))
            i = j

    expand(0, len(regions), 0, ())
    return out, warnings


def build_traces(rg: RegionGraph, region_seconds: Sequence[float], n_ranks: int | None = None) -> TraceSet:
    """Build the per-device traces. ``region_seconds[r.id]`` is one execution of region ``r``."""
    n = n_ranks or rg.n_devices
    loops = rg.graph.loops
    instances, warnings = schedule(rg)
    rg.graph.warnings.extend(w for w in warnings if w not in rg.graph.warnings)
    region_loops = {r.id: tuple(lp for lp, _ in inst.key) for inst in instances for r in [inst.region]}
    group_ids: dict[tuple[int, ...], int] = {}
    traces: list[list[EtNode]] = [[] for _ in range(n)]
    # per rank: (region id, iteration key) -> node ids that stand for that instance's completion. While
    # every rank has run the same nodes (uniform), the ranks share one such map and one trace (template),
    # in which a collective node that names a communicator group stands for one node per group (variants:
    # its position and every rank's node); a program uniform to the end gives a RankTraces, which makes a
    # rank's list when asked, so a step of thousands of ranks costs one rank's work. A collective permute in
    # which every rank sends once and receives once (a ring) is two such variant nodes, SEND and RECV. The
    # first collective some ranks sit out, or another permute, gives each rank its own map and list from
    # then on.
    uniform = True
    done: list[dict[tuple, list[int]]] = [{}] * n
    template: list[EtNode] = []
    variants: list[tuple[int, list[EtNode]]] = []

    def shared_traces() -> chakra.RankTraces:
        """The ranks' traces so far, their communication in order."""
        _order_communication([template])
        for pos, per_rank in variants:
            for node in per_rank:
                node.ctrl_deps = template[pos].ctrl_deps
        return chakra.RankTraces(template, variants, n)

    def diverge() -> None:
        nonlocal uniform
        if uniform:
            uniform = False
            done[:] = [dict(done[0]) for _ in range(n)]
            shared = shared_traces()
            traces[:] = [shared[rank] for rank in range(n)]

    # the sinks of each unrolled loop body: what the next trip waits for (the loop-carried values)
    sinks: dict[int, list[int]] = {}
    for loop in {lp for chain in region_loops.values() for lp in chain}:
        inside = [rid for rid, chain in region_loops.items() if loop in chain]
        used = {d for rid in inside for d in rg.regions[rid].deps}
        sinks[loop] = [rid for rid in inside if rid not in used]
    next_id = 0
    exact_total = 0.0
    carried_exact = 0.0
    carried_us = 0
    region_of_node: dict[int, int] = {}
    permute_count = 0
    trip_ends: dict[tuple, list[int]] = {}
    trip_first: dict[tuple, int] = {}       # loop trip (iteration key) -> the first node id made in it

    def dep_nodes(rank: int, inst: _Instance) -> list[int]:
        """Nodes an instance waits for: its region's producers in the matching iterations, and — for the
        regions that start a loop trip — the sinks of the previous trip (where loop-carried values end)."""
        r, key = inst.region, inst.key
        it = dict(key)
        out: list[int] = []
        inner_dep = False
        for d in r.deps:
            d_loops = region_loops.get(d, ())
            d_key = tuple((lp, it.get(lp, max(1, loops[lp].trip_count) - 1)) for lp in d_loops)
            out.extend(done[rank].get((d, d_key), ()))
            if key and key[-1][0] in d_loops:
                inner_dep = True
        if key and not inner_dep and key[-1][1] > 0:
            out.extend(trip_end(rank, key))
        return sorted(set(out)) if len(out) > 1 else out

    def trip_end(rank: int, key: tuple[tuple[int, int], ...]) -> list[int]:
        """The nodes of the sinks of the trip before ``key``'s (kept: every region that starts the trip
        waits for them). A sink without a node stands for what it waited for, which reaches back into
        older trips: what the previous trip's own start waited for. When the previous trip has nodes of
        its own, each of them waited for that already, so it is left out: the same order, without edges
        that grow with every trip."""
        who = 0 if uniform else rank
        hit = trip_ends.get((who, key))
        if hit is None:
            loop, k = key[-1]
            prev = dict(key)
            prev[loop] = k - 1
            found: list[int] = []
            for s_id in sinks[loop]:
                s_key = tuple((lp, prev.get(lp, max(1, loops[lp].trip_count) - 1)) for lp in region_loops[s_id])
                found.extend(done[rank].get((s_id, s_key), ()))
            prev_key = key[:-1] + ((loop, k - 1),)
            older, first = trip_ends.get((who, prev_key)), trip_first.get(prev_key)
            if older and first is not None and any(i >= first for i in found):
                drop = set(older)
                found = [i for i in found if i not in drop]
            hit = trip_ends[(who, key)] = found
        return hit

    def finish(rank: int, inst: _Instance, nodes: list[int]) -> None:
        done[rank][(inst.region.id, inst.key)] = nodes

    for inst in instances:
        r = inst.region
        suffix = "".join(f"_{k}" for _, k in inst.key)
        for depth in range(1, len(inst.key) + 1):
            trip_first.setdefault(inst.key[:depth], next_id)
        if r.kind == "compute":
            seconds = float(region_seconds[r.id]) * inst.times
            flops = r.flops * inst.times
            nbytes = r.bytes * inst.times
            if seconds <= 0.0 and flops == 0 and nbytes == 0:
                for rank in range(1 if uniform else n):
                    finish(rank, inst, dep_nodes(rank, inst))
                continue
            exact_total += seconds
            carried_exact += seconds * 1e6
            micros = int(round(carried_exact)) - carried_us
            carried_us += micros
            nid = next_id
            next_id += 1
            region_of_node[nid] = r.id
            attrs = {"num_ops": max(1, int(flops)), "tensor_size": max(1, int(nbytes))}
            name = f"comp_{r.id}{suffix}"
            if uniform:
                template.append(EtNode(nid, name, chakra.COMP_NODE, dep_nodes(0, inst), [], micros, attrs))
                finish(0, inst, [nid])
                continue
            for rank in range(n):
                traces[rank].append(EtNode(nid, name, chakra.COMP_NODE, dep_nodes(rank, inst), [], micros,
                                           dict(attrs)))
                finish(rank, inst, [nid])
            continue
        c = r.collective
        if c.kind == "collective_permute" and uniform and _is_ring(c.pairs, n):
            # every rank sends once and receives once: the same two nodes on every rank (variants)
            size = max(1, int(c.comm_bytes))
            dst = {src: d for src, d in c.pairs}
            src_of = {d: src for src, d in c.pairs}
            for rep in range(inst.times):
                permute_count += 1
                deps = dep_nodes(0, inst) if rep == 0 else done[0][(r.id, inst.key)]
                sid = next_id
                next_id += 2
                for node_id, kind, name, peers in ((sid, chakra.COMM_SEND_NODE, f"send_{r.id}", dst),
                                                   (sid + 1, chakra.COMM_RECV_NODE, f"recv_{r.id}", src_of)):
                    per_rank = []
                    for rank in range(n):
                        src, dst_rank = (rank, peers[rank]) if kind == chakra.COMM_SEND_NODE else (peers[rank], rank)
                        per_rank.append(EtNode(node_id, name, kind, deps, [], 0,
                                               {"comm_src": src, "comm_dst": dst_rank, "comm_size": size,
                                                "comm_tag": permute_count}))
                    template.append(per_rank[0])
                    variants.append((len(template) - 1, per_rank))
                finish(0, inst, [sid, sid + 1])
            continue
        if c.kind == "collective_permute":
            diverge()
            for rep in range(inst.times):
                permute_count += 1          # a tag per execution: every rank counts them in the same order

                def deps_of(rank: int, inst=inst, rep=rep) -> list[int]:
                    return dep_nodes(rank, inst) if rep == 0 else done[rank][(inst.region.id, inst.key)]

                next_id = _permute_nodes(traces, inst, c, next_id, permute_count, deps_of, finish)
            continue
        comm_type = getattr(chakra, COLLECTIVE_TO_COMM.get(c.kind, "ALL_REDUCE"))
        size = max(MIN_COMM_BYTES, int(c.comm_bytes))
        member_pg: dict[int, str] = {}
        for g in c.groups:
            pg = "" if len(g) == n and sorted(g) == list(range(n)) else \
                str(group_ids.setdefault(tuple(g), len(group_ids) + 1))
            for rank in g:
                if rank < n:
                    member_pg[rank] = pg
        if c.groups and len(member_pg) < n:
            diverge()                                     # some ranks sit this collective out
        for rep in range(inst.times):
            nid = next_id
            next_id += 1
            name = f"{c.kind}_{r.id}{suffix}" + (f"_{rep}" if inst.times > 1 else "")
            if uniform:
                deps = dep_nodes(0, inst) if rep == 0 else done[0][(r.id, inst.key)]
                by_pg: dict[str, EtNode] = {}
                for pg in dict.fromkeys(member_pg.values()) if member_pg else [""]:
                    attrs = {"comm_type": comm_type, "comm_size": size, **({"pg_name": pg} if pg else {})}
                    by_pg[pg] = EtNode(nid, name, chakra.COMM_COLL_NODE, deps, [], 0, attrs)
                template.append(by_pg[member_pg.get(0, "")])
                if len(by_pg) > 1:
                    variants.append((len(template) - 1, [by_pg[member_pg[rank]] for rank in range(n)]))
                finish(0, inst, [nid])
                continue
            for rank in range(n):
                deps = dep_nodes(rank, inst) if rep == 0 else done[rank][(r.id, inst.key)]
                if c.groups and rank not in member_pg:
                    finish(rank, inst, deps)
                    continue
                attrs = {"comm_type": comm_type, "comm_size": size}
                if member_pg.get(rank):
                    attrs["pg_name"] = member_pg[rank]
                traces[rank].append(EtNode(nid, name, chakra.COMM_COLL_NODE, deps, [], 0, attrs))
                finish(rank, inst, [nid])
    encoded = carried_us * 1e-6
    idle = EtNode(next_id, "idle", chakra.COMP_NODE, [], [], 0, {"num_ops": 1, "tensor_size": 1})
    groups = {gid: list(key) for key, gid in group_ids.items()}
    if uniform:
        if not template:       # ASTRA-sim aborts on a rank without nodes
            template.append(idle)
        return TraceSet(shared_traces(), groups, exact_total, encoded, region_of_node)
    _order_communication(traces, len(template))
    for rank in range(n):
        if not traces[rank]:
            traces[rank].append(idle)
    return TraceSet(traces, groups, exact_total, encoded, region_of_node)


def _is_ring(pairs, n: int) -> bool:
    """Whether a collective permute's ``pairs`` make every one of ``n`` ranks send once and receive once."""
    if len(pairs) != n:
        return False
    sources = {src for src, _ in pairs}
    targets = {dst for _, dst in pairs}
    return len(sources) == len(targets) == n and all(0 <= r < n for r in sources | targets) and \
        all(src != dst for src, dst in pairs)


def _order_communication(traces: list[list[EtNode]], start: int = 0) -> None:
    """Issue each device's collectives and sends in program order (a ctrl_dep on the previous one).

    ASTRA-sim matches collectives across ranks by the order in which each rank issues them, and issues
    whichever is ready first: when ranks' dependencies differ (send/recv, groups), two collectives can
    become ready in different orders on different ranks and the run hangs. Devices run their collectives
    in one fixed order (XLA schedules them on a stream), so chaining them costs nothing real. ``start``:
    the nodes before it are in order already."""
    for nodes in traces:
        prev: int | None = next((nodes[i].id for i in range(start - 1, -1, -1)
                                 if nodes[i].type in (chakra.COMM_COLL_NODE, chakra.COMM_SEND_NODE)), None)
        for node in nodes[start:]:
            if node.type in (chakra.COMM_COLL_NODE, chakra.COMM_SEND_NODE):
                if prev is not None and prev not in node.data_deps:
                    node.ctrl_deps = [prev]
                prev = node.id


def _permute_nodes(traces, inst, c, next_id: int, tag: int, deps_of, finish) -> int:
    """SEND/RECV nodes of one collective_permute execution; returns the next free node id."""
    n = len(traces)
    r = inst.region
    size = max(1, int(c.comm_bytes))
    pairs = [(src, dst) for src, dst in c.pairs if src != dst and src < n and dst < n]
    ids = {pair: next_id + 2 * i for i, pair in enumerate(pairs)}
    ends: dict[int, list[tuple[int, int, int]]] = {}      # rank -> its (src, dst, send id) in pair order
    for (src, dst), sid in ids.items():
        ends.setdefault(src, []).append((src, dst, sid))
        if dst != src:
            ends.setdefault(dst, []).append((src, dst, sid))
    for rank in range(n):
        deps = deps_of(rank)
        mine: list[int] = []
        for src, dst, sid in ends.get(rank, ()):
            attrs = {"comm_src": src, "comm_dst": dst, "comm_size": size, "comm_tag": tag}
            if src == rank:
                traces[rank].append(EtNode(sid, f"send_{r.id}", chakra.COMM_SEND_NODE, deps, [], 0, attrs))
                mine.append(sid)
            if dst == rank:
                traces[rank].append(EtNode(sid + 1, f"recv_{r.id}", chakra.COMM_RECV_NODE, deps, [], 0, dict(attrs)))
                mine.append(sid + 1)
        finish(rank, inst, mine or deps)
    return next_id + 2 * len(pairs)
