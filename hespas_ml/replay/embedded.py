"""Embedded replay of Chakra traces following ASTRA-sim's congestion-unaware analytical model.

This is a discrete-event re-implementation (our own code) of the behaviour of ASTRA-sim 518bd51's
workload and system layers on its congestion-unaware analytical network (facts in
shared/reference/astra-sim.md and shared/astra-vectors/README.md):

* Network: a message of `b` bytes between two ranks takes `floor(hops*latency + b/B)` ns, charged on
  the first dimension (dim 0 varies fastest) where the two rank coordinates differ; hops are the
  shorter way round on a Ring, 1 on FullyConnected, 2 on Switch; B = GB/s * 2^30 / 1e9 bytes per ns.
  Sends and receives are matched on (tag, src, dst, size, sequence number).
* Workload layer (per rank): a node is ready when all its data and ctrl parents finished; ready nodes
  are issued in ascending id, at most one GPU COMP, one CPU op and one "comm" op (COLL, SEND, MEM,
  INVALID) in flight, RECV unlimited; a 0 us node takes 1 ns; BROADCAST is replayed by duration;
  replay-only and roofline modes as in ASTRA-sim.
* System layer (per rank): a collective is cut into chunks (preferred-dataset-splits, with ASTRA-sim's
  clamping and remainder rules), every chunk is a stream with one phase per involved dimension
  (localBWAware: RS ... AR ... AG; baseline: the collective on every dimension), each dimension has a
  queue running at most active-chunks-per-dimension streams; each phase runs the configured algorithm
  (ring, direct[N], halvingDoubling, doubleBinaryTree, and their one* forms) message by message,
  with endpoint-delay (10 ns on a sub-group's local ring) and the local-memory reduction delay
  `3*floor(bytes/local_mem_bw)`.  Collectives are not barriers: each rank progresses on arrivals.

Two engines share this code:
* the full engine simulates every rank and every message (exact, used for any input);
* the symmetric engine is used when all ranks run the same traces of COMP and collective nodes (names
  and pg_name aside; sub-group collectives in equally sized groups used consistently by their
  members): it simulates rank 0 only and takes each collective phase's duration from a one-phase run
  of the full engine over the ranks of that phase (memoised, checked on every peer group).  It falls
  back to the full engine when a phase is not rank-symmetric (doubleBinaryTree, ...).
  `replay_embedded(engine="auto")` uses the full engine for small workloads and the symmetric one for
  large ones.  Both reproduce every recorded ASTRA-sim vector exactly.

Deadlocks (mismatched collectives, a recv without a send, unresolvable dependencies) raise
`ReplayError` naming the stuck ranks and nodes, where ASTRA-sim hangs silently.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from hespas_ml.replay import chakra as et
from hespas_ml.replay.errors import ReplayError
from hespas_ml.replay.system import SystemConfig, parse_implementation, validate_dims, validate_system

NS_PER_S = 1e9
COLLECTIVE_TAG_BASE = 500_000_000  # ASTRA-sim's tag window for collective messages
GROUP_STREAM_BASE = 1_000_000  # stream ids of communicator group g start at g * 1e6

_AR, _AG, _RS, _A2A = et.ALL_REDUCE, et.ALL_GATHER, et.REDUCE_SCATTER, et.ALL_TO_ALL
_COLL_KEY = {_AR: "all-reduce", _AG: "all-gather", _RS: "reduce-scatter", _A2A: "all-to-all"}
_CW, _ACW = 0, 1  # ring directions: clockwise, anticlockwise


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------
@dataclass
class RankResult:
    """One rank's replay outcome in ns (ASTRA-sim's `sys[i] finished` line and statistics)."""

    rank: int
    finish_ns: int
    exposed_comm_ns: int  # finish - sum of GPU compute time of the rank
    gpu_ns: int  # union of GPU COMP busy intervals
    comm_ns: int  # union of communication node busy intervals
    overlap_ns: int  # gpu + comm - wall (0 when the rank lacks one of the two)


@dataclass
class ReplayResult:
    """Per-rank results of one replay and the backend that produced them."""

    ranks: list[RankResult]
    backend: str
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def step_time_s(self) -> float:
        """Simulated step time: the latest rank finish, in seconds."""
        return max(r.finish_ns for r in self.ranks) / NS_PER_S

    @property
    def exposed_comm_s(self) -> float:
        """Exposed communication of the rank that finishes last, in seconds."""
        last = max(self.ranks, key=lambda r: (r.finish_ns, -r.rank))
        return last.exposed_comm_ns / NS_PER_S

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        return {"step_time_s": self.step_time_s, "exposed_comm_s": self.exposed_comm_s,
                "backend": self.backend, "ranks": [asdict(r) for r in self.ranks]}


# --------------------------------------------------------------------------------------------------
# Configuration shared by all ranks
# --------------------------------------------------------------------------------------------------
class _Config:
    """System parameters as ASTRA-sim reads them (types and unit conversions included)."""

    def __init__(self, system: SystemConfig):
        s = system.system
        self.source = system.source
        self.npus = [d.npus for d in system.dims]
        self.total = math.prod(self.npus)
        self.n_dims = len(self.npus)
        self.endpoint_delay = int(s.get("endpoint-delay", 10))
        if self.endpoint_delay < 1:
            raise ReplayError(f"{system.source}: endpoint-delay must be >= 1 ns (0 aborts ASTRA-sim)")
        self.splits = int(s.get("preferred-dataset-splits", 0))
        self.active_chunks = int(s.get("active-chunks-per-dimension", 1))
        self.policy = s.get("scheduling-policy", "LIFO")
        self.local_bw_aware = s.get("collective-optimization", "baseline") == "localBWAware"
        self.local_mem_bw = float(s.get("local-mem-bw", 0)) * 1000000000  # bytes per second
        self.peak_perf = float(s.get("peak-perf", 0)) * 1000000000000
        self.roofline = bool(s.get("roofline-enabled", 0))
        self.replay_only = bool(s.get("replay-only", 0))
        if s.get("model-shared-bus", 0) == 1:
            raise ReplayError(f"{system.source}: model-shared-bus (LogGP memory bus) is not supported")
        if s.get("track-local-mem", 0):
            raise ReplayError(f"{system.source}: track-local-mem is not supported by the embedded replay")
        self.no_remote_memory = system.remote_memory.get("memory-type") == "NO_MEMORY_EXPANSION"
        self.remote_latency = float(system.remote_memory.get("remote-mem-latency", 0))
        self.remote_bw = float(system.remote_memory.get("remote-mem-bw", 0))
        self.impls: dict[int, list[tuple[str, int]] | None] = {}
        for comm_type, key in _COLL_KEY.items():
            names = system.implementation(key)
            self.impls[comm_type] = None if names is None else [parse_implementation(n) for n in names]
        self._reduction_cache: dict[int, int] = {}

    def reduction_delay(self, size: int) -> int:
        """ASTRA-sim's local reduction time: write + 2 reads, each truncated to whole ns."""
        cached = self._reduction_cache.get(size)
        if cached is None:
            # A missing local-mem-bw makes ASTRA-sim divide by 0; the x86 build then yields 0 ns.
            one = int(float(size) / self.local_mem_bw * 1e9) if self.local_mem_bw > 0 else 0
            cached = self._reduction_cache[size] = 3 * one
        return cached


