"""Import the per-module GPU runtimes that the Hespas authors published for the LLaMA-3 100M 4-device training
step as measured region labels (``datasets/measured/hespas-llama3-100m/``).

The ``hespas.out`` logs of ``imec-int/hespas_workloads`` (kept byte for byte under ``raw/`` in the output
folder) list one line per compute block of Hespas's split, in the order Hespas evaluated them:

* ``Runtime estimate for mini_module_K.mlir - runtime: T`` — block measured with XLA's ``hlo_runner_main``;
* ``Cache hit (J) for mini_module_K.mlir - runtime: T`` — an identical block; it reuses module J's time;
* footer ``Compute Runtime Estimation: S us`` — the sum of every line's T (microseconds).

``K`` is a counter that Hespas's thread pool hands out in completion order, so it does not name the block
reliably. Hespas evaluates the blocks in strictly descending split index, so the j-th line belongs to the
j-th compute block of :func:`hespas_ml.split.hespas_blocks.hespas_blocks` taken from the last one down (its
region from ``split_program(graph, "hespas")``).
The importer checks that matching before writing anything:

* the log's line count, ``Number of splits`` and ``Number of non-expanded ops`` equal our split's;
* the lines group the blocks (a measured line and the cache hits naming it) exactly as our structural
  hashes do;
* the sum of the lines equals the footer, and so does the sum of the written labels over the program's
  compute blocks (each block counted once).

Each label is one distinct block hash on one GPU in one run (log): fidelity ``profiling``, ``target`` the
project's preset, ``seconds`` the measured line's time, ``meta`` the source line (repository, path,
commit, line number), the block, Hespas's K, the line's kind and the cache-hit lines that reuse it.
``labels.parquet`` also holds the roofline's labels of the same regions on the four presets.

    python eval/import_hespas_logs.py
    python eval/import_hespas_logs.py --program ../shared/mlir/maxtext/llama3-100m-4dev.mlir \\
        --out datasets/measured/hespas-llama3-100m
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hespas_ml.host import package_version  # noqa: E402
from hespas_ml.ingest.errors import HespasError  # noqa: E402

REPOSITORY = "imec-int/hespas_workloads"
DEFAULT_PROGRAM = "../shared/mlir/maxtext/llama3-100m-4dev.mlir"
DEFAULT_OUT = "datasets/measured/hespas-llama3-100m"
NAME = "hespas-llama3-100m"
FAMILY = "llama"
SPLIT = "hespas-blocks"

# The published runs of the LLaMA-3 100M step. ``system`` is Hespas's node name (its 4-GPU system
# ``<system>_4GPU``); ``target`` the project's preset with that ``hespas_node``.
RUNS = (
    {"run": "A100-da621cf", "gpu": "A100", "system": "A100_SXM_40GB", "target": "A100-40GB",
     "path": "A100/llama3-100m/hespas.out", "commit": "da621cf8915ef9dd63691b1ea56430a5cde47c1b"},
    {"run": "H100-a793200", "gpu": "H100", "system": "H100_80GB", "target": "H100",
     "path": "H100/llama3-100m/hespas.out", "commit": "a79320049a4de49da46de936c414282ebc1b4787"},
    {"run": "H100-13597cb", "gpu": "H100", "system": "H100_80GB", "target": "H100",
     "path": "H100/llama3-100m/hespas.out", "commit": "13597cb7ab47f0fe42141b34e810b1a234370e79"},
    {"run": "H100-d66a5b8", "gpu": "H100", "system": "H100_80GB", "target": "H100",
     "path": "H100/llama3-100m/hespas.out", "commit": "d66a5b828f05c2da61ccacd4b38f860fd1f42a97"},
    {"run": "H200-a793200", "gpu": "H200", "system": "H200_141GB", "target": "H200",
     "path": "H200/llama3-100m/hespas.out", "commit": "a79320049a4de49da46de936c414282ebc1b4787"},
    {"run": "H200-13597cb", "gpu": "H200", "system": "H200_141GB", "target": "H200",
     "path": "H200/llama3-100m/hespas.out", "commit": "13597cb7ab47f0fe42141b34e810b1a234370e79"},
    {"run": "B200-da621cf", "gpu": "B200", "system": "B200_180GB", "target": "B200",
     "path": "B200/llama3-100m/hespas.out", "commit": "da621cf8915ef9dd63691b1ea56430a5cde47c1b"},
)
# The footer is printed with two decimals.
FOOTER_TOLERANCE_US = 0.005 + 1e-6

_MEASURED = re.compile(r"^Runtime estimate for mini_module_(\d+)\.mlir - runtime: (\S+)$")
_CACHED = re.compile(r"^Cache hit \((\d+)\) for mini_module_(\d+)\.mlir - runtime: (\S+)$")
_FOOTER = re.compile(r"^Compute Runtime Estimation: (\S+) us$")
_HEADER_INT = {"n_ops": re.compile(r"^Number of non-expanded ops:\|\s*(\d+)$"),
               "n_splits": re.compile(r"^Number of splits: (\d+)$"),
               "cache_hits": re.compile(r"^Cache hits: (\d+)$")}


class HespasLogError(HespasError):
    pass


@dataclass(frozen=True)
class LogEntry:
    """One timed line of a Hespas log: ``line`` its 1-based number (lines end at ``\\n``), ``k`` the
    module label it names, ``kind`` ``measured`` or ``cache_hit``, ``source_k`` the label of the measured
    module whose time it carries (``k`` itself for a measurement), ``us`` the time and ``text`` its digits."""

    line: int
    k: int
    kind: str
    source_k: int
    us: float
    text: str


@dataclass
class HespasLog:
    entries: list[LogEntry]
    footer_us: float
    n_ops: int | None = None
    n_splits: int | None = None
    cache_hits: int | None = None

    @property
    def total_us(self) -> float:
        return math.fsum(e.us for e in self.entries)


def parse_log(text: str, origin: str = "<log>") -> HespasLog:
    """Parse a ``hespas.out`` log; raises :class:`HespasLogError` (naming ``origin`` and the line) when a
    timed line is malformed, a cache hit names a module not measured before it or carries another time,
    a module is measured twice, the footer is missing or does not equal the sum of the lines, or the
    ``Cache hits`` count disagrees."""
    entries: list[LogEntry] = []
    measured: dict[int, LogEntry] = {}
    footer = None
    header: dict[str, int] = {}
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if m := _MEASURED.match(line):
            k, value = int(m.group(1)), m.group(2)
            if k in measured:
                raise HespasLogError(f"{origin}:{number}: mini_module_{k} measured a second time "
                                     f"(first at line {measured[k].line})")
            entry = LogEntry(number, k, "measured", k, _time(value, origin, number), value)
            measured[k] = entry
        elif m := _CACHED.match(line):
            j, k, value = int(m.group(1)), int(m.group(2)), m.group(3)
            source = measured.get(j)
            if source is None:
                raise HespasLogError(f"{origin}:{number}: cache hit of mini_module_{j}, which no earlier line "
                                     "measured")
            entry = LogEntry(number, k, "cache_hit", j, _time(value, origin, number), value)
            if entry.us != source.us:
                raise HespasLogError(f"{origin}:{number}: cache hit of mini_module_{j} carries {value} µs, "
                                     f"but line {source.line} measured {source.text} µs")
        elif m := _FOOTER.match(line):
            if footer is not None:
                raise HespasLogError(f"{origin}:{number}: a second 'Compute Runtime Estimation' line")
            footer = _time(m.group(1), origin, number)
            continue
        elif line.startswith(("Runtime estimate", "Cache hit (")):
            raise HespasLogError(f"{origin}:{number}: timed line not understood: {line[:120]!r}")
        else:
            for key, pattern in _HEADER_INT.items():
                if hm := pattern.match(line):
                    header[key] = int(hm.group(1))
            continue
        entries.append(entry)
    if footer is None:
        raise HespasLogError(f"{origin}: no 'Compute Runtime Estimation: … us' footer (log cut short?)")
    log = HespasLog(entries, footer, header.get("n_ops"), header.get("n_splits"), header.get("cache_hits"))
    if abs(log.total_us - footer) > FOOTER_TOLERANCE_US:
        raise HespasLogError(f"{origin}: the {len(entries)} timed lines sum to {log.total_us:.4f} µs, the footer "
                             f"says {footer:.2f} µs")
    hits = sum(1 for e in entries if e.kind == "cache_hit")
    if log.cache_hits is not None and log.cache_hits != hits:
        raise HespasLogError(f"{origin}: {hits} cache-hit lines, the log's 'Cache hits' says {log.cache_hits}")
    return log


def _time(value: str, origin: str, number: int) -> float:
    try:
        us = float(value)
    except ValueError:
        raise HespasLogError(f"{origin}:{number}: runtime {value!r} is not a number") from None
    if not math.isfinite(us) or us < 0:
        raise HespasLogError(f"{origin}:{number}: runtime {value!r} is not a finite time")
    return us


# ------------------------------------------------------------------------------------------ matching

def compute_blocks(graph, everything: list) -> list:
    """The compute blocks of ``everything`` (Hespas's blocks of ``graph``), each with its ``region`` of the
    ``hespas`` split."""
    from types import SimpleNamespace
    from dataclasses import asdict

    from hespas_ml.split.regions import split_program

    compute = [b for b in everything if b.kind == "compute"]
    empty = [b.index for b in compute if not b.op_ids]
    if empty:
        raise HespasLogError(f"{graph.source}: compute block {empty[0]} holds only main's terminator, which the "
                             "hespas split has no region for")
    regions = split_program(graph, "hespas").compute_regions()
    return [SimpleNamespace(**asdict(b), region=r) for b, r in zip(compute, regions)]


def match_blocks(log: HespasLog, blocks: list, hashes: list[str], origin: str) -> list[tuple[Any, LogEntry]]:
    """Pair the j-th line of ``log`` with the j-th of ``blocks`` (compute blocks in split order, hashes
    ``hashes``) counted from the last; checks the counts and that the lines group the blocks exactly as
    the hashes do. Returns ``(block, entry)`` in split order."""
    if len(log.entries) != len(blocks):
        raise HespasLogError(f"{origin}: {len(log.entries)} timed lines for {len(blocks)} compute blocks")
    pairs = list(zip(reversed(blocks), log.entries))[::-1]
    hash_of = {b.index: h for b, h in zip(blocks, hashes)}
    by_group: dict[int, set[str]] = {}
    by_hash: dict[str, set[int]] = {}
    for block, entry in pairs:
        by_group.setdefault(entry.source_k, set()).add(hash_of[block.index])
        by_hash.setdefault(hash_of[block.index], set()).add(entry.source_k)
    split = {k: v for k, v in by_group.items() if len(v) > 1}
    merged = {h: v for h, v in by_hash.items() if len(v) > 1}
    if split or merged:
        what = (f"mini_module_{next(iter(split))}'s lines fall on {len(next(iter(split.values())))} different "
                "block hashes" if split else
                f"hash {next(iter(merged))[:12]}… carries the times of {len(next(iter(merged.values())))} "
                "different measured modules")
        raise HespasLogError(f"{origin}: the log's cache-hit grouping differs from the blocks' hashes ({what}; "
                             f"{len(by_group)} log groups, {len(by_hash)} hashes): not this program's split?")
    return pairs


# ------------------------------------------------------------------------------------------ tables

def _label_schema():
    import pyarrow as pa
    return pa.schema([("hash", pa.string()), ("target", pa.string()), ("fidelity", pa.string()),
                      ("seconds", pa.float64()), ("noise", pa.float64()), ("status", pa.string()),
                      ("reason", pa.string()), ("meta", pa.string()), ("label_s", pa.float64()),
                      ("finished_at", pa.float64())])


def write_block_tables(folder: Path, source: str, graph, blocks: list, hashes: list[str], targets: list,
                       n_collectives: int) -> dict[str, Any]:
    """The dataset tables of the compute blocks' distinct regions (records from
    :mod:`hespas_ml.label.region_records`) and their roofline labels on ``targets``, in ``folder``. Nothing
    in them depends on the clock, so an unchanged import rewrites the same bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hespas_ml.ingest.graph import program_users
    from hespas_ml.label.dataset_tables import (GRAPH_COLUMNS, PROGRAM_COLUMNS, REGION_COLUMNS, write_manifest)
    from hespas_ml.label.region_records import region_features, region_record
    from hespas_ml.label.roofline import RooflineFidelity
    from hespas_ml.split.signature import signature_parts

    users = program_users(graph)
    records: dict[str, dict[str, Any]] = {}
    occurrences: dict[str, int] = {}
    first_region: dict[str, Any] = {}
    for block, digest in zip(blocks, hashes):
        occurrences[digest] = occurrences.get(digest, 0) + 1
        if digest not in records:
            _, order, escapes = signature_parts(block.region, users)
            records[digest] = region_record(block.region, digest, users, order, escapes)
            first_region[digest] = block.region
    regions = {c: [] for c in REGION_COLUMNS}
    graphs = {c: [] for c in GRAPH_COLUMNS}
    for digest, record in records.items():
        features = region_features(record)
        row = {"hash": digest, "family": FAMILY, "families": json.dumps([FAMILY]), "programs": json.dumps([source]),
               "n_programs": 1, "occurrences": occurrences[digest], "executions": occurrences[digest], **features}
        for c in REGION_COLUMNS:
            regions[c].append(row[c])
        graphs["hash"].append(digest)
        graphs["n_nodes"].append(features["n_ops"])
        graphs["n_edges"].append(features["n_edges"])
        graphs["graph"].append(json.dumps(record, separators=(",", ":")))
    pq.write_table(pa.table(regions), folder / "regions.parquet", compression="zstd")
    graph_schema = pa.schema([("hash", pa.string()), ("n_nodes", pa.int64()), ("n_edges", pa.int64()),
                              ("graph", pa.string())])
    pq.write_table(pa.table(graphs, schema=graph_schema), folder / "graphs.parquet", compression="zstd")

    roofline = RooflineFidelity()
    labels: dict[str, list[Any]] = {c: [] for c in _label_schema().names}
    roofline_s: dict[tuple[str, str], float] = {}
    for target in targets:
        for digest, region in first_region.items():
            lab = roofline.label(region, target)
            roofline_s[(target.name, digest)] = lab.seconds
            for c, v in (("hash", digest), ("target", target.name), ("fidelity", "roofline"),
                         ("seconds", lab.seconds), ("noise", 0.0), ("status", lab.status), ("reason", None),
                         ("meta", json.dumps(lab.meta, separators=(",", ":"))), ("label_s", 0.0),
                         ("finished_at", None)):
                labels[c].append(v)
    pq.write_table(pa.table(labels, schema=_label_schema()), folder / "labels.parquet", compression="zstd")

    program = {"source": [source], "family": [FAMILY], "status": ["ok"], "reason": [""], "n_ops": [len(graph.ops)],
               "n_regions": [len(blocks)], "n_unique": [len(records)], "n_collectives": [n_collectives],
               "n_skipped": [0], "truncated": [0], "seconds": [None]}
    prog_schema = pa.schema([(c, pa.string()) if c in ("source", "family", "status", "reason") else
                             (c, pa.float64() if c == "seconds" else pa.int64()) for c in PROGRAM_COLUMNS])
    pq.write_table(pa.table(program, schema=prog_schema), folder / "programs.parquet", compression="zstd")

    target_cols: dict[str, list[Any]] = {"target": [], "ref": [], "fidelities": []}
    for target in targets:
        target_cols["target"].append(target.name)
        target_cols["ref"].append(target.name)
        target_cols["fidelities"].append(json.dumps(["roofline", "profiling"]))
        for k, v in target.to_vector().items():
            target_cols.setdefault(k, []).append(v)
    pq.write_table(pa.table(target_cols), folder / "targets.parquet", compression="zstd")

    manifest = {"format": 1, "spec_path": "eval/import_hespas_logs.py",
                "spec": {"name": NAME, "programs": [{"mlir": source, "family": FAMILY}], "split": SPLIT,
                         "fidelities": {"roofline": {"targets": [t.name for t in targets]},
                                        "profiling": {"targets": [t.name for t in targets],
                                                      "source": REPOSITORY}}},
                "split": SPLIT,
                "versions": {"hespas-ml": package_version("hespas-ml"), "pyarrow": package_version("pyarrow"),
                             "python": sys.version.split()[0]},
                "counts": {"programs": 1, "programs_ok": 1, "programs_failed": 0, "regions_seen": len(blocks),
                           "regions_unique": len(records), "dedup_ratio": len(blocks) / max(1, len(records)),
                           "families": 1, "labels": len(labels["hash"]),
                           "labels_by_fidelity": {"roofline": {"ok": len(labels["hash"])}}}}
    write_manifest(folder, manifest)
    return {"regions": len(records), "roofline_labels": len(labels["hash"]), "records": records,
            "roofline_s": roofline_s}


