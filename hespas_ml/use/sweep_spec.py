"""Sweep specs: a YAML file naming workloads × parallelism × targets × fidelities × replays × systems.

::

    name: smoke                        # optional (default: the file name)
    split: fusion                      # how programs are cut into regions (default fusion)
    pipeline: lockstep                 # a pipelined zoo step (mesh pp > 1) as one lock-step program (default)
                                       # or from its stages' own programs (stages: as simulate --pipeline stages)
    workloads:
      - zoo: llama                     # a zoo family; each parameter a value or a list (a grid)
        params: {layers: [1, 2], d_model: 64, heads: 4, vocab: 256, seq: 16, batch: 8}
      - zoo: mlp
        params: {width: [64, 128]}
        parallelism: [{devices: 4, parallel: dp}]   # replaces the sweep-wide list for this workload
      - mlir: programs/step.mlir       # a file (path relative to the spec); devices: N optional
    parallelism:                       # crossed with every zoo workload whose family takes devices
      - {devices: 4, parallel: dp}
      - {devices: 8, parallel: fsdp}
      - {devices: 8, mesh: "dp:2,tp:4"}   # several axes at once (families that take a mesh: llama, gpt)
      - {devices: 8, mesh: auto}          # every pp × dp × fsdp × tp (× ep) mesh of 8 devices, as `layouts`
    targets: [H100, A100-80GB]         # presets or target YAML files
    costs: {H100: 2.5}                 # optional: $ per device-hour, per target
    fidelities: [default]              # default: surrogate:roofline once available, else roofline
    replay: [embedded]                 # embedded (exact; fast path when ranks are symmetric) | astra-sim
    systems:                           # generated for every device count the workloads run on
      topologies: [ring, fc, "switch,ring:2"]   # dims joined by ','; NAME or NAME:NPUS; one dim may
                                                # leave its NPUs out and takes what the count leaves
      bandwidth_gbps: [100, [400, 50]]          # a number (every dim) or one number per dim
      latency_ns: [500]
      specs: ["ring:4x150", path/to/astra-sim-folder]   # explicit systems, used where NPUs match
    chunk_size: 1000                   # configurations per results chunk (default 1000)

Configurations are enumerated program by program (workload grid point × parallelism plan), then
target, fidelity, replay, and system; ``config_id`` is the position in that order. A program whose
parameter combination the zoo rejects (say ``tp`` over more devices than heads) is kept: its
configurations are recorded as failed. Anything else wrong (an unknown family, parameter, target,
fidelity, topology; a system no workload can use) is a :class:`SweepSpecError`, one line naming the file.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..ingest.errors import HespasError

SINGLE_DEVICE = "single device"
REPLAYS = ("embedded", "astra-sim")
PIPELINES = ("lockstep", "stages")
DEFAULT_FIDELITIES = ("surrogate:roofline", "roofline")
PLAN_KEYS = ("devices", "parallel", "mesh")      # what a parallelism plan sets
RESULTS_VERSION = 3     # of the results table's columns: folders written with other columns hold another sweep
DEFAULT_CHUNK = 1000
TOP_KEYS = {"name", "split", "pipeline", "workloads", "parallelism", "targets", "costs", "fidelities", "replay",
            "systems", "chunk_size"}
SYSTEM_KEYS = {"topologies", "bandwidth_gbps", "latency_ns", "specs"}
TOPOLOGY_NAMES = {"ring": "ring", "fc": "fc", "fullyconnected": "fc", "switch": "switch"}


class SweepSpecError(HespasError):
    """A sweep spec is wrong: ``<file>: <problem>`` on one line."""


@dataclass(frozen=True)
class ProgramSpec:
    """One program of the sweep: a workload grid point under one parallelism plan."""

    index: int
    workload: str                   # the model, without devices/parallel (groups rows in reports)
    family: str                     # zoo family, or "mlir"
    source: str                     # canonical zoo spec or .mlir path
    devices: int
    parallel: str                   # "" when the family has no parallel parameter
    params: dict[str, Any]          # the grid parameters the spec names (columns of the results)
    error: str | None = None        # why the zoo rejects this combination (its configs then fail)
    pipeline: str = "lockstep"      # stages: a pipelined step simulated from its stages' programs


@dataclass(frozen=True)
class SystemSpec:
    """One system: what ``load_system`` reads, plus its descriptive columns."""

    name: str                       # spec string, folder path, or "single device"
    topology: str                   # e.g. "switch,ring"
    npus_per_dim: str               # e.g. "2x4"
    bandwidth_gbps: float           # the slowest link
    latency_ns: float               # the slowest hop
    n_npus: int


@dataclass(frozen=True)
class Variant:
    """What, besides the system, a trace set depends on."""

    target: str
    fidelity: str
    replay: str


@dataclass(frozen=True)
class Chunk:
    """A contiguous range of configurations of one program, written as one results file."""

    id: int
    program: int
    variants: tuple[int, ...]       # indices into SweepSpec.variants
    systems: tuple[int, int]        # [start, stop) into the program's system list
    first_config: int

    def n_configs(self) -> int:
        return len(self.variants) * (self.systems[1] - self.systems[0])


@dataclass
class SweepSpec:
    path: str
    name: str
    split: str
    programs: list[ProgramSpec]
    targets: list[str]
    costs: dict[str, float]
    fidelities: list[str]
    replays: list[str]
    systems: dict[int, list[SystemSpec]]          # by device count
    chunk_size: int
    param_columns: dict[str, str]                  # grid parameter -> "int" | "float" | "bool" | "str"
    notes: list[str] = field(default_factory=list)
    # what the names above name, loaded once while the spec is checked (the sweep uses these objects)
    target_objects: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    fidelity_objects: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def variants(self) -> list[Variant]:
        return [Variant(t, f, r) for t in self.targets for f in self.fidelities for r in self.replays]

    def systems_for(self, program: ProgramSpec) -> list[SystemSpec]:
        return self.systems.get(program.devices, [])

    def n_configs(self) -> int:
        v = len(self.variants)
        return sum(v * len(self.systems_for(p)) for p in self.programs)

    def chunks(self) -> list[Chunk]:
        """The results chunks: whole trace sets (one variant × every system of a program) grouped up to
        ``chunk_size`` configurations; a trace set with more systems than that is cut by systems."""
        out: list[Chunk] = []
        first = 0
        nv = len(self.variants)
        for p in self.programs:
            ns = len(self.systems_for(p))
            if ns == 0:
                continue
            if ns >= self.chunk_size:
                for v in range(nv):
                    for s in range(0, ns, self.chunk_size):
                        stop = min(ns, s + self.chunk_size)
                        out.append(Chunk(len(out), p.index, (v,), (s, stop), first))
                        first += stop - s
            else:
                per = max(1, self.chunk_size // ns)
                for v in range(0, nv, per):
                    vs = tuple(range(v, min(nv, v + per)))
                    out.append(Chunk(len(out), p.index, vs, (0, ns), first))
                    first += len(vs) * ns
        return out

    def fingerprint(self) -> str:
        """Hash of everything that decides the configurations and their order (resume checks it)."""
        data = {"results": RESULTS_VERSION, "split": self.split, "programs": [asdict(p) for p in self.programs],
                "targets": self.targets,
                "costs": self.costs, "fidelities": self.fidelities, "replays": self.replays,
                "systems": {str(k): [asdict(s) for s in v] for k, v in sorted(self.systems.items())},
                "chunk_size": self.chunk_size}
        from ..fidelities import changed_label_versions
        changed = changed_label_versions(self.fidelities)
        if changed:                                     # so results of older labels are not resumed into
            data["labels"] = changed
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------ loading

def load_sweep_spec(path: str | Path) -> SweepSpec:
    """Read and check a sweep spec (see the module docstring)."""
    p = Path(path)
    where = str(p)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise SweepSpecError(f"{where}: file does not exist") from None
    except OSError as exc:
        raise SweepSpecError(f"{where}: cannot read ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise SweepSpecError(f"{where}: invalid YAML ({' '.join(str(exc).split())[:200]})") from None
    if not isinstance(data, dict):
        raise SweepSpecError(f"{where}: a sweep spec is a YAML mapping (workloads, targets, systems, …)")
    return _Loader(p, data).load()


def auto_plans(devices: int, entry: Any) -> list[dict[str, Any]]:
    """``mesh: auto``: a plan per mesh of ``devices`` that a layout search over the zoo family ``entry``
    enumerates (pp × dp × fsdp × tp, × ep with experts; as ``hespas-ml layouts`` lays them out); a pipeline
    runs microbatches of one sequence unless the workload names its own ``microbatch``."""
    from ..ingest.zoo.checks import all_meshes, format_mesh, search_axes

    return [{"devices": devices, "mesh": format_mesh(m), **({"microbatch": 1} if m["pp"] > 1 else {})}
            for m in all_meshes(devices, search_axes(entry))]


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


class _Loader:
    def __init__(self, path: Path, data: dict[str, Any]):
        self.path = path
        self.data = data
        self.notes: list[str] = []
        self.target_objects: dict[str, Any] = {}
        self.pipeline = "lockstep"
        self.fidelity_objects: dict[str, Any] = {}

    def fail(self, problem: str) -> SweepSpecError:
        return SweepSpecError(f"{self.path}: {problem}")

    def load(self) -> SweepSpec:
        d = self.data
        unknown = sorted(set(d) - TOP_KEYS)
        if unknown:
            raise self.fail(f"unknown key '{unknown[0]}' (keys: {', '.join(sorted(TOP_KEYS))})")
        for key in ("workloads", "targets", "systems"):
            if not d.get(key):
                raise self.fail(f"'{key}' is missing or empty")
        split = str(d.get("split", "fusion"))
        from ..split.regions import SPLITS
        if split not in SPLITS:
            raise self.fail(f"split '{split}' is not one of {', '.join(SPLITS)}")
        self.pipeline = str(d.get("pipeline", "lockstep"))
        if self.pipeline not in PIPELINES:
            raise self.fail(f"pipeline '{self.pipeline}' is not one of {', '.join(PIPELINES)}")
        targets = self.targets()
        costs = self.costs(targets)
        fidelities = self.fidelities()
        self.note_caveats(fidelities, targets)
        replays = [str(r) for r in _as_list(d.get("replay", ["embedded"]))]
        for r in replays:
            if r not in REPLAYS:
                raise self.fail(f"replay '{r}' is not one of {', '.join(REPLAYS)}")
        chunk = d.get("chunk_size", DEFAULT_CHUNK)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise self.fail(f"chunk_size must be a positive integer, got {chunk!r}")
        programs, columns = self.programs()
        systems = self.systems(sorted({p.devices for p in programs}))
        return SweepSpec(str(self.path), str(d.get("name") or self.path.stem), split, programs, targets, costs,
                         fidelities, replays, systems, chunk, columns, self.notes, self.target_objects,
                         self.fidelity_objects)

    # -- targets, costs, fidelities ----------------------------------------------------------------
    def targets(self) -> list[str]:
        from ..label.targets import load_target
        names: list[str] = []
        for t in _as_list(self.data["targets"]):
            ref = str(t)
            candidate = self.path.parent / ref
            if ("/" in ref or ref.endswith((".yaml", ".yml"))) and candidate.exists():
                ref = str(candidate)
            try:
                target = load_target(ref)
            except HespasError as exc:
                raise self.fail(f"target '{t}': {exc}") from None
            if ref in names:
                raise self.fail(f"target '{t}' is listed twice")
            names.append(ref)
            self.target_objects[ref] = target
        return names

    def costs(self, targets: list[str]) -> dict[str, float]:
        raw = self.data.get("costs") or {}
        if not isinstance(raw, dict):
            raise self.fail("costs must map target names to $ per device-hour")
        out: dict[str, float] = {}
        for name, value in raw.items():
            if str(name) not in targets:
                raise self.fail(f"costs names target '{name}', which is not in targets")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise self.fail(f"cost of '{name}' must be a non-negative number ($ per device-hour)")
            out[str(name)] = float(value)
        return out

    def note_caveats(self, fidelities: list[str], targets: list[str]) -> None:
        """Notes for what a learned fidelity says about a target (e.g. a profiling surrogate on a host-cpu
        that is not the machine it learned)."""
        for name in fidelities:
            caveat = getattr(self.fidelity_objects[name], "caveat", None)
            if callable(caveat):
                self.notes.extend(note for note in dict.fromkeys(caveat(t) for t in targets) if note)

    def fidelities(self) -> list[str]:
        from ..fidelities import get_fidelity
        out: list[str] = []
        for f in _as_list(self.data.get("fidelities", ["default"])):
            name = str(f).strip()
            if name == "default":
                name, fid = resolve_default_fidelity()
                self.notes.append(f"fidelity 'default' is {name}")
            else:
                try:
                    fid = get_fidelity(name)
                except HespasError as exc:
                    raise self.fail(f"fidelity '{f}': {exc}") from None
                except Exception as exc:  # noqa: BLE001 - a fidelity that cannot start is a spec problem
                    raise self.fail(f"fidelity '{f}' cannot be used ({type(exc).__name__}: {exc})") from None
            if name in out:
                raise self.fail(f"fidelity '{name}' is listed twice")
            out.append(name)
            self.fidelity_objects[name] = fid
        return out

    # -- workloads --------------------------------------------------------------------------------
    def programs(self) -> tuple[list[ProgramSpec], dict[str, str]]:
        plans = self.plans(self.data.get("parallelism"), "parallelism")
        programs: list[ProgramSpec] = []
        columns: dict[str, set[str]] = {}
        for i, w in enumerate(_as_list(self.data["workloads"])):
            where = f"workloads[{i}]"
            if not isinstance(w, dict):
                raise self.fail(f"{where} must be a mapping with 'zoo' or 'mlir'")
            if "zoo" in w:
                new = self.zoo_programs(w, where, plans, len(programs))
            elif "mlir" in w:
                new = [self.mlir_program(w, where, len(programs))]
            else:
                raise self.fail(f"{where} names neither 'zoo' (a family) nor 'mlir' (a file)")
            for p in new:
                for k, v in p.params.items():
                    columns.setdefault(k, set()).add(_kind(v))
            programs.extend(new)
        seen: set[str] = set()
        for p in programs:
            if p.source in seen:
                raise self.fail(f"program {p.source} appears twice in the sweep")
            seen.add(p.source)
        return programs, {k: (v.pop() if len(v) == 1 else "float" if v == {"int", "float"} else "str")
                          for k, v in columns.items()}

    def plans(self, raw: Any, where: str) -> list[dict[str, Any]]:
        if raw is None:
            return []
        plans = []
        for j, plan in enumerate(_as_list(raw)):
            if not isinstance(plan, dict) or not set(plan) <= set(PLAN_KEYS) or "devices" not in plan:
                raise self.fail(f"{where}[{j}] must be a mapping with devices (and parallel or mesh), got {plan!r}")
            devices = plan["devices"]
            if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
                raise self.fail(f"{where}[{j}]: devices must be a positive integer, got {devices!r}")
            if "parallel" in plan and "mesh" in plan:
                raise self.fail(f"{where}[{j}]: give parallel or mesh, not both")
            plans.append({k: plan[k] for k in PLAN_KEYS if k in plan})
        return plans

    def zoo_programs(self, w: dict[str, Any], where: str, plans: list[dict[str, Any]],
                     start: int) -> list[ProgramSpec]:
        from ..ingest.zoo import ZOO, canonical_spec, parse_zoo_spec
        from ..ingest.zoo.checks import mesh_of
        from ..ingest.errors import IngestError
        extra = sorted(set(w) - {"zoo", "params", "parallelism"})
        if extra:
            raise self.fail(f"{where}: unknown key '{extra[0]}' (zoo, params, parallelism)")
        family = str(w["zoo"]).strip()
        entry = ZOO.get(family)
        if entry is None:
            raise self.fail(f"{where}: unknown zoo family '{family}' (known: {', '.join(sorted(ZOO))})")
        params = w.get("params") or {}
        if not isinstance(params, dict):
            raise self.fail(f"{where}: params must map parameter names to a value or a list of values")
        for name in params:
            if entry.param(str(name)) is None:
                names = ", ".join(p.name for p in entry.params)
                raise self.fail(f"{where}: {family} has no parameter '{name}' (parameters: {names})")
        if "parallelism" in w:
            plans = self.plans(w["parallelism"], f"{where}.parallelism")
        plans = [q for plan in plans
                 for q in (auto_plans(plan["devices"], entry) if plan.get("mesh") == "auto" else [plan])]
        takes = [k for k in ("devices", "parallel") if entry.param(k) is not None]
        if not takes or any(k in params for k in PLAN_KEYS):
            plans = [{}]
        elif not plans:
            plans = [{}]
        names = list(params)
        grids = [[v for v in _as_list(params[n])] for n in names]
        for n, g in zip(names, grids):
            if not g:
                raise self.fail(f"{where}: parameter '{n}' has an empty list")
        out: list[ProgramSpec] = []
        for values in itertools.product(*grids):
            point = dict(zip(names, values))
            label = family + ("?" + "&".join(f"{k}={_fmt(v)}" for k, v in point.items()
                                             if k not in PLAN_KEYS) if point else "")
            label = label.rstrip("?")
            for plan in plans:
                query = {**point, **{k: v for k, v in plan.items() if entry.param(k) is not None or k == "mesh"}}
                if "microbatch" in point and plan.get("microbatch") is not None:
                    query["microbatch"] = point["microbatch"]          # the workload's own microbatches
                text = f"zoo:{family}" + ("?" + "&".join(f"{k}={_fmt(v)}" for k, v in query.items()) if query else "")
                error, how = None, "lockstep"
                try:
                    fam, parsed = parse_zoo_spec(text)
                    source = canonical_spec(fam, parsed)
                    devices = int(entry.devices(parsed))
                    parallel = str(parsed.get("mesh") or parsed.get("parallel", ""))
                    if self.pipeline == "stages" and mesh_of(parsed).get("pp", 1) > 1:
                        how = "stages"
                except IngestError as exc:
                    error = exc.message
                    source = text
                    devices = int(query.get("devices", 1))
                    parallel = str(query.get("mesh") or query.get("parallel", ""))
                out.append(ProgramSpec(start + len(out), label, family, source, devices, parallel,
                                       {k: v for k, v in point.items() if k not in PLAN_KEYS},
                                       error, how))
        return out

    def mlir_program(self, w: dict[str, Any], where: str, index: int) -> ProgramSpec:
        extra = sorted(set(w) - {"mlir", "devices"})
        if extra:
            raise self.fail(f"{where}: unknown key '{extra[0]}' (mlir, devices)")
        path = Path(str(w["mlir"]))
        if not path.is_absolute():
            path = self.path.parent / path
        if not path.is_file():
            raise self.fail(f"{where}: {path} does not exist")
        devices = w.get("devices")
        if devices is None:
            from ..ingest import parse_file
            try:
                devices = parse_file(path).n_devices
            except HespasError as exc:
                raise self.fail(f"{where}: {exc}") from None
        elif isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise self.fail(f"{where}: devices must be a positive integer")
        return ProgramSpec(index, path.name, "mlir", str(path), int(devices), "", {})

    # -- systems ----------------------------------------------------------------------------------
    def systems(self, device_counts: list[int]) -> dict[int, list[SystemSpec]]:
        raw = self.data["systems"]
        if not isinstance(raw, dict):
            raise self.fail("systems must be a mapping (topologies, bandwidth_gbps, latency_ns, specs)")
        unknown = sorted(set(raw) - SYSTEM_KEYS)
        if unknown:
            raise self.fail(f"systems: unknown key '{unknown[0]}' ({', '.join(sorted(SYSTEM_KEYS))})")
        out: dict[int, list[SystemSpec]] = {n: [] for n in device_counts}
        if 1 in out:
            out[1].append(SystemSpec(SINGLE_DEVICE, "", "1", math.nan, math.nan, 1))
        multi = [n for n in device_counts if n > 1]
        topologies = [self.topology(t) for t in _as_list(raw.get("topologies", []))]
        if topologies:
            bws = [self.per_dim(v, "bandwidth_gbps", positive=True) for v in _as_list(raw.get("bandwidth_gbps", []))]
            lats = [self.per_dim(v, "latency_ns", positive=False) for v in _as_list(raw.get("latency_ns", [500]))]
            if not bws:
                raise self.fail("systems: topologies need bandwidth_gbps (a list of GB/s)")
            for text, dims in topologies:
                fits = [n for n in multi if _resolve(dims, n) is not None]
                if not fits:
                    raise self.fail(f"systems: topology '{text}' fits none of the device counts "
                                    f"({', '.join(map(str, multi)) or 'none above 1'})")
                for bw, lat in itertools.product(bws, lats):
                    for values, what in ((bw, "bandwidth_gbps"), (lat, "latency_ns")):
                        if isinstance(values, list) and len(values) != len(dims):
                            raise self.fail(f"systems: {what} {values} has {len(values)} entries but topology "
                                            f"'{text}' has {len(dims)} dimension(s)")
                    for n in fits:
                        out[n].append(_generated(dims, _resolve(dims, n), bw, lat))
        for spec in _as_list(raw.get("specs", [])):
            system = self.explicit(str(spec))
            if system.n_npus not in out or system.n_npus == 1:
                raise self.fail(f"systems: '{spec}' has {system.n_npus} NPUs but no workload runs on "
                                f"{system.n_npus} devices (device counts: {', '.join(map(str, device_counts))})")
            out[system.n_npus].append(system)
        for n, systems in out.items():
            names = [s.name for s in systems]
            dup = next((x for x in names if names.count(x) > 1), None)
            if dup:
                raise self.fail(f"systems: '{dup}' is listed twice")
            if not systems:
                self.notes.append(f"no system has {n} NPUs: workloads on {n} devices are skipped")
        return out

    def topology(self, entry: Any) -> tuple[str, list[tuple[str, int | None]]]:
        text = str(entry).strip()
        dims: list[tuple[str, int | None]] = []
        for part in text.split(","):
            name, _, npus = part.strip().partition(":")
            topo = TOPOLOGY_NAMES.get(name.strip().lower())
            if topo is None:
                raise self.fail(f"systems: topology '{text}': unknown '{name}' (ring, fc, switch)")
            if npus.strip():
                if not npus.strip().isdigit() or int(npus) < 2:
                    raise self.fail(f"systems: topology '{text}': NPUs of '{part.strip()}' must be an integer > 1")
                dims.append((topo, int(npus)))
            else:
                dims.append((topo, None))
        if sum(1 for _, n in dims if n is None) > 1:
            raise self.fail(f"systems: topology '{text}': at most one dimension may leave its NPUs out")
        return text, dims

    def per_dim(self, value: Any, key: str, positive: bool) -> float | list[float]:
        items = value if isinstance(value, list) else [value]
        for v in items:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (v <= 0 if positive else v < 0):
                raise self.fail(f"systems: {key} entries must be {'positive' if positive else 'non-negative'} "
                                f"numbers or lists of them, got {value!r}")
        return [float(v) for v in value] if isinstance(value, list) else float(value)

    def explicit(self, text: str) -> SystemSpec:
        from ..replay.system import load_system
        candidate = self.path.parent / text
        ref = str(candidate) if ("/" in text and candidate.is_dir()) else text
        try:
            cfg = load_system(ref)
        except HespasError as exc:
            raise self.fail(f"systems: {exc}") from None
        topo = ",".join({"Ring": "ring", "FullyConnected": "fc", "Switch": "switch"}[d.topology] for d in cfg.dims)
        return SystemSpec(ref, topo, "x".join(str(d.npus) for d in cfg.dims),
                          min(d.bandwidth_gbps for d in cfg.dims), max(d.latency_ns for d in cfg.dims), cfg.n_npus)


def _resolve(dims: list[tuple[str, int | None]], n: int) -> list[int] | None:
    """NPUs per dimension for ``n`` devices, or None when the topology cannot hold exactly ``n``."""
    fixed = math.prod(k for _, k in dims if k is not None)
    if any(k is None for _, k in dims):
        if n % fixed or n // fixed < 2:
            return None
        return [k if k is not None else n // fixed for _, k in dims]
    return [k for _, k in dims] if fixed == n else None


def _generated(dims: list[tuple[str, int | None]], npus: list[int], bw: float | list[float],
               lat: float | list[float]) -> SystemSpec:
    bws = bw if isinstance(bw, list) else [bw] * len(dims)
    lats = lat if isinstance(lat, list) else [lat] * len(dims)
    name = ",".join(f"{t}:{k}x{_num(b)}@{_num(l)}" for (t, _), k, b, l in zip(dims, npus, bws, lats))
    return SystemSpec(name, ",".join(t for t, _ in dims), "x".join(map(str, npus)), min(bws), max(lats),
                      math.prod(npus))


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    return "str"


def resolve_default_fidelity() -> tuple[str, Any]:
    """The first of :data:`DEFAULT_FIDELITIES` that :func:`get_fidelity` can build, and the fidelity."""
    from ..fidelities import get_fidelity
    for name in DEFAULT_FIDELITIES[:-1]:
        try:
            return name, get_fidelity(name)
        except Exception:  # noqa: BLE001 - not available (yet): try the next one
            continue
    return DEFAULT_FIDELITIES[-1], get_fidelity(DEFAULT_FIDELITIES[-1])
