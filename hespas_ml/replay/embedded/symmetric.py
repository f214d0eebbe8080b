"""The symmetric engine: when every rank runs the same traces, simulate rank 0 only.

It applies when all ranks run the same COMP and collective nodes (names and pg_name aside) and every
sub-group collective runs in equally sized groups that each member uses consistently.  Rank 0's
workload and system layers then run as usual, except that each collective phase is a timed stand-in
whose duration comes from a one-phase run of the full engine over the ranks of that phase
(memoised; for a sub-group, checked on every group used in its place).  A phase whose ranks do not
all finish at the same tick (doubleBinaryTree, a listed group order that is not a network ring, ...)
raises `Asymmetric`, and the caller falls back to the full engine.
"""
from __future__ import annotations

from dataclasses import replace
from itertools import compress
from operator import is_not
from typing import Any, Callable, Sequence

from hespas_ml.replay import chakra as et
from hespas_ml.replay.embedded.collectives import make_algorithm
from hespas_ml.replay.embedded.config import ReplayConfig
from hespas_ml.replay.embedded.engine import Engine
from hespas_ml.replay.embedded.network import Network
from hespas_ml.replay.embedded.nodes import group_id
from hespas_ml.replay.embedded.results import RankResult
from hespas_ml.replay.embedded.streams import DataSet, Phase, Stream
from hespas_ml.replay.embedded.system_layer import SystemLayer
from hespas_ml.replay.embedded.topology import DimTopology, RingTopology, global_topology
from hespas_ml.replay.embedded.workload import Workload, raise_if_stuck


class Asymmetric(Exception):
    """The symmetric engine does not apply to this replay."""


# --------------------------------------------------------------------------------------------------
# Timed phases
# --------------------------------------------------------------------------------------------------
class TimedPhase:
    """A phase of known duration standing in for a collective algorithm: finishes `duration` ns
    after it starts, through an event registered `lead` ns before the end like the real phase's last
    one, so that same-tick completions are ordered as in ASTRA-sim."""

    __slots__ = ("sys", "stream", "comm_type", "final_size", "duration", "lead")

    def __init__(self, sys: SystemLayer, comm_type: int, final_size: int, duration: int, lead: int):
        self.sys = sys
        self.stream: Stream | None = None
        self.comm_type = comm_type
        self.final_size = final_size
        self.duration = duration
        self.lead = lead

    def run_init(self) -> None:
        self.sys.engine.at(self.duration - self.lead, self._arm, None)

    def _arm(self, _arg: Any) -> None:
        self.sys.register(self.lead, self._finish, None)

    def _finish(self, _arg: Any) -> None:
        self.sys.proceed(self.stream)

    def run_general(self) -> None:  # never called: a timed phase bundles nothing
        raise AssertionError("TimedPhase.run_general")

    run_received = run_general