class _Network:
    """Congestion-unaware delays: hops x latency + bytes / bandwidth on the first differing dim."""

    def __init__(self, system: SystemConfig):
        self.sizes = [d.npus for d in system.dims]
        self.kinds = [d.topology for d in system.dims]
        self.latency = [float(d.latency_ns) for d in system.dims]
        self.bytes_per_ns = [float(d.bandwidth_gbps) * (1 << 30) / 1_000_000_000 for d in system.dims]
        self.strides = [math.prod(self.sizes[:d]) for d in range(len(self.sizes))]
        self._cache: dict[tuple[int, int, int], int] = {}

    def delay(self, src: int, dst: int, size: int) -> int:
        key = (src, dst, size)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        for dim, (n, stride) in enumerate(zip(self.sizes, self.strides)):
            a, b = (src // stride) % n, (dst // stride) % n
            if a != b:
                kind = self.kinds[dim]
                if kind == "Ring":
                    k = (b - a) % n
                    hops = min(k, n - k)
                elif kind == "Switch":
                    hops = 2
                else:
                    hops = 1
                value = int(hops * self.latency[dim] + float(size) / self.bytes_per_ns[dim])
                if len(self._cache) < 1_000_000:
                    self._cache[key] = value
                return value
        raise ReplayError(f"rank {src} sends to itself")


# --------------------------------------------------------------------------------------------------
# Event engine and message matching
# --------------------------------------------------------------------------------------------------
def _noop(_arg: Any) -> None:
    return None


_NOOP = (_noop, None)


class _Engine:
    """Global event queue (time, insertion order) plus the network's send/recv matching."""

    def __init__(self, network: _Network):
        self.now = 0
        self.heap: list[tuple[int, int, Callable[[Any], None], Any]] = []
        self.seq = 0
        self.network = network
        self.chunk_ids: dict[tuple[int, int, int, int], list[int]] = {}
        self.pending: dict[tuple[int, int, int, int, int], list[Any]] = {}

    def at(self, delay: int, fn: Callable[[Any], None], arg: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (self.now + delay, self.seq, fn, arg))

    def run(self) -> None:
        heap = self.heap
        pop = heapq.heappop
        while heap:
            time, _seq, fn, arg = pop(heap)
            self.now = time
            fn(arg)

    def send(self, src: int, dst: int, size: int, tag: int, handler: tuple) -> None:
        """Inject a message; `handler` runs on the sender when it arrives."""
        base = (tag, src, dst, size)
        ids = self.chunk_ids.get(base)
        if ids is None:
            ids = self.chunk_ids[base] = [-1, -1]
        ids[0] += 1
        key = base + (ids[0],)
        entry = self.pending.get(key)
        if entry is None:
            self.pending[key] = [handler, None, False]
        else:
            entry[0] = handler
        self.at(self.network.delay(src, dst, size), self._arrive, key)

    def _arrive(self, key: tuple) -> None:
        entry = self.pending[key]
        send_fn, send_arg = entry[0]
        if entry[1] is not None:
            del self.pending[key]
            send_fn(send_arg)
            recv_fn, recv_arg = entry[1]
            recv_fn(recv_arg)
        else:
            send_fn(send_arg)
            entry[2] = True

    def recv(self, dst: int, src: int, size: int, tag: int, handler: tuple) -> None:
        """Post a receive; `handler` runs on the receiver when the matching message has arrived."""
        base = (tag, src, dst, size)
        ids = self.chunk_ids.get(base)
        if ids is None:
            ids = self.chunk_ids[base] = [-1, -1]
        ids[1] += 1
        key = base + (ids[1],)
        entry = self.pending.get(key)
        if entry is None:
            self.pending[key] = [None, handler, False]
        elif entry[2]:
            del self.pending[key]
            self.at(0, handler[0], handler[1])
        else:
            entry[1] = handler


# --------------------------------------------------------------------------------------------------
# Logical topologies (per rank)
# --------------------------------------------------------------------------------------------------
class _RingTopo:
    """A logical ring over global rank ids; `local` marks a communicator-group ring."""

    __slots__ = ("members", "index", "local", "n", "_pos")

    def __init__(self, members: Sequence[int], index: int, local: bool):
        self.members = tuple(members)
        self.index = index
        self.local = local
        self.n = len(self.members)
        self._pos = {m: i for i, m in enumerate(self.members)}

    def receiver(self, node: int, direction: int) -> int:
        i = self._pos[node]
        return self.members[(i + 1) % self.n if direction == _CW else (i - 1) % self.n]

    def sender(self, node: int, direction: int) -> int:
        i = self._pos[node]
        return self.members[(i - 1) % self.n if direction == _CW else (i + 1) % self.n]

    def key(self) -> tuple:
        return ("ring", self.members, self.local)


_LEAF, _ROOT, _INTERMEDIATE = 0, 1, 2


class _Tree:
    """A binary tree over ranks start, start+stride, ... numbered in order (ASTRA-sim's BinaryTree)."""

    def __init__(self, n: int, start: int, stride: int, root_min: bool):
        depth, tmp = 1, n
        while tmp > 1:
            depth += 1
            tmp //= 2
        # node: [id, parent, left, right]
        root: list[Any] = [-1, None, None, None]

        def grow(levels: int, parent: list[Any]) -> list[Any]:
            node: list[Any] = [-1, parent, None, None]
            if levels > 1:
                node[2] = grow(levels - 1, node)
                node[3] = grow(levels - 1, node)
            return node

        if root_min:
            root[3] = grow(depth - 1, root)
        else:
            root[2] = grow(depth - 1, root)
        self.nodes: dict[int, list[Any]] = {}
        counter = [start]

        def number(node: list[Any]) -> None:
            if node[2] is not None:
                number(node[2])
            node[0] = counter[0]
            self.nodes[counter[0]] = node
            counter[0] += stride
            if node[3] is not None:
                number(node[3])

        number(root)
        if len(self.nodes) != n:
            raise ReplayError(f"doubleBinaryTree needs a power-of-two group size, got {n} "
                              "(ASTRA-sim crashes on it)")

    def role(self, rank: int) -> tuple[int, int, int, int]:
        """(type, parent, left child, right child) of `rank`; -1 for a missing relative."""
        node = self.nodes[rank]
        parent = node[1][0] if node[1] is not None else -1
        left = node[2][0] if node[2] is not None else -1
        right = node[3][0] if node[3] is not None else -1
        if node[1] is None:
            kind = _ROOT
        elif node[2] is None and node[3] is None:
            kind = _LEAF
        else:
            kind = _INTERMEDIATE
        return kind, parent, left, right


class _DbtTopo:
    """Two alternating binary trees (root max, root min) over one dimension."""

    __slots__ = ("n", "trees", "counter", "start", "stride")

    def __init__(self, n: int, start: int, stride: int):
        self.n = n
        self.start, self.stride = start, stride
        self.trees = (_Tree(n, start, stride, False), _Tree(n, start, stride, True))
        self.counter = 0

    def next_tree(self) -> _Tree:
        tree = self.trees[self.counter % 2]
        self.counter += 1
        return tree


def _global_topology(cfg: _Config, rank: int, impls: list[tuple[str, int]]) -> list[Any]:
    """Per-dimension logical topologies of `rank` for one collective type (GeneralComplexTopology)."""
    dims: list[Any] = []
    offset = 1
    last = len(impls) - 1
    for d, (kind, _window) in enumerate(impls):
        n = cfg.npus[d]
        if kind in ("ring", "direct", "halvingDoubling"):
            index = (rank % (offset * n)) // offset
            base = rank - index * offset
            dims.append(_RingTopo([base + i * offset for i in range(n)], index, False))
        elif kind in ("oneRing", "oneDirect", "oneHalvingDoubling"):
            dims.append(_RingTopo(range(cfg.total), rank % cfg.total, False))
            return dims
        else:  # doubleBinaryTree
            start = rank % offset if d == last else (rank - rank % (offset * n)) + rank % offset
            dims.append(_DbtTopo(n, start, offset))
        offset *= n
    return dims


# --------------------------------------------------------------------------------------------------
# Streams, datasets and collective algorithms
# --------------------------------------------------------------------------------------------------
class _DataSet:
    """A collective in flight: finished when all its chunk streams finished."""

    __slots__ = ("total", "done", "on_done")

    def __init__(self, on_done: Callable[[], None]):
        self.total = 0
        self.done = 0
        self.on_done = on_done

    def stream_finished(self) -> None:
        self.done += 1
        if self.done == self.total:
            self.on_done()


class _Phase:
    __slots__ = ("queue", "algo", "comm_type", "final_size")

    def __init__(self, queue: int, algo: Any):
        self.queue = queue
        self.algo = algo
        self.comm_type = algo.comm_type
        self.final_size = algo.final_size


class _Stream:
    """One chunk of a collective moving through its phases."""

    __slots__ = ("sid", "phases", "current", "queue", "initialized", "priority", "dataset")

    def __init__(self, sid: int, phases: list[_Phase], priority: int, dataset: _DataSet):
        self.sid = sid
        self.phases = deque(phases)
        self.current: _Phase | None = None
        self.queue = -1
        self.initialized = False
        self.priority = priority
        self.dataset = dataset
        for phase in phases:
            phase.algo.stream = self


class _RingAlgo:
    """ASTRA-sim's ring algorithm for one phase of one chunk on one rank."""

    comm_type: int
    final_size: int

    def __init__(self, sys: "_Sys", comm_type: int, topo: _RingTopo, size: int, direction: int):
        n = topo.n
        self.sys = sys
        self.stream: _Stream | None = None
        self.comm_type = comm_type
        self.topo = topo
        self.size = size
        self.direction = direction
        self.n = n
        self.receiver = topo.receiver(sys.rank, direction)
        self.sender = topo.sender(sys.rank, direction)
        self.parallel = 1
        if comm_type == _AR:
            self.count = 2 * (n - 1)
            self.msg = size // n
            self.final_size = size
        elif comm_type == _A2A:
            self.count = (n - 1) * n // 2
            self.msg = size // n
            self.final_size = size
        elif comm_type == _AG:
            self.count = n - 1
            self.msg = size
            self.final_size = size * n
        else:
            self.count = n - 1
            self.msg = size // n
            self.final_size = size // n
        self.fast = topo.local
        self.zero = 0
        self.nonzero = 0
        self.toggle = False
        self.free = 0
        self.received = 0
        self.packets: deque[tuple[int, int]] = deque()

    def nonzero_packets(self) -> int:
        return (self.n - 1) * self.parallel

    def run_init(self) -> None:
        for _ in range(self.parallel):
            self.insert_packet()

    def run_received(self) -> None:
        self.received += 1
        self.insert_packet()

    def run_general(self) -> None:
        self.free += 1
        self.ready()
        self.iterate()

    def insert_packet(self) -> None:
        if self.zero == 0 and self.nonzero == 0:
            self.zero = self.parallel
            self.nonzero = self.nonzero_packets()
            self.toggle = not self.toggle
        if self.zero > 0:
            self.packets.append((self.sender, self.receiver))
            self.release(False)
            self.zero -= 1
        elif self.nonzero > 0:
            self.packets.append((self.sender, self.receiver))
            ct = self.comm_type
            self.release(ct == _RS or (ct == _AR and self.toggle))
            self.nonzero -= 1
        else:
            raise ReplayError(f"rank {self.sys.rank}: collective algorithm injected nothing (internal error)")

    def release(self, processed: bool) -> None:
        self.sys.bundle(self.stream, processed, self.msg, self.fast)

    def ready(self) -> bool:
        if not self.packets or self.count == 0 or self.free == 0:
            return False
        src, dst = self.packets.popleft()
        sys = self.sys
        sys.coll_send(dst, self.msg, self.stream)
        sys.coll_recv(src, self.msg, self.stream)
        self.count -= 1
        self.free -= 1
        return True

    def iterate(self) -> None:
        if self.count == 0 and self.free == self.parallel:
            self.sys.proceed(self.stream)


class _DirectAlgo(_RingAlgo):
    """ASTRA-sim's direct (all-to-all style) algorithm with a window of parallel messages."""

    def __init__(self, sys: "_Sys", comm_type: int, topo: _RingTopo, size: int, direction: int, window: int):
        super().__init__(sys, comm_type, topo, size, direction)
        self.middle = self.n - 1
        self.parallel = self.n - 1 if window == -1 else min(window, self.n - 1)
        if comm_type == _A2A:
            self.count = self.n - 1

    def nonzero_packets(self) -> int:
        return (self.n - 1) * self.parallel if self.topo.local else self.parallel

    def run_general(self) -> None:
        self.free += 1
        if self.comm_type == _AR and self.count <= self.middle:
            if self.received < self.middle:
                return
            for _ in range(self.parallel):
                self.ready()
            self.iterate()
        else:
            self.ready()
            self.iterate()

    def release(self, processed: bool) -> None:
        super().release(processed)
        rank, topo, direction = self.sys.rank, self.topo, self.direction
        self.receiver = topo.receiver(self.receiver, direction)
        if self.receiver == rank:
            self.receiver = topo.receiver(self.receiver, direction)
        self.sender = topo.sender(self.sender, direction)
        if self.sender == rank:
            self.sender = topo.sender(self.sender, direction)


class _HalvingDoublingAlgo:
    """ASTRA-sim's halving-doubling algorithm (recursive halving / doubling partners)."""

    def __init__(self, sys: "_Sys", comm_type: int, topo: _RingTopo, size: int):
        n = topo.n
        self.sys = sys
        self.stream: _Stream | None = None
        self.comm_type = comm_type
        self.topo = topo
        self.n = n
        self.parallel = 1
        log2n = math.log2(n)
        self.count = int(2 * log2n) if comm_type == _AR else int(log2n)
        if comm_type == _AR:
            self.final_size, self.msg, self.rank_offset, self.multiplier = size, size // 2, 1, 2.0
        elif comm_type == _AG:
            self.final_size, self.msg, self.rank_offset, self.multiplier = size * n, size, n // 2, 0.5
        elif comm_type == _RS:
            self.final_size, self.msg, self.rank_offset, self.multiplier = size // n, size // 2, 1, 2.0
        else:
            raise ReplayError("halvingDoubling does not implement ALL_TO_ALL (ASTRA-sim exits)")
        self.fast = topo.local
        self.zero = self.nonzero = 0
        self.toggle = False
        self.free = 0
        self.received = 0
        self.packets: deque[tuple[int, int, int]] = deque()
        self._aim()

    def _aim(self) -> None:
        offset = self.rank_offset
        direction = _CW if offset == 0 or (self.topo.index // offset) % 2 == 0 else _ACW
        partner = self.sys.rank
        for _ in range(offset):
            partner = self.topo.receiver(partner, direction)
        self.receiver = self.sender = partner

    def run_init(self) -> None:
        for _ in range(self.parallel):
            self.insert_packet()

    def run_received(self) -> None:
        self.received += 1
        self.insert_packet()

    def run_general(self) -> None:
        self.free += 1
        self.ready()
        self.iterate()

    def insert_packet(self) -> None:
        if self.zero == 0 and self.nonzero == 0:
            self.zero = self.parallel
            self.nonzero = int(math.log2(self.n) - 1 * self.parallel)
            self.toggle = not self.toggle
        if self.zero > 0:
            self.packets.append((self.sender, self.receiver, self.msg))
            self.release(False)
            self.zero -= 1
        elif self.nonzero > 0:
            self.packets.append((self.sender, self.receiver, self.msg))
            ct = self.comm_type
            self.release(ct == _RS or (ct == _AR and self.toggle))
            self.nonzero -= 1
        else:
            raise ReplayError(f"rank {self.sys.rank}: collective algorithm injected nothing (internal error)")

    def release(self, processed: bool) -> None:
        self.sys.bundle(self.stream, processed, self.msg, self.fast)
        self.rank_offset = int(self.rank_offset * self.multiplier)
        self.msg = int(float(self.msg) / self.multiplier)
        if self.rank_offset == self.n and self.comm_type == _AR:
            self.multiplier = 0.5
            self.rank_offset = int(self.rank_offset * self.multiplier)
            self.msg = int(float(self.msg) / self.multiplier)
        self._aim()

    def ready(self) -> bool:
        if not self.packets or self.count == 0 or self.free == 0:
            return False
        src, dst, msg = self.packets.popleft()
        self.sys.coll_send(dst, msg, self.stream)
        self.sys.coll_recv(src, msg, self.stream)
        self.count -= 1
        self.free -= 1
        return True

    def iterate(self) -> None:
        if self.count == 0 and self.free == self.parallel:
            self.sys.proceed(self.stream)


_BEGIN, _TO_PARENT, _WAIT_PARENT, _END, _WAIT_TWO, _WAIT_ONE, _TO_CHILDREN = range(7)
_EV_INIT, _EV_GENERAL, _EV_RECEIVED = range(3)


class _DoubleBinaryTreeAlgo:
    """ASTRA-sim's double-binary-tree all-reduce (run whatever the collective type)."""

    def __init__(self, sys: "_Sys", tree: _Tree, size: int):
        self.sys = sys
        self.stream: _Stream | None = None
        self.comm_type = _AR
        self.size = size
        self.final_size = size
        self.state = _BEGIN
        self.reductions = 0
        self.kind, self.parent, self.left, self.right = tree.role(sys.rank)

    def run_init(self) -> None:
        self.run(_EV_INIT)

    def run_general(self) -> None:
        self.run(_EV_GENERAL)

    def run_received(self) -> None:
        self.run(_EV_RECEIVED)

    def run(self, ev: int) -> None:
        sys, stream, size, st, kind = self.sys, self.stream, self.size, self.state, self.kind
        if st == _BEGIN and kind == _LEAF:
            sys.bundle(stream, False, size, False)
            self.state = _TO_PARENT
        elif st == _TO_PARENT and kind == _LEAF:
            sys.coll_send(self.parent, size, stream)
            sys.coll_recv(self.parent, size, stream)
            self.state = _WAIT_PARENT
        elif st == _WAIT_PARENT and kind == _LEAF:
            sys.bundle(stream, False, size, False)
            self.state = _END
        elif st == _END and kind == _LEAF:
            sys.proceed(stream)
        elif st == _BEGIN and kind == _INTERMEDIATE:
            self.state = _WAIT_TWO
            sys.coll_recv(self.left, size, stream)
            sys.coll_recv(self.right, size, stream)
        elif st == _WAIT_TWO and kind == _INTERMEDIATE and ev == _EV_RECEIVED:
            sys.bundle(stream, True, size, False)
            self.state = _WAIT_ONE
        elif st == _WAIT_ONE and kind == _INTERMEDIATE and ev == _EV_RECEIVED:
            sys.bundle(stream, True, size, False)
            self.state = _TO_PARENT
        elif self.reductions < 1 and kind == _INTERMEDIATE and ev == _EV_GENERAL:
            self.reductions += 1
        elif st == _TO_PARENT and kind == _INTERMEDIATE:
            self.state = _WAIT_PARENT
            sys.coll_send(self.parent, size, stream)
            sys.coll_recv(self.parent, size, stream)
        elif st == _WAIT_PARENT and kind == _INTERMEDIATE and ev == _EV_RECEIVED:
            sys.bundle(stream, True, size, False)
            self.state = _TO_CHILDREN
        elif st == _TO_CHILDREN and kind == _INTERMEDIATE:
            sys.coll_send(self.left, size, stream)
            sys.coll_send(self.right, size, stream)
            sys.proceed(stream)
        elif st == _BEGIN and kind == _ROOT:
            self.state = _WAIT_ONE
            sys.coll_recv(self.left if self.left >= 0 else self.right, size, stream)
        elif st == _WAIT_ONE and kind == _ROOT:
            sys.bundle(stream, True, size, False)
            self.state = _TO_CHILDREN
        elif st == _TO_CHILDREN and kind == _ROOT:
            sys.coll_send(self.left if self.left >= 0 else self.right, size, stream)
            sys.proceed(stream)


class _TimedAlgo:
    """A phase of known duration (symmetric engine): finishes `duration` ns after it starts."""

    __slots__ = ("sys", "stream", "comm_type", "final_size", "duration", "lead")

    def __init__(self, sys: "_Sys", comm_type: int, final_size: int, duration: int, lead: int):
        self.sys = sys
        self.stream: _Stream | None = None
        self.comm_type = comm_type
        self.final_size = final_size
        self.duration = duration
        self.lead = lead

    def run_init(self) -> None:
        # The real phase ends in an event registered `lead` ns before its end; mirror that so
        # same-tick completions are ordered as in ASTRA-sim.
        self.sys.engine.at(self.duration - self.lead, self._arm, None)

    def _arm(self, _arg: Any) -> None:
        self.sys.register(self.lead, self._finish, None)

    def _finish(self, _arg: Any) -> None:
        self.sys.proceed(self.stream)


# --------------------------------------------------------------------------------------------------
# System layer of one rank
# --------------------------------------------------------------------------------------------------
class _Sys:
    """One rank's ASTRA-sim system layer: per-tick event lists, chunk queues, collective generation."""

    def __init__(self, engine: _Engine, cfg: _Config, rank: int, groups: dict[int, list[int]]):
        self.engine = engine
        self.cfg = cfg
        self.rank = rank
        self.groups = groups
        self.events: dict[int, list[tuple[Callable[[Any], None], Any]]] = {}
        self.num_streams = 0
        self.priority_counter = 0
        self.queues: list[list[_Stream]] = [[] for _ in range(cfg.n_dims)]
        self.running = [0] * cfg.n_dims
        self.threshold = cfg.active_chunks
        self.topologies: dict[int, list[Any]] = {}
        self.group_topologies: dict[int, _RingTopo] = {}
        self.group_streams: dict[int, int] = {}
        self.last_register: dict[int, int] | None = None  # stream id -> tick of its last bundle event

    # --- per-rank event lists (Sys::register_event) ------------------------------------------------
    def register(self, delay: int, fn: Callable[[Any], None], arg: Any) -> None:
        time = self.engine.now + delay
        bucket = self.events.get(time)
        if bucket is None:
            self.events[time] = [(fn, arg)]
            self.engine.at(delay, self._call_events, time)
        else:
            bucket.append((fn, arg))

    def _call_events(self, time: int) -> None:
        bucket = self.events[time]
        i = 0
        while i < len(bucket):
            fn, arg = bucket[i]
            i += 1
            fn(arg)
        del self.events[time]

    # --- messages and memory-bus bundles ----------------------------------------------------------
    def bundle(self, stream: _Stream, processed: bool, size: int, fast: bool) -> None:
        """A memory-bus transfer of a message (endpoint delay, or 10 ns on a local ring), then the
        local reduction when `processed`; then the stream's algorithm gets a General event."""
        if self.last_register is not None:
            self.last_register[stream.sid] = self.engine.now
        self.register(10 if fast else self.cfg.endpoint_delay, self._bundle_fire, [stream, processed, size])

    def _bundle_fire(self, bundle: list[Any]) -> None:
        if bundle[1]:
            bundle[1] = False
            if self.last_register is not None:
                self.last_register[bundle[0].sid] = self.engine.now
            self.register(self.cfg.reduction_delay(bundle[2]), self._bundle_fire, bundle)
            return
        bundle[0].current.algo.run_general()

    def coll_send(self, dst: int, size: int, stream: _Stream) -> None:
        self.engine.send(self.rank, dst, size, stream.sid % COLLECTIVE_TAG_BASE + COLLECTIVE_TAG_BASE, _NOOP)

    def coll_recv(self, src: int, size: int, stream: _Stream) -> None:
        self.engine.recv(self.rank, src, size, stream.sid % COLLECTIVE_TAG_BASE + COLLECTIVE_TAG_BASE,
                         (self._consume, stream))

    @staticmethod
    def _consume(stream: _Stream) -> None:
        stream.current.algo.run_received()

    # --- stream scheduling (queues per dimension) --------------------------------------------------
    def proceed(self, stream: _Stream) -> None:
        """Move a stream to its next phase (or finish it): Sys::proceed_to_next_vnet_baseline."""
        previous = stream.queue
        if not stream.phases:
            stream.dataset.stream_finished()
        if stream.queue >= 0:
            queue = self.queues[stream.current.queue]
            for i, other in enumerate(queue):
                if other.sid == stream.sid:
                    del queue[i]
                    break
        if not stream.phases:
            if previous >= 0:
                self._stream_removed(previous)
            return
        phase = stream.phases.popleft()
        stream.queue = phase.queue
        stream.current = phase
        stream.initialized = False
        self._insert(self.queues[phase.queue], stream)
        if previous >= 0:
            self._stream_removed(previous)
        self._start_waiting(phase.queue)

    @staticmethod
    def _insert(queue: list[_Stream], stream: _Stream) -> None:
        i = 0
        for other in queue:
            if other.initialized or other.priority >= stream.priority:
                i += 1
                continue
            break
        queue.insert(i, stream)

    def _stream_removed(self, q: int) -> None:
        self.running[q] -= 1
        self._start_waiting(q)

    def _start_waiting(self, q: int) -> None:
        queue = self.queues[q]
        i = self.running[q]
        while i < len(queue) and self.running[q] < self.threshold:
            stream = queue[i]
            stream.initialized = True
            stream.current.algo.run_init()
            self.running[q] += 1
            i += 1

    # --- collective generation ---------------------------------------------------------------------
    def _priority(self, explicit: int) -> int:
        if self.cfg.policy == "LIFO":
            self.priority_counter += 1
            return self.priority_counter - 1
        if self.cfg.policy == "FIFO":
            self.priority_counter -= 1
            return self.priority_counter + 1
        return explicit

    def _impls(self, comm_type: int) -> list[tuple[str, int]]:
        impls = self.cfg.impls[comm_type]
        if impls is None:
            raise ReplayError(f"{self.cfg.source}: no {_COLL_KEY[comm_type]}-implementation in the system "
                              f"configuration, but rank {self.rank} issues a {et.COLLECTIVE_NAMES[comm_type]}")
        return impls

    def _topology(self, comm_type: int) -> list[Any]:
        topo = self.topologies.get(comm_type)
        if topo is None:
            topo = self.topologies[comm_type] = _global_topology(self.cfg, self.rank, self._impls(comm_type))
        return topo

    def generate(self, comm_type: int, size: int, involved: list[bool] | None, group: int | None,
                 explicit_priority: int, on_done: Callable[[], None]) -> None:
        """Issue one collective (Sys::generate_collective); `on_done` runs when its last chunk ends."""
        cfg = self.cfg
        impls = self._impls(comm_type)
        members = self.groups[group] if group is not None else None
        if members is None or len(members) == cfg.total:
            topo = self._topology(comm_type)
            if members is not None:
                involved = [True] * 10
            elif involved is None:
                involved = [True] * 4
            if len(involved) < len(topo):
                raise ReplayError(f"rank {self.rank}: involved_dim has {len(involved)} entries for a "
                                  f"{len(topo)}-dimension network")
        else:
            ring = self.group_topologies.get(group)
            if ring is None:
                if self.rank not in members:
                    raise ReplayError(f"rank {self.rank} issues a collective of communicator group {group} "
                                      f"{members} it is not part of")
                ring = self.group_topologies[group] = _RingTopo(members, members.index(self.rank), True)
            topo = [ring]
            impls = impls if len(impls) == 1 else [("ring", -1)]
            if impls[0][0] == "doubleBinaryTree":
                raise ReplayError(f"communicator group {group}: doubleBinaryTree is undefined for sub-groups "
                                  "in ASTRA-sim")
            involved = [True]

        splits, total = cfg.splits, cfg.total
        chunk = size // splits
        if comm_type != _AG and total > chunk:
            chunk = total
            size = splits * chunk
        if chunk == 0:
            raise ReplayError(f"rank {self.rank}: ALL_GATHER of {size} bytes with preferred-dataset-splits "
                              f"{splits} gives 0-byte chunks (ASTRA-sim loops forever)")
        active = [d for d in range(len(topo)) if topo[d].n > 1 and involved[d]]
        if not active:
            raise ReplayError(f"rank {self.rank}: a {et.COLLECTIVE_NAMES[comm_type]} involves no network "
                              "dimension (ASTRA-sim never finishes it)")
        dataset = _DataSet(on_done)
        priority = self._priority(explicit_priority)
        count = 0
        while size > 0:
            count += 1
            size = 0 if chunk > size else size - chunk
            phases = self._phases(comm_type, chunk, topo, impls, involved)
            if group is not None:
                sid = self.group_streams.get(group, group * GROUP_STREAM_BASE)
                self.group_streams[group] = sid + 1
                self.num_streams += 1
            else:
                sid = self.num_streams
                self.num_streams += 1
            self.proceed(_Stream(sid, phases, priority, dataset))
        dataset.total = count

    def _phases(self, comm_type: int, chunk: int, topo: list[Any], impls: list[tuple[str, int]],
                involved: list[bool]) -> list[_Phase]:
        n_dims = len(topo)
        order = list(range(n_dims))
        if comm_type == _AG:
            order.reverse()

        def active(d: int) -> bool:
            return topo[d].n != 1 and involved[d]

        phases: list[_Phase] = []
        remain = chunk
        if comm_type != _AR or not self.cfg.local_bw_aware:
            for d in order:
                if active(d):
                    phases.append(self._phase(comm_type, topo, impls, d, remain, _CW))
                    remain = phases[-1].final_size
            return phases
        last = 0
        for i in range(n_dims):
            if active(order[i]):
                last = i
        for i in range(last):
            if active(order[i]):
                phases.append(self._phase(_RS, topo, impls, order[i], remain, _CW))
                remain = phases[-1].final_size
        i = last
        while i > 0 and not active(order[i]):
            i -= 1
        if active(order[i]):
            phases.append(self._phase(_AR, topo, impls, order[i], remain, _CW))
            remain = phases[-1].final_size
        for j in range(i - 1, -1, -1):
            if active(order[j]):
                phases.append(self._phase(_AG, topo, impls, order[j], remain, _ACW))
                remain = phases[-1].final_size
        return phases

    def _phase(self, comm_type: int, topo: list[Any], impls: list[tuple[str, int]], d: int, size: int,
               direction: int) -> _Phase:
        kind, window = impls[d]
        return _Phase(d, _make_algorithm(self, comm_type, topo[d], kind, window, size, direction))


def _make_algorithm(sys: _Sys, comm_type: int, dim: Any, kind: str, window: int, size: int,
                    direction: int) -> Any:
    if kind in ("ring", "oneRing"):
        return _RingAlgo(sys, comm_type, dim, size, direction)
    if kind in ("direct", "oneDirect"):
        return _DirectAlgo(sys, comm_type, dim, size, direction, window)
    if kind in ("halvingDoubling", "oneHalvingDoubling"):
        return _HalvingDoublingAlgo(sys, comm_type, dim, size)
    return _DoubleBinaryTreeAlgo(sys, dim.next_tree(), size)


# --------------------------------------------------------------------------------------------------
# Workload layer of one rank
# --------------------------------------------------------------------------------------------------
_GPU, _CPU, _COMM, _RECV = range(4)
_CAT_GPU, _CAT_CPU, _CAT_COMM, _CAT_MEM, _CAT_INVALID = range(5)


class _Node:
    """A trace node reduced to what the replay needs."""

    __slots__ = ("id", "name", "type", "runtime", "slot", "category", "children", "n_parents",
                 "comm_type", "size", "involved", "group", "priority", "peer", "tag", "instant",
                 "num_ops", "tensor_size")

    def __init__(self, node: et.EtNode, rank: int, cfg: _Config, groups: dict[int, list[int]]):
        self.id = node.id
        self.name = node.name
        self.type = node.type
        self.runtime = node.duration_micros * 1000 if node.duration_micros else 1
        self.children: list[int] = []
        self.n_parents = 0
        self.instant = False
        self.comm_type = self.size = self.priority = self.peer = self.tag = 0
        self.involved: list[bool] | None = None
        self.group: int | None = None
        self.num_ops = self.tensor_size = 0
        attrs = node.attrs
        where = f"rank {rank} node {node.id} ({node.name!r})"
        cpu = bool(attrs.get("is_cpu_op", False))
        t = node.type
        if t == et.METADATA_NODE:
            raise ReplayError(f"{where}: METADATA_NODE makes ASTRA-sim abort; do not emit it")
        if t not in et.NODE_TYPE_NAMES:
            raise ReplayError(f"{where}: unknown node type {t}")
        if cpu:
            self.slot = _CPU
        elif t == et.COMP_NODE:
            self.slot = _GPU
        elif t == et.COMM_RECV_NODE:
            self.slot = _RECV
        else:
            self.slot = _COMM
        if t == et.COMP_NODE:
            self.category = _CAT_CPU if cpu else _CAT_GPU
        elif t in (et.COMM_COLL_NODE, et.COMM_SEND_NODE, et.COMM_RECV_NODE):
            self.category = _CAT_COMM
        elif t in (et.MEM_LOAD_NODE, et.MEM_STORE_NODE):
            self.category = _CAT_MEM
        else:
            self.category = _CAT_INVALID
        if cfg.replay_only:
            return
        if t == et.INVALID_NODE:
            self.instant = True
        elif t == et.COMP_NODE and cfg.roofline and not cpu:
            self.num_ops = _int_attr(attrs, "num_ops", where)
            self.tensor_size = _int_attr(attrs, "tensor_size", where)
            self.instant = self.tensor_size == 0
            if self.num_ops <= 0 and not self.instant:
                raise ReplayError(f"{where}: num_ops must be > 0 in roofline mode (ASTRA-sim divides by the "
                                  "resulting zero performance)")
        elif t in (et.MEM_LOAD_NODE, et.MEM_STORE_NODE):
            if cfg.no_remote_memory:
                raise ReplayError(f"{where}: MEM nodes need remote memory, but the system has "
                                  "NO_MEMORY_EXPANSION (ASTRA-sim exits)")
            self.size = _int_attr(attrs, "tensor_size", where)
        elif t in (et.COMM_COLL_NODE, et.COMM_SEND_NODE, et.COMM_RECV_NODE):
            if cpu:
                raise ReplayError(f"{where}: a communication node cannot be a CPU op (ASTRA-sim throws)")
            if t == et.COMM_COLL_NODE:
                self._collective(attrs, rank, cfg, groups, where)
            else:
                self._p2p(attrs, rank, cfg, where)

    def _collective(self, attrs: dict[str, Any], rank: int, cfg: _Config, groups: dict[int, list[int]],
                    where: str) -> None:
        self.comm_type = _int_attr(attrs, "comm_type", where)
        self.size = _int_attr(attrs, "comm_size", where)
        self.priority = _int_attr(attrs, "comm_priority", where, 0)
        if self.comm_type == et.BROADCAST:
            return
        if self.comm_type not in _COLL_KEY:
            name = et.COLLECTIVE_NAMES.get(self.comm_type, str(self.comm_type))
            raise ReplayError(f"{where}: unsupported collective type {name} (ASTRA-sim aborts)")
        if "involved_dim" in attrs:
            value = attrs["involved_dim"]
            if not isinstance(value, list) or not all(isinstance(v, bool) for v in value):
                raise ReplayError(f"{where}: involved_dim must be a bool_list")
            self.involved = value
        pg = attrs.get("pg_name", "")
        if not isinstance(pg, (str, bytes)):
            raise ReplayError(f"{where}: pg_name must be a string (ASTRA-sim aborts on {type(pg).__name__})")
        pg = pg.decode() if isinstance(pg, bytes) else pg
        if pg not in ("", "0"):
            try:
                group = int(pg)
            except ValueError:
                raise ReplayError(f"{where}: pg_name {pg!r} is not a communicator group id") from None
            if group not in groups:
                raise ReplayError(f"{where}: communicator group {group} not found")
            self.group = group

    def _p2p(self, attrs: dict[str, Any], rank: int, cfg: _Config, where: str) -> None:
        self.size = _int_attr(attrs, "comm_size", where)
        self.tag = _int_attr(attrs, "comm_tag", where) % COLLECTIVE_TAG_BASE
        if self.type == et.COMM_SEND_NODE:
            src = _int_attr(attrs, "comm_src", where, rank)
            if src != rank:
                raise ReplayError(f"{where}: a SEND must be issued by its comm_src ({src})")
            self.peer = _int_attr(attrs, "comm_dst", where)
        else:
            dst = _int_attr(attrs, "comm_dst", where, rank)
            if dst != rank:
                raise ReplayError(f"{where}: a RECV must be issued by its comm_dst ({dst})")
            self.peer = _int_attr(attrs, "comm_src", where)
        if not 0 <= self.peer < cfg.total or self.peer == rank:
            raise ReplayError(f"{where}: peer rank {self.peer} is not another rank of the {cfg.total} NPUs")


def _int_attr(attrs: dict[str, Any], name: str, where: str, default: int | None = None) -> int:
    if name not in attrs:
        if default is None:
            raise ReplayError(f"{where}: attribute {name} is missing")
        return default
    value = attrs[name]
    if not isinstance(value, int):  # bool is an int, as ASTRA-sim accepts bool_val
        raise ReplayError(f"{where}: attribute {name} must be an integer, got {type(value).__name__} "
                          "(ASTRA-sim throws bad_cast)")
    return int(value)


class _Workload:
    """One rank's ASTRA-sim workload layer: dependency resolution, resource slots, statistics."""

    def __init__(self, rank: int, nodes: list[et.EtNode], sys: _Sys, cfg: _Config,
                 groups: dict[int, list[int]]):
        self.rank = rank
        self.sys = sys
        self.cfg = cfg
        self.engine = sys.engine
        self.nodes: dict[int, _Node] = {}
        for node in nodes:
            if node.id in self.nodes:
                raise ReplayError(f"rank {rank}: node id {node.id} appears twice (ASTRA-sim keeps only the last)")
            self.nodes[node.id] = _Node(node, rank, cfg, groups)
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
        self.free: list[list[int]] = [[], [], [], []]  # heaps per slot kind (_RECV: plain list)
        for nid, node in self.nodes.items():
            if node.n_parents == 0:
                self._make_free(node)
        self.busy = [False, False, False]
        self.in_flight: set[int] = set()
        self.gpu_ticks = 0
        self.start: dict[int, int] = {}
        self.end: dict[int, int] = {}
        self.finished_at: int | None = None
        self.exposed = 0

    def _make_free(self, node: _Node) -> None:
        if node.slot == _RECV:
            self.free[_RECV].append(node.id)
        else:
            heapq.heappush(self.free[node.slot], node.id)

    # --- issuing -----------------------------------------------------------------------------------
    def fire(self) -> None:
        self._issue_ready()
        self._check_finished()

    def _issue_ready(self) -> None:
        chosen: list[int] = []
        nodes = self.nodes
        for slot in (_GPU, _CPU, _COMM):
            if self.busy[slot]:
                continue
            heap = self.free[slot]
            while heap:
                nid = heapq.heappop(heap)
                chosen.append(nid)
                if not nodes[nid].instant:
                    break
        if self.free[_RECV]:
            chosen.extend(self.free[_RECV])
            self.free[_RECV] = []
        if len(chosen) > 1:
            chosen.sort()
        for nid in chosen:
            self._issue(nodes[nid])

    def _issue(self, node: _Node) -> None:
        now = self.engine.now
        self.start[node.id] = now
        self.in_flight.add(node.id)
        if node.slot != _RECV:
            self.busy[node.slot] = True
        cfg = self.cfg
        t = node.type
        if cfg.replay_only or (t == et.COMP_NODE and (not cfg.roofline or node.slot == _CPU)):
            if node.slot != _CPU:
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
            if node.comm_type == et.BROADCAST:
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

    def _skip(self, node: _Node) -> None:
        """An instantly finished node; its children wait for the next completion (as in ASTRA-sim)."""
        self._finish_node(node)
        if node.slot != _RECV:
            self.busy[node.slot] = False

    def _finish_node(self, node: _Node) -> None:
        self.end[node.id] = self.engine.now
        self.in_flight.discard(node.id)
        nodes = self.nodes
        for child_id in node.children:
            child = nodes[child_id]
            child.n_parents -= 1
            if child.n_parents == 0:
                self._make_free(child)

    def _done(self, node: _Node) -> None:
        if self.finished_at is not None:
            return
        if node.slot != _RECV:
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
        wall = max(self.end.values(), default=0)
        totals: dict[int, int] = {}
        per_category: dict[int, list[tuple[int, int]]] = {}
        for nid, start in self.start.items():
            per_category.setdefault(self.nodes[nid].category, []).append((start, self.end[nid]))
        for category, intervals in per_category.items():
            totals[category] = _union_length(intervals)
        gpu, comm = totals.get(_CAT_GPU), totals.get(_CAT_COMM)
        overlap = gpu + comm - wall if gpu is not None and comm is not None else 0
        return RankResult(self.rank, self.finished_at or 0, self.exposed, gpu or 0, comm or 0, overlap)

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


def _union_length(intervals: list[tuple[int, int]]) -> int:
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


# --------------------------------------------------------------------------------------------------
# Engines
# --------------------------------------------------------------------------------------------------
def _run_full(traces: Sequence[Sequence[et.EtNode]], cfg: _Config, network: _Network,
              groups: dict[int, list[int]]) -> tuple[list[RankResult], list[_Workload]]:
    engine = _Engine(network)
    systems = [_Sys(engine, cfg, rank, groups) for rank in range(cfg.total)]
    workloads = [_Workload(rank, nodes, systems[rank], cfg, groups) for rank, nodes in enumerate(traces)]
    for workload in workloads:
        workload.fire()
    engine.run()
    _raise_if_stuck(workloads)
    return [w.result() for w in workloads], workloads


def _raise_if_stuck(workloads: Sequence[_Workload]) -> None:
    stuck = [w for w in workloads if w.finished_at is None]
    if not stuck:
        return
    shown = "; ".join(f"rank {w.rank}: {w.stuck()}" for w in stuck[:4])
    more = f" (and {len(stuck) - 4} more ranks)" if len(stuck) > 4 else ""
    raise ReplayError(f"replay deadlock: {len(stuck)} of {len(workloads)} ranks never finish "
                      f"(mismatched collectives, a recv without a matching send, or a stalled DAG) - "
                      f"{shown}{more}")


class _Asymmetric(Exception):
    """Internal: the symmetric engine does not apply."""


class _PhaseOracle:
    """Durations of single collective phases, measured with the full engine and memoised.

    A phase is measured on all ranks of rank 0's ring (global dimension or communicator group), and
    for a group also on every group that other ranks use in its place; all must finish at the same
    tick, with the same final event lead, or the symmetric engine does not apply.
    """

    def __init__(self, cfg: _Config, network: _Network, groups: dict[int, list[int]],
                 peer_groups: dict[int, set[int]]):
        self.cfg = cfg
        self.network = network
        self.groups = groups
        self.peer_groups = peer_groups
        self.cache: dict[tuple, tuple[int, int, int]] = {}

    def timed(self, sys: _Sys, comm_type: int, topo: list[Any], impls: list[tuple[str, int]], d: int,
              size: int, direction: int, group: int | None) -> _TimedAlgo:
        """A timed stand-in for the phase `sys` would create on logical dimension `d`."""
        kind, window = impls[d]
        if kind == "doubleBinaryTree":
            raise _Asymmetric()
        key = (comm_type, kind, window, size, direction, d, tuple(impls), topo[d].key(), group)
        hit = self.cache.get(key)
        if hit is None:
            if group is None:
                members = topo[d].members
                hit = self._measure(comm_type, members, lambda m: _global_topology(self.cfg, m, impls)[d],
                                    kind, window, size, direction)
            else:
                results = set()
                for peer in sorted(self.peer_groups.get(group, {group})):
                    members = self.groups[peer]
                    results.add(self._measure(comm_type, members,
                                              lambda m, ms=members: _RingTopo(ms, ms.index(m), True),
                                              kind, window, size, direction))
                if len(results) != 1:
                    raise _Asymmetric()
                hit = results.pop()
            self.cache[key] = hit
        duration, lead, final_size = hit
        return _TimedAlgo(sys, comm_type, final_size, duration, lead)

    def _measure(self, comm_type: int, members: Sequence[int], topo_of: Callable[[int], _RingTopo], kind: str,
                 window: int, size: int, direction: int) -> tuple[int, int, int]:
        """(duration, lead of the last event, output size) of one phase started at once on `members`."""
        engine = _Engine(self.network)
        finish: dict[int, int] = {}
        systems = []
        final_size = 0
        for member in members:
            sys = _Sys(engine, self.cfg, member, {})
            sys.last_register = {}
            algo = _make_algorithm(sys, comm_type, topo_of(member), kind, window, size, direction)
            final_size = algo.final_size
            dataset = _DataSet(lambda m=member: finish.__setitem__(m, engine.now))
            dataset.total = 1
            systems.append((sys, _Stream(0, [_Phase(0, algo)], 0, dataset)))
        for sys, stream in systems:
            sys.proceed(stream)
        engine.run()
        if len(finish) != len(members):
            raise _Asymmetric()
        times = {finish[m] for m in members}
        leads = {finish[m] - sys.last_register.get(0, 0) for (sys, _s), m in zip(systems, members)}
        if len(times) != 1 or len(leads) != 1:
            raise _Asymmetric()
        return times.pop(), leads.pop(), final_size


def _node_shape(node: et.EtNode) -> tuple:
    """What must be equal on every rank for the symmetric engine (names and pg_name excluded)."""
    return (node.id, node.type, tuple(node.data_deps), tuple(node.ctrl_deps), node.duration_micros,
            tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                         for k, v in node.attrs.items() if k != "pg_name")))


