"""The labels a surrogate learns from a built dataset, and the targets they were made on.

:func:`label_rows` selects the usable labels of one fidelity (status ok, finite positive seconds,
optionally restricted to some targets and to a noise ceiling) and joins each with its region's
provenance and size. Row ``pos`` is the label's position in ``dataset.labels``; splits and
:meth:`Surrogate.fit` speak in those positions.

:func:`dataset_targets` rebuilds the :class:`Target` of every target the dataset names: the preset or
YAML file it was built from when that still has the same hardware vector, otherwise (e.g. ``host-cpu``
measured differently on this machine) a target reconstructed from the vector stored in
``targets.parquet``, so that estimates always match what the labels were made on.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from ..label.targets import (DATAFLOWS, VECTOR_DTYPES, Systolic, Target, TargetError, load_target)
from .config import FIDELITIES, LearnError
from .features import HW_FEATURES

MODEL_FAMILIES = ("llama", "vit", "moe", "resnet", "mlp")
"""Zoo model families; the rest of a dataset (micro-benchmarks, shared files) always stays in training."""


def label_rows(dataset, fidelity: str, targets: Iterable[str] | None = None,
               max_noise: float | None = None) -> pd.DataFrame:
    """The usable labels of ``fidelity``: columns ``pos`` (position in ``dataset.labels``), ``hash``,
    ``target``, ``seconds``, ``noise``, ``family``, ``families`` (list), ``work`` (region FLOPs + bytes).

    Raises :class:`LearnError` for an unknown fidelity, an unknown target or when nothing is left.
    """
    where = dataset.path
    if fidelity not in FIDELITIES:
        raise LearnError(f"{where}: unknown fidelity '{fidelity}' (known: {', '.join(FIDELITIES)})")
    labels = dataset.labels
    mask = (labels["fidelity"] == fidelity).to_numpy().copy()
    have = sorted(set(labels.loc[mask, "target"]))
    if not have:
        raise LearnError(f"{where}: no labels of fidelity '{fidelity}' in this dataset")
    if targets is not None:
        wanted = list(targets)
        missing = [t for t in wanted if t not in have]
        if missing:
            raise LearnError(f"{where}: no {fidelity} labels for target '{missing[0]}' "
                             f"(this dataset has: {', '.join(have)})")
        mask &= labels["target"].isin(wanted).to_numpy()
    seconds = labels["seconds"].to_numpy(dtype=np.float64, na_value=np.nan)
    mask &= (labels["status"] == "ok").to_numpy() & np.isfinite(seconds) & (seconds > 0)
    noise = labels["noise"].to_numpy(dtype=np.float64, na_value=np.nan)
    if max_noise is not None:
        mask &= ~(noise > max_noise)
    pos = np.flatnonzero(mask)
    if pos.size == 0:
        raise LearnError(f"{where}: no usable (ok, positive) {fidelity} labels"
                         + (f" with noise <= {max_noise}" if max_noise is not None else ""))
    regions = dataset.regions.set_index("hash")
    hashes = labels["hash"].to_numpy()[pos]
    try:
        reg = regions.loc[hashes]
    except KeyError:
        raise LearnError(f"{where}: labels.parquet names regions that regions.parquet lacks") from None
    return pd.DataFrame({
        "pos": pos, "hash": hashes, "target": labels["target"].to_numpy()[pos], "seconds": seconds[pos],
        "noise": noise[pos], "family": reg["family"].to_numpy(),
        "families": [json.loads(f) if isinstance(f, str) else list(f) for f in reg["families"]],
        "work": reg["flops"].to_numpy(dtype=np.float64) + reg["bytes"].to_numpy(dtype=np.float64),
    })


def in_program_labels(dataset):
    """``dataset`` with each profiling label's seconds made its time inside a program: less the dispatch
    overhead its ``meta`` records (:func:`hespas_ml.label.measured_fidelity.in_program`; unchanged where none
    is recorded). A label left at zero is marked failed, so no model learns it."""
    from dataclasses import replace

    from ..label.measured_fidelity import in_program

    labels = dataset.labels.copy()
    rows = (labels["fidelity"] == "profiling").to_numpy() & (labels["status"] == "ok").to_numpy()
    seconds = labels["seconds"].to_numpy(dtype=np.float64, na_value=np.nan).copy()
    metas = labels["meta"].to_numpy()
    for i in np.flatnonzero(rows):
        seconds[i] = in_program(float(seconds[i]), metas[i] if isinstance(metas[i], str) else None)
    labels["seconds"] = seconds
    gone = rows & ~(seconds > 0)
    labels.loc[gone, "status"] = "failed"
    labels.loc[gone, "reason"] = "no time left once the dispatch overhead is taken off"
    return replace(dataset, labels=labels)


def target_from_vector(name: str, vector: dict[str, float]) -> Target:
    """A :class:`Target` whose ``to_vector()`` is ``vector`` (peaks of the vector's dtypes only)."""
    matrix = {d: 10.0 ** vector[f"log10_matrix_flops_{d}"] for d in VECTOR_DTYPES}
    vec = {d: 10.0 ** vector[f"log10_vector_flops_{d}"] for d in VECTOR_DTYPES}
    systolic = None
    if vector["log2_systolic_rows"] > 0:
        flow = next((f for f in DATAFLOWS if vector[f"dataflow_{f}"] > 0.5), "ws")
        systolic = Systolic(rows=round(2 ** vector["log2_systolic_rows"]),
                            cols=round(2 ** vector["log2_systolic_cols"]),
                            count=round(2 ** vector["log2_systolic_count"]), dataflow=flow,
                            ifmap_sram_kb=0, filter_sram_kb=0, ofmap_sram_kb=0)
    onchip = 10.0 ** vector["log10_onchip_mem"] if vector["log10_onchip_mem"] else 0.0
    return Target(name=name, description="reconstructed from a dataset's hardware vector", matrix_flops=matrix,
                  vector_flops=vec, mem_bw=10.0 ** vector["log10_mem_bw"],
                  mem_capacity=10.0 ** vector["log10_mem_capacity"], onchip_mem=onchip,
                  clock_hz=vector["clock_ghz"] * 1e9, systolic=systolic,
                  sources=("dataset targets.parquet",), notes="")


def _same_vector(a: dict[str, float], b: dict[str, float]) -> bool:
    return all(math.isclose(a[k], b[k], rel_tol=1e-9, abs_tol=1e-9) for k in HW_FEATURES)


def dataset_targets(dataset) -> dict[str, Target]:
    """Every target of ``dataset`` (by name) as the labels saw it (see the module docstring)."""
    table = dataset.targets
    missing = [k for k in HW_FEATURES if k not in table.columns]
    if missing:
        raise LearnError(f"{dataset.path / 'targets.parquet'}: missing hardware column '{missing[0]}'")
    spec_dir = Path(str(dataset.manifest.get("spec_path", "."))).parent
    out: dict[str, Target] = {}
    for _, row in table.iterrows():
        stored = {k: float(row[k]) for k in HW_FEATURES}
        name, ref = str(row["target"]), str(row["ref"])
        target = None
        for candidate in (ref, str(spec_dir / ref)):
            try:
                loaded = load_target(candidate)
            except TargetError:
                continue
            if _same_vector(loaded.to_vector(), stored):
                target = loaded
                break
        out[name] = target if target is not None else target_from_vector(name, stored)
    return out


def region_records(dataset, hashes: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The stored records of ``hashes`` (each parsed once)."""
    return {h: dataset.region_graph(h) for h in dict.fromkeys(hashes)}