# ------------------------------------------------------------------------------------------ import

def label_rows(run: dict[str, Any], pairs: list[tuple[Any, LogEntry]], hash_of: dict[int, str],
               raw_name: str) -> list[dict[str, Any]]:
    """One ``profiling`` label per distinct block hash of ``run``: the measured line's time, and its
    provenance in ``meta``."""
    groups: dict[str, list[tuple[Any, LogEntry]]] = {}
    for block, entry in pairs:
        groups.setdefault(hash_of[block.index], []).append((block, entry))
    rows = []
    for digest, members in groups.items():
        measured = [(b, e) for b, e in members if e.kind == "measured"]
        if len(measured) != 1:
            raise HespasLogError(f"{run['run']}: hash {digest[:12]}… has {len(measured)} measured lines")
        block, entry = measured[0]
        meta = {"source": {"repository": REPOSITORY, "path": run["path"], "commit": run["commit"],
                           "line": entry.line},
                "raw_file": raw_name, "run": run["run"], "gpu": run["gpu"], "hespas_system": run["system"],
                "block": block.index, "hespas_k": entry.k, "line_kind": entry.kind, "runtime_us": entry.text,
                "blocks": sorted(b.index for b, _ in members),
                "cache_hits": [{"block": b.index, "line": e.line, "hespas_k": e.k}
                               for b, e in sorted(members, key=lambda m: m[0].index) if e.kind == "cache_hit"],
                "units": "the log's microseconds, as seconds"}
        rows.append({"hash": digest, "target": run["target"], "fidelity": "profiling", "seconds": entry.us * 1e-6,
                     "noise": None, "status": "ok", "reason": None,
                     "meta": json.dumps(meta, separators=(",", ":")), "label_s": None, "finished_at": None})
    return rows


