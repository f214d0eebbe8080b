"""ASTRA-sim's collective algorithms, run message by message for one phase of one chunk on one rank:
Ring, Direct (AllToAll with a window), HalvingDoubling and DoubleBinaryTree (an all-reduce).

Each algorithm talks to its rank's system layer (`sys`): `bundle` (a memory-bus transfer, with the
local reduction when the message carries partial sums, ending in `run_general`), `coll_send` /
`coll_recv` (messages; a receive ends in `run_received`) and `proceed` (the phase is over).
"""
from __future__ import annotations

import math
from collections import deque

from hespas_ml.replay import chakra as et
from hespas_ml.replay.embedded.streams import Algorithm, CollectiveHost, Stream
from hespas_ml.replay.embedded.topology import (ACW, CW, INTERMEDIATE, LEAF, ROOT, BinaryTree, DimTopology,
                                                RingTopology)
from hespas_ml.replay.errors import ReplayError


AR, AG, RS, A2A = et.ALL_REDUCE, et.ALL_GATHER, et.REDUCE_SCATTER, et.ALL_TO_ALL


class _MessageAlgorithm:
    """Machinery shared by Ring, Direct and HalvingDoubling (their common ASTRA-sim structure).

    Packets come in rounds of `parallel` plain ones, then `nonzero_packets()` ones whose bundle
    includes the local reduction (always for RS, every other round for AR).  `insert_packet` queues a
    message and releases its memory-bus bundle; each completed bundle (`run_general`) frees a slot,
    and `ready` sends one queued message and posts the matching receive while a slot is free; each
    received message inserts the next packet.  The phase ends once `count` messages went out and all
    `parallel` slots are free.
    """

    comm_type: int
    final_size: int
    count: int  # messages still to send
    msg: int  # bytes of the next message

    def __init__(self, sys: CollectiveHost, comm_type: int, topo: RingTopology):
        self.sys = sys
        self.stream: Stream | None = None
        self.comm_type = comm_type
        self.topo = topo
        self.n = topo.n
        self.parallel = 1
        self.fast = topo.local
        self.zero = 0  # plain packets left in this round
        self.nonzero = 0  # partial-sum packets left in this round
        self.toggle = False  # flips every round (AR reduces on every other round)
        self.free = 0  # completed bundles not yet used to send
        self.received = 0
        self.sender = self.receiver = -1
        self.packets: deque[tuple[int, int, int]] = deque()  # (src, dst, bytes)

    def nonzero_packets(self) -> int:
        raise NotImplementedError

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
            self.packets.append((self.sender, self.receiver, self.msg))
            self.release(False)
            self.zero -= 1
        elif self.nonzero > 0:
            self.packets.append((self.sender, self.receiver, self.msg))
            ct = self.comm_type
            self.release(ct == RS or (ct == AR and self.toggle))
            self.nonzero -= 1
        else:
            raise ReplayError(f"rank {self.sys.rank}: collective algorithm injected nothing (internal error)")

    def release(self, processed: bool) -> None:
        """The memory-bus bundle of the packet just queued (then the local reduction if `processed`)."""
        self.sys.bundle(self.stream, processed, self.msg, self.fast)

    def ready(self) -> bool:
        if not self.packets or self.count == 0 or self.free == 0:
            return False
        src, dst, msg = self.packets.popleft()
        sys = self.sys
        sys.coll_send(dst, msg, self.stream)
        sys.coll_recv(src, msg, self.stream)
        self.count -= 1
        self.free -= 1
        return True

    def iterate(self) -> None:
        if self.count == 0 and self.free == self.parallel:
            self.sys.proceed(self.stream)


class RingAlgorithm(_MessageAlgorithm):
    """ASTRA-sim's Ring: every message goes to the next rank in `direction`."""

    def __init__(self, sys: CollectiveHost, comm_type: int, topo: RingTopology, size: int, direction: int):
        super().__init__(sys, comm_type, topo)
        n = self.n
        self.direction = direction
        self.receiver = topo.receiver(sys.rank, direction)
        self.sender = topo.sender(sys.rank, direction)
        if comm_type == AR:
            self.count = 2 * (n - 1)
            self.msg = size // n
            self.final_size = size
        elif comm_type == A2A:
            self.count = (n - 1) * n // 2
            self.msg = size // n
            self.final_size = size
        elif comm_type == AG:
            self.count = n - 1
            self.msg = size
            self.final_size = size * n
        else:
            self.count = n - 1
            self.msg = size // n
            self.final_size = size // n

    def nonzero_packets(self) -> int:
        return (self.n - 1) * self.parallel


class DirectAlgorithm(RingAlgorithm):
    """ASTRA-sim's AllToAll ("direct"): up to `window` messages in parallel (-1: all n - 1), each to
    the next peer round the ring."""

    def __init__(self, sys: CollectiveHost, comm_type: int, topo: RingTopology, size: int, direction: int,
                 window: int):
        super().__init__(sys, comm_type, topo, size, direction)
        self.middle = self.n - 1
        self.parallel = self.n - 1 if window == -1 else min(window, self.n - 1)
        if comm_type == A2A:
            self.count = self.n - 1

    def nonzero_packets(self) -> int:
        return (self.n - 1) * self.parallel if self.topo.local else self.parallel

    def run_general(self) -> None:
        self.free += 1
        if self.comm_type == AR and self.count <= self.middle:
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