class PhaseOracle:
    """Durations of single collective phases, measured with the full engine and memoised.

    A phase is measured on all ranks of rank 0's ring (global dimension or communicator group), and
    for a group also on every group that other ranks use in its place; all must finish at the same
    tick, with the same final event lead, or the symmetric engine does not apply.
    """

    def __init__(self, cfg: ReplayConfig, network: Network, groups: dict[int, list[int]],
                 peer_groups: dict[int, set[int]]):
        self.cfg = cfg
        self.network = network
        self.groups = groups
        self.peer_groups = peer_groups
        self.cache: dict[tuple, tuple[int, int, int]] = {}  # phase key -> (duration, lead, final size)

    def timed(self, sys: SystemLayer, comm_type: int, topo: list[DimTopology], impls: list[tuple[str, int]],
              d: int, size: int, direction: int, sub_group: int | None) -> TimedPhase:
        """A timed stand-in for the phase `sys` would create on logical dimension `d`."""
        kind, window = impls[d]
        if kind == "doubleBinaryTree":
            raise Asymmetric()
        key = (comm_type, kind, window, size, direction, d, tuple(impls), topo[d].key(), sub_group)
        hit = self.cache.get(key)
        if hit is None:
            if sub_group is None:
                members = topo[d].members
                hit = self._measure(comm_type, members, lambda m: global_topology(self.cfg, m, impls)[d],
                                    kind, window, size, direction)
            else:
                results = set()
                for peer in sorted(self.peer_groups.get(sub_group, {sub_group})):
                    members = self.groups[peer]
                    results.add(self._measure(comm_type, members,
                                              lambda m, ms=members: RingTopology(ms, ms.index(m), True),
                                              kind, window, size, direction))
                if len(results) != 1:
                    raise Asymmetric()
                hit = results.pop()
            self.cache[key] = hit
        duration, lead, final_size = hit
        return TimedPhase(sys, comm_type, final_size, duration, lead)

    def _measure(self, comm_type: int, members: Sequence[int], topo_of: Callable[[int], DimTopology],
                 kind: str, window: int, size: int, direction: int) -> tuple[int, int, int]:
        """(duration, lead of the last event, output size) of one phase started at once on `members`."""
        engine = Engine(self.network)
        finish: dict[int, int] = {}
        systems = []
        final_size = 0
        for member in members:
            sys = SystemLayer(engine, self.cfg, member, {})
            sys.last_register = {}
            algo = make_algorithm(sys, comm_type, topo_of(member), kind, window, size, direction)
            final_size = algo.final_size
            dataset = DataSet(lambda m=member: finish.__setitem__(m, engine.now))
            dataset.total = 1
            systems.append((sys, Stream(0, [Phase(0, algo)], 0, dataset)))
        for sys, stream in systems:
            sys.proceed(stream)
        engine.run()
        if len(finish) != len(members):
            raise Asymmetric()
        times = {finish[m] for m in members}
        leads = {finish[m] - sys.last_register.get(0, 0) for (sys, _s), m in zip(systems, members)}
        if len(times) != 1 or len(leads) != 1:
            raise Asymmetric()
        return times.pop(), leads.pop(), final_size


class TimedSystemLayer(SystemLayer):
    """A system layer whose phases take durations measured by a `PhaseOracle`."""

    def __init__(self, engine: Engine, cfg: ReplayConfig, rank: int, groups: dict[int, list[int]],
                 oracle: PhaseOracle):
        super().__init__(engine, cfg, rank, groups)
        self.oracle = oracle

    def make_phase(self, comm_type: int, topo: list[DimTopology], impls: list[tuple[str, int]], d: int,
                   size: int, direction: int, sub_group: int | None) -> Phase:
        return Phase(d, self.oracle.timed(self, comm_type, topo, impls, d, size, direction, sub_group))


# --------------------------------------------------------------------------------------------------
# Applicability and the engine
# --------------------------------------------------------------------------------------------------
P2P_PEERS = ("comm_src", "comm_dst")


def _node_shape(node: et.EtNode, p2p: bool = False) -> tuple:
    """What must be equal on every rank for the symmetric engine (names and pg_name excluded; with ``p2p``
    a SEND's or RECV's peers too)."""
    skip = ("pg_name", *P2P_PEERS) if p2p and node.type in (et.COMM_SEND_NODE, et.COMM_RECV_NODE) else ("pg_name",)
    return (node.id, node.type, tuple(node.data_deps), tuple(node.ctrl_deps), node.duration_micros,
            tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                         for k, v in node.attrs.items() if k not in skip)))


def _runs_alike(node: et.EtNode, ref: et.EtNode, ref_shape: tuple, p2p: bool = False) -> bool:
    """Whether `node` has the shape of `ref` (`ref_shape`); plain field equality first, as it
    implies equal shapes and is much cheaper than building the shape."""
    if node is ref or (node.id == ref.id and node.type == ref.type and node.duration_micros == ref.duration_micros
                       and node.data_deps == ref.data_deps and node.ctrl_deps == ref.ctrl_deps
                       and node.attrs == ref.attrs):
        return True
    return _node_shape(node, p2p) == ref_shape