def _group_of(node: et.EtNode, cfg: _Config, groups: dict[int, list[int]]) -> int | None:
    """The sub-group id of a collective; None for the global communicator (or a full group)."""
    pg = node.attrs.get("pg_name", "")
    pg = pg.decode() if isinstance(pg, bytes) else pg
    if pg in ("", "0"):
        return None
    group = int(pg)
    return None if len(groups[group]) == cfg.total else group


def _symmetric_plan(traces: Sequence[Sequence[et.EtNode]], cfg: _Config,
                    groups: dict[int, list[int]]) -> dict[int, set[int]] | None:
    """None when ranks may not behave alike; else, for each sub-group rank 0 uses, the groups other
    ranks use in its place.  Ranks behave alike when they run the same nodes (up to names and
    pg_name), only COMP and collective nodes, and every sub-group collective is issued by all ranks
    in equally sized groups that each member uses consistently."""
    first = traces[0]
    if any(len(t) != len(first) for t in traces):
        return None
    shape = [_node_shape(n) for n in first]
    if any(_node_shape(n) != want for t in traces[1:] for n, want in zip(t, shape)):
        return None
    if cfg.replay_only:
        return {}
    peers: dict[int, set[int]] = {}
    for i, node in enumerate(first):
        if node.type == et.COMP_NODE:
            continue
        if node.type != et.COMM_COLL_NODE:
            return None
        try:
            per_rank = [_group_of(t[i], cfg, groups) for t in traces]
        except (KeyError, ValueError, TypeError):
            return None  # the full engine reports the bad pg_name
        if all(g is None for g in per_rank):
            continue
        if any(g is None for g in per_rank) or len({len(groups[g]) for g in per_rank}) != 1:
            return None
        for rank, group in enumerate(per_rank):
            if rank not in groups[group] or any(per_rank[m] != group for m in groups[group]):
                return None
        peers.setdefault(per_rank[0], set()).update(per_rank)
    return peers


