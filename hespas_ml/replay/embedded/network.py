"""ASTRA-sim's congestion-unaware analytical network: the delay of one message between two ranks."""
from __future__ import annotations

import math

from hespas_ml.replay.errors import ReplayError
from hespas_ml.replay.system import SystemConfig

_CACHE_LIMIT = 1_000_000  # delays memoised per (src, dst, size), up to this many entries


class Network:
    """Message delays: `floor(hops * latency + bytes / bandwidth)` ns on the first dimension (dim 0
    varies fastest) where the two ranks' coordinates differ.  Hops are the shorter way round on a
    Ring, 1 on FullyConnected and 2 on Switch; bandwidth is GB/s * 2^30 / 1e9 bytes per ns."""

    def __init__(self, system: SystemConfig):
        self.sizes = [d.npus for d in system.dims]
        self.kinds = [d.topology for d in system.dims]
        self.latency = [float(d.latency_ns) for d in system.dims]
        self.bytes_per_ns = [float(d.bandwidth_gbps) * (1 << 30) / 1_000_000_000 for d in system.dims]
        self.strides = [math.prod(self.sizes[:d]) for d in range(len(self.sizes))]
        self._cache: dict[tuple[int, int, int], int] = {}

    def delay(self, src: int, dst: int, size: int) -> int:
        """Time in ns for `size` bytes to travel from rank `src` to rank `dst`."""
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
                if len(self._cache) < _CACHE_LIMIT:
                    self._cache[key] = value
                return value
        raise ReplayError(f"rank {src} sends to itself")
