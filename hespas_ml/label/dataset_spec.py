"""The dataset spec: which programs to split, and which (target, fidelity) pairs label their regions.

A spec is a YAML file (see ``datasets/README.md`` for the full reference)::

    name: smoke                       # optional (default: the file's stem)
    split: fusion                     # fusion | linear | individual (default fusion)
    programs:
      - zoo: mlp                      # a zoo family (or a spec: "mlp?layers=2&dtype=bf16") …
        grid: {layers: [2, 4], width: [64, 128]}   # cartesian product (a list of grids: their union)
        list: [{batch: 8}, {batch: 64, dtype: bf16}]  # explicit sets, each crossed with the grid
        params: {dtype: f32}          # fixed for every combination (grid and list values win)
        devices: [1, 2]               # shorthands for grid axes over devices / parallel
        parallel: dp
      - mlir: ../shared/conv.mlir     # … or .mlir files (one path or a list), relative to the spec
        family: conv                  # the family recorded in the dataset (default: the file's stem)
    targets: [H100, TPUv4]            # default targets of fidelities that name none (or: all)
    fidelities:
      roofline: {targets: all}
      scalesim: {targets: [TPUv3, TPUv4, sa32.yaml], budget_s: 10, memory_gb: 2, mode: auto}
      profiling: {targets: [host-cpu], budget_s: 0.5, families: [mlp]}   # label only mlp's regions
    caps: {max_regions_per_program: 5000, max_ops_per_region: 2000, skip_empty_regions: true}

Every problem is a :class:`DatasetSpecError` naming the spec file and the key, e.g.
``smoke.yaml: programs[1].grid.layers: 'x' is not an integer``.
"""
from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..ingest.errors import HespasError
from ..split.regions import SPLITS
from .fidelity import options_off_default
from .registry import label_version, labeller_class

KNOWN_FIDELITIES = ("roofline", "scalesim", "profiling")
COMMON_FIDELITY_KEYS = ("targets", "max_regions", "chunk", "families")
SCALESIM_KEYS = ("budget_s", "memory_gb", "mode", "analytical_tail", "workers")
CAP_DEFAULTS: dict[str, Any] = {"max_regions_per_program": None, "max_ops_per_region": None,
                                "skip_empty_regions": True, "max_programs": None}
DEFAULT_CHUNK = {"roofline": 512, "scalesim": 16, "profiling": 4}
MAX_PROGRAMS = 100_000


class DatasetSpecError(HespasError):
    """A dataset spec is invalid: ``<spec file>: <key>: <problem>``."""

    def __init__(self, origin: str, key: str, message: str):
        self.origin, self.key, self.message = origin, key, message
        super().__init__(f"{origin}: {key}: {message}" if key else f"{origin}: {message}")


@dataclass(frozen=True)
class ProgramSpec:
    """One program of the dataset: a canonical zoo spec or an absolute .mlir path, and its family."""

    source: str
    family: str
    origin: str                         # the spec key it came from, e.g. programs[0]

    @property
    def is_zoo(self) -> bool:
        return self.source.startswith("zoo:")


@dataclass(frozen=True)
class TargetRef:
    """A target as the spec names it: a preset name or a path (resolved against the spec's folder)."""

    ref: str
    path: str | None = None             # absolute path for a user YAML, None for a preset

    @property
    def loadable(self) -> str:
        return self.path or self.ref


