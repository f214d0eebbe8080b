"""Replay results: one rank's outcome (ASTRA-sim's end-of-run statistics) and the per-rank summary."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

NS_PER_S = 1e9


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
