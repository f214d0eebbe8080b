"""The tables of a built dataset, how they are written from the build cache, and :func:`load_dataset`.

A dataset folder holds (every file written to a temporary name and renamed into place):

* ``regions.parquet`` — one row per unique compute region: ``hash``, ``family`` (of the first program in
  spec order that has it), ``families`` / ``programs`` (JSON lists), ``n_programs``, ``occurrences``
  (regions with this hash over all programs), ``executions`` (the same, weighted by loop trip counts),
  ``n_ops``, ``n_kernels``, ``n_edges``, ``op_counts`` (JSON map kind → ops), ``matrix_flops``,
  ``vector_flops``, ``flops``, ``transcendentals``, ``bytes`` (at kernel boundaries), ``dtype`` (main
  element type), ``input_shapes`` / ``output_shapes`` (JSON lists like ``"64x256xf32"``), ``input_bytes``,
  ``output_bytes``, ``unmodelled``.
* ``labels.parquet`` — ``hash``, ``target``, ``fidelity``, ``seconds`` (one execution; null when failed),
  ``noise`` (IQR / median of the measurement; 0 for deterministic fidelities), ``status`` (ok | failed),
  ``reason``, ``meta`` (JSON), ``label_s`` (time spent making the label), ``finished_at`` (unix time).
* ``graphs.parquet`` — ``hash``, ``n_nodes``, ``n_edges``, ``graph``: the region record as JSON (schema in
  :mod:`hespas_ml.label.region_records`).
* ``programs.parquet`` — each program of the spec: ``source``, ``family``, ``status``, ``reason`` and its
  op / region counts.
* ``targets.parquet`` — each target used: ``target``, ``ref`` (as the spec names it), ``fidelities`` (JSON)
  and the columns of :meth:`~hespas_ml.label.targets.Target.to_vector`.
* ``manifest.json`` — the spec, versions, counts and timings.
* ``cache.sqlite`` — the build cache (resume state); not needed to read the dataset.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..host import package_version
from .dataset_cache import BuildCache, DatasetError

FORMAT_VERSION = 1
_UMASK = os.umask(0o022)
os.umask(_UMASK)
REGION_COLUMNS = ("hash", "family", "families", "programs", "n_programs", "occurrences", "executions", "n_ops",
                  "n_kernels", "n_edges", "op_counts", "matrix_flops", "vector_flops", "flops", "transcendentals",
                  "bytes", "dtype", "input_shapes", "output_shapes", "input_bytes", "output_bytes", "unmodelled")
LABEL_COLUMNS = ("hash", "target", "fidelity", "seconds", "noise", "status", "reason", "meta", "label_s",
                 "finished_at")
GRAPH_COLUMNS = ("hash", "n_nodes", "n_edges", "graph")
PROGRAM_COLUMNS = ("source", "family", "status", "reason", "n_ops", "n_regions", "n_unique", "n_collectives",
                   "n_skipped", "truncated", "seconds")
TABLES = {"regions.parquet": REGION_COLUMNS, "labels.parquet": LABEL_COLUMNS, "graphs.parquet": GRAPH_COLUMNS,
          "programs.parquet": PROGRAM_COLUMNS, "targets.parquet": ("target", "ref", "fidelities")}


def _atomic(path: Path, write) -> None:
    """Call ``write(tmp_path)`` and rename the result onto ``path``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_parquet(path: Path, columns: dict[str, list[Any]], schema=None) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(columns, schema=schema)
    _atomic(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"))


# ------------------------------------------------------------------------------------------ writing

def write_tables(spec, cache: BuildCache, hashes: list[str], run: dict[str, Any],
                 progress: bool = True) -> dict[str, Any]:
    """Write every table and the manifest for ``hashes`` (the spec's unique regions); returns the summary."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = cache.dir
    order = {p.source: i for i, p in enumerate(spec.programs)}
    family_of = {p.source: p.family for p in spec.programs}
    programs_rows = {(r["source"], r["split"]): r for r in cache.programs()}
    # provenance of each region, in spec order
    prov: dict[str, list[tuple[int, str, int, int]]] = {}
    for source, split, digest, occ, execs in cache.occurrences():
        if split == spec.split and source in order and programs_rows.get((source, split), {}).get("status") == "ok":
            prov.setdefault(digest, []).append((order[source], source, occ, execs))
    wanted = set(hashes)
    region_cols: dict[str, list[Any]] = {c: [] for c in REGION_COLUMNS}
    graph_schema = pa.schema([("hash", pa.string()), ("n_nodes", pa.int64()), ("n_edges", pa.int64()),
                              ("graph", pa.string())])
    graphs_tmp = tempfile.mkstemp(prefix=".graphs.parquet.", suffix=".tmp", dir=out)
    os.close(graphs_tmp[0])
    writer = pq.ParquetWriter(graphs_tmp[1], graph_schema, compression="zstd")
    batch: dict[str, list[Any]] = {c: [] for c in GRAPH_COLUMNS}
    try:
        for digest, record_json, features_json in cache.region_rows(hashes):
            features = json.loads(features_json)
            src = sorted(prov.get(digest, []))
            families = list(dict.fromkeys(family_of[s] for _, s, _, _ in src))
            row = {"hash": digest, "family": families[0] if families else "", "families": json.dumps(families),
                   "programs": json.dumps([s for _, s, _, _ in src]), "n_programs": len(src),
                   "occurrences": sum(o for _, _, o, _ in src), "executions": sum(e for _, _, _, e in src),
                   **features}
            for c in REGION_COLUMNS:
                region_cols[c].append(row[c])
            batch["hash"].append(digest)
            batch["n_nodes"].append(features["n_ops"])
            batch["n_edges"].append(features["n_edges"])
            batch["graph"].append(record_json)
            if len(batch["hash"]) >= 1000:
                writer.write_table(pa.table(batch, schema=graph_schema))
                batch = {c: [] for c in GRAPH_COLUMNS}
        if batch["hash"]:
            writer.write_table(pa.table(batch, schema=graph_schema))
        writer.close()
        os.chmod(graphs_tmp[1], 0o666 & ~_UMASK)
        with open(graphs_tmp[1], "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(graphs_tmp[1], out / "graphs.parquet")
    except BaseException:
        Path(graphs_tmp[1]).unlink(missing_ok=True)
        raise
    _write_parquet(out / "regions.parquet", region_cols)

    # labels of this spec's (fidelity, target) pairs on its regions
    pairs = set()
    targets_used: dict[str, dict[str, Any]] = {}
    from .targets import load_target
    for fs in spec.fidelities:
        for ref in fs.targets:
            target = load_target(ref.loadable)
            pairs.add((fs.name, target.name))
            entry = targets_used.setdefault(target.name, {"target": target, "ref": ref.ref, "fidelities": []})
            entry["fidelities"].append(fs.name)
    label_cols: dict[str, list[Any]] = {c: [] for c in LABEL_COLUMNS}
    for row in cache.labels():
        if row[0] in wanted and (row[2], row[1]) in pairs:
            for c, v in zip(LABEL_COLUMNS, row):
                label_cols[c].append(v)
    label_schema = pa.schema([("hash", pa.string()), ("target", pa.string()), ("fidelity", pa.string()),
                              ("seconds", pa.float64()), ("noise", pa.float64()), ("status", pa.string()),
                              ("reason", pa.string()), ("meta", pa.string()), ("label_s", pa.float64()),
                              ("finished_at", pa.float64())])
    _write_parquet(out / "labels.parquet", label_cols, label_schema)

    prog_cols: dict[str, list[Any]] = {c: [] for c in PROGRAM_COLUMNS}
    for p in spec.programs:
        r = programs_rows.get((p.source, spec.split), {"source": p.source, "status": "missing"})
        r = {**r, "family": p.family}
        for c in PROGRAM_COLUMNS:
            prog_cols[c].append(r.get(c))
    prog_schema = pa.schema([(c, pa.string()) if c in ("source", "family", "status", "reason") else
                             (c, pa.float64() if c == "seconds" else pa.int64()) for c in PROGRAM_COLUMNS])
    _write_parquet(out / "programs.parquet", prog_cols, prog_schema)

    target_cols: dict[str, list[Any]] = {"target": [], "ref": [], "fidelities": []}
    for name, entry in targets_used.items():
        target_cols["target"].append(name)
        target_cols["ref"].append(entry["ref"])
        target_cols["fidelities"].append(json.dumps(entry["fidelities"]))
        for k, v in entry["target"].to_vector().items():
            target_cols.setdefault(k, []).append(v)
    _write_parquet(out / "targets.parquet", target_cols)

    summary = _summary(spec, programs_rows, prov, hashes, label_cols, run)
    manifest = {"format": FORMAT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "spec_path": str(spec.path), "spec": spec.raw, "split": spec.split,
                "versions": {"hespas-ml": package_version("hespas-ml"), "jax": package_version("jax"),
                             "scalesim": package_version("scalesim"), "numpy": package_version("numpy"),
                             "pyarrow": package_version("pyarrow"), "python": sys.version.split()[0],
                             "platform": platform.platform()},
                **summary}
    write_manifest(out, manifest)
    return manifest


def write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` atomically."""
    text = json.dumps(manifest, indent=1, default=str)
    _atomic(Path(out) / "manifest.json", lambda tmp: Path(tmp).write_text(text))


def _summary(spec, programs_rows, prov, hashes, label_cols, run) -> dict[str, Any]:
    rows = [programs_rows.get((p.source, spec.split)) for p in spec.programs]
    seen = sum(o for entries in prov.values() for _, _, o, _ in entries)
    by_fid: dict[str, dict[str, int]] = {}
    label_s: dict[str, float] = {}
    for fid, status, secs in zip(label_cols["fidelity"], label_cols["status"], label_cols["label_s"]):
        by_fid.setdefault(fid, {}).setdefault(status, 0)
        by_fid[fid][status] += 1
        label_s[fid] = label_s.get(fid, 0.0) + (secs or 0.0)
    counts = {"programs": len(spec.programs), "programs_ok": sum(1 for r in rows if r and r["status"] == "ok"),
              "programs_failed": sum(1 for r in rows if r and r["status"] == "failed"),
              "regions_seen": seen, "regions_unique": len(hashes),
              "dedup_ratio": seen / len(hashes) if hashes else None,
              "families": len({p.family for p in spec.programs}), "labels": len(label_cols["hash"]),
              "labels_by_fidelity": by_fid}
    timings = dict(run.get("timings", {}))
    timings["program_split_s_total"] = sum((r or {}).get("seconds") or 0.0 for r in rows)
    timings["label_s_total"] = label_s
    return {"counts": counts, "timings": timings, "this_run": run.get("new", {})}


# ------------------------------------------------------------------------------------------ reading

@dataclass
class Dataset:
    """A built dataset: its tables as pandas DataFrames and the manifest; graphs are read on demand."""

    path: Path
    regions: Any
    labels: Any
    programs: Any
    targets: Any
    manifest: dict[str, Any]
    _graphs: dict[str, str] | None = field(default=None, repr=False)

    def _graph_index(self) -> dict[str, str]:
        if self._graphs is None:
            table = _read_table(self.path / "graphs.parquet", GRAPH_COLUMNS, columns=["hash", "graph"])
            self._graphs = dict(zip(table.column("hash").to_pylist(), table.column("graph").to_pylist()))
        return self._graphs

    def region_graph(self, digest: str) -> dict[str, Any]:
        """The stored record of a region (nodes, edges, inputs, outputs, kernels; see region_records)."""
        text = self._graph_index().get(digest)
        if text is None:
            raise DatasetError(f"{self.path / 'graphs.parquet'}: no region {digest}")
        return json.loads(text)

    def region(self, digest: str):
        """The region as a standalone :class:`~hespas_ml.split.regions.Region`, ready for a fidelity."""
        from .region_records import region_from_record
        return region_from_record(self.region_graph(digest))

    def hashes(self) -> list[str]:
        return list(self.regions["hash"])

    def steadiness(self) -> list[dict[str, Any]]:
        """The timing steadiness checks that opened its profiling stages (:mod:`.steadiness`; oldest first)."""
        from .steadiness import read_log
        try:
            return read_log(self.path)
        except (OSError, ValueError) as exc:
            raise DatasetError(str(exc)) from None


def _read_table(path: Path, required: tuple[str, ...], columns: list[str] | None = None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not path.is_file():
        raise DatasetError(f"{path}: missing (not a built dataset folder?)")
    try:
        table = pq.read_table(path, columns=columns)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{path}: unreadable parquet ({' '.join(str(exc).split())[:200]})") from None
    missing = [c for c in (columns or required) if c not in table.column_names]
    if missing:
        raise DatasetError(f"{path}: missing column(s) {', '.join(missing)}")
    return table


def load_dataset(path: str | os.PathLike[str]) -> Dataset:
    """Read a dataset folder written by :func:`~hespas_ml.use.dataset.build_dataset`."""
    folder = Path(path)
    if not folder.is_dir():
        raise DatasetError(f"{folder}: no such dataset folder")
    manifest_path = folder / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise DatasetError(f"{manifest_path}: missing (not a built dataset folder?)") from None
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{manifest_path}: unreadable ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        raise DatasetError(f"{manifest_path}: not a dataset manifest of format {FORMAT_VERSION}")
    frames = {name: _read_table(folder / name, cols).to_pandas()
              for name, cols in TABLES.items() if name != "graphs.parquet"}
    _read_table(folder / "graphs.parquet", GRAPH_COLUMNS, columns=["hash"])
    return Dataset(folder, frames["regions.parquet"], frames["labels.parquet"], frames["programs.parquet"],
                   frames["targets.parquet"], manifest)
