"""A collective in flight: a dataset of chunk streams, each a sequence of per-dimension phases."""
from __future__ import annotations

from collections import deque
from typing import Callable, Protocol

from hespas_ml.replay.embedded.config import COLLECTIVE_TAG_BASE


class CollectiveHost(Protocol):
    """What an algorithm needs from the rank's system layer it runs on
    (:class:`~hespas_ml.replay.embedded.system_layer.SystemLayer`)."""

    rank: int

    def bundle(self, stream: "Stream", processed: bool, size: int, fast: bool) -> None:
        """A memory-bus transfer of a message, then the local reduction when ``processed``."""

    def coll_send(self, dst: int, size: int, stream: "Stream") -> None:
        """Send a message of ``stream`` to rank ``dst``."""

    def coll_recv(self, src: int, size: int, stream: "Stream") -> None:
        """Post the receive of a message of ``stream`` from rank ``src``."""

    def proceed(self, stream: "Stream") -> None:
        """Move a stream to its next phase (or finish it)."""


class Algorithm(Protocol):
    """What the system layer needs from the algorithm running one phase of one chunk on one rank."""

    stream: Stream | None
    comm_type: int  # the collective this phase runs
    final_size: int  # bytes per rank at the end of the phase (the next phase's input)

    def run_init(self) -> None:
        """The phase starts (its stream got a slot in its dimension's queue)."""

    def run_general(self) -> None:
        """A memory-bus bundle of this phase completed."""

    def run_received(self) -> None:
        """A message of this phase was received."""


class DataSet:
    """A collective in flight: done when all `total` chunk streams finished."""

    __slots__ = ("total", "done", "on_done")

    def __init__(self, on_done: Callable[[], None]):
        self.total = 0
        self.done = 0
        self.on_done = on_done

    def stream_finished(self) -> None:
        self.done += 1
        if self.done == self.total:
            self.on_done()


class Phase:
    """One step of a stream: `algo` run on logical dimension `queue`."""

    __slots__ = ("queue", "algo", "final_size")

    def __init__(self, queue: int, algo: Algorithm):
        self.queue = queue
        self.algo = algo
        self.final_size = algo.final_size


class Stream:
    """One chunk of a collective moving through its phases (ASTRA-sim's StreamBaseline)."""

    __slots__ = ("sid", "tag", "phases", "current", "queue", "initialized", "priority", "dataset")

    def __init__(self, sid: int, phases: list[Phase], priority: int, dataset: DataSet):
        self.sid = sid
        self.tag = sid % COLLECTIVE_TAG_BASE + COLLECTIVE_TAG_BASE  # of all its messages
        self.phases = deque(phases)
        self.current: Phase | None = None
        self.queue = -1  # dimension queue of the current phase; -1 before the first
        self.initialized = False  # the current phase has started
        self.priority = priority
        self.dataset = dataset
        for phase in phases:
            phase.algo.stream = self