@dataclass
class FidelitySpec:
    """One fidelity: its targets, options (passed to the fidelity) and per-target caps. ``families``: label
    only the regions that occur in a program of one of these families (None: every region)."""

    name: str
    targets: list[TargetRef]
    options: dict[str, Any] = field(default_factory=dict)
    max_regions: int | None = None
    chunk: int = 1
    families: list[str] | None = None

    def counted_options(self) -> dict[str, Any]:
        """The options labels of this fidelity depend on: those written, less those at the fidelity's own
        default (writing a default down changes nothing) and those that only change how the fidelity runs
        (its ``RUN_OPTIONS``: a time limit, a cache, a worker count)."""
        cls = labeller_class(self.name)
        run = getattr(cls, "RUN_OPTIONS", ())
        return {k: v for k, v in options_off_default(cls, self.options).items() if k not in run}

    def label_version(self) -> int:
        """What this fidelity's labels measure (:func:`~hespas_ml.label.registry.label_version`)."""
        return label_version(self.name)

    def fingerprint(self) -> str:
        """What labels of this fidelity depend on besides the region and target: its counted options and,
        once it changed, its label version."""
        version = self.label_version()
        return _digest([self.name, self.counted_options()] + ([version] if version > 1 else []))

    def older_fingerprints(self) -> list[str]:
        """The fingerprints that folders built by earlier schemes recorded for these options (all of version 1
        labels), oldest first: every option written, every option off its default, the counted options."""
        return [_digest([self.name, self.options]),
                _digest([self.name, options_off_default(labeller_class(self.name), self.options)]),
                _digest([self.name, self.counted_options()])]


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class DatasetSpec:
    """A validated dataset spec."""

    path: Path
    name: str
    split: str
    programs: list[ProgramSpec]
    fidelities: list[FidelitySpec]
    caps: dict[str, Any]
    raw: dict[str, Any]

    def targets(self) -> list[TargetRef]:
        """Every target some fidelity uses, once each, in first-use order."""
        seen: dict[str, TargetRef] = {}
        for f in self.fidelities:
            for t in f.targets:
                seen.setdefault(t.loadable, t)
        return list(seen.values())


# ------------------------------------------------------------------------------------------ helpers

def _fail(origin: str, key: str, message: str) -> DatasetSpecError:
    return DatasetSpecError(origin, key, message)


