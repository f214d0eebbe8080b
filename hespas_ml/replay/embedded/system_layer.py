"""One rank's system layer (ASTRA-sim's Sys): per-tick event lists, memory-bus bundles, collective
messages, chunking of collectives into streams, their phases and the per-dimension queues."""
from __future__ import annotations

from typing import Any, Callable

from hespas_ml.replay import chakra as et
from hespas_ml.replay.embedded.collectives import AG, AR, RS, make_algorithm
from hespas_ml.replay.embedded.config import IMPLEMENTATION_KEYS, ReplayConfig
from hespas_ml.replay.embedded.engine import NO_HANDLER, Engine
from hespas_ml.replay.embedded.streams import DataSet, Phase, Stream
from hespas_ml.replay.embedded.topology import ACW, CW, DimTopology, RingTopology, global_topology
from hespas_ml.replay.errors import ReplayError

GROUP_STREAM_BASE = 1_000_000  # stream ids of communicator group g start at g * 1e6
LOCAL_RING_BUNDLE_NS = 10  # a bundle on a communicator-group ring takes this instead of endpoint-delay


def split_into_chunks(comm_type: int, size: int, splits: int, total: int) -> tuple[int, int]:
    """(chunk bytes, bytes to cut into chunks) of a collective of `size` bytes, as ASTRA-sim chunks it:
    size / preferred-dataset-splits, raised to the NPU count (and the total to splits x that) for
    every type but ALL_GATHER."""
    chunk = size // splits
    if comm_type != AG and total > chunk:
        chunk = total
        size = splits * chunk
    return chunk, size


