"""How far generated region graphs are from real ones: per-graph statistics and the maximum mean
discrepancy (MMD) between two sets of them.

:func:`graph_statistics` describes a region record (the pipeline's, :mod:`hespas_ml.label.region_records`)
by its op-kind histogram, in- and out-degree histograms, depth (topological layers), node count, and
log10 FLOPs and bytes. :func:`mmd` is the squared MMD with a Gaussian kernel whose width is the median
distance between the pooled points (the biased estimate: 0 for identical sets, never negative).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..label.region_records import region_features
from .region_programs import OP_KINDS, dag_layers

__all__ = ["STATISTICS", "graph_statistics", "mmd", "distances"]

#: The statistics compared, each a vector per graph.
STATISTICS = ("op_kinds", "in_degree", "out_degree", "depth", "nodes", "flops", "bytes")
_DEGREES = 5                                 # 0, 1, 2, 3, 4 or more


def graph_statistics(record: dict[str, Any]) -> dict[str, np.ndarray]:
    """:data:`STATISTICS` of one region record."""
    nodes, edges = record["nodes"], record["edges"]
    kinds = np.zeros(len(OP_KINDS) + 1)
    index = {k: i for i, k in enumerate(OP_KINDS)}
    for node in nodes:
        kinds[index.get(node["kind"], len(OP_KINDS))] += 1
    n = max(len(nodes), 1)
    fan_in, fan_out = np.zeros(len(nodes), int), np.zeros(len(nodes), int)
    sources: list[list[int | None]] = [[] for _ in nodes]
    for src, dst, _, _ in edges:
        fan_out[src] += 1
        fan_in[dst] += 1
        sources[dst].append(src)
    order_ok = all(s < d for d, srcs in enumerate(sources) for s in srcs)
    depth = max(dag_layers(sources)) + 1 if nodes and order_ok else 1
    feats = region_features(record)
    return {"op_kinds": kinds / n,
            "in_degree": np.bincount(np.minimum(fan_in, _DEGREES - 1), minlength=_DEGREES) / n,
            "out_degree": np.bincount(np.minimum(fan_out, _DEGREES - 1), minlength=_DEGREES) / n,
            "depth": np.array([float(depth)]), "nodes": np.array([_log10p(len(nodes))]),
            "flops": np.array([_log10p(feats["flops"])]), "bytes": np.array([_log10p(feats["bytes"])])}


def _log10p(x: float) -> float:
    return float(np.log10(1.0 + max(float(x), 0.0)))


def mmd(x: np.ndarray, y: np.ndarray) -> float:
    """Squared MMD between the rows of ``x`` and of ``y`` (Gaussian kernel, median-distance width)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if x.ndim == 1:
        x, y = x[:, None], y[:, None]
    z = np.concatenate([x, y])
    d2 = ((z[:, None, :] - z[None, :, :]) ** 2).sum(-1)
    width = np.median(d2[d2 > 0]) if (d2 > 0).any() else 1.0
    k = np.exp(-d2 / width)
    n = len(x)
    return float(k[:n, :n].mean() + k[n:, n:].mean() - 2 * k[:n, n:].mean())


def distances(real: Sequence[dict[str, np.ndarray]], other: Sequence[dict[str, np.ndarray]]) -> dict[str, float]:
    """:func:`mmd` of every statistic between two sets of :func:`graph_statistics`."""
    return {name: mmd(np.stack([r[name] for r in real]), np.stack([o[name] for o in other]))
            for name in STATISTICS}