def _mapping(value: Any, origin: str, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _fail(origin, key, f"expected a mapping, got {type(value).__name__}")
    return value


def _check_keys(data: dict[str, Any], allowed: tuple[str, ...], origin: str, key: str) -> None:
    for k in data:
        if k not in allowed:
            where = f"{key}.{k}" if key else str(k)
            raise _fail(origin, where, f"unknown key (allowed: {', '.join(allowed)})")


def _positive_int(value: Any, origin: str, key: str, allow_none: bool = True) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail(origin, key, f"expected a positive integer, got {value!r}")
    return value


def _positive_number(value: Any, origin: str, key: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value != value \
            or value == float("inf"):
        raise _fail(origin, key, f"expected a positive number, got {value!r}")
    return float(value)


# ------------------------------------------------------------------------------------------ programs

def _values(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


def _zoo_programs(entry: dict[str, Any], origin: str, key: str) -> list[ProgramSpec]:
    from ..ingest.errors import IngestError
    from ..ingest.zoo import ZOO, canonical_spec, parse_zoo_spec

    _check_keys(entry, ("zoo", "grid", "list", "params", "devices", "parallel", "family"), origin, key)
    value = entry["zoo"]
    family, _, query = value.partition("?") if isinstance(value, str) else (value, "", "")
    if not isinstance(family, str) or family.strip() not in ZOO:
        raise _fail(origin, f"{key}.zoo", f"unknown zoo family {family!r} (known: {', '.join(sorted(ZOO))})")
    family = family.strip()
    zoo = ZOO[family]
    fixed: dict[str, Any] = {}
    for item in query.split("&") if query.strip() else []:
        name, eq, text = item.partition("=")
        if not eq:
            raise _fail(origin, f"{key}.zoo", f"parameter '{name}' has no value (write {name}=VALUE)")
        fixed[name.strip()] = text.strip()
    fixed.update(_mapping(entry.get("params"), origin, f"{key}.params"))
    shorthands = {k: _values(entry[k]) for k in ("devices", "parallel") if k in entry}
    grids = entry.get("grid")
    if grids is None:
        grids = [{}]
    elif isinstance(grids, dict):
        grids = [grids]
    elif not isinstance(grids, list) or not grids or not all(isinstance(g, dict) for g in grids):
        raise _fail(origin, f"{key}.grid", "expected a mapping of parameter -> value or list, or a list of them")
    explicit = entry.get("list")
    if explicit is None:
        explicit = [{}]
    elif not isinstance(explicit, list) or not explicit or not all(isinstance(x, dict) for x in explicit):
        raise _fail(origin, f"{key}.list", "expected a non-empty list of parameter mappings")
    # every explicit set × every combination of every grid (a list of grids is their union)
    combos: list[tuple[str, dict[str, Any]]] = []
    for gi, grid in enumerate(grids):
        axes = {**shorthands, **{k: _values(v) for k, v in grid.items()}}
        for k, vs in axes.items():
            if not vs:
                raise _fail(origin, f"{key}.grid.{k}", "empty list of values")
        names = list(axes)
        gkey = f"{key}.grid" + (f"[{gi}]" if len(grids) > 1 else "") if grid else key
        for values in itertools.product(*(axes[n] for n in names)):
            for li, item in enumerate(explicit):
                where = f"{key}.list[{li}]" if item else gkey
                combos.append((where, {**dict(zip(names, values)), **item}))
    if len(combos) > MAX_PROGRAMS:
        raise _fail(origin, key, f"expands to {len(combos)} programs (at most {MAX_PROGRAMS})")
    out = []
    label = entry.get("family", family)
    if not isinstance(label, str) or not label.strip():
        raise _fail(origin, f"{key}.family", "expected a non-empty string")
    for where, combo in combos:
        params = {**fixed, **combo}
        query = []
        for name, value in params.items():
            param = zoo.param(name)
            if param is None:
                names = ", ".join(p.name for p in zoo.params)
                raise _fail(origin, f"{where}.{name}", f"{family} has no parameter '{name}' (parameters: {names})")
            if isinstance(value, (list, dict)) or value is None:
                raise _fail(origin, f"{where}.{name}", f"expected a single value, got {value!r}")
            text = ("true" if value else "false") if isinstance(value, bool) else str(value)
            try:
                param.parse(text)
            except ValueError as exc:
                raise _fail(origin, f"{where}.{name}", str(exc)) from None
            query.append(f"{name}={text}")
        spec = f"zoo:{family}" + ("?" + "&".join(query) if query else "")
        try:
            fam, parsed = parse_zoo_spec(spec)
        except IngestError as exc:
            raise _fail(origin, where, f"{spec}: {exc.message}") from None
        out.append(ProgramSpec(canonical_spec(fam, parsed), label.strip(), where))
    return out


def _mlir_programs(entry: dict[str, Any], base: Path, origin: str, key: str) -> list[ProgramSpec]:
    _check_keys(entry, ("mlir", "family"), origin, key)
    paths = _values(entry["mlir"])
    family = entry.get("family")
    if family is not None and (not isinstance(family, str) or not family.strip()):
        raise _fail(origin, f"{key}.family", "expected a non-empty string")
    out = []
    for i, p in enumerate(paths):
        where = f"{key}.mlir" + (f"[{i}]" if isinstance(entry["mlir"], list) else "")
        if not isinstance(p, str) or not p.strip():
            raise _fail(origin, where, f"expected a path, got {p!r}")
        path = (base / os.path.expanduser(p)).resolve()
        if not path.is_file():
            raise _fail(origin, where, f"no such file: {path}")
        out.append(ProgramSpec(str(path), (family or path.stem).strip(), where))
    return out


def parse_programs(value: Any, base: Path, origin: str, where: str = "programs") -> list[ProgramSpec]:
    """The programs of a list of program entries (``zoo:`` or ``mlir:``, as under a spec's ``programs``),
    each program once; ``where`` names the list in errors."""
    if not isinstance(value, list) or not value:
        raise _fail(origin, where, "expected a non-empty list of program entries (zoo: or mlir:)")
    out: list[ProgramSpec] = []
    for i, entry in enumerate(value):
        key = f"{where}[{i}]"
        if not isinstance(entry, dict):
            raise _fail(origin, key, f"expected a mapping with 'zoo' or 'mlir', got {entry!r}")
        if ("zoo" in entry) == ("mlir" in entry):
            raise _fail(origin, key, "give exactly one of 'zoo' (a family) or 'mlir' (a path)")
        out.extend(_zoo_programs(entry, origin, key) if "zoo" in entry else _mlir_programs(entry, base, origin, key))
    seen: dict[str, str] = {}
    unique = []
    for p in out:                       # the same program named twice is built once
        if p.source not in seen:
            seen[p.source] = p.origin
            unique.append(p)
    return unique


# ------------------------------------------------------------------------------------------ targets

def _targets(value: Any, base: Path, origin: str, key: str) -> list[TargetRef]:
    from .targets import TargetError, list_targets, preset_path, read_target_file

    if value == "all":
        return [TargetRef(name) for name in list_targets()]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise _fail(origin, key, "expected 'all' or a non-empty list of target names / YAML paths")
    out: list[TargetRef] = []
    for i, t in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(t, str) or not t.strip():
            raise _fail(origin, where, f"expected a target name or path, got {t!r}")
        if t == "all":
            out.extend(TargetRef(name) for name in list_targets())
            continue
        if t.endswith((".yaml", ".yml")) or "/" in t:
            path = (base / os.path.expanduser(t)).resolve()
            if not path.is_file():
                raise _fail(origin, where, f"no such target file: {path}")
            try:
                read_target_file(path)
            except TargetError as exc:
                raise _fail(origin, where, str(exc)) from None
            out.append(TargetRef(t, str(path)))
        elif preset_path(t) is None:
            raise _fail(origin, where, f"unknown target {t!r} (presets: {', '.join(list_targets())}, or a "
                                       f"path to a target YAML)")
        else:
            out.append(TargetRef(t))
    unique: dict[str, TargetRef] = {}
    for t in out:
        unique.setdefault(t.loadable, t)
    return list(unique.values())


def _systolic_check(refs: list[TargetRef], origin: str, key: str) -> None:
    from .targets import preset_path, read_target_file

    for i, t in enumerate(refs):
        target = read_target_file(t.path or preset_path(t.ref))
        if target.systolic is None:
            raise _fail(origin, f"{key}[{i}]", f"target {target.name} has no systolic arrays (scalesim needs them)")


# ------------------------------------------------------------------------------------------ fidelities

def _fidelity(name: str, data: Any, default_targets: list[TargetRef] | None, base: Path,
              origin: str) -> FidelitySpec:
    key = f"fidelities.{name}"
    data = _mapping(data, origin, key)
    if "targets" in data:
        targets = _targets(data["targets"], base, origin, f"{key}.targets")
    elif default_targets:
        targets = default_targets
    else:
        raise _fail(origin, f"{key}.targets", "missing (and no top-level 'targets' to default to)")
    max_regions = _positive_int(data.get("max_regions"), origin, f"{key}.max_regions")
    chunk = _positive_int(data.get("chunk", DEFAULT_CHUNK.get(name, 1)), origin, f"{key}.chunk")
    families = data.get("families")
    if families is not None and (not isinstance(families, list) or not families
                                 or not all(isinstance(f, str) and f.strip() for f in families)):
        raise _fail(origin, f"{key}.families", f"expected a non-empty list of family names, got {families!r}")
    options = {k: v for k, v in data.items() if k not in COMMON_FIDELITY_KEYS}
    if name == "roofline":
        _check_keys(options, (), origin, key)
    elif name == "scalesim":
        _check_keys(options, SCALESIM_KEYS, origin, key)
        if "budget_s" in options:
            options["budget_s"] = _positive_number(options["budget_s"], origin, f"{key}.budget_s")
        if "memory_gb" in options:
            options["memory_gb"] = _positive_number(options["memory_gb"], origin, f"{key}.memory_gb")
        if "workers" in options:
            _positive_int(options["workers"], origin, f"{key}.workers", allow_none=False)
        from .scalesim_worker import MODES
        mode = options.get("mode", "auto")
        if mode != "auto" and mode not in MODES:
            raise _fail(origin, f"{key}.mode", f"expected auto or one of {', '.join(MODES)}, got {mode!r}")
        if not isinstance(options.get("analytical_tail", True), bool):
            raise _fail(origin, f"{key}.analytical_tail", "expected true or false")
        _systolic_check(targets, origin, f"{key}.targets")
    else:
        try:
            cls = labeller_class(name)
        except HespasError as exc:
            raise _fail(origin, key, str(exc)) from None
        params = inspect.signature(cls).parameters
        accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for k in options:
            if not accepts_any and k not in params:
                allowed = ", ".join([*COMMON_FIDELITY_KEYS, *params])
                raise _fail(origin, f"{key}.{k}", f"unknown option of {name} (allowed: {allowed})")
        try:
            cls(**options)                  # let the fidelity check its option values now
        except (HespasError, TypeError, ValueError) as exc:
            raise _fail(origin, key, str(exc)) from None
    return FidelitySpec(name, targets, options, max_regions, chunk,
                        sorted({f.strip() for f in families}) if families is not None else None)


def _fidelities(value: Any, default_targets: list[TargetRef] | None, base: Path,
                origin: str) -> list[FidelitySpec]:
    data = _mapping(value, origin, "fidelities")
    if not data:
        raise _fail(origin, "fidelities", "expected a mapping of fidelity name -> options (e.g. roofline: {})")
    out = []
    for name, options in data.items():
        if not isinstance(name, str):
            raise _fail(origin, "fidelities", f"fidelity names are strings, got {name!r}")
        if name not in ("roofline", "scalesim"):
            try:
                labeller_class(name)
            except HespasError as exc:
                raise _fail(origin, f"fidelities.{name}", str(exc)) from None
        out.append(_fidelity(name, options, default_targets, base, origin))
    return out


def _caps(value: Any, origin: str) -> dict[str, Any]:
    data = _mapping(value, origin, "caps")
    _check_keys(data, tuple(CAP_DEFAULTS), origin, "caps")
    caps = dict(CAP_DEFAULTS)
    for k, v in data.items():
        if k == "skip_empty_regions":
            if not isinstance(v, bool):
                raise _fail(origin, f"caps.{k}", f"expected true or false, got {v!r}")
            caps[k] = v
        else:
            caps[k] = _positive_int(v, origin, f"caps.{k}")
    return caps


# ------------------------------------------------------------------------------------------ entry point

TOP_KEYS = ("name", "description", "split", "programs", "targets", "fidelities", "caps")


def load_spec(path: str | os.PathLike[str]) -> DatasetSpec:
    """Read and validate a dataset spec; raises :class:`DatasetSpecError` naming the file and the key."""
    p = Path(path)
    origin = str(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetSpecError(origin, "", f"cannot read the spec: {exc.strerror if isinstance(exc, OSError) else exc}")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise DatasetSpecError(origin, "", f"malformed YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    if not isinstance(raw, dict):
        raise DatasetSpecError(origin, "", "a dataset spec is a YAML mapping (programs, fidelities, …)")
    _check_keys(raw, TOP_KEYS, origin, "")
    base = p.resolve().parent
    name = raw.get("name", p.stem)
    if not isinstance(name, str) or not name.strip():
        raise _fail(origin, "name", "expected a non-empty string")
    split = raw.get("split", "fusion")
    if split not in SPLITS:
        raise _fail(origin, "split", f"expected one of {', '.join(SPLITS)}, got {split!r}")
    programs = parse_programs(raw.get("programs"), base, origin)
    caps = _caps(raw.get("caps"), origin)
    if caps["max_programs"] is not None:
        programs = programs[: caps["max_programs"]]
    default_targets = _targets(raw["targets"], base, origin, "targets") if "targets" in raw else None
    fidelities = _fidelities(raw.get("fidelities"), default_targets, base, origin)
    known = {prog.family for prog in programs}
    for fs in fidelities:
        unknown = sorted(set(fs.families or ()) - known)
        if unknown:
            raise _fail(origin, f"fidelities.{fs.name}.families", f"no program of family {', '.join(unknown)} "
                        f"(the spec's families: {', '.join(sorted(known))})")
    return DatasetSpec(p.resolve(), name.strip(), split, programs, fidelities, caps, raw)
