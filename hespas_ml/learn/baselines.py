"""Baselines the surrogate must beat, measured on the same splits.

* :class:`EstimateBaseline` — the analytical estimate itself as the prediction: the roofline (exactly
  the roofline fidelity) or the systolic fold estimate (:meth:`Featuriser.systolic_seconds`). No
  training. For the roofline fidelity it is exact by construction.
* :class:`GBMBaseline` — scikit-learn's ``HistGradientBoostingRegressor`` on a flat vector per (region,
  target): the region aggregates, per-node maxima and sums of the node features (:func:`flat_features`),
  and the same target features the GNN sees (hardware vector and, with ``roofline_input``, the
  analytical estimates); it learns log-seconds, or the residual over the config's analytical estimate
  (``TrainConfig.base``).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from .config import LearnError, TrainConfig
from .evaluate import report
from .features import _N_NUMERIC, Featuriser, RegionArrays
from .surrogate import ALL_ROW_FEATURES, row_feature_names
from .tables import dataset_targets, label_rows


def flat_features(regions: list[RegionArrays]) -> np.ndarray:
    """Per region: its aggregates, the max of each numeric node feature and the sum of each one-hot."""
    out = np.empty((len(regions), 0), dtype=np.float32)
    if not regions:
        return out
    return np.stack([np.concatenate([r.region, r.x[:, :_N_NUMERIC].max(0), r.x[:, _N_NUMERIC:].sum(0)])
                     for r in regions]).astype(np.float32)


def _by_target(rows: pd.DataFrame):
    tn = rows["target"].to_numpy()
    for name in pd.unique(tn):
        yield name, np.flatnonzero(tn == name)


def _select(rows: pd.DataFrame, index) -> pd.DataFrame:
    return rows[rows["pos"].isin(np.asarray(index))].reset_index(drop=True)


class EstimateBaseline:
    """Predicts the analytical ``estimate`` ("roofline" or "systolic") for every row."""

    def __init__(self, fidelity: str = "roofline", estimate: str = "roofline"):
        if estimate not in ("roofline", "systolic"):
            raise LearnError(f"EstimateBaseline: estimate must be roofline or systolic, got {estimate!r}")
        self.fidelity, self.estimate = fidelity, estimate
        self.featuriser = Featuriser()

    def fit(self, dataset=None, train_index=None, val_index=None) -> "EstimateBaseline":
        return self

    def predict_rows(self, dataset, index) -> tuple[pd.DataFrame, np.ndarray]:
        rows = _select(label_rows(dataset, self.fidelity), index)
        targets = dataset_targets(dataset)
        pred = np.zeros(len(rows))
        hashes = rows["hash"].to_numpy()
        for name, sel in _by_target(rows):
            arrays = self.featuriser.regions_for(hashes[sel], dataset.region_graph)
            _, est = self.featuriser.target_features(arrays, targets[name])
            pred[sel] = np.exp(est[self.estimate])
        return rows, pred

    def evaluate(self, dataset, index) -> dict[str, Any]:
        rows, pred = self.predict_rows(dataset, index)
        return report(rows, pred)


class GBMBaseline:
    """Gradient-boosted trees on flat region + target features (see the module docstring)."""

    def __init__(self, config: TrainConfig | None = None, max_iter: int = 1000, learning_rate: float = 0.1,
                 max_leaf_nodes: int = 63):
        self.config = config if config is not None else TrainConfig()
        self.featuriser = Featuriser()
        self.columns = np.asarray([ALL_ROW_FEATURES.index(n) for n in row_feature_names(self.config)])
        self.params = {"max_iter": max_iter, "learning_rate": learning_rate, "max_leaf_nodes": max_leaf_nodes}
        self.model = None

    def _matrix(self, dataset, rows: pd.DataFrame, targets) -> tuple[np.ndarray, np.ndarray]:
        """(features, log base estimate) for label rows."""
        hashes = rows["hash"].to_numpy()
        cols = None
        base = np.zeros(len(rows))
        for name, sel in _by_target(rows):
            arrays = self.featuriser.regions_for(hashes[sel], dataset.region_graph)
            tf, est = self.featuriser.target_features(arrays, targets[name])
            block = np.concatenate([flat_features(arrays), tf[:, self.columns]], axis=1)
            if cols is None:
                cols = np.zeros((len(rows), block.shape[1]), dtype=np.float32)
            cols[sel] = block
            base[sel] = est[self.config.base] if self.config.base else 0.0
        return cols, base

    def fit(self, dataset, train_index, val_index=None) -> "GBMBaseline":
        from sklearn.ensemble import HistGradientBoostingRegressor

        c = self.config
        rows = label_rows(dataset, c.fidelity, c.targets, c.max_noise)
        targets = dataset_targets(dataset)
        tr = _select(rows, train_index)
        if tr.empty:
            raise LearnError(f"{dataset.path}: the training index selects no usable {c.fidelity} labels")
        x, base = self._matrix(dataset, tr, targets)
        y = np.log(tr["seconds"].to_numpy()) - base
        kwargs: dict[str, Any] = {}
        early = "auto"
        if val_index is not None and len(val_index):
            va = _select(rows, val_index)
            if not va.empty:
                xv, bv = self._matrix(dataset, va, targets)
                kwargs = {"X_val": xv, "y_val": np.log(va["seconds"].to_numpy()) - bv}
                early = True
        self.model = HistGradientBoostingRegressor(
            loss="squared_error", early_stopping=early, n_iter_no_change=30, random_state=c.seed,
            l2_regularization=1e-3, **self.params)
        self.model.fit(x, y, **kwargs)
        return self

    def predict_rows(self, dataset, index) -> tuple[pd.DataFrame, np.ndarray]:
        if self.model is None:
            raise LearnError("GBMBaseline is not fitted")
        rows = _select(label_rows(dataset, self.config.fidelity), index)
        x, base = self._matrix(dataset, rows, dataset_targets(dataset))
        out = self.model.predict(x) + base
        return rows, np.exp(out)

    def evaluate(self, dataset, index) -> dict[str, Any]:
        rows, pred = self.predict_rows(dataset, index)
        return report(rows, pred)
