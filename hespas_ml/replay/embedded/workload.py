"""One rank's workload layer (ASTRA-sim's Workload): dependency resolution, issue order, resource
slots, the node kinds' costs and the end-of-run statistics."""
from __future__ import annotations

import heapq
from typing import Sequence

from hespas_ml.replay import chakra as et
from hespas_ml.replay.embedded.config import ReplayConfig
from hespas_ml.replay.embedded.nodes import (CAT_COMM, CAT_GPU, COMM_SLOT, CPU_SLOT, GPU_SLOT, RECV_SLOT,
                                             ReplayNode)
from hespas_ml.replay.embedded.results import RankResult
from hespas_ml.replay.embedded.system_layer import SystemLayer
from hespas_ml.replay.errors import ReplayError


class Workload:
    """One rank's ASTRA-sim workload layer.

    A node is ready when all its data and ctrl parents finished.  Ready nodes are issued in ascending
    id, at most one each on the GPU, CPU and COMM slots (instant nodes do not hold theirs), RECVs
    without limit.  Compute takes its duration (or its roofline time), collectives go to the system
    layer, SEND/RECV to the network, MEM nodes take the remote-memory latency + bytes / bandwidth.
    """

    def __init__(self, rank: int, nodes: list[et.EtNode], sys: SystemLayer, cfg: ReplayConfig,
                 groups: dict[int, list[int]]):
        self.rank = rank
        self.sys = sys
        self.cfg = cfg
        self.engine = sys.engine
        self.nodes: dict[int, ReplayNode] = {}
        for node in nodes:
            if node.id in self.nodes:
                raise ReplayError(f"rank {rank}: node id {node.id} appears twice (ASTRA-sim keeps only the last)")
            self.nodes[node.id] = ReplayNode(node, rank, cfg, groups)
        if not self.nodes:
            raise ReplayError(f"rank {rank}: the trace has no node (ASTRA-sim aborts)")
        for node in nodes:
            parents = set(node.data_deps) | set(node.ctrl_deps)
            for parent in parents:
                if parent not in self.nodes:
                    raise ReplayError(f"rank {rank} node {node.id} ({node.name!r}): depends on node {parent}, "
                                      "which is not in the trace")
                self.nodes[parent].children.append(node.id)
            self.nodes[node.id].n_parents = len(parents)
        self.free: list[list[int]] = [[], [], [], []]  # ready node ids per slot: heaps (RECV: a list)
        for node in self.nodes.values():
            if node.n_parents == 0:
                self._make_free(node)
        self.busy = [False, False, False]  # GPU, CPU, COMM slot taken
        self.in_flight: set[int] = set()
        self.gpu_ticks = 0  # GPU compute time issued
        self.start: dict[int, int] = {}  # node id -> issue tick
        self.end: dict[int, int] = {}  # node id -> finish tick
        self.finished_at: int | None = None
        self.exposed = 0

    def _make_free(self, node: ReplayNode) -> None:
        if node.slot == RECV_SLOT:
            self.free[RECV_SLOT].append(node.id)
        else:
            heapq.heappush(self.free[node.slot], node.id)

    # --- issuing -----------------------------------------------------------------------------------
    def fire(self) -> None:
        """Start the rank: issue what is ready at time 0."""
        self._issue_ready()
        self._check_finished()

    def _issue_ready(self) -> None:
        chosen: list[int] = []
        nodes = self.nodes
        for slot in (GPU_SLOT, CPU_SLOT, COMM_SLOT):
            if self.busy[slot]:
                continue
            heap = self.free[slot]
            while heap:
                nid = heapq.heappop(heap)
                chosen.append(nid)
                if not nodes[nid].instant:
                    break
        if self.free[RECV_SLOT]:
            chosen.extend(self.free[RECV_SLOT])
            self.free[RECV_SLOT] = []
        if len(chosen) > 1:
            chosen.sort()
        for nid in chosen:
            self._issue(nodes[nid])

    def _issue(self, node: ReplayNode) -> None:
        now = self.engine.now
        self.start[node.id] = now
        self.in_flight.add(node.id)
        if node.slot != RECV_SLOT:
            self.busy[node.slot] = True
        cfg = self.cfg
        t = node.type
        if cfg.replay_only or (t == et.COMP_NODE and (not cfg.roofline or node.slot == CPU_SLOT)):
            if node.slot != CPU_SLOT:
                self.gpu_ticks += node.runtime
            self.sys.register(node.runtime, self._done, node)
        elif t == et.COMP_NODE:
            if node.instant:
                self._skip(node)
                return
            intensity = node.num_ops / node.tensor_size
            perf = min(cfg.local_mem_bw * intensity, cfg.peak_perf)
            runtime = int(float(node.num_ops) / perf * 1e9)
            self.gpu_ticks += runtime
            self.sys.register(runtime, self._done, node)
        elif t == et.COMM_COLL_NODE:
            if node.comm_type == et.BROADCAST:  # replayed by its duration
                self.sys.register(node.runtime, self._done, node)
            else:
                self.sys.generate(node.comm_type, node.size, node.involved, node.group, node.priority,
                                  lambda n=node: self._done(n))
        elif t == et.COMM_SEND_NODE:
            self.engine.send(self.rank, node.peer, node.size, node.tag, (self._done, node))
        elif t == et.COMM_RECV_NODE:
            self.engine.recv(self.rank, node.peer, node.size, node.tag, (self._done, node))
        elif t in (et.MEM_LOAD_NODE, et.MEM_STORE_NODE):
            bw = cfg.remote_bw
            runtime = int(cfg.remote_latency + (node.size / bw if bw > 0 else 0))
            self.sys.register(runtime, self._done, node)
        else:  # INVALID_NODE
            self._skip(node)

    def _skip(self, node: ReplayNode) -> None:
        """An instantly finished node; its children wait for the next completion (as in ASTRA-sim)."""
        self._finish_node(node)
        if node.slot != RECV_SLOT:
            self.busy[node.slot] = False

    def _finish_node(self, node: ReplayNode) -> None:
        self.end[node.id] = self.engine.now
        self.in_flight.discard(node.id)
        nodes = self.nodes
        for child_id in node.children:
            child = nodes[child_id]
            child.n_parents -= 1
            if child.n_parents == 0:
                self._make_free(child)

    def _done(self, node: ReplayNode) -> None:
        if self.finished_at is not None:
            return
        if node.slot != RECV_SLOT:
            self.busy[node.slot] = False
        self._finish_node(node)
        self._issue_ready()
        self._check_finished()

    def _check_finished(self) -> None:
        if self.in_flight or any(self.free) or any(self.busy):
            return
        self.finished_at = self.engine.now
        self.exposed = self.finished_at - self.gpu_ticks

    # --- results -----------------------------------------------------------------------------------
    def result(self) -> RankResult:
        """The rank's finish tick and busy-time statistics."""
        wall = max(self.end.values(), default=0)
        totals: dict[int, int] = {}
        per_category: dict[int, list[tuple[int, int]]] = {}
        for nid, start in self.start.items():
            per_category.setdefault(self.nodes[nid].category, []).append((start, self.end[nid]))
        for category, intervals in per_category.items():
            totals[category] = union_length(intervals)
        gpu, comm = totals.get(CAT_GPU), totals.get(CAT_COMM)
        overlap = gpu + comm - wall if gpu is not None and comm is not None else 0
        return RankResult(self.rank, self.finished_at or 0, self.exposed, gpu or 0, comm or 0, overlap)

    def node_ticks(self) -> dict[int, tuple[int, int]]:
        """(issue tick, finish tick) of every issued node, by node id."""
        return {nid: (start, self.end[nid]) for nid, start in self.start.items()}

    def stuck(self) -> str:
        """A description of the nodes that keep this rank from finishing."""
        def label(nid: int) -> str:
            node = self.nodes[nid]
            return f"{nid} ({node.name!r}, {et.NODE_TYPE_NAMES.get(node.type, node.type)})"
        parts = []
        if self.in_flight:
            parts.append("in flight: " + ", ".join(label(n) for n in sorted(self.in_flight)[:5]))
        ready = sorted(n for heap in self.free for n in heap)
        if ready:
            parts.append("ready but never issued: " + ", ".join(label(n) for n in ready[:5]))
        waiting = [nid for nid, node in self.nodes.items() if node.n_parents > 0]
        if waiting:
            parts.append(f"{len(waiting)} node(s) waiting on parents, first {label(min(waiting))}")
        return "; ".join(parts) or "nothing in flight"


def union_length(intervals: list[tuple[int, int]]) -> int:
    """Total length covered by a non-empty list of [start, end] intervals (sorts it in place)."""
    intervals.sort()
    total = 0
    start, end = intervals[0]
    for s, e in intervals[1:]:
        if s <= end:
            if e > end:
                end = e
        else:
            total += end - start
            start, end = s, e
    return total + end - start


def raise_if_stuck(workloads: Sequence[Workload]) -> None:
    """ReplayError naming the ranks that never finished (ASTRA-sim would hang silently)."""
    stuck = [w for w in workloads if w.finished_at is None]
    if not stuck:
        return
    shown = "; ".join(f"rank {w.rank}: {w.stuck()}" for w in stuck[:4])
    more = f" (and {len(stuck) - 4} more ranks)" if len(stuck) > 4 else ""
    raise ReplayError(f"replay deadlock: {len(stuck)} of {len(workloads)} ranks never finish "
                      f"(mismatched collectives, a recv without a matching send, or a stalled DAG) - "
                      f"{shown}{more}")
