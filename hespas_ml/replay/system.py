"""ASTRA-sim system configurations: the network, system and remote-memory files, and comm groups.

A `SystemConfig` is what ASTRA-sim's analytical binaries take as `--network-configuration`,
`--system-configuration` and `--remote-memory-configuration`.  `load_system` reads either an ASTRA-sim
folder (network.yml + system.json + remote_memory.json) or a short spec such as

    ring:4x150                 one Ring of 4 NPUs, 150 GB/s per link
    switch:8x400,ring:4x50     two dimensions (dim 0 first), 32 NPUs
    fc:8x300@250               FullyConnected of 8 NPUs, 300 GB/s, 250 ns latency

(topology names ring | fc | fullyconnected | switch, case-insensitive; `NxBW` is NPUs x GB/s; the
optional `@L` is the per-hop latency in ns, default `DEFAULT_LATENCY_NS` = 500 ns).

The system.json built for a spec (documented choices):
    scheduling-policy LIFO, collective-optimization localBWAware, endpoint-delay 10 ns,
    active-chunks-per-dimension 1, preferred-dataset-splits 4, one implementation entry per
    dimension for all four collectives: `ring` on Ring and Switch dimensions, `direct` on
    FullyConnected ones; local-mem-bw = the `local_mem_bw_gbps` argument, else
    `DEFAULT_LOCAL_MEM_BW_GBPS` (1600 GB/s, an A100-class HBM figure).
The remote-memory file is always {"memory-type": "NO_MEMORY_EXPANSION"}.

Bandwidth units follow ASTRA-sim: network GB/s are 2^30 bytes per second, local-mem-bw GB/s are 1e9.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

import yaml

from hespas_ml.replay.errors import SystemConfigError

TOPOLOGIES = ("Ring", "FullyConnected", "Switch")
_SPEC_TOPOLOGY = {"ring": "Ring", "fc": "FullyConnected", "fullyconnected": "FullyConnected", "switch": "Switch"}
DEFAULT_LATENCY_NS = 500.0
DEFAULT_LOCAL_MEM_BW_GBPS = 1600.0
DEFAULT_ENDPOINT_DELAY_NS = 10
DEFAULT_SPLITS = 4

IMPLEMENTATION_KEYS = {
    "all-reduce": "all-reduce-implementation",
    "all-gather": "all-gather-implementation",
    "reduce-scatter": "reduce-scatter-implementation",
    "all-to-all": "all-to-all-implementation",
}
SCHEDULING_POLICIES = ("LIFO", "FIFO", "EXPLICIT")
COLLECTIVE_OPTIMIZATIONS = ("baseline", "localBWAware")
MEMORY_TYPES = ("NO_MEMORY_EXPANSION", "PER_NODE_MEMORY_EXPANSION", "PER_NPU_MEMORY_EXPANSION", "MEMORY_POOL")
NETWORK_FILE, SYSTEM_FILE, REMOTE_MEMORY_FILE = "network.yml", "system.json", "remote_memory.json"


@dataclass
class NetworkDim:
    """One network dimension: its topology block, NPU count, link bandwidth (GB/s) and hop latency (ns)."""

    topology: str  # "Ring" | "FullyConnected" | "Switch"
    npus: int
    bandwidth_gbps: float
    latency_ns: float


@dataclass
class SystemConfig:
    """An ASTRA-sim system: network dimensions, system.json content, remote-memory content, origin."""

    dims: list[NetworkDim]
    system: dict[str, Any]
    remote_memory: dict[str, Any] = field(default_factory=lambda: {"memory-type": "NO_MEMORY_EXPANSION"})
    source: str = "<memory>"

    @property
    def n_npus(self) -> int:
        """Total NPU (rank) count: the product of the per-dimension counts."""
        return prod(d.npus for d in self.dims)

    @property
    def npus_per_dim(self) -> list[int]:
        return [d.npus for d in self.dims]

    @property
    def name(self) -> str:
        """Folder name for a folder, the spec itself for a spec."""
        path = Path(self.source)
        return path.name if path.is_dir() else self.source

    def implementation(self, collective: str) -> list[str] | None:
        """Implementation list of `collective` ("all-reduce", ...), or None when the key is absent."""
        value = self.system.get(IMPLEMENTATION_KEYS[collective])
        return list(value) if value is not None else None


def parse_implementation(name: str) -> tuple[str, int]:
    """(kind, window) of an implementation name; kind in ring, oneRing, direct, oneDirect,
    halvingDoubling, oneHalvingDoubling, doubleBinaryTree; window -1 means all peers."""
    if name in ("ring", "oneRing", "halvingDoubling", "oneHalvingDoubling", "doubleBinaryTree"):
        return name, -1
    for prefix in ("oneDirect", "direct"):
        if name.startswith(prefix):
            rest = name[len(prefix):]
            if rest == "":
                return prefix, -1
            if rest.isdigit() and int(rest) > 0:
                return prefix, int(rest)
    raise ValueError(name)


def _fail(where: str, problem: str) -> SystemConfigError:
    return SystemConfigError(f"{where}: {problem}")


def _number(where: str, key: str, value: Any, *, minimum: float | None = None, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(where, f"{key} must be a number, got {value!r}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise _fail(where, f"{key} must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
    return value


def validate_dims(dims: list[NetworkDim], where: str) -> None:
    """Check topology names, NPU counts (> 1), bandwidths (> 0) and latencies (>= 0)."""
    if not dims:
        raise _fail(where, "the network has no dimension")
    for i, dim in enumerate(dims):
        if dim.topology not in TOPOLOGIES:
            raise _fail(where, f"topology[{i}] {dim.topology!r} is not one of {', '.join(TOPOLOGIES)}")
        if isinstance(dim.npus, bool) or not isinstance(dim.npus, int) or dim.npus < 2:
            raise _fail(where, f"npus_count[{i}] must be an integer > 1, got {dim.npus!r}")
        _number(where, f"bandwidth[{i}]", dim.bandwidth_gbps, minimum=0, strict=True)
        _number(where, f"latency[{i}]", dim.latency_ns, minimum=0)


def validate_system(system: Any, n_dims: int, where: str) -> None:
    """Check the system.json keys that ASTRA-sim reads (unknown keys are ignored, as ASTRA-sim does)."""
    if not isinstance(system, dict):
        raise _fail(where, "system configuration must be a JSON object")
    policy = system.get("scheduling-policy", "LIFO")
    if policy not in SCHEDULING_POLICIES:
        raise _fail(where, f"scheduling-policy {policy!r} is not one of {', '.join(SCHEDULING_POLICIES)}")
    optimization = system.get("collective-optimization", "baseline")
    if optimization not in COLLECTIVE_OPTIMIZATIONS:
        raise _fail(where, f"collective-optimization {optimization!r} is not one of "
                           f"{', '.join(COLLECTIVE_OPTIMIZATIONS)}")
    if "endpoint-delay" in system:
        delay = _number(where, "endpoint-delay", system["endpoint-delay"])
        if int(delay) < 1:
            raise _fail(where, f"endpoint-delay must be >= 1 ns (0 aborts ASTRA-sim), got {delay!r}")
    for key in ("active-chunks-per-dimension", "preferred-dataset-splits"):
        if key not in system:
            if key == "preferred-dataset-splits":
                raise _fail(where, "preferred-dataset-splits is missing (ASTRA-sim divides every collective by it)")
            continue
        value = system[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _fail(where, f"{key} must be an integer >= 1, got {value!r}")
    if "local-mem-bw" in system:
        _number(where, "local-mem-bw", system["local-mem-bw"], minimum=0, strict=True)
    if system.get("roofline-enabled", 0):
        _number(where, "peak-perf", system.get("peak-perf"), minimum=0, strict=True)
        if "local-mem-bw" not in system:
            raise _fail(where, "roofline-enabled needs local-mem-bw")
    for key in IMPLEMENTATION_KEYS.values():
        if key not in system:
            continue
        impls = system[key]
        if not isinstance(impls, list) or not all(isinstance(x, str) for x in impls):
            raise _fail(where, f"{key} must be a list of implementation names")
        if len(impls) != n_dims:
            raise _fail(where, f"{key} has {len(impls)} entries but the network has {n_dims} dimension(s) "
                               "(ASTRA-sim needs one per dimension)")
        for impl in impls:
            try:
                parse_implementation(impl)
            except ValueError:
                raise _fail(where, f"{key}: unknown implementation {impl!r}") from None
    for key in ("all-reduce-implementation-custom", "all-gather-implementation-custom",
                "reduce-scatter-implementation-custom", "all-to-all-implementation-custom",
                "per-node-custom-implementation"):
        if key in system:
            raise _fail(where, f"{key}: custom collective implementations are not supported")


def validate_remote_memory(remote: Any, where: str) -> None:
    if not isinstance(remote, dict):
        raise _fail(where, "remote-memory configuration must be a JSON object")
    kind = remote.get("memory-type")
    if kind not in MEMORY_TYPES:
        raise _fail(where, f"memory-type {kind!r} is not one of {', '.join(MEMORY_TYPES)}")


def default_system(dims: list[NetworkDim], local_mem_bw_gbps: float | None = None) -> dict[str, Any]:
    """The system.json used for a short spec (choices listed in the module docstring)."""
    impls = ["direct" if d.topology == "FullyConnected" else "ring" for d in dims]
    system: dict[str, Any] = {
        "scheduling-policy": "LIFO",
        "endpoint-delay": DEFAULT_ENDPOINT_DELAY_NS,
        "active-chunks-per-dimension": 1,
        "preferred-dataset-splits": DEFAULT_SPLITS,
        "collective-optimization": "localBWAware",
        "local-mem-bw": float(local_mem_bw_gbps if local_mem_bw_gbps is not None else DEFAULT_LOCAL_MEM_BW_GBPS),
    }
    for key in IMPLEMENTATION_KEYS.values():
        system[key] = list(impls)
    return system


_DIM_RE = re.compile(r"^([a-z]+):(\d+)x(\d+(?:\.\d*)?|\.\d+)(?:@(\d+(?:\.\d*)?|\.\d+))?$", re.IGNORECASE)


def parse_spec(spec: str) -> list[NetworkDim]:
    """Network dimensions of a short spec such as `switch:8x400,ring:4x50@700`."""
    dims: list[NetworkDim] = []
    for part in spec.split(","):
        text = part.strip()
        match = _DIM_RE.match(text)
        if not match:
            raise SystemConfigError(
                f"system spec {spec!r}: cannot parse {text!r} (expected TOPOLOGY:NPUSxGBPS[@LATENCY_NS], "
                "e.g. ring:4x150 or switch:8x400@500)")
        topo_name, npus, bandwidth, latency = match.groups()
        topology = _SPEC_TOPOLOGY.get(topo_name.lower())
        if topology is None:
            raise SystemConfigError(f"system spec {spec!r}: unknown topology {topo_name!r} "
                                    "(ring, fc, fullyconnected or switch)")
        dims.append(NetworkDim(topology, int(npus), float(bandwidth),
                               float(latency) if latency is not None else DEFAULT_LATENCY_NS))
    validate_dims(dims, f"system spec {spec!r}")
    return dims


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemConfigError(f"{path}: file does not exist") from None
    except json.JSONDecodeError as exc:
        raise SystemConfigError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    except OSError as exc:
        raise SystemConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None


def load_network(path: Path) -> list[NetworkDim]:
    """Network dimensions of an ASTRA-sim analytical network YAML file."""
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SystemConfigError(f"{path}: file does not exist") from None
    except yaml.YAMLError as exc:
        raise SystemConfigError(f"{path}: invalid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise SystemConfigError(f"{path}: network file must be a YAML mapping")
    lists = {}
    for key in ("topology", "npus_count", "bandwidth", "latency"):
        value = data.get(key)
        if not isinstance(value, list) or not value:
            raise SystemConfigError(f"{path}: {key} must be a non-empty list")
        lists[key] = value
    lengths = {key: len(value) for key, value in lists.items()}
    if len(set(lengths.values())) != 1:
        raise SystemConfigError(f"{path}: topology, npus_count, bandwidth and latency must have equal lengths, "
                                f"got {lengths}")
    dims = [NetworkDim(t, n, b, l) for t, n, b, l in
            zip(lists["topology"], lists["npus_count"], lists["bandwidth"], lists["latency"])]
    validate_dims(dims, str(path))
    for dim in dims:
        dim.bandwidth_gbps = float(dim.bandwidth_gbps)
        dim.latency_ns = float(dim.latency_ns)
    return dims


def load_system(spec: str | Path, *, local_mem_bw_gbps: float | None = None) -> SystemConfig:
    """A SystemConfig from an ASTRA-sim folder or a short spec (see the module docstring).

    For a folder, `local_mem_bw_gbps` (when given) replaces the folder's `local-mem-bw`.
    """
    if local_mem_bw_gbps is not None and (isinstance(local_mem_bw_gbps, bool) or
                                          not isinstance(local_mem_bw_gbps, (int, float)) or local_mem_bw_gbps <= 0):
        raise SystemConfigError(f"{spec}: local_mem_bw_gbps must be a positive number, got {local_mem_bw_gbps!r}")
    text = str(spec)
    path = Path(text)
    if path.is_dir():
        dims = load_network(path / NETWORK_FILE)
        system = _read_json(path / SYSTEM_FILE)
        if isinstance(system, dict) and local_mem_bw_gbps is not None:
            system["local-mem-bw"] = float(local_mem_bw_gbps)
        validate_system(system, len(dims), str(path / SYSTEM_FILE))
        remote = _read_json(path / REMOTE_MEMORY_FILE)
        validate_remote_memory(remote, str(path / REMOTE_MEMORY_FILE))
        return SystemConfig(dims, system, remote, str(path))
    if isinstance(spec, Path) or "/" in text or path.exists():
        raise SystemConfigError(f"{text}: not an ASTRA-sim system folder (expected a directory holding "
                                f"{NETWORK_FILE}, {SYSTEM_FILE} and {REMOTE_MEMORY_FILE})")
    dims = parse_spec(text)
    system = default_system(dims, local_mem_bw_gbps)
    validate_system(system, len(dims), f"system spec {text!r}")
    return SystemConfig(dims, system, {"memory-type": "NO_MEMORY_EXPANSION"}, text)


Placed = list[tuple[NetworkDim, int]]
"""Network dimensions, each with the index of the dimension of the whole system it is (a part of)."""


def _cut(placed: Placed, npus: int, source: str) -> tuple[Placed, Placed]:
    """``placed`` split where its first ``npus`` ranks end: (the dimensions they span, the rest); a
    dimension they end inside is cut in two, each part keeping its topology, bandwidth, latency and index."""
    inner: Placed = []
    outer: Placed = []
    left = npus
    for dim, index in placed:
        if left == 1:
            outer.append((dim, index))
            continue
        if left % dim.npus == 0:
            take = dim.npus
        elif dim.npus % left == 0:
            take = left
        else:
            raise SystemConfigError(f"{source}: its first {npus} NPUs do not make whole groups of its "
                                    f"dimensions ({' x '.join(str(d.npus) for d, _ in placed)})")
        inner.append((NetworkDim(dim.topology, take, dim.bandwidth_gbps, dim.latency_ns), index))
        if dim.npus > take:
            outer.append((NetworkDim(dim.topology, dim.npus // take, dim.bandwidth_gbps, dim.latency_ns), index))
        left //= take
    if left != 1:
        raise SystemConfigError(f"{source}: has {prod(d.npus for d, _ in placed)} NPUs, fewer than {npus}")
    return inner, outer


def _made_of(cfg: SystemConfig, placed: Placed, what: str) -> SystemConfig | None:
    """A system of the ``placed`` dimensions (None for none) with ``cfg``'s settings, each dimension taking
    the collective implementations of the dimension of ``cfg`` it is (a part of)."""
    if not placed:
        return None
    system = dict(cfg.system)
    for key in IMPLEMENTATION_KEYS.values():
        if isinstance(system.get(key), list) and system[key]:
            original = list(system[key])
            system[key] = [original[min(index, len(original) - 1)] for _, index in placed]
    dims = [dim for dim, _ in placed]
    shown = ",".join(f"{d.topology.lower()}:{d.npus}x{d.bandwidth_gbps:g}" for d in dims)
    return SystemConfig(dims, system, dict(cfg.remote_memory), f"{shown} ({what} of {cfg.source})")


def leading_system(cfg: SystemConfig, npus: int) -> SystemConfig | None:
    """The system that ``cfg``'s first ``npus`` ranks make up: its innermost dimensions, the last of them cut
    to what is left of ``npus`` where they end inside it (its topology, bandwidth and latency kept), the
    per-dimension collective implementations to match; None for one rank. A SystemConfigError (one line)
    when ``npus`` ranks do not make whole groups of the dimensions."""
    placed = [(dim, i) for i, dim in enumerate(cfg.dims)]
    return _made_of(cfg, _cut(placed, npus, cfg.source)[0], f"the first {npus} NPUs")


def strided_system(cfg: SystemConfig, stride: int, npus: int) -> SystemConfig | None:
    """The system that ranks 0, ``stride``, 2·``stride``, … (``npus`` of them) of ``cfg`` make up: what is
    left after the first ``stride`` ranks' dimensions, then the first ``npus`` of that (as
    :func:`leading_system` cuts); None for one rank. In a congestion-unaware replay their collectives and
    messages take the time they take on it."""
    placed = [(dim, i) for i, dim in enumerate(cfg.dims)]
    rest = _cut(placed, stride, cfg.source)[1]
    if npus == 1:
        return None
    if not rest:
        raise SystemConfigError(f"{cfg.source}: has {cfg.n_npus} NPUs, fewer than {stride * npus}")
    return _made_of(cfg, _cut(rest, npus, cfg.source)[0], f"its NPUs 0, {stride}, …, {stride * (npus - 1)}")


def network_yaml(dims: list[NetworkDim]) -> str:
    """Text of an analytical network file (flow lists, floats written exactly)."""
    def flow(items: list[Any]) -> str:
        return "[ " + ", ".join(items) + " ]"
    return (f"topology: {flow([d.topology for d in dims])}\n"
            f"npus_count: {flow([str(d.npus) for d in dims])}\n"
            f"bandwidth: {flow([repr(float(d.bandwidth_gbps)) for d in dims])}\n"
            f"latency: {flow([repr(float(d.latency_ns)) for d in dims])}\n")


def write_system(cfg: SystemConfig, out_dir: str | Path) -> dict[str, Path]:
    """Write network.yml, system.json and remote_memory.json into out_dir; returns their paths by role."""
    folder = Path(out_dir)
    validate_dims(cfg.dims, cfg.source)
    validate_system(cfg.system, len(cfg.dims), cfg.source)
    validate_remote_memory(cfg.remote_memory, cfg.source)
    paths = {"network": folder / NETWORK_FILE, "system": folder / SYSTEM_FILE,
             "remote_memory": folder / REMOTE_MEMORY_FILE}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        paths["network"].write_text(network_yaml(cfg.dims))
        paths["system"].write_text(json.dumps(cfg.system, indent=2) + "\n")
        paths["remote_memory"].write_text(json.dumps(cfg.remote_memory, indent=2) + "\n")
    except OSError as exc:
        raise SystemConfigError(f"{folder}: cannot write system files ({exc.strerror or exc})") from None
    return paths


def validate_comm_groups(groups: Any, where: str, n_npus: int | None = None) -> dict[int, list[int]]:
    """Normalised {group id: ranks}; ids are integers > 0 (0 means all ranks), ranks unique and >= 0."""
    if not isinstance(groups, dict):
        raise _fail(where, "communicator groups must be an object mapping group ids to rank lists")
    result: dict[int, list[int]] = {}
    for key, ranks in groups.items():
        try:
            group_id = int(key)
        except (TypeError, ValueError):
            raise _fail(where, f"group key {key!r} is not an integer") from None
        if isinstance(key, bool) or str(group_id) != str(key).strip():
            raise _fail(where, f"group key {key!r} is not an integer")
        if group_id <= 0:
            raise _fail(where, f"group key {key!r}: ids must be > 0 (0 is reserved for all ranks)")
        if group_id in result:
            raise _fail(where, f"group {group_id} is listed twice")
        if not isinstance(ranks, list) or not ranks:
            raise _fail(where, f"group {group_id} must be a non-empty list of ranks")
        for rank in ranks:
            if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
                raise _fail(where, f"group {group_id}: rank {rank!r} is not a non-negative integer")
            if n_npus is not None and rank >= n_npus:
                raise _fail(where, f"group {group_id}: rank {rank} is outside the {n_npus} NPUs of the system")
        if len(set(ranks)) != len(ranks):
            raise _fail(where, f"group {group_id} lists a rank twice")
        result[group_id] = list(ranks)
    return result


def load_comm_groups(path: str | Path, n_npus: int | None = None) -> dict[int, list[int]]:
    """Communicator groups of an ASTRA-sim comm_group.json ({"1": [0, 1], ...}); member order is kept."""
    source = Path(path)
    return validate_comm_groups(_read_json(source), str(source), n_npus)


def write_comm_groups(groups: dict[int, list[int]], path: str | Path) -> Path:
    """Write a comm_group.json (keys as integer strings); returns its path."""
    target = Path(path)
    normalised = validate_comm_groups(groups, str(target))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps({str(k): v for k, v in normalised.items()}) + "\n")
    except OSError as exc:
        raise SystemConfigError(f"{target}: cannot write comm groups ({exc.strerror or exc})") from None
    return target