def _run_symmetric(traces: Sequence[Sequence[et.EtNode]], cfg: _Config, network: _Network,
                   groups: dict[int, list[int]], peer_groups: dict[int, set[int]]
                   ) -> tuple[list[RankResult], list[_Workload]]:
    """Simulate rank 0 only; every phase takes its (rank-independent) measured duration."""
    engine = _Engine(network)
    sys = _OracleSys(engine, cfg, 0, groups, _PhaseOracle(cfg, network, groups, peer_groups))
    workload = _Workload(0, traces[0], sys, cfg, groups)
    workload.fire()
    engine.run()
    _raise_if_stuck([workload])
    result = workload.result()
    ranks = [RankResult(rank, result.finish_ns, result.exposed_comm_ns, result.gpu_ns, result.comm_ns,
                        result.overlap_ns) for rank in range(cfg.total)]
    return ranks, [workload] * cfg.total


def _estimated_messages(nodes: Sequence[et.EtNode], cfg: _Config, groups: dict[int, list[int]]) -> int:
    """Rough count of collective messages the full engine would simulate for these traces."""
    total = 0
    for node in nodes:
        if node.type != et.COMM_COLL_NODE or node.attrs.get("comm_type") == et.BROADCAST:
            continue
        size = node.attrs.get("comm_size", 0)
        size = size if isinstance(size, int) else 0
        chunk = max(size // cfg.splits, 1)
        if node.attrs.get("comm_type") != _AG and cfg.total > chunk:
            chunk, size = cfg.total, cfg.splits * cfg.total
        chunks = -(-size // chunk)
        pg = node.attrs.get("pg_name", "")
        members = groups.get(int(pg)) if isinstance(pg, str) and pg.isdigit() and pg != "0" else None
        if members is not None and len(members) != cfg.total:
            total += chunks * 2 * len(members) * len(members)
        else:
            total += chunks * sum(2 * n for n in cfg.npus) * cfg.total
    return total


class _OracleSys(_Sys):
    """A system layer whose phases take durations measured by a `_PhaseOracle` (symmetric engine)."""

    def __init__(self, engine: _Engine, cfg: _Config, rank: int, groups: dict[int, list[int]],
                 oracle: _PhaseOracle):
        super().__init__(engine, cfg, rank, groups)
        self.oracle = oracle
        self.sub_group: int | None = None

    def generate(self, comm_type: int, size: int, involved: list[bool] | None, group: int | None,
                 explicit_priority: int, on_done: Callable[[], None]) -> None:
        full = group is None or len(self.groups[group]) == self.cfg.total
        self.sub_group = None if full else group
        super().generate(comm_type, size, involved, group, explicit_priority, on_done)

    def _phase(self, comm_type: int, topo: list[Any], impls: list[tuple[str, int]], d: int, size: int,
               direction: int) -> _Phase:
        return _Phase(d, self.oracle.timed(self, comm_type, topo, impls, d, size, direction, self.sub_group))


# --------------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------------
FULL_ENGINE_MESSAGE_BUDGET = 20_000  # "auto" uses the exact full engine below this estimate


def replay_embedded(traces: Sequence[Sequence[et.EtNode]], system: SystemConfig,
                    comm_groups: dict[int, list[int]] | None = None, *, engine: str = "auto",
                    record_nodes: bool = False) -> ReplayResult:
    """Replay per-rank Chakra traces on `system` with the embedded congestion-unaware model.

    `engine`: "full" simulates every rank and message; "symmetric" simulates one rank of identical
    traces (ReplayError when that does not apply); "auto" uses the full engine for small workloads
    (estimated below FULL_ENGINE_MESSAGE_BUDGET messages) and the symmetric one, when it applies,
    for larger ones.  With `record_nodes`, `details["nodes"][rank][node_id]` = (issue ns, finish ns).
    """
    validate_dims(system.dims, system.source)
    validate_system(system.system, len(system.dims), system.source)
    cfg = _Config(system)
    if len(traces) != cfg.total:
        raise ReplayError(f"{len(traces)} rank trace(s) given for a system of {cfg.total} NPUs ({system.source})")
    groups: dict[int, list[int]] = {}
    for gid, members in (comm_groups or {}).items():
        if int(gid) <= 0:
            raise ReplayError(f"communicator group {gid}: ids must be > 0 (0 means all ranks)")
        bad = [m for m in members if not 0 <= m < cfg.total]
        if bad or not members:
            raise ReplayError(f"communicator group {gid}: ranks {bad or members} outside the {cfg.total} NPUs")
        groups[int(gid)] = list(members)
    for rank, nodes in enumerate(traces):
        if not nodes:
            raise ReplayError(f"rank {rank}: the trace has no node (ASTRA-sim aborts)")
    if engine not in ("auto", "full", "symmetric"):
        raise ReplayError(f"unknown embedded engine {engine!r} (auto, full or symmetric)")
    network = _Network(system)
    chosen = "full"
    if engine == "symmetric" or (engine == "auto" and
                                 _estimated_messages(traces[0], cfg, groups) > FULL_ENGINE_MESSAGE_BUDGET):
        peer_groups = _symmetric_plan(traces, cfg, groups)
        if peer_groups is not None:
            chosen = "symmetric"
        elif engine == "symmetric":
            raise ReplayError("the symmetric engine does not apply: ranks run different traces, p2p or "
                              "MEM/INVALID nodes, or sub-group collectives that differ between ranks")
    workloads: list[_Workload] = []
    if chosen == "symmetric":
        try:
            ranks, workloads = _run_symmetric(traces, cfg, network, groups, peer_groups or {})
        except _Asymmetric:
            if engine == "symmetric":
                raise ReplayError("the symmetric engine does not apply: a collective phase is not "
                                  "rank-symmetric (doubleBinaryTree, oneDirect on several dimensions, ...)") from None
            chosen = "full"
    if chosen == "full":
        ranks, workloads = _run_full(traces, cfg, network, groups)
    details: dict[str, Any] = {"engine": chosen}
    if record_nodes:
        details["nodes"] = {w.rank if chosen == "full" else r: {nid: (w.start[nid], w.end[nid]) for nid in w.start}
                            for r, w in enumerate(workloads)}
    return ReplayResult(ranks, "embedded", details)
