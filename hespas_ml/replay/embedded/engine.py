"""Discrete-event core: the global event queue and the network's send/receive matching."""
from __future__ import annotations

import heapq
from typing import Any, Callable

from hespas_ml.replay.embedded.network import Network

Handler = tuple[Callable[[Any], None], Any]  # (function, argument): called as function(argument)


def _ignore(_arg: Any) -> None:
    return None


NO_HANDLER: Handler = (_ignore, None)  # for sends nobody waits on (collective messages)


class Engine:
    """Events ordered by (time, insertion order), plus ASTRA-sim's network front end.

    Messages are matched on (tag, src, dst, size, sequence number): the k-th send and the k-th
    receive with the same (tag, src, dst, size) pair up whatever order they are posted in.  A send's
    handler runs on arrival; a receive's handler runs on arrival too, or in a 0-delay event when the
    receive is posted after the message arrived.
    """

    def __init__(self, network: Network):
        self.now = 0
        self.heap: list[tuple[int, int, Callable[[Any], None], Any]] = []
        self.seq = 0
        self.network = network
        # (tag, src, dst, size) -> [sends posted - 1, receives posted - 1]
        self.chunk_ids: dict[tuple[int, int, int, int], list[int]] = {}
        # (tag, src, dst, size, sequence) -> [send handler, receive handler, arrived]
        self.pending: dict[tuple[int, int, int, int, int], list[Any]] = {}

    def at(self, delay: int, fn: Callable[[Any], None], arg: Any) -> None:
        """Schedule `fn(arg)` `delay` ns from now."""
        self.seq += 1
        heapq.heappush(self.heap, (self.now + delay, self.seq, fn, arg))

    def run(self) -> None:
        """Process events until none is left."""
        heap = self.heap
        pop = heapq.heappop
        while heap:
            time, _seq, fn, arg = pop(heap)
            self.now = time
            fn(arg)

    def send(self, src: int, dst: int, size: int, tag: int, handler: Handler) -> None:
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
        self.seq += 1  # inlined self.at(delay, self._arrive, key): one call per message saved
        heapq.heappush(self.heap, (self.now + self.network.delay(src, dst, size), self.seq, self._arrive, key))

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

    def recv(self, dst: int, src: int, size: int, tag: int, handler: Handler) -> None:
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
