"""The study spec (a YAML file) and the measured step-time CSV it may name, both validated strictly.

A study runs workloads × targets (× systems for multi-device workloads) through several *sources* of step
times: fidelities (``roofline``, ``scalesim``, ``profiling``, ``surrogate:…``), the same fidelity on other
splits (``roofline@individual``), and measured times. See ``eval/studies/README.md`` for the reference::

    name: smoke                                  # optional (default: the file's stem)
    split: fusion                                # the study's split (default fusion)
    workloads:
      - {name: gemm, program: "zoo:gemm?m=256&n=256&k=256"}      # a zoo spec or a .mlir path
      - {name: mlp-dp, program: "zoo:mlp?parallel=dp", systems: [ring:2x100, ring:4x100]}
    targets: [A100-40GB, H100, TPUv3, TPUv4, host-cpu]           # presets or target YAML paths
    fidelities:
      roofline: {splits: [fusion, individual]}   # default targets: every target
      scalesim: {budget_s: 5, memory_gb: 1}      # default targets: the systolic ones
      profiling: {measure_s: 0.1}                # default targets: host-cpu
      surrogate:scalesim: {targets: [TPUv4], optional: true}     # skipped (with a note) if unavailable
    measured: measured_smoke.csv                 # optional: workload,target,system,runtime_s[,…]
    reference: [measured, profiling, scalesim]   # per configuration, the first source that has it
    transitions: [[A100-40GB, H100], [TPUv3, TPUv4]]             # default: every ordered pair
    top_regions: 15

Every problem raises :class:`StudySpecError` as one line naming the file and the key (or the CSV line).
"""
from __future__ import annotations

import csv
import inspect
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..ingest.errors import HespasError
from ..label.dataset_spec import SCALESIM_KEYS   # the SCALE-Sim options a dataset spec takes
from ..split.regions import SPLITS

SINGLE = "single"                      # the system of a one-device workload
MEASURED = "measured"                  # the source name of measured step times
TOP_KEYS = ("name", "description", "split", "workloads", "targets", "fidelities", "measured", "reference",
            "transitions", "top_regions", "replay")
WORKLOAD_KEYS = ("name", "program", "systems")
COMMON_FIDELITY_KEYS = ("targets", "splits", "optional")
REPLAYS = ("auto", "embedded", "astra-sim")
MEASURED_REQUIRED = ("workload", "target", "system", "runtime_s")
MEASURED_OPTIONAL = ("iqr_s", "repeats", "machine", "date", "method")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


class StudySpecError(HespasError):
    """A study spec or measured CSV is invalid: ``<file>: <key or line>: <problem>``."""

    def __init__(self, origin: str, key: str, message: str):
        self.origin, self.key, self.message = origin, key, message
        super().__init__(f"{origin}: {key}: {message}" if key else f"{origin}: {message}")


@dataclass(frozen=True)
class TargetSpec:
    """A target of the study: its canonical name and what to load (a preset name or an absolute path)."""

    name: str
    load: str
    systolic: bool


@dataclass(frozen=True)
class WorkloadSpec:
    """One workload: a short name, its program (zoo spec or absolute .mlir path) and its systems."""

    name: str
    program: str
    systems: tuple[str, ...] = (SINGLE,)


@dataclass
class SourceSpec:
    """One fidelity on one split: ``name`` is ``fidelity`` for the study's split, else ``fidelity@split``."""

    name: str
    fidelity: str
    split: str
    targets: list[str]                          # canonical target names
    options: dict[str, Any] = field(default_factory=dict)
    optional: bool = False
    origin: str = ""                            # the spec key, e.g. fidelities.scalesim


