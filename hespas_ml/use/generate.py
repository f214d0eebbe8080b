"""Synthetic region programs: fit a generator on a dataset's region graphs, draw graphs, write the valid
ones as StableHLO modules.

:func:`real_graphs` reads a dataset folder's (or a device plan's) ``graphs.parquet`` with each region's
family (``regions.parquet``). :func:`generate_regions` writes ``region-NNNNN.mlir`` into a folder with one
line per drawn graph in ``manifest.jsonl`` (valid or not, and why; the regions the pipeline splits it
into); a graph that fails validation is counted there and no module of it is written. Graph ``i`` is
drawn and shaped from the seed and ``i`` alone, so a generation that is killed resumes where it stopped
and gives the same modules it would have.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from ..label.device_run import read_lines
from ..learn.config import LearnError
from ..learn.layer_dag import LayerDAGGenerator, RandomDagGenerator, load_generator, typed_dag
from ..learn.region_programs import FLOATS, InvalidProgram, check_module, module_text, program_text, realise

__all__ = ["RealGraphs", "real_graphs", "program_sizes", "fit_generator", "load_or_fit", "generate_regions",
           "generate_programs", "records_of"]

MANIFEST = "manifest.jsonl"


class RealGraphs:
    """Region records of a dataset with their families, and what shapes and element types they read."""

    def __init__(self, records: list[dict[str, Any]], families: list[str]):
        self.records, self.families = records, families

    def only(self, keep: Callable[[str], bool]) -> "RealGraphs":
        pairs = [(r, f) for r, f in zip(self.records, self.families) if keep(f)]
        return RealGraphs([r for r, _ in pairs], [f for _, f in pairs])

    def shapes(self) -> list[tuple[int, ...]]:
        """Each region's largest floating-point input shape (what a generated graph is shaped from: one
        drawn per graph)."""
        out = []
        for r in self.records:
            floats = [x for x in r.get("inputs", []) if x.get("dtype") in FLOATS and x.get("shape")]
            if floats:
                out.append(tuple(max(floats, key=lambda x: x["bytes"])["shape"]))
        return out or [(8, 256)]

    def bf16_share(self) -> float:
        dtypes = [x.get("dtype") for r in self.records for x in r.get("inputs", []) if x.get("dtype") in FLOATS]
        return dtypes.count("bf16") / len(dtypes) if dtypes else 0.0


def real_graphs(folder: str | os.PathLike[str]) -> RealGraphs:
    """The region records of ``folder`` (a dataset or a device plan: ``graphs.parquet`` and
    ``regions.parquet``); LearnError naming the file when one is missing or unreadable."""
    import pyarrow.parquet as pq

    folder = Path(folder)
    tables = {}
    for name, columns in (("graphs.parquet", ["hash", "graph"]), ("regions.parquet", ["hash", "family"])):
        path = folder / name
        if not path.is_file():
            raise LearnError(f"{path}: no such file (a dataset folder holds graphs.parquet and regions.parquet)")
        try:
            tables[name] = pq.read_table(path, columns=columns).to_pylist()
        except Exception as exc:  # noqa: BLE001 - any unreadable file is one line
            raise LearnError(f"{path}: cannot read it: {str(exc).splitlines()[0]}") from None
    family = {r["hash"]: r["family"] or "" for r in tables["regions.parquet"]}
    records, families = [], []
    for row in tables["graphs.parquet"]:
        records.append(json.loads(row["graph"]))
        families.append(family.get(row["hash"], ""))
    return RealGraphs(records, families)


def program_sizes(folder: str | os.PathLike[str], families: Callable[[str], bool] = lambda f: True) -> list[int]:
    """The op counts of ``folder``'s programs (``programs.parquet``) of the families ``families`` keeps: how
    large a synthetic program like them is drawn."""
    import pyarrow.parquet as pq

    path = Path(folder) / "programs.parquet"
    if not path.is_file():
        raise LearnError(f"{path}: no such file (a dataset folder holds programs.parquet)")
    rows = pq.read_table(path, columns=["family", "status", "n_ops"]).to_pylist()
    sizes = [int(r["n_ops"]) for r in rows if r["status"] == "ok" and r["n_ops"] and families(r["family"] or "")]
    if not sizes:
        raise LearnError(f"{path}: no program of the families asked for")
    return sizes


def fit_generator(graphs: RealGraphs, kind: str = "layerdag", progress=None, **options):
    """A generator fitted on ``graphs``: ``layerdag`` (:class:`LayerDAGGenerator`, ``options`` its
    parameters) or ``random`` (:class:`RandomDagGenerator`)."""
    dags = [d for d in (typed_dag(r) for r in graphs.records) if d is not None]
    if kind == "random":
        return RandomDagGenerator(seed=options.get("seed", 0)).fit(dags)
    if kind != "layerdag":
        raise LearnError(f"generator: unknown kind {kind!r} (choose layerdag or random)")
    return LayerDAGGenerator(**options).fit(dags, progress=progress)


def _done(out: Path, repair: bool = False) -> dict[int, dict[str, Any]]:
    """The manifest's rows by index; with ``repair``, a last line cut short by a killed run is cut off the
    file (so the next line appended starts a line of its own)."""
    path = out / MANIFEST
    if repair and path.is_file():
        text = path.read_bytes()
        if text and not text.endswith(b"\n"):
            with open(path, "r+b") as f:
                f.truncate(text.rfind(b"\n") + 1)
    return {int(row["index"]): row for row in read_lines(path)}


def generate_regions(generator, graphs: RealGraphs, n: int, out: str | os.PathLike[str], seed: int = 0,
                     progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Draw graphs ``0 .. n-1`` (those not in ``out``'s manifest yet), shape and check each, write the
    valid ones as ``region-NNNNN.mlir``; returns the manifest's counts (``drawn``, ``valid``, ``invalid``,
    ``regions``, ``rewired`` slots). ``progress(done, n)`` after each graph."""
    shapes, bf16 = graphs.shapes(), graphs.bf16_share()

    def make(i: int) -> tuple[str, dict[str, Any]]:
        rng = np.random.default_rng([int(seed), i, 11])
        dag = generator.sample_one(seed, i)
        r = realise(dag, rng, shapes, dtype="bf16" if rng.random() < bf16 else "f32")
        return module_text(r, f"region_{i:05d}"), {"nodes": len(dag.kinds), "rewired": r.rewired}

    return _draw(Path(out), "region", n, make, progress)


