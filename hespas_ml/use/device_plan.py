"""Measurement plans: what to time on a device that is lent for minutes, prepared where there is none.

A plan spec (YAML, e.g. ``eval/device/h100.yaml``) names the target, the training corpus (a dataset spec)
and two lists of whole single-device programs: ``steps`` (families of the corpus) and ``held_out``
(families kept out of training). :func:`build_plan` exports, ingests and splits them all here (through
the dataset builder, so every region is keyed by the same structural hash as the training corpus, and
labelled with the roofline on the target for comparison), chooses the regions to time and writes a plan
folder that the device run (:mod:`hespas_ml.label.device_run`) needs nothing else to read:

* ``plan.json`` — the spec as read, the target, the profiling options, the phases and their shares of a
  run's budget, counts, and the versions and machine the plan was made with;
* ``regions.jsonl.gz`` — one line per region to time, in the order to time them: ``hash``, ``phase``
  (``regions``: the step programs' regions, then a stratified sample of the corpus; ``held_out``: the
  held-out programs' regions), ``family``, ``stratum``, ``module_sha256`` and ``text`` (the region cut out
  of its program, exactly as the profiling fidelity times it);
* ``steps.jsonl.gz`` — one line per whole program: ``id``, ``source``, ``family``, ``phase`` (``steps`` or
  ``held_out``), ``text`` (StableHLO text), ``regions`` (``[hash, executions]`` of its compute regions),
  ``roofline_s`` (the sum of their roofline labels on the target, executions counted);
* the dataset tables of the planned regions (``regions``, ``graphs``, ``programs``, ``targets`` and the
  roofline ``labels`` parquet files, ``manifest.json``), so that measured labels imported next to them
  (:mod:`hespas_ml.label.measured`) form a dataset folder :func:`~hespas_ml.label.dataset_tables.load_dataset`
  reads.

Regions of the corpus are sampled round-robin over strata (op family × element type × size band, see
:func:`stratum`), each stratum in hash order, so that a run cut short has still timed a spread of kinds
and sizes.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

import yaml

from ..host import machine_identity, package_version
from ..ingest.errors import HespasError
from ..label.device_run import PHASES, read_jsonl_gz
from ..label.dataset_spec import DatasetSpec, FidelitySpec, TargetRef, load_spec, parse_programs
from ..label.profiling import ProfilingFidelity
from ..label.targets import load_target

DEFAULT_SHARES = {"regions": 0.55, "steps": 0.2, "held_out": 0.25}
PLAN_KEYS = ("name", "description", "target", "corpus", "corpus_regions", "steps", "held_out", "profiling",
             "step_measure_s", "shares")
PLAN_FORMAT = 1


class PlanError(HespasError):
    pass


def _fail(origin: str, key: str, message: str) -> PlanError:
    return PlanError(f"{origin}: {key}: {message}" if key else f"{origin}: {message}")


def load_plan_spec(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a plan spec; raises :class:`PlanError` naming the file and the key."""
    origin = str(path)
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise _fail(origin, "", f"cannot read the plan spec ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise _fail(origin, "", f"malformed YAML ({' '.join(str(exc).split())[:200]})") from None
    if not isinstance(raw, dict):
        raise _fail(origin, "", "a plan spec is a YAML mapping (target, corpus, steps, …)")
    unknown = sorted(set(raw) - set(PLAN_KEYS))
    if unknown:
        raise _fail(origin, unknown[0], f"unknown key (keys: {', '.join(PLAN_KEYS)})")
    base = Path(path).resolve().parent
    spec: dict[str, Any] = {"path": str(Path(path).resolve()), "name": str(raw.get("name") or Path(path).stem)}
    target = raw.get("target")
    if not isinstance(target, str) or not target.strip():
        raise _fail(origin, "target", "name the target the plan is for (a preset such as H100, or host-cpu)")
    try:
        spec["target"] = load_target(target).name
    except HespasError as exc:
        raise _fail(origin, "target", str(exc)) from None
    corpus = raw.get("corpus")
    if not isinstance(corpus, str):
        raise _fail(origin, "corpus", "give the training corpus's dataset spec (a path)")
    corpus_path = (base / corpus).resolve()
    try:
        spec["corpus"] = load_spec(corpus_path)
    except HespasError as exc:
        raise _fail(origin, "corpus", str(exc)) from None
    n = raw.get("corpus_regions", 2400)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise _fail(origin, "corpus_regions", f"expected a whole number >= 0, got {n!r}")
    spec["corpus_regions"] = n
    for key in ("steps", "held_out"):
        entries = raw.get(key) or []
        try:
            spec[key] = parse_programs(entries, base, origin, key) if entries else []
        except HespasError as exc:
            raise PlanError(str(exc)) from None
    corpus_families = {p.family for p in spec["corpus"].programs}
    mixed = sorted({p.family for p in spec["held_out"]} & corpus_families)
    if mixed:
        raise _fail(origin, "held_out", f"family {', '.join(mixed)} is in the corpus: held-out families are "
                    "families the surrogates never learn from")
    options = raw.get("profiling") or {}
    if not isinstance(options, dict):
        raise _fail(origin, "profiling", "expected a mapping of profiling options")
    try:
        ProfilingFidelity(**options)
    except (HespasError, TypeError) as exc:
        raise _fail(origin, "profiling", str(exc)) from None
    spec["profiling"] = options
    step_s = raw.get("step_measure_s", 2.0)
    if not isinstance(step_s, (int, float)) or isinstance(step_s, bool) or not step_s > 0:
        raise _fail(origin, "step_measure_s", f"expected a positive number of seconds, got {step_s!r}")
    spec["step_measure_s"] = float(step_s)
    shares = {**DEFAULT_SHARES, **(raw.get("shares") or {})}
    if set(shares) != set(PHASES) or not all(isinstance(v, (int, float)) and v >= 0 for v in shares.values()) \
            or not sum(shares.values()) > 0:
        raise _fail(origin, "shares", f"expected non-negative numbers for {', '.join(PHASES)}")
    total = sum(shares.values())
    spec["shares"] = {k: shares[k] / total for k in PHASES}
    spec["description"] = str(raw.get("description") or "")
    return spec


def stratum(row: dict[str, Any]) -> str:
    """A region's sampling stratum: op family, element type and size band (a factor of 10 in the larger
    of its FLOPs and bytes)."""
    from ..split.families import region_family

    kinds = json.loads(row["op_counts"]) if isinstance(row["op_counts"], str) else dict(row["op_counts"])
    size = max(float(row["flops"] or 0.0), float(row["bytes"] or 0.0), 1.0)
    return f"{region_family(kinds)}/{row['dtype']}/1e{int(math.log10(size))}"


def sample_strata(rows: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """Up to ``n`` rows, one stratum after another (round-robin), each stratum in hash order."""
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in sorted(rows, key=lambda r: r["hash"]):
        by[row["stratum"]].append(row)
    queues = [by[k] for k in sorted(by)]
    out: list[dict[str, Any]] = []
    depth = 0
    while len(out) < n and any(depth < len(q) for q in queues):
        for q in queues:
            if depth < len(q) and len(out) < n:
                out.append(q[depth])
        depth += 1
    return out


def _program_text(source: str) -> str:
    """A program's StableHLO as text (bytecode is printed as text; the device may run another jax)."""
    from ..ingest.bindings import mlir
    from ..ingest.zoo import is_zoo_spec, zoo_program

    data = zoo_program(source) if is_zoo_spec(source) else Path(source).read_bytes()
    if isinstance(data, bytes) and data.startswith(b"ML\xefR"):
        ir = mlir()
        with ir.Context() as ctx:
            ctx.allow_unregistered_dialects = True
            return str(ir.Module.parse(data))
    return data.decode() if isinstance(data, bytes) else data


def _region_texts(hashes: list[str], sources: dict[str, list[str]], order: dict[str, int], split: str,
                  progress: bool) -> dict[str, str]:
    """``hash -> module text`` (or ``hash -> "!reason"`` where a region cannot be cut out), re-ingesting
    as few programs as hold every region."""
    from ..units import progress_bar
    from .dataset_labels import cover_programs, program_regions
    from ..label.profiling import extract_region_modules

    out: dict[str, str] = {}
    plan = cover_programs(set(hashes), sources, order)
    bar = progress_bar(len(hashes), "cut out regions", "region", progress)
    for source, wanted in plan:
        bar.update(len(wanted))
        if not source:
            out.update({h: "!no program holds it" for h in wanted})
            continue
        try:
            found = program_regions(source, split, set(wanted))
        except HespasError as exc:
            out.update({h: f"!{exc}" for h in wanted})
            continue
        keys = [h for h in wanted if h in found]
        for digest, module in zip(keys, extract_region_modules([found[h] for h in keys])):
            out[digest] = module if isinstance(module, str) else "!" + str(module.meta.get("reason"))
        out.update({h: "!not found in its program" for h in wanted if h not in found})
    bar.close()
    return out


def _write_jsonl_gz(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    tmp = path.with_suffix(".tmp")
    n = 0
    with gzip.open(tmp, "wt") as fh:
        for row in rows:
            fh.write(json.dumps(row, separators=(",", ":")) + "\n")
            n += 1
    os.replace(tmp, path)
    return n


def _filtered_tables(work: Path, out: Path, hashes: set[str], target: str, sources: set[str]) -> None:
    """The work dataset's tables, restricted to the planned regions and their programs (roofline labels on
    the plan's target only)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from ..label.dataset_tables import write_manifest

    keep = {"regions.parquet": lambda t: pc.is_in(t["hash"], value_set=_array(hashes)),
            "graphs.parquet": lambda t: pc.is_in(t["hash"], value_set=_array(hashes)),
            "labels.parquet": lambda t: pc.and_(pc.is_in(t["hash"], value_set=_array(hashes)),
                                                pc.equal(t["target"], target)),
            "programs.parquet": lambda t: pc.is_in(t["source"], value_set=_array(sources)),
            "targets.parquet": lambda t: pc.equal(t["target"], target)}
    for name, mask in keep.items():
        table = pq.read_table(work / name)
        table = table.filter(mask(table))
        if name == "programs.parquet":
            table = table.set_column(table.schema.get_field_index("source"), "source",
                                     _array_of([relative(s) for s in table["source"].to_pylist()]))
        if name == "regions.parquet":
            table = table.set_column(table.schema.get_field_index("programs"), "programs", _array_of(
                [json.dumps([relative(s) for s in json.loads(v)]) for v in table["programs"].to_pylist()]))
        pq.write_table(table, out / name, compression="zstd")
    manifest = json.loads((work / "manifest.json").read_text())
    manifest["plan"] = {"regions": len(hashes), "programs": len(sources)}
    manifest["spec_path"] = relative(manifest.get("spec_path", ""))
    write_manifest(out, manifest)


def relative(source: str | os.PathLike[str]) -> str:
    """A path or program source as a plan keeps it: a file path relative to the working folder (no machine's
    absolute paths in a committed plan), a zoo spec as it is."""
    text = str(source)
    return os.path.relpath(text) if text.startswith(os.sep) else text


def _array_of(values: list[str]):
    import pyarrow as pa
    return pa.array(values, type=pa.string())


def _array(values: set[str]):
    import pyarrow as pa
    return pa.array(sorted(values), type=pa.string())


def build_plan(spec_path: str | os.PathLike[str], out_dir: str | os.PathLike[str],
               work_dir: str | os.PathLike[str], *, workers: int | None = None,
               progress: bool = True) -> dict[str, Any]:
    """Build the plan folder of the plan spec at ``spec_path`` in ``out_dir`` (see the module docstring).
    ``work_dir`` holds the dataset build of every program (resumable: a second call reuses it)."""
    from .dataset import build_dataset
    from ..label.dataset_cache import BuildCache
    from ..label.dataset_tables import load_dataset

    spec = load_plan_spec(spec_path)
    corpus: DatasetSpec = spec["corpus"]
    programs = list(corpus.programs)
    known = {p.source for p in programs}
    extra = [p for p in spec["steps"] + spec["held_out"] if p.source not in known]
    target = spec["target"]
    combined = DatasetSpec(path=Path(spec["path"]), name=f"plan-{spec['name']}", split=corpus.split,
                           programs=programs + extra,
                           fidelities=[FidelitySpec("roofline", [TargetRef(target)], {}, None, 512)],
                           caps=corpus.caps, raw={"plan": relative(spec["path"]), "corpus": relative(corpus.path)})
    work = Path(work_dir)
    build_dataset(combined, work, workers=workers, progress=progress)
    ds = load_dataset(work)
    with BuildCache(work) as cache:
        occurrences = cache.occurrences()
        status = cache.program_status()
    executions: dict[str, list[list[Any]]] = defaultdict(list)
    sources: dict[str, list[str]] = defaultdict(list)
    for source, split, digest, _, n_exec in occurrences:
        if split == corpus.split:
            executions[source].append([digest, int(n_exec)])
            sources[digest].append(source)
    order = {p.source: i for i, p in enumerate(combined.programs)}
    regions = ds.regions.to_dict("records")
    by_hash = {r["hash"]: r for r in regions}
    roofline = {h: s for h, s, f, st in zip(ds.labels["hash"], ds.labels["seconds"], ds.labels["fidelity"],
                                           ds.labels["status"]) if f == "roofline" and st == "ok"}

    def ok(p) -> bool:
        return status.get((p.source, corpus.split)) == "ok"

    held_sources = {p.source for p in spec["held_out"]}
    corpus_sources = {p.source for p in corpus.programs}
    chosen: dict[str, dict[str, Any]] = {}

    def take(digest: str, phase: str) -> None:
        if digest in by_hash and digest not in chosen:
            row = by_hash[digest]
            chosen[digest] = {"hash": digest, "phase": phase, "family": row["family"], "stratum": stratum(row)}

    for prog in spec["steps"]:
        if ok(prog):
            for digest, _ in sorted(executions[prog.source]):
                take(digest, "regions")
    pool = [dict(r, stratum=stratum(r)) for r in regions
            if r["hash"] not in chosen and any(s in corpus_sources for s in sources.get(r["hash"], ()))]
    for row in sample_strata(pool, max(0, spec["corpus_regions"] - len(chosen))):
        take(row["hash"], "regions")
    for prog in spec["held_out"]:
        if ok(prog):
            for digest, _ in sorted(executions[prog.source]):
                if not any(s not in held_sources for s in sources.get(digest, ())):
                    take(digest, "held_out")
    # regions a held-out program shares with the corpus are timed in the corpus phase (kept above)

    texts = _region_texts(list(chosen), sources, order, corpus.split, progress)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    region_lines = []
    skipped: dict[str, str] = {}
    for digest, row in chosen.items():
        text = texts.get(digest, "!not cut out")
        if text.startswith("!"):
            skipped[digest] = text[1:]
            continue
        region_lines.append({**row, "module_sha256": hashlib.sha256(text.encode()).hexdigest(), "text": text})
    step_lines = []
    for phase, progs in (("steps", spec["steps"]), ("held_out", spec["held_out"])):
        for prog in progs:
            if not ok(prog):
                skipped[prog.source] = "the program did not export or split"
                continue
            regs = sorted(executions[prog.source])
            try:
                text = _program_text(prog.source)
            except (HespasError, OSError, ValueError) as exc:
                skipped[prog.source] = f"cannot print the program: {exc}"
                continue
            step_lines.append({"id": f"{phase}:{len(step_lines)}", "source": prog.source, "family": prog.family,
                               "phase": phase, "regions": regs, "text": text,
                               "roofline_s": sum(n * roofline.get(h, math.nan) for h, n in regs)})
    n_regions = _write_jsonl_gz(out / "regions.jsonl.gz", region_lines)
    n_steps = _write_jsonl_gz(out / "steps.jsonl.gz", step_lines)
    planned = {r["hash"] for r in region_lines} | {h for s in step_lines for h, _ in s["regions"]}
    _filtered_tables(work, out, planned, target, {s["source"] for s in step_lines} |
                     {src for h in planned for src in sources.get(h, ())[:1]})
    counts: dict[str, int] = defaultdict(int)
    for r in region_lines:
        counts[f"regions_{r['phase']}"] += 1
    for s in step_lines:
        counts[f"programs_{s['phase']}"] += 1
    plan = {"format": PLAN_FORMAT, "name": spec["name"], "description": spec["description"], "target": target,
            "spec": relative(spec["path"]), "corpus": relative(corpus.path), "split": corpus.split,
            "profiling": spec["profiling"], "step_measure_s": spec["step_measure_s"], "shares": spec["shares"],
            "counts": dict(counts), "skipped": skipped, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "made_with": {"hespas_ml": package_version("hespas-ml"), "jax": package_version("jax"),
                          "machine": machine_identity()}}
    (out / "plan.json").write_text(json.dumps(plan, indent=1))
    return {"regions": n_regions, "steps": n_steps, **counts, "skipped": len(skipped)}


__all__ = ["PHASES", "PlanError", "build_plan", "load_plan_spec", "read_jsonl_gz", "sample_strata", "stratum"]
