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
* A collective inside a loop body runs once per trip: its node is repeated, chained, ``count`` times.
* Compute regions with nothing to do (only free ops: reshapes, constants) get no node.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..split.regions import COLLECTIVE_TO_COMM, RegionGraph
from . import chakra
from .chakra import EtNode

MIN_COMM_BYTES = 64   # ASTRA-sim loops forever on an ALL_GATHER smaller than its chunk count


@dataclass(slots=True)
class TraceSet:
    traces: list[list[EtNode]]                  # one node list per device (rank)
    comm_groups: dict[int, list[int]] = field(default_factory=dict)
    compute_time_s: float = 0.0                 # exact per-device compute time before rounding
    encoded_compute_s: float = 0.0              # the same after rounding to whole microseconds
    region_of_node: dict[int, int] = field(default_factory=dict)   # COMP node id -> region id

    @property
    def n_ranks(self) -> int:
        return len(self.traces)

    def node_counts(self, rank: int = 0) -> tuple[int, int]:
        """(compute nodes, communication nodes) of one device."""
        comp = sum(1 for n in self.traces[rank] if n.type == chakra.COMP_NODE)
        return comp, len(self.traces[rank]) - comp


def build_traces(rg: RegionGraph, region_seconds: Sequence[float], n_ranks: int | None = None) -> TraceSet:
    """Build the per-device traces. ``region_seconds[r.id]`` is one execution of region ``r``."""
    n = n_ranks or rg.n_devices
    regions = rg.regions
    group_ids: dict[tuple[int, ...], int] = {}
    traces: list[list[EtNode]] = [[] for _ in range(n)]
    # per rank: region id -> node ids that stand for the region's completion on that rank
    done: list[dict[int, list[int]]] = [dict() for _ in range(n)]
    next_id = 0
    exact_total = 0.0
    carried_exact = 0.0
    carried_us = 0
    region_of_node: dict[int, int] = {}
    permute_tag = 0
    for r in regions:
        if r.kind == "compute":
            seconds = float(region_seconds[r.id]) * r.count
            flops = r.flops * r.count
            nbytes = r.bytes * r.count
            if seconds <= 0.0 and flops == 0 and nbytes == 0:
                for rank in range(n):
                    done[rank][r.id] = _deps(done[rank], r.deps)
                continue
            exact_total += seconds
            carried_exact += seconds * 1e6
            micros = int(round(carried_exact)) - carried_us
            carried_us += micros
            nid = next_id
            next_id += 1
            region_of_node[nid] = r.id
            attrs = {"num_ops": max(1, int(flops)), "tensor_size": max(1, int(nbytes))}
            name = f"comp_{r.id}"
            for rank in range(n):
                deps = _deps(done[rank], r.deps)
                traces[rank].append(EtNode(nid, name, chakra.COMP_NODE, deps, [], micros, dict(attrs)))
                done[rank][r.id] = [nid]
            continue
        c = r.collective
        if c.kind == "collective_permute":
            permute_tag += 1
            for _ in range(max(1, r.count)):
                ids = _permute_nodes(traces, done, r, c, next_id, permute_tag)
                next_id = ids
            continue
        comm_type = getattr(chakra, COLLECTIVE_TO_COMM.get(c.kind, "ALL_REDUCE"))
        size = max(MIN_COMM_BYTES, int(c.comm_bytes))
        member_pg: dict[int, str] = {}
        if c.groups:
            for g in c.groups:
                key = tuple(g)
                if len(g) == n and sorted(g) == list(range(n)):
                    pg = ""
                else:
                    pg = str(group_ids.setdefault(key, len(group_ids) + 1))
                for rank in g:
                    if rank < n:
                        member_pg[rank] = pg
        for rep in range(max(1, r.count)):
            nid = next_id
            next_id += 1
            name = f"{c.kind}_{r.id}" + (f"_{rep}" if r.count > 1 else "")
            for rank in range(n):
                deps = _deps(done[rank], r.deps) if rep == 0 else done[rank][r.id]
                if c.groups and rank not in member_pg:
                    done[rank][r.id] = deps
                    continue
                attrs = {"comm_type": comm_type, "comm_size": size}
                pg = member_pg.get(rank, "")
                if pg:
                    attrs["pg_name"] = pg
                traces[rank].append(EtNode(nid, name, chakra.COMM_COLL_NODE, deps, [], 0, attrs))
                done[rank][r.id] = [nid]
    encoded = carried_us * 1e-6
    for rank in range(n):
        if not traces[rank]:   # ASTRA-sim aborts on a rank without nodes
            traces[rank].append(EtNode(next_id, "idle", chakra.COMP_NODE, [], [], 0, {"num_ops": 1, "tensor_size": 1}))
    groups = {gid: list(key) for key, gid in group_ids.items()}
    return TraceSet(traces, groups, exact_total, encoded, region_of_node)


def _deps(done: dict[int, list[int]], region_deps: list[int]) -> list[int]:
    out: list[int] = []
    for d in region_deps:
        out.extend(done.get(d, ()))
    return sorted(set(out)) if len(out) > 1 else out


def _permute_nodes(traces, done, r, c, next_id: int, tag: int) -> int:
    """SEND/RECV nodes of one collective_permute execution; returns the next free node id."""
    n = len(traces)
    size = max(1, int(c.comm_bytes))
    send_ids: dict[tuple[int, int], int] = {}
    recv_ids: dict[tuple[int, int], int] = {}
    for src, dst in c.pairs:
        if src == dst or src >= n or dst >= n:
            continue
        send_ids[(src, dst)] = next_id
        recv_ids[(src, dst)] = next_id + 1
        next_id += 2
    for rank in range(n):
        base = done[rank].get(r.id)
        deps = base if base is not None else _deps(done[rank], r.deps)
        mine: list[int] = []
        for (src, dst), sid in send_ids.items():
            attrs = {"comm_src": src, "comm_dst": dst, "comm_size": size, "comm_tag": tag}
            if src == rank:
                traces[rank].append(EtNode(sid, f"send_{r.id}", chakra.COMM_SEND_NODE, deps, [], 0, attrs))
                mine.append(sid)
            if dst == rank:
                rid = recv_ids[(src, dst)]
                traces[rank].append(EtNode(rid, f"recv_{r.id}", chakra.COMM_RECV_NODE, deps, [], 0, dict(attrs)))
                mine.append(rid)
        done[rank][r.id] = mine or deps
    return next_id