@dataclass
class StudySpec:
    """A validated study spec."""

    path: Path
    name: str
    split: str
    workloads: list[WorkloadSpec]
    targets: list[TargetSpec]
    sources: list[SourceSpec]
    measured: Path | None
    reference: list[str]
    transitions: list[tuple[str, str]]
    top_regions: int
    replay: str
    raw: dict[str, Any]

    def target(self, name: str) -> TargetSpec:
        return next(t for t in self.targets if t.name == name)

    def source_names(self) -> list[str]:
        return [s.name for s in self.sources]


# ------------------------------------------------------------------------------------------ helpers

def _mapping(value: Any, origin: str, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise StudySpecError(origin, key, f"expected a mapping, got {type(value).__name__}")
    return value


def _check_keys(data: dict[str, Any], allowed: tuple[str, ...], origin: str, key: str) -> None:
    for k in data:
        if k not in allowed:
            where = f"{key}.{k}" if key else str(k)
            raise StudySpecError(origin, where, f"unknown key (allowed: {', '.join(allowed)})")


def _str_list(value: Any, origin: str, key: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v.strip() for v in value):
        raise StudySpecError(origin, key, f"expected a non-empty list of names, got {value!r}")
    return [v.strip() for v in value]


def _positive_int(value: Any, origin: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StudySpecError(origin, key, f"expected a positive integer, got {value!r}")
    return value


# ------------------------------------------------------------------------------------------ sections

def _workloads(value: Any, base: Path, origin: str) -> list[WorkloadSpec]:
    from ..ingest.errors import IngestError
    from ..ingest.zoo import is_zoo_spec, parse_zoo_spec
    from ..replay.system import load_system

    if not isinstance(value, list) or not value:
        raise StudySpecError(origin, "workloads", "expected a non-empty list of {name, program[, systems]}")
    out: list[WorkloadSpec] = []
    for i, entry in enumerate(value):
        key = f"workloads[{i}]"
        if not isinstance(entry, dict):
            raise StudySpecError(origin, key, f"expected a mapping with name and program, got {entry!r}")
        _check_keys(entry, WORKLOAD_KEYS, origin, key)
        name = entry.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise StudySpecError(origin, f"{key}.name", f"expected a short name (letters, digits, _.+-), got {name!r}")
        if any(w.name == name for w in out):
            raise StudySpecError(origin, f"{key}.name", f"workload {name!r} is named twice")
        program = entry.get("program")
        if not isinstance(program, str) or not program.strip():
            raise StudySpecError(origin, f"{key}.program", "expected a zoo spec (zoo:…) or a .mlir path")
        if is_zoo_spec(program):
            try:
                parse_zoo_spec(program)
            except IngestError as exc:
                raise StudySpecError(origin, f"{key}.program", str(exc)) from None
            program = program.strip()
        else:
            path = (base / os.path.expanduser(program)).resolve()
            if not path.is_file():
                raise StudySpecError(origin, f"{key}.program", f"no such file: {path}")
            program = str(path)
        systems = tuple(_str_list(entry.get("systems", [SINGLE]), origin, f"{key}.systems"))
        for j, s in enumerate(systems):
            if s == SINGLE:
                continue
            try:
                load_system(s)
            except HespasError as exc:
                raise StudySpecError(origin, f"{key}.systems[{j}]", str(exc)) from None
        if len(set(systems)) != len(systems):
            raise StudySpecError(origin, f"{key}.systems", "a system is listed twice")
        out.append(WorkloadSpec(name, program, systems))
    return out


def _targets(value: Any, base: Path, origin: str) -> list[TargetSpec]:
    from ..label.targets import load_target

    out: list[TargetSpec] = []
    for i, ref in enumerate(_str_list(value, origin, "targets")):
        load = ref
        if ref.endswith((".yaml", ".yml")) or "/" in ref:
            path = (base / os.path.expanduser(ref)).resolve()
            if not path.is_file():
                raise StudySpecError(origin, f"targets[{i}]", f"no such target file: {path}")
            load = str(path)
        try:
            target = load_target(load)
        except HespasError as exc:
            raise StudySpecError(origin, f"targets[{i}]", str(exc)) from None
        if any(t.name == target.name for t in out):
            raise StudySpecError(origin, f"targets[{i}]", f"target {target.name} is listed twice")
        out.append(TargetSpec(target.name, load, target.systolic is not None))
    return out


def _default_targets(fidelity: str, targets: list[TargetSpec]) -> list[str]:
    from ..label.targets import HOST_CPU

    if fidelity == "scalesim":
        return [t.name for t in targets if t.systolic]
    if fidelity == "profiling":
        return [t.name for t in targets if t.name == HOST_CPU]
    return [t.name for t in targets]


def _check_options(name: str, options: dict[str, Any], origin: str, key: str) -> None:
    """Unknown option keys are spec errors; values are checked when the fidelity is built."""
    from ..fidelities import fidelity_class

    if name == "roofline":
        _check_keys(options, COMMON_FIDELITY_KEYS, origin, key)
        return
    if name == "scalesim":
        _check_keys(options, COMMON_FIDELITY_KEYS + SCALESIM_KEYS, origin, key)
        return
    params = inspect.signature(fidelity_class(name)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    _check_keys(options, COMMON_FIDELITY_KEYS + tuple(params), origin, key)


def _sources(value: Any, split: str, targets: list[TargetSpec], origin: str) -> list[SourceSpec]:
    from ..fidelities import fidelity_class

    data = _mapping(value, origin, "fidelities")
    if not data:
        raise StudySpecError(origin, "fidelities", "expected a mapping of fidelity name -> options (e.g. roofline: {})")
    names = [t.name for t in targets]
    out: list[SourceSpec] = []
    for name, entry in data.items():
        key = f"fidelities.{name}"
        entry = _mapping(entry, origin, key)
        optional = entry.get("optional", False)
        if not isinstance(optional, bool):
            raise StudySpecError(origin, f"{key}.optional", f"expected true or false, got {optional!r}")
        available = True
        try:
            fidelity_class(str(name))
        except HespasError as exc:
            if not optional:
                raise StudySpecError(origin, key, str(exc)) from None
            available = False
        options = {k: v for k, v in entry.items() if k not in COMMON_FIDELITY_KEYS}
        if available:
            _check_options(str(name), entry, origin, key)
        if "targets" in entry:
            tlist = _str_list(entry["targets"], origin, f"{key}.targets")
            canon = {_norm(n): n for n in names}
            resolved = []
            for j, t in enumerate(tlist):
                if _norm(t) not in canon:
                    raise StudySpecError(origin, f"{key}.targets[{j}]", f"{t!r} is not one of the study's targets "
                                                                        f"({', '.join(names)})")
                resolved.append(canon[_norm(t)])
            if name == "scalesim":
                for j, t in enumerate(resolved):
                    if not next(x for x in targets if x.name == t).systolic:
                        raise StudySpecError(origin, f"{key}.targets[{j}]",
                                             f"target {t} has no systolic arrays (scalesim needs them)")
        else:
            resolved = _default_targets(str(name), targets)
        if not resolved and not optional:
            raise StudySpecError(origin, key, "applies to none of the study's targets")
        splits = _str_list(entry.get("splits", [split]), origin, f"{key}.splits")
        for j, s in enumerate(splits):
            if s not in SPLITS:
                raise StudySpecError(origin, f"{key}.splits[{j}]",
                                     f"unknown split {s!r} (choose from {', '.join(SPLITS)})")
        for s in dict.fromkeys(splits):
            sname = str(name) if s == split else f"{name}@{s}"
            out.append(SourceSpec(sname, str(name), s, resolved, options, optional, key))
    return out


def _norm(name: str) -> str:
    return re.sub(r"[\s_.-]", "", name).lower()


def _reference(value: Any, sources: list[SourceSpec], measured: bool, origin: str) -> list[str]:
    if value is None:                   # default: measured times, else the first fidelity listed
        value = [MEASURED] if measured else [sources[0].name]
    chain = _str_list(value, origin, "reference")
    known = [s.name for s in sources]
    for i, r in enumerate(chain):
        if r == MEASURED:
            if not measured:
                raise StudySpecError(origin, f"reference[{i}]", "'measured' needs a measured CSV (key 'measured')")
        elif r not in known:
            raise StudySpecError(origin, f"reference[{i}]", f"unknown source {r!r} (choose from measured, "
                                                            f"{', '.join(known)})")
    if len(set(chain)) != len(chain):
        raise StudySpecError(origin, "reference", "a source is listed twice")
    return chain


def _transitions(value: Any, targets: list[TargetSpec], origin: str) -> list[tuple[str, str]]:
    names = [t.name for t in targets]
    if value is None:
        return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    if not isinstance(value, list) or not value:
        raise StudySpecError(origin, "transitions", "expected a non-empty list of [from, to] target pairs")
    canon = {_norm(n): n for n in names}
    out: list[tuple[str, str]] = []
    for i, pair in enumerate(value):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise StudySpecError(origin, f"transitions[{i}]", f"expected [from, to], got {pair!r}")
        a, b = (canon.get(_norm(p)) for p in pair)
        if a is None or b is None:
            bad = pair[0] if a is None else pair[1]
            raise StudySpecError(origin, f"transitions[{i}]", f"{bad!r} is not one of the study's targets")
        if a == b:
            raise StudySpecError(origin, f"transitions[{i}]", "from and to are the same target")
        out.append((a, b))
    return out


# ------------------------------------------------------------------------------------------ entry points

def load_spec(path: str | os.PathLike[str], *, read_measured_csv: bool = True) -> StudySpec:
    """Read and validate a study spec; :class:`StudySpecError` on the first problem. With
    ``read_measured_csv=False`` the measured CSV may be absent (it is about to be measured) and is not read."""
    p = Path(path)
    origin = str(path)
    if not p.is_file():
        raise StudySpecError(origin, "", "no such study spec")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        first = " ".join(str(exc).split())[:200]
        raise StudySpecError(origin, "", f"not valid YAML ({first})") from None
    if not isinstance(data, dict):
        raise StudySpecError(origin, "", "expected a YAML mapping at the top level")
    _check_keys(data, TOP_KEYS, origin, "")
    base = p.resolve().parent
    name = data.get("name", p.stem)
    if not isinstance(name, str) or not _NAME.match(name):
        raise StudySpecError(origin, "name", f"expected a short name, got {name!r}")
    split = data.get("split", "fusion")
    if split not in SPLITS:
        raise StudySpecError(origin, "split", f"unknown split {split!r} (choose from {', '.join(SPLITS)})")
    replay = data.get("replay", "auto")
    if replay not in REPLAYS:
        raise StudySpecError(origin, "replay", f"expected one of {', '.join(REPLAYS)}, got {replay!r}")
    workloads = _workloads(data.get("workloads"), base, origin)
    targets = _targets(data.get("targets"), base, origin)
    sources = _sources(data.get("fidelities"), split, targets, origin)
    measured = None
    if data.get("measured") is not None:
        if not isinstance(data["measured"], str):
            raise StudySpecError(origin, "measured", "expected the path of a CSV file")
        measured = (base / os.path.expanduser(data["measured"])).resolve()
        if read_measured_csv and not measured.is_file():
            raise StudySpecError(origin, "measured", f"no such file: {measured}")
    reference = _reference(data.get("reference"), sources, measured is not None, origin)
    transitions = _transitions(data.get("transitions"), targets, origin)
    top = _positive_int(data.get("top_regions", 20), origin, "top_regions")
    spec = StudySpec(p.resolve(), name, split, workloads, targets, sources, measured, reference, transitions,
                     top, replay, data)
    if measured is not None and read_measured_csv:
        read_measured(measured, spec)        # fail early on a bad CSV
    return spec


@dataclass(frozen=True)
class Measurement:
    """One measured step time."""

    workload: str
    target: str
    system: str
    runtime_s: float
    extra: dict[str, str] = field(default_factory=dict)


def read_measured(path: str | os.PathLike[str], spec: StudySpec) -> list[Measurement]:
    """The measured CSV: header with ``workload,target,system,runtime_s`` (and optionally
    ``iqr_s,repeats,machine,date,method``), each row a workload, target and system of ``spec`` and a positive
    runtime, no configuration twice. :class:`StudySpecError` names the file and line of the first problem."""
    origin = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise StudySpecError(origin, "", f"cannot read it ({exc.__class__.__name__})") from None
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise StudySpecError(origin, "", "empty (expected a header workload,target,system,runtime_s)")
    reader = csv.reader(lines)
    header = [h.strip() for h in next(reader)]
    for col in header:
        if col not in MEASURED_REQUIRED + MEASURED_OPTIONAL:
            raise StudySpecError(origin, "line 1", f"unknown column {col!r} (allowed: "
                                                   f"{', '.join(MEASURED_REQUIRED + MEASURED_OPTIONAL)})")
    if len(set(header)) != len(header):
        raise StudySpecError(origin, "line 1", "a column is named twice")
    missing = [c for c in MEASURED_REQUIRED if c not in header]
    if missing:
        raise StudySpecError(origin, "line 1", f"missing column(s) {', '.join(missing)}")
    workloads = {w.name: w for w in spec.workloads}
    canon = {_norm(t.name): t.name for t in spec.targets}
    out: list[Measurement] = []
    seen: set[tuple[str, str, str]] = set()
    line_numbers = [i + 1 for i, ln in enumerate(text.splitlines()) if ln.strip() and not ln.lstrip().startswith("#")]
    for n, row in zip(line_numbers[1:], reader):
        where = f"line {n}"
        if len(row) != len(header):
            raise StudySpecError(origin, where, f"{len(row)} fields, expected {len(header)}")
        rec = {h: v.strip() for h, v in zip(header, row)}
        w = workloads.get(rec["workload"])
        if w is None:
            raise StudySpecError(origin, where, f"unknown workload {rec['workload']!r} (the spec has "
                                                f"{', '.join(workloads)})")
        target = canon.get(_norm(rec["target"]))
        if target is None:
            raise StudySpecError(origin, where, f"target {rec['target']!r} is not one of the study's targets")
        if rec["system"] not in w.systems:
            raise StudySpecError(origin, where, f"workload {w.name} runs on {', '.join(w.systems)}, not "
                                                f"{rec['system']!r}")
        runtime = _float(rec["runtime_s"])
        if runtime is None or not runtime > 0:
            raise StudySpecError(origin, where, f"runtime_s {rec['runtime_s']!r} is not a positive number of seconds")
        if "iqr_s" in rec and rec["iqr_s"]:
            iqr = _float(rec["iqr_s"])
            if iqr is None or iqr < 0:
                raise StudySpecError(origin, where, f"iqr_s {rec['iqr_s']!r} is not a non-negative number")
        if "repeats" in rec and rec["repeats"] and not (rec["repeats"].isdigit() and int(rec["repeats"]) > 0):
            raise StudySpecError(origin, where, f"repeats {rec['repeats']!r} is not a positive integer")
        key = (w.name, target, rec["system"])
        if key in seen:
            raise StudySpecError(origin, where, f"{w.name} on {target} ({rec['system']}) is measured twice")
        seen.add(key)
        extra = {k: v for k, v in rec.items() if k in MEASURED_OPTIONAL and v}
        out.append(Measurement(w.name, target, rec["system"], runtime, extra))
    if not out:
        raise StudySpecError(origin, "", "no measurements below the header")
    return out


def _float(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None