def _sub_group_of(node: et.EtNode, cfg: ReplayConfig, groups: dict[int, list[int]]) -> int | None:
    """The sub-group id of a collective; None for the global communicator (or a group of all ranks)."""
    group = group_id(node.attrs.get("pg_name", ""))
    if group is None:
        return None
    return None if len(groups[group]) == cfg.total else group


def symmetric_plan(traces: Sequence[Sequence[et.EtNode]], cfg: ReplayConfig,
                   groups: dict[int, list[int]], p2p: bool = False) -> dict[int, set[int]] | None:
    """None when ranks may not behave alike; else, for each sub-group rank 0 uses, the groups other
    ranks use in its place.  Ranks behave alike when they run the same nodes (up to names and
    pg_name), only COMP and collective nodes, and every sub-group collective is issued by all ranks
    in equally sized groups that each member uses consistently.  ``p2p``: SEND and RECV nodes are let
    through too, alike up to their peers (the caller checks that their messages take equal times)."""
    if isinstance(traces, et.RankTraces):           # ranks alike by construction but at the variants
        first = traces.template
        columns = dict(traces.variants)
        differing = [(i, n) for i, per_rank in traces.variants for n in {id(n): n for n in per_rank}.values()]
    else:
        first = traces[0]
        if any(len(t) != len(first) for t in traces):
            return None
        columns = None
        differing = ((i, t[i]) for t in traces[1:] if t is not first
                     for i in compress(range(len(t)), map(is_not, t, first)))   # where t has its own node
    shape = [_node_shape(n, p2p) for n in first]
    alike: set[tuple[int, int]] = set()             # (position, node object) checked already: ranks may
    for i, n in differing:                          # share node objects
        if (i, id(n)) not in alike:
            if not _runs_alike(n, first[i], shape[i], p2p):
                return None
            alike.add((i, id(n)))
    if cfg.replay_only:
        return {}
    peers: dict[int, set[int]] = {}
    sub_group: dict[int, int | None] = {}           # by node object
    for i, node in enumerate(first):
        if node.type == et.COMP_NODE or (p2p and node.type in (et.COMM_SEND_NODE, et.COMM_RECV_NODE)):
            continue
        if node.type != et.COMM_COLL_NODE:
            return None
        one_node = columns is not None and i not in columns      # one node object on every rank
        column = [node] if one_node else columns[i] if columns is not None else [t[i] for t in traces]
        try:
            per_rank = []
            for n in column:
                g = sub_group.get(id(n), -1)
                if g == -1:
                    g = sub_group[id(n)] = _sub_group_of(n, cfg, groups)
                per_rank.append(g)
        except (KeyError, ValueError, TypeError):
            return None  # the full engine reports the bad pg_name
        used = set(per_rank)
        if used == {None}:
            continue
        if None in used or len({len(groups[g]) for g in used}) != 1:
            return None
        users: dict[int, set[int]] = {per_rank[0]: set(range(len(traces)))} if one_node else {}
        for rank, group in enumerate(() if one_node else per_rank):
            users.setdefault(group, set()).add(rank)
        if any(users[g] != set(groups[g]) for g in used):     # each group used by exactly its members
            return None
        peers.setdefault(per_rank[0], set()).update(used)
    return peers


def run_symmetric(traces: Sequence[Sequence[et.EtNode]], cfg: ReplayConfig, network: Network,
                  groups: dict[int, list[int]], peer_groups: dict[int, set[int]]
                  ) -> tuple[list[RankResult], list[Workload]]:
    """Simulate rank 0 only, every phase taking its measured (rank-independent) duration; rank 0's
    results and workload stand for every rank."""
    engine = Engine(network)
    sys = TimedSystemLayer(engine, cfg, 0, groups, PhaseOracle(cfg, network, groups, peer_groups))
    workload = Workload(0, traces[0], sys, cfg, groups)
    workload.fire()
    engine.run()
    raise_if_stuck([workload])
    result = workload.result()
    return [replace(result, rank=rank) for rank in range(cfg.total)], [workload] * cfg.total