def block_sums(rows: list[dict[str, Any]], blocks: list, hashes: list[str]) -> dict[str, float]:
    """Per run, the sum in µs of the run's labels over the compute blocks (each block once)."""
    per_run: dict[str, dict[str, float]] = {}
    for row in rows:
        run = json.loads(row["meta"])["run"]
        per_run.setdefault(run, {})[row["hash"]] = row["seconds"]
    return {run: math.fsum(values[h] for h in hashes) * 1e6 for run, values in per_run.items()}


def import_logs(program: str, out_dir: str, raw_dir: str | None = None, *, command: str = "",
                verbose: bool = True) -> dict[str, Any]:
    """Build ``out_dir`` from the raw logs in ``raw_dir`` (default ``out_dir/raw``; they are written back
    byte for byte) and the program ``program``. Returns the summary (counts and checks)."""
    from hespas_ml.ingest import load_program
    from hespas_ml.ingest.graph import program_users
    from hespas_ml.label.measured import csv_text, write_measured
    from hespas_ml.label.targets import list_targets, load_target
    from hespas_ml.split.hespas_blocks import hespas_blocks
    from hespas_ml.split.signature import signature_parts

    say = print if verbose else (lambda *a, **k: None)
    out = Path(out_dir)
    raw = Path(raw_dir) if raw_dir else out / "raw"
    raws: dict[str, bytes] = {}
    for run in RUNS:
        path = raw / f"{run['run']}.out"
        try:
            raws[run["run"]] = path.read_bytes()
        except OSError as exc:
            raise HespasLogError(f"{path}: cannot read the raw log ({exc.strerror or exc})") from None
    presets = set(list_targets())
    targets = {}
    for run in RUNS:
        if run["target"] not in presets:
            raise HespasLogError(f"preset target {run['target']} is missing (presets: {', '.join(sorted(presets))})")
        target = load_target(run["target"])
        if target.hespas_node != run["system"]:
            raise HespasLogError(f"preset {target.name} is Hespas node {target.hespas_node}, the log's system is "
                                 f"{run['system']}")
        targets[target.name] = target

    graph = load_program(program)
    everything = hespas_blocks(graph)
    blocks = compute_blocks(graph, everything)
    users = program_users(graph)
    hashes = [signature_parts(b.region, users)[0] for b in blocks]
    n_top = sum(b.n_top for b in everything)
    n_coll = sum(1 for b in everything if b.kind == "collective")
    say(f"{program}: {len(graph.ops)} graph ops, {n_top} top-level ops of main; {len(everything)} blocks "
        f"({len(blocks)} compute, {n_coll} collective), {len(set(hashes))} distinct compute hashes")
    hash_of = {b.index: h for b, h in zip(blocks, hashes)}

    rows: list[dict[str, Any]] = []
    runs_out = []
    for run in RUNS:
        name = f"raw/{run['run']}.out"
        data = raws[run["run"]]
        log = parse_log(data.decode("utf-8"), name)
        if log.n_splits is not None and log.n_splits != len(everything):
            raise HespasLogError(f"{name}: {log.n_splits} splits in the log, {len(everything)} in our split")
        if log.n_ops is not None and log.n_ops != n_top:
            raise HespasLogError(f"{name}: {log.n_ops} top-level ops in the log, {n_top} in our program")
        pairs = match_blocks(log, blocks, hashes, name)
        run_rows = label_rows(run, pairs, hash_of, name)
        rows += run_rows
        mismatched = sorted(b.index for b, e in pairs if e.k != b.index)
        runs_out.append({**run, "raw_file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                         "lines": len(log.entries), "measured": sum(e.kind == "measured" for e in log.entries),
                         "cache_hits": sum(e.kind == "cache_hit" for e in log.entries), "footer_us": log.footer_us,
                         "lines_sum_us": log.total_us, "labels": len(run_rows),
                         "k_differs_from_block": mismatched})
    sums = block_sums(rows, blocks, hashes)
    for entry in runs_out:
        entry["labels_sum_us"] = sums[entry["run"]]
        entry["footer_check"] = abs(entry["labels_sum_us"] - entry["footer_us"]) <= FOOTER_TOLERANCE_US
        if not entry["footer_check"]:
            raise HespasLogError(f"{entry['raw_file']}: labels sum to {entry['labels_sum_us']:.4f} µs over the "
                                 f"{len(blocks)} compute blocks, the footer says {entry['footer_us']:.2f} µs")
    say("run            labels  lines(measured/hits)  sum of labels (µs)  footer (µs)  check  K≠block at")
    for e in runs_out:
        say(f"{e['run']:<14} {e['labels']:>6}  {e['lines']:>4} ({e['measured']}/{e['cache_hits']})"
            f"{e['labels_sum_us']:>22.3f} {e['footer_us']:>12.2f}  {'ok' if e['footer_check'] else 'FAIL'}"
            f"   {e['k_differs_from_block'] or '-'}")

    block_rows = [{"block": b.index, "first_top_op": b.first, "n_top_ops": b.n_top, "n_graph_ops": len(b.op_ids),
                   "hash": h} for b, h in zip(blocks, hashes)]
    with tempfile.TemporaryDirectory(prefix="hespas-blocks-") as tmp:
        info = write_block_tables(Path(tmp), program, graph, blocks, hashes, list(targets.values()), n_coll)
        for entry in runs_out:
            entry["roofline_sum_us"] = math.fsum(info["roofline_s"][(entry["target"], h)] for h in hashes) * 1e6
        summary = {"source": REPOSITORY, "program": program, "split": SPLIT, "blocks": len(everything),
                   "compute_blocks": len(blocks), "collective_blocks": n_coll, "top_level_ops": n_top,
                   "regions": info["regions"], "labels": len(rows), "roofline_labels": info["roofline_labels"],
                   "runs": [{k: e[k] for k in ("run", "target", "commit", "labels", "footer_us", "labels_sum_us",
                                               "footer_check")} for e in runs_out]}
        provenance = {"repository": REPOSITORY, "licence": "MIT, (c) imec (hespas_workloads README)",
                      "program": program, "runs": runs_out}
        files = {"README.md": readme(summary, runs_out, blocks, hashes, command),
                 "provenance.json": json.dumps(provenance, indent=1) + "\n",
                 "blocks.csv": csv_text(block_rows, list(block_rows[0]))}
        try:
            write_measured(out, tmp, rows, summary, files)
        finally:
            (out / "raw").mkdir(parents=True, exist_ok=True)
            for run in RUNS:
                (out / "raw" / f"{run['run']}.out").write_bytes(raws[run["run"]])
    for run in RUNS:
        if (out / "raw" / f"{run['run']}.out").read_bytes() != raws[run["run"]]:
            raise HespasLogError(f"{out / 'raw'}: {run['run']}.out did not come back byte for byte")
    say(f"wrote {out}: {info['regions']} regions, {len(rows)} profiling labels, "
        f"{info['roofline_labels']} roofline labels")
    return summary


