"""System parameters of a replay, read the way ASTRA-sim reads them (defaults, types, units)."""
from __future__ import annotations

import math

from hespas_ml.replay import chakra as et
from hespas_ml.replay.errors import ReplayError
from hespas_ml.replay.system import SystemConfig, parse_implementation

COLLECTIVE_TAG_BASE = 500_000_000  # ASTRA-sim's tag window for collective messages; p2p tags wrap below it

IMPLEMENTATION_KEYS = {  # collective type -> prefix of its "<key>-implementation" system entry
    et.ALL_REDUCE: "all-reduce", et.ALL_GATHER: "all-gather", et.REDUCE_SCATTER: "reduce-scatter",
    et.ALL_TO_ALL: "all-to-all",
}


class ReplayConfig:
    """System parameters shared by all ranks, with ASTRA-sim's defaults and unit conversions."""

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
        # collective type -> per-dimension (algorithm, window); None when the system names none
        self.impls: dict[int, list[tuple[str, int]] | None] = {}
        for comm_type, key in IMPLEMENTATION_KEYS.items():
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