def generate_programs(generator, graphs: RealGraphs, sizes: list[int], n: int, out: str | os.PathLike[str],
                      seed: int = 0, max_ops: int = 2000,
                      progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Synthetic whole programs: program ``i`` draws a size from ``sizes`` (op counts of real programs, at
    most ``max_ops``) and generated graphs until their ops reach it, each shaped as
    :func:`generate_regions` shapes one, then chains them in one module
    (:func:`~hespas_ml.learn.region_programs.program_text`: a graph's parameters read earlier graphs'
    results of their type). Written, checked and resumed as :func:`generate_regions` does, as
    ``program-NNNNN.mlir``; returns the manifest's counts."""
    shapes, bf16 = graphs.shapes(), graphs.bf16_share()

    def make(i: int) -> tuple[str, dict[str, Any]]:
        rng = np.random.default_rng([int(seed), i, 13])
        target = min(int(sizes[int(rng.integers(len(sizes)))]), max_ops)
        stream = int(rng.integers(2**31))
        dtype = "bf16" if rng.random() < bf16 else "f32"
        parts, ops = [], 0
        while ops < target and len(parts) < max_ops:
            dag = generator.sample_one(stream, len(parts))
            parts.append(realise(dag, rng, shapes, dtype=dtype))
            ops += len(dag.kinds)
        return (program_text(parts, f"program_{i:05d}"),
                {"nodes": ops, "graphs": len(parts), "rewired": sum(p.rewired for p in parts)})

    return _draw(Path(out), "program", n, make, progress)


def _draw(out: Path, kind: str, n: int, make: Callable[[int], tuple[str, dict[str, Any]]],
          progress: Callable[[int, int], None] | None) -> dict[str, Any]:
    """Modules ``0 .. n-1`` not in ``out``'s manifest yet, each ``make(i)`` (its text and the manifest
    row's facts): checked (:func:`check_module`), written as ``<kind>-NNNNN.mlir`` when valid, one manifest
    line each as it ends."""
    out.mkdir(parents=True, exist_ok=True)
    done = _done(out, repair=True)
    with open(out / MANIFEST, "a") as manifest:
        for i in range(n):
            if i in done:
                continue
            text, facts = make(i)
            name = f"{kind}-{i:05d}.mlir"
            row: dict[str, Any] = {"index": i, **facts}
            try:
                records = check_module(text, str(out / name))
            except InvalidProgram as exc:
                row.update(valid=False, reason=str(exc))
            else:
                tmp = out / f".{name}.tmp"
                tmp.write_text(text)
                os.replace(tmp, out / name)
                row.update(valid=True, file=name, regions=[rec["hash"] for rec in records])
            manifest.write(json.dumps(row) + "\n")
            manifest.flush()
            done[i] = row
            if progress is not None:
                progress(len([k for k in done if k < n]), n)
    rows = [done[i] for i in range(n) if i in done]
    return {"drawn": len(rows), "valid": sum(r["valid"] for r in rows),
            "invalid": sum(not r["valid"] for r in rows),
            "regions": sum(len(r.get("regions", [])) for r in rows),
            "rewired": sum(r["rewired"] for r in rows), "out": str(out)}


def load_or_fit(path: Path, graphs: RealGraphs, progress=None, **options) -> LayerDAGGenerator:
    """The generator saved at ``path`` when it was fitted on ``graphs`` with ``options``; else one fitted
    now and saved there."""
    import hashlib

    fitted_on = hashlib.sha256("\n".join(sorted(r["hash"] for r in graphs.records)).encode()).hexdigest()
    if path.is_file():
        model = load_generator(path)
        if model.fitted_on == fitted_on and all(model.config.get(k) == v for k, v in options.items()):
            return model
        if (path.parent / MANIFEST).is_file():
            raise LearnError(f"{path.parent}: its graphs were drawn from a generator fitted on other graphs or "
                             f"with other options; write to a new folder")
    model = fit_generator(graphs, "layerdag", progress=progress, **options)
    model.fitted_on = fitted_on
    tmp = path.with_name(path.name + ".tmp")
    model.save(tmp, fitted_on)
    os.replace(tmp, path)
    return model


def records_of(out: str | os.PathLike[str], rows: Iterable[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The region records of the valid modules written in ``out`` (ingested and split again)."""
    out = Path(out)
    found = []
    for row in (rows if rows is not None else _done(out).values()):
        if row.get("valid"):
            found.extend(check_module((out / row["file"]).read_text(), str(out / row["file"])))
    return found
