"""The ``measured`` fidelity: a region's time on a target, from labels measured on that target itself.

The labels come from measured dataset folders (:mod:`hespas_ml.label.measured`; ``datasets/measured/``): a
region's time is the median of the ok profiling labels measured on the target for a region of the same
structural hash (:mod:`hespas_ml.split.signature`), less the dispatch overhead its measurement recorded
(``overhead_s``: one execution of a trivial module on the same device). A region timed on its own pays one
launch of a whole executable per execution; inside a program it is a kernel among others, launched with
them. Labels that record no overhead (profiles of whole programs, another project's kernel times) are taken
as they are. It answers for a program only when every one of its
compute regions was measured there, and otherwise says how many were not (a surrogate answers for the rest
of the world).
"""
from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

from ..ingest.graph import program_users
from ..split.signature import region_signature
from .fidelity import FidelityError, Label

MEASURED_ENV = "HESPAS_ML_MEASURED"


def measured_folders(folders: str | os.PathLike[str] | list | None = None) -> list[Path]:
    """Measured dataset folders: ``folders`` (a folder holding measured folders, one measured folder, or a
    list of either), else ``$HESPAS_ML_MEASURED`` (paths separated by ``os.pathsep``), else
    ``datasets/measured`` under the working folder."""
    if folders is None:
        configured = os.environ.get(MEASURED_ENV)
        folders = configured.split(os.pathsep) if configured else [Path("datasets") / "measured"]
    elif isinstance(folders, (str, os.PathLike)):
        folders = [folders]
    out: list[Path] = []
    for entry in folders:
        path = Path(entry)
        if (path / "labels.parquet").is_file():
            out.append(path)
        elif path.is_dir():
            out.extend(sorted(p for p in path.iterdir() if (p / "labels.parquet").is_file()))
    return out


def in_program(seconds: float, meta: str | None) -> float:
    """A measured region's time inside a program: ``seconds`` less the dispatch overhead recorded in its
    label's ``meta`` (JSON), never below zero; as it is where none was recorded. A region timed in a loop of
    K + 1 passes per execution (``loop`` K) pays per pass what one pass of a trivial module looped the same
    way took (``pass_overhead_s``: its share of the launch and the loop's own cost), or, where a label does
    not record that, 1 / (K + 1) of the launch."""
    if not meta or "overhead_s" not in meta:
        return seconds
    try:
        facts = json.loads(meta)
        if facts.get("loop") and facts.get("pass_overhead_s") is not None:
            overhead = float(facts["pass_overhead_s"])
        else:
            overhead = float(facts.get("overhead_s") or 0.0) / (int(facts.get("loop") or 0) + 1)
    except (ValueError, TypeError, AttributeError):
        return seconds
    return max(0.0, seconds - overhead)


class MeasuredFidelity:
    """Region times measured on the target itself, looked up in measured dataset folders (see the module
    docstring). ``folders``: as :func:`measured_folders` takes them."""

    name = "measured"

    def __init__(self, folders: str | os.PathLike[str] | list | None = None):
        self.folders = measured_folders(folders)
        self._index: dict[str, dict[str, list[tuple[float, str]]]] = {}

    def _labels_on(self, target: str) -> dict[str, list[tuple[float, str]]]:
        """``hash -> [(seconds, folder name)]`` of every ok profiling label measured on ``target``."""
        if target not in self._index:
            import pyarrow.compute as pc
            import pyarrow.parquet as pq

            found: dict[str, list[tuple[float, str]]] = {}
            for folder in self.folders:
                table = pq.read_table(folder / "labels.parquet", columns=["hash", "target", "fidelity", "seconds",
                                                                          "status", "meta"])
                mask = pc.and_(pc.and_(pc.equal(table["target"], target), pc.equal(table["fidelity"], "profiling")),
                               pc.equal(table["status"], "ok"))
                part = table.filter(mask)
                for digest, seconds, meta in zip(part["hash"].to_pylist(), part["seconds"].to_pylist(),
                                                 part["meta"].to_pylist()):
                    found.setdefault(digest, []).append((in_program(float(seconds), meta), folder.name))
            self._index[target] = found
        return self._index[target]

    def check_target(self, target) -> None:
        """FidelityError when no folder holds a label measured on ``target``."""
        name = getattr(target, "name", str(target))
        if not self._labels_on(name):
            where = ", ".join(str(f) for f in self.folders) or "no measured folders"
            raise FidelityError(f"measured: no labels measured on {name} (in {where})")

    def provenance(self, target) -> dict[str, Any]:
        name = getattr(target, "name", str(target))
        return {"fidelity": self.name, "target": name, "folders": [str(f) for f in self.folders],
                "regions_measured": len(self._labels_on(name))}

    def label(self, region, target) -> Label:
        return self.label_regions([region], target)[0]

    def label_regions(self, regions, target) -> list[Label]:
        name = getattr(target, "name", str(target))
        known = self._labels_on(name)
        users: dict[int, list[list[int]]] = {}          # per program, worked out once
        labels, missing = [], 0
        for region in regions:
            graph = region.graph
            if id(graph) not in users:
                users[id(graph)] = program_users(graph)
            digest = region_signature(region, users[id(graph)])
            rows = known.get(digest)
            if not rows:
                missing += 1
                labels.append(Label(math.nan, "failed", {"reason": f"no label measured on {name}", "hash": digest}))
                continue
            labels.append(Label(statistics.median(s for s, _ in rows), "ok",
                                {"hash": digest, "measurements": len(rows),
                                 "sources": sorted({f for _, f in rows}), "bound": "measured"}))
        if missing:
            where = ", ".join(str(f) for f in self.folders) or "no measured folders"
            raise FidelityError(f"measured: {missing} of {len(regions)} compute regions have no label measured on "
                                f"{name} (in {where}); a learned surrogate answers for regions nobody measured "
                                f"(--fidelity surrogate:profiling)")
        return labels


__all__ = ["MEASURED_ENV", "MeasuredFidelity", "in_program", "measured_folders"]
