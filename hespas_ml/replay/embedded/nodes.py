"""Trace nodes as the workload layer replays them: validated (ASTRA-sim's aborts become
ReplayError) and reduced to their resource slot, statistics category and replay fields."""
from __future__ import annotations

from typing import Any

from hespas_ml.replay import chakra as et
from hespas_ml.replay.embedded.config import COLLECTIVE_TAG_BASE, IMPLEMENTATION_KEYS, ReplayConfig
from hespas_ml.replay.errors import ReplayError

# resource slots: at most one node in flight on each of GPU, CPU and COMM; RECV is unlimited
GPU_SLOT, CPU_SLOT, COMM_SLOT, RECV_SLOT = range(4)
# statistics categories (busy-time unions)
CAT_GPU, CAT_CPU, CAT_COMM, CAT_MEM, CAT_INVALID = range(5)


def group_id(pg_name: Any) -> int | None:
    """The communicator group a `pg_name` attribute names; None for the global one ("" or "0").

    Raises ValueError (or TypeError) when the name is not a group id.
    """
    pg = pg_name.decode() if isinstance(pg_name, bytes) else pg_name
    return None if pg in ("", "0") else int(pg)


def int_attr(attrs: dict[str, Any], name: str, where: str, default: int | None = None) -> int:
    """An integer attribute (bools count, as ASTRA-sim accepts bool_val); ReplayError otherwise."""
    if name not in attrs:
        if default is None:
            raise ReplayError(f"{where}: attribute {name} is missing")
        return default
    value = attrs[name]
    if not isinstance(value, int):
        raise ReplayError(f"{where}: attribute {name} must be an integer, got {type(value).__name__} "
                          "(ASTRA-sim throws bad_cast)")
    return int(value)


class ReplayNode:
    """A trace node reduced to what the replay needs (plus its dependency bookkeeping)."""

    __slots__ = ("id", "name", "type", "runtime", "slot", "category", "children", "n_parents",
                 "comm_type", "size", "involved", "group", "priority", "peer", "tag", "instant",
                 "num_ops", "tensor_size")

    def __init__(self, node: et.EtNode, rank: int, cfg: ReplayConfig, groups: dict[int, list[int]]):
        self.id = node.id
        self.name = node.name
        self.type = node.type
        self.runtime = node.duration_micros * 1000 if node.duration_micros else 1  # ns; 0 us takes 1 ns
        self.children: list[int] = []
        self.n_parents = 0  # parents not finished yet
        self.instant = False  # finishes when issued (INVALID, roofline COMP of 0 bytes)
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
            self.slot = CPU_SLOT
        elif t == et.COMP_NODE:
            self.slot = GPU_SLOT
        elif t == et.COMM_RECV_NODE:
            self.slot = RECV_SLOT
        else:
            self.slot = COMM_SLOT
        if t == et.COMP_NODE:
            self.category = CAT_CPU if cpu else CAT_GPU
        elif t in (et.COMM_COLL_NODE, et.COMM_SEND_NODE, et.COMM_RECV_NODE):
            self.category = CAT_COMM
        elif t in (et.MEM_LOAD_NODE, et.MEM_STORE_NODE):
            self.category = CAT_MEM
        else:
            self.category = CAT_INVALID
        if cfg.replay_only:
            return
        if t == et.INVALID_NODE:
            self.instant = True
        elif t == et.COMP_NODE and cfg.roofline and not cpu:
            self.num_ops = int_attr(attrs, "num_ops", where)
            self.tensor_size = int_attr(attrs, "tensor_size", where)
            self.instant = self.tensor_size == 0
            if self.num_ops <= 0 and not self.instant:
                raise ReplayError(f"{where}: num_ops must be > 0 in roofline mode (ASTRA-sim divides by the "
                                  "resulting zero performance)")
        elif t in (et.MEM_LOAD_NODE, et.MEM_STORE_NODE):
            if cfg.no_remote_memory:
                raise ReplayError(f"{where}: MEM nodes need remote memory, but the system has "
                                  "NO_MEMORY_EXPANSION (ASTRA-sim exits)")
            self.size = int_attr(attrs, "tensor_size", where)
        elif t in (et.COMM_COLL_NODE, et.COMM_SEND_NODE, et.COMM_RECV_NODE):
            if cpu:
                raise ReplayError(f"{where}: a communication node cannot be a CPU op (ASTRA-sim throws)")
            if t == et.COMM_COLL_NODE:
                self._collective(attrs, groups, where)
            else:
                self._p2p(attrs, rank, cfg, where)

    def _collective(self, attrs: dict[str, Any], groups: dict[int, list[int]], where: str) -> None:
        self.comm_type = int_attr(attrs, "comm_type", where)
        self.size = int_attr(attrs, "comm_size", where)
        self.priority = int_attr(attrs, "comm_priority", where, 0)
        if self.comm_type == et.BROADCAST:
            return
        if self.comm_type not in IMPLEMENTATION_KEYS:
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
        try:
            group = group_id(pg)
        except ValueError:  # including bytes that are not UTF-8
            shown = pg.decode(errors="replace") if isinstance(pg, bytes) else pg
            raise ReplayError(f"{where}: pg_name {shown!r} is not a communicator group id") from None
        if group is not None and group not in groups:
            raise ReplayError(f"{where}: communicator group {group} not found")
        self.group = group

    def _p2p(self, attrs: dict[str, Any], rank: int, cfg: ReplayConfig, where: str) -> None:
        self.size = int_attr(attrs, "comm_size", where)
        self.tag = int_attr(attrs, "comm_tag", where) % COLLECTIVE_TAG_BASE
        if self.type == et.COMM_SEND_NODE:
            src = int_attr(attrs, "comm_src", where, rank)
            if src != rank:
                raise ReplayError(f"{where}: a SEND must be issued by its comm_src ({src})")
            self.peer = int_attr(attrs, "comm_dst", where)
        else:
            dst = int_attr(attrs, "comm_dst", where, rank)
            if dst != rank:
                raise ReplayError(f"{where}: a RECV must be issued by its comm_dst ({dst})")
            self.peer = int_attr(attrs, "comm_src", where)
        if not 0 <= self.peer < cfg.total or self.peer == rank:
            raise ReplayError(f"{where}: peer rank {self.peer} is not another rank of the {cfg.total} NPUs")