class SystemLayer:
    """One rank's ASTRA-sim system layer: per-tick event lists, chunk queues, collective generation.

    `make_phase` builds the algorithm of one phase; the symmetric engine overrides it.
    """

    def __init__(self, engine: Engine, cfg: ReplayConfig, rank: int, groups: dict[int, list[int]]):
        self.engine = engine
        self.cfg = cfg
        self.rank = rank
        self.groups = groups
        self.events: dict[int, list[tuple[Callable[[Any], None], Any]]] = {}  # tick -> callbacks
        self.num_streams = 0
        self.priority_counter = 0
        self.queues: list[list[Stream]] = [[] for _ in range(cfg.n_dims)]  # per logical dimension
        self.running = [0] * cfg.n_dims  # started streams per queue
        self.threshold = cfg.active_chunks
        self.topologies: dict[int, list[DimTopology]] = {}  # per collective type
        self.group_topologies: dict[int, RingTopology] = {}
        self.group_streams: dict[int, int] = {}  # next stream id per communicator group
        # stream id -> tick at which its last bundle event was registered (set only to measure phases)
        self.last_register: dict[int, int] | None = None

    # --- per-rank event lists (Sys::register_event) ------------------------------------------------
    def register(self, delay: int, fn: Callable[[Any], None], arg: Any) -> None:
        """Call `fn(arg)` in `delay` ns, after the callbacks registered earlier for that tick."""
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
    def bundle(self, stream: Stream, processed: bool, size: int, fast: bool) -> None:
        """A memory-bus transfer of a message (endpoint delay, or 10 ns on a local ring), then the
        local reduction when `processed`; then the stream's algorithm gets a General event."""
        if self.last_register is not None:
            self.last_register[stream.sid] = self.engine.now
        self.register(LOCAL_RING_BUNDLE_NS if fast else self.cfg.endpoint_delay, self._bundle_fire,
                      [stream, processed, size])

    def _bundle_fire(self, bundle: list[Any]) -> None:
        if bundle[1]:
            bundle[1] = False
            if self.last_register is not None:
                self.last_register[bundle[0].sid] = self.engine.now
            self.register(self.cfg.reduction_delay(bundle[2]), self._bundle_fire, bundle)
            return
        bundle[0].current.algo.run_general()

    def coll_send(self, dst: int, size: int, stream: Stream) -> None:
        """Send a message of `stream` to rank `dst`."""
        self.engine.send(self.rank, dst, size, stream.tag, NO_HANDLER)

    def coll_recv(self, src: int, size: int, stream: Stream) -> None:
        """Post the receive of a message of `stream` from rank `src`."""
        self.engine.recv(self.rank, src, size, stream.tag, (self._consume, stream))

    @staticmethod
    def _consume(stream: Stream) -> None:
        stream.current.algo.run_received()

    # --- stream scheduling (queues per dimension) --------------------------------------------------
    def proceed(self, stream: Stream) -> None:
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
    def _insert(queue: list[Stream], stream: Stream) -> None:
        """Queue `stream` behind the started streams and those of higher or equal priority."""
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
        """Start queued streams of dimension `q` while fewer than active-chunks-per-dimension run."""
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
            raise ReplayError(f"{self.cfg.source}: no {IMPLEMENTATION_KEYS[comm_type]}-implementation in the "
                              f"system configuration, but rank {self.rank} issues a "
                              f"{et.COLLECTIVE_NAMES[comm_type]}")
        return impls

    def _topology(self, comm_type: int) -> list[DimTopology]:
        topo = self.topologies.get(comm_type)
        if topo is None:
            topo = self.topologies[comm_type] = global_topology(self.cfg, self.rank, self._impls(comm_type))
        return topo

    def generate(self, comm_type: int, size: int, involved: list[bool] | None, group: int | None,
                 explicit_priority: int, on_done: Callable[[], None]) -> None:
        """Issue one collective (Sys::generate_collective); `on_done` runs when its last chunk ends.

        A group of all ranks runs on the global topology like no group; a smaller one on a ring of
        its members, with its dimensions' single implementation or else "ring".
        """
        cfg = self.cfg
        impls = self._impls(comm_type)
        members = self.groups[group] if group is not None else None
        sub_group: int | None = None
        if members is None or len(members) == cfg.total:
            topo = self._topology(comm_type)
            if members is not None:
                involved = [True] * 10  # ASTRA-sim ignores involved_dim for a communicator group
            elif involved is None:
                involved = [True] * 4  # ASTRA-sim's default involved_dim
            if len(involved) < len(topo):
                raise ReplayError(f"rank {self.rank}: involved_dim has {len(involved)} entries for a "
                                  f"{len(topo)}-dimension network")
        else:
            sub_group = group
            ring = self.group_topologies.get(group)
            if ring is None:
                if self.rank not in members:
                    raise ReplayError(f"rank {self.rank} issues a collective of communicator group {group} "
                                      f"{members} it is not part of")
                ring = self.group_topologies[group] = RingTopology(members, members.index(self.rank), True)
            topo = [ring]
            impls = impls if len(impls) == 1 else [("ring", -1)]
            if impls[0][0] == "doubleBinaryTree":
                raise ReplayError(f"communicator group {group}: doubleBinaryTree is undefined for sub-groups "
                                  "in ASTRA-sim")
            involved = [True]

        chunk, size = split_into_chunks(comm_type, size, cfg.splits, cfg.total)
        if chunk == 0:
            raise ReplayError(f"rank {self.rank}: ALL_GATHER of {size} bytes with preferred-dataset-splits "
                              f"{cfg.splits} gives 0-byte chunks (ASTRA-sim loops forever)")
        if not any(topo[d].n > 1 and involved[d] for d in range(len(topo))):
            raise ReplayError(f"rank {self.rank}: a {et.COLLECTIVE_NAMES[comm_type]} involves no network "
                              "dimension (ASTRA-sim never finishes it)")
        dataset = DataSet(on_done)
        priority = self._priority(explicit_priority)
        count = 0
        while size > 0:
            count += 1
            size = 0 if chunk > size else size - chunk
            phases = self._phases(comm_type, chunk, topo, impls, involved, sub_group)
            if group is not None:
                sid = self.group_streams.get(group, group * GROUP_STREAM_BASE)
                self.group_streams[group] = sid + 1
            else:
                sid = self.num_streams
            self.num_streams += 1
            self.proceed(Stream(sid, phases, priority, dataset))
        dataset.total = count

    def _phases(self, comm_type: int, chunk: int, topo: list[DimTopology], impls: list[tuple[str, int]],
                involved: list[bool], sub_group: int | None) -> list[Phase]:
        """The phases of one chunk: the collective on every involved dimension (ALL_GATHER from the
        last one down), or with localBWAware an ALL_REDUCE as RS up, AR on the last, AG back down."""
        n_dims = len(topo)
        order = list(range(n_dims))
        if comm_type == AG:
            order.reverse()

        def active(d: int) -> bool:
            return topo[d].n != 1 and involved[d]

        phases: list[Phase] = []
        remain = chunk

        def add(phase_type: int, d: int, direction: int) -> None:
            nonlocal remain
            phases.append(self.make_phase(phase_type, topo, impls, d, remain, direction, sub_group))
            remain = phases[-1].final_size

        if comm_type != AR or not self.cfg.local_bw_aware:
            for d in order:
                if active(d):
                    add(comm_type, d, CW)
            return phases
        last = 0
        for i in range(n_dims):
            if active(order[i]):
                last = i
        for i in range(last):
            if active(order[i]):
                add(RS, order[i], CW)
        i = last
        while i > 0 and not active(order[i]):
            i -= 1
        if active(order[i]):
            add(AR, order[i], CW)
        for j in range(i - 1, -1, -1):
            if active(order[j]):
                add(AG, order[j], ACW)
        return phases

    def make_phase(self, comm_type: int, topo: list[DimTopology], impls: list[tuple[str, int]], d: int,
                   size: int, direction: int, sub_group: int | None) -> Phase:
        """The phase running `comm_type` on logical dimension `d` (`sub_group`: the communicator group
        of a sub-group collective, else None)."""
        kind, window = impls[d]
        return Phase(d, make_algorithm(self, comm_type, topo[d], kind, window, size, direction))