def readme(summary: dict[str, Any], runs: list[dict[str, Any]], blocks: list, hashes: list[str], command: str) -> str:
    """The folder's README: provenance first, then the split, the labels and the footer check."""
    sizes = sorted(b.n_top for b in blocks)
    lines = [
        "# Hespas's GPU runtimes of the LLaMA-3 100M step, as region labels",
        "",
        "Per-block runtimes that the Hespas authors measured with XLA on A100, H100, H200 and B200 GPUs for the",
        "LLaMA-3 100M 4-device training step, imported as `profiling` labels of the blocks' regions. The",
        f"program is `{summary['program']}`, the file their logs parse. Written by",
        "`eval/import_hespas_logs.py`; read it with `hespas_ml.label.dataset_tables.load_dataset`.",
        "",
        "## Source and licence",
        "",
        f"The logs are the `hespas.out` files of [`{REPOSITORY}`](https://github.com/{REPOSITORY}),",
        "kept under `raw/` (sizes and SHA-256 below and in `provenance.json`). No clone of that repository",
        "was available here, so each file was rebuilt from the pages a public file index shows of it: its",
        "header and footer as shown, its entry lines from the fixed line template. Each rebuilt file has",
        "the indexed file's length and its text at every page boundary, and its times sum to its footer; an",
        "independent transcription agreed entry for entry. They are data published by imec under the MIT licence,",
        "(c) imec, as that repository's README states; their copyright stays with imec. Nothing else here",
        "comes from Hespas: the split, the hashes and the tables are this project's.",
        "",
        "| run | GPU (Hespas system) | preset | file @ commit | bytes | SHA-256 |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(f"| {r['run']} | {r['gpu']} ({r['system']}) | {r['target']} | `{r['path']}` @ `{r['commit']}` | "
                     f"{r['bytes']} | `{r['sha256']}` |")
    lines += [
        "",
        "The progress-bar line of five logs holds the carriage returns of its redraws; line numbers in the",
        "labels count `\\n` line ends only.",
        "",
        "## What was measured",
        "",
        "Hespas cuts `@main` into blocks: each top-level collective (all-reduce, all-gather, reduce-scatter,",
        "all-to-all, collective-permute) alone, the other top-level ops in runs of at most 1024 (a call or a",
        "loop is one op). Each compute block became its own module, which Hespas lowered to HLO and timed with",
        "`hlo_runner_main --num_repeats=5 --profile_execution=true --hlo_argument_mode=uninitialized` on one",
        "GPU; identical blocks were timed once and the rest logged as cache hits. Times are microseconds per",
        "block execution. Collectives were not timed.",
        "",
        "`hespas_ml.split.hespas_blocks` rebuilds that split on our ingested graph:",
        f"{summary['blocks']} blocks, {summary['compute_blocks']} compute and {summary['collective_blocks']} "
        f"collective, over {summary['top_level_ops']} top-level ops, as each log's header says.",
        f"Compute blocks hold {sizes[0]} to {sizes[-1]} top-level ops "
        f"({sum(1 for n in sizes if n == 1024)} at the 1024 cap); their {len(set(hashes))} distinct",
        f"structural hashes are the {summary['regions']} regions here, and they group the blocks exactly as",
        "each log's cache hits do. `blocks.csv` lists every compute block: split index, first top-level op,",
        "top-level and graph op counts, hash.",
        "",
        "The module number K in a log line is not the block: Hespas hands K out in the order its thread pool",
        "finishes building modules, so K and block disagree around the slow 1024-op block. Hespas times the",
        "blocks in descending split index, and the importer pairs the j-th timed line with the j-th compute",
        "block from the last, then checks that pairing against the cache-hit grouping (above).",
        "",
        "## Labels",
        "",
        f"- {summary['labels']} `profiling` labels: one per distinct hash, GPU and run; `seconds` is the",
        "  measured line's time. Their `meta` names the source line (`source`: repository, path, commit,",
        "  line), `block` (split index), `hespas_k`, `line_kind`, the blocks that share the hash and the",
        "  cache-hit lines that reused the time. Three H100 runs and two H200 runs are kept side by side",
        "  (`meta.run`); filter on it to take one run per GPU. `noise` is unknown (the logs give one number).",
        f"- {summary['roofline_labels']} `roofline` labels of the same regions on the four presets, for",
        "  comparison.",
        "",
        "Check: per run, the labels summed over the program's compute blocks (each block once) equal the",
        "log's footer `Compute Runtime Estimation`, which is a sum of compute blocks, not a step time.",
        "",
        "| run | labels | lines (measured / cache hits) | labels summed over blocks (µs) | footer (µs) | "
        "K ≠ block at | roofline summed (µs) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(f"| {r['run']} | {r['labels']} | {r['lines']} ({r['measured']} / {r['cache_hits']}) | "
                     f"{r['labels_sum_us']:.3f} | {r['footer_us']:.2f} | "
                     f"{', '.join(map(str, r['k_differs_from_block'])) or '—'} | {r['roofline_sum_us']:.1f} |")
    lines += [
        "",
        "## Caveats",
        "",
        "- Each block was timed alone with uninitialised arguments, so its time includes launching its",
        "  kernels and none of the overlap or caching a whole step would see.",
        "- A block's region is our ingested ops of its top-level ops; its kernels are our fusion groups cut",
        "  at the block's edge, a model of what XLA compiled, not the compiled HLO.",
        "- Hespas's mini-modules themselves are not published; the match rests on the counts and the cache-hit",
        "  grouping above.",
    ]
    if command:
        lines += ["", "## Command", "", "```", command.strip(), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--program", default=DEFAULT_PROGRAM, help=f"the LLaMA-3 100M program (default {DEFAULT_PROGRAM})")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"output folder, replaced (default {DEFAULT_OUT})")
    ap.add_argument("--raw", default=None, help="folder of the raw logs <run>.out (default OUT/raw)")
    args = ap.parse_args(argv)
    command = "python eval/import_hespas_logs.py" + "".join(
        f" --{k} {v}" for k, v in (("program", args.program), ("out", args.out), ("raw", args.raw))
        if v is not None and v != {"program": DEFAULT_PROGRAM, "out": DEFAULT_OUT}.get(k))
    try:
        import_logs(args.program, args.out, args.raw, command=command)
    except HespasError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