class HalvingDoublingAlgorithm(_MessageAlgorithm):
    """ASTRA-sim's HalvingDoubling: messages to partners at doubling (RS, AR) or halving (AG) ring
    offsets, halving (or doubling) the message size; an all-reduce turns back at offset n."""

    def __init__(self, sys: CollectiveHost, comm_type: int, topo: RingTopology, size: int):
        super().__init__(sys, comm_type, topo)
        n = self.n
        log2n = math.log2(n)
        self.count = int(2 * log2n) if comm_type == AR else int(log2n)
        if comm_type == AR:
            self.final_size, self.msg, self.rank_offset, self.multiplier = size, size // 2, 1, 2.0
        elif comm_type == AG:
            self.final_size, self.msg, self.rank_offset, self.multiplier = size * n, size, n // 2, 0.5
        elif comm_type == RS:
            self.final_size, self.msg, self.rank_offset, self.multiplier = size // n, size // 2, 1, 2.0
        else:
            raise ReplayError("halvingDoubling does not implement ALL_TO_ALL (ASTRA-sim exits)")
        self._aim()

    def _aim(self) -> None:
        """Point sender and receiver at the partner `rank_offset` steps round the ring."""
        offset = self.rank_offset
        direction = CW if offset == 0 or (self.topo.index // offset) % 2 == 0 else ACW
        partner = self.sys.rank
        for _ in range(offset):
            partner = self.topo.receiver(partner, direction)
        self.receiver = self.sender = partner

    def nonzero_packets(self) -> int:
        return int(math.log2(self.n) - 1 * self.parallel)

    def release(self, processed: bool) -> None:
        super().release(processed)
        self.rank_offset = int(self.rank_offset * self.multiplier)
        self.msg = int(float(self.msg) / self.multiplier)
        if self.rank_offset == self.n and self.comm_type == AR:
            self.multiplier = 0.5
            self.rank_offset = int(self.rank_offset * self.multiplier)
            self.msg = int(float(self.msg) / self.multiplier)
        self._aim()


# DoubleBinaryTree states and events
_BEGIN, _TO_PARENT, _WAIT_PARENT, _END, _WAIT_TWO, _WAIT_ONE, _TO_CHILDREN = range(7)
_EV_INIT, _EV_GENERAL, _EV_RECEIVED = range(3)


class DoubleBinaryTreeAlgorithm:
    """ASTRA-sim's DoubleBinaryTreeAllReduce state machine (run whatever the collective type): reduce
    up the tree to the root, then broadcast back down."""

    def __init__(self, sys: CollectiveHost, tree: BinaryTree, size: int):
        self.sys = sys
        self.stream: Stream | None = None
        self.comm_type = AR
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
        if st == _BEGIN and kind == LEAF:
            sys.bundle(stream, False, size, False)
            self.state = _TO_PARENT
        elif st == _TO_PARENT and kind == LEAF:
            sys.coll_send(self.parent, size, stream)
            sys.coll_recv(self.parent, size, stream)
            self.state = _WAIT_PARENT
        elif st == _WAIT_PARENT and kind == LEAF:
            sys.bundle(stream, False, size, False)
            self.state = _END
        elif st == _END and kind == LEAF:
            sys.proceed(stream)
        elif st == _BEGIN and kind == INTERMEDIATE:
            self.state = _WAIT_TWO
            sys.coll_recv(self.left, size, stream)
            sys.coll_recv(self.right, size, stream)
        elif st == _WAIT_TWO and kind == INTERMEDIATE and ev == _EV_RECEIVED:
            sys.bundle(stream, True, size, False)
            self.state = _WAIT_ONE
        elif st == _WAIT_ONE and kind == INTERMEDIATE and ev == _EV_RECEIVED:
            sys.bundle(stream, True, size, False)
            self.state = _TO_PARENT
        elif self.reductions < 1 and kind == INTERMEDIATE and ev == _EV_GENERAL:
            self.reductions += 1
        elif st == _TO_PARENT and kind == INTERMEDIATE:
            self.state = _WAIT_PARENT
            sys.coll_send(self.parent, size, stream)
            sys.coll_recv(self.parent, size, stream)
        elif st == _WAIT_PARENT and kind == INTERMEDIATE and ev == _EV_RECEIVED:
            sys.bundle(stream, True, size, False)
            self.state = _TO_CHILDREN
        elif st == _TO_CHILDREN and kind == INTERMEDIATE:
            sys.coll_send(self.left, size, stream)
            sys.coll_send(self.right, size, stream)
            sys.proceed(stream)
        elif st == _BEGIN and kind == ROOT:
            self.state = _WAIT_ONE
            sys.coll_recv(self.left if self.left >= 0 else self.right, size, stream)
        elif st == _WAIT_ONE and kind == ROOT:
            sys.bundle(stream, True, size, False)
            self.state = _TO_CHILDREN
        elif st == _TO_CHILDREN and kind == ROOT:
            sys.coll_send(self.left if self.left >= 0 else self.right, size, stream)
            sys.proceed(stream)


def make_algorithm(sys: CollectiveHost, comm_type: int, dim: DimTopology, kind: str, window: int, size: int,
                   direction: int) -> Algorithm:
    """The algorithm named `kind` (an implementation entry) for `size` bytes per rank on `dim`."""
    if kind in ("ring", "oneRing"):
        return RingAlgorithm(sys, comm_type, dim, size, direction)
    if kind in ("direct", "oneDirect"):
        return DirectAlgorithm(sys, comm_type, dim, size, direction, window)
    if kind in ("halvingDoubling", "oneHalvingDoubling"):
        return HalvingDoublingAlgorithm(sys, comm_type, dim, size)
    return DoubleBinaryTreeAlgorithm(sys, dim.next_tree(), size)
