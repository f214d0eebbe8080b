"""The learned surrogate of one fidelity: fit on a dataset, predict regions on any target, save and load.

A :class:`Surrogate` (scikit-learn style: configure, :meth:`~Surrogate.fit`, predict) answers "how long
does this compute region take on this target, according to fidelity F?" with a point prediction and a
calibrated interval (:class:`~hespas_ml.learn.ensemble.Prediction`). The hardware enters as a feature
vector, so one surrogate serves every target, including targets it never saw.

Saved form (a directory): ``weights.pt`` (the network's state_dict, written with ``torch.save`` and read
with ``weights_only=True``), ``surrogate.json`` (format version, the :class:`TrainConfig`, opcode
vocabulary, feature names, interval calibration, what it was trained on) and ``metrics.json`` (training
history and validation figures). No pickle.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch

from .config import LearnError, TrainConfig
from .domain import Domain, learned_programs
from .ensemble import IntervalCalibration, Prediction, member_stats
from ..label.targets import Target
from .features import (EDGE_FEATURES, HW_FEATURES, NODE_FEATURES, REGION_FEATURES, ROOFLINE_FEATURES,
                       SYSTOLIC_FEATURES, Featuriser, RegionArrays, collate_arrays, hardware_vector,
                       resolve_target)
from .model import SurrogateNet
from .splits import make_split
from .tables import dataset_targets, label_rows
from .train import (EpochCallback, fit_normalisers, predict_members, region_dataset, seed_everything,
                    train_network)

FORMAT = 1
KIND = "hespas-ml-surrogate"
WEIGHTS, META, METRICS = "weights.pt", "surrogate.json", "metrics.json"
ALL_ROW_FEATURES = (*ROOFLINE_FEATURES, *SYSTOLIC_FEATURES, *HW_FEATURES)

__all__ = ["Surrogate", "Prediction", "row_feature_names"]


def label_options(dataset, fidelity: str) -> dict[str, Any] | None:
    """The options ``dataset``'s spec labelled ``fidelity`` with (its targets and worker counts aside), or
    None where the manifest does not say."""
    spec = (getattr(dataset, "manifest", None) or {}).get("spec") or {}
    options = (spec.get("fidelities") or {}).get(fidelity)
    if not isinstance(options, dict):
        return None
    return {k: v for k, v in options.items() if k not in ("targets", "workers", "families")}


def row_feature_names(config: TrainConfig) -> list[str]:
    """The target features a model of ``config`` sees (the hardware vector always; the analytical
    estimates only with ``roofline_input``, the systolic one only with ``systolic_input`` too)."""
    names = list(HW_FEATURES)
    if config.roofline_input:
        extra = list(ROOFLINE_FEATURES) + (list(SYSTOLIC_FEATURES) if config.systolic_input else [])
        names = extra + names
    return names


class Surrogate:
    """A learned surrogate for one fidelity (see the module docstring)."""

    def __init__(self, config: TrainConfig | None = None):
        self.config = config if config is not None else TrainConfig()
        self.featuriser = Featuriser()
        self.net: SurrogateNet | None = None
        self.calibration = IntervalCalibration(coverage=self.config.interval)
        self.metrics: dict[str, Any] = {}
        self.trained_on: dict[str, Any] = {}
        self.domain: Domain | None = None
        self._columns = np.asarray([ALL_ROW_FEATURES.index(n) for n in row_feature_names(self.config)])

    # ------------------------------------------------------------------ training

    def _new_net(self) -> SurrogateNet:
        c = self.config
        return SurrogateNet(len(self.featuriser.vocabulary), len(self._columns), members=c.ensemble, hidden=c.hidden,
                            layers=c.layers, head_hidden=c.head_hidden, pooling=tuple(c.pooling), dropout=c.dropout)

    def fit(self, dataset, train_index=None, val_index=None, on_epoch: EpochCallback | None = None) -> "Surrogate":
        """Train on ``dataset`` (a :class:`~hespas_ml.label.dataset_tables.Dataset`).

        ``train_index`` / ``val_index``: label positions (into ``dataset.labels``) of the config's
        fidelity; None takes them from :func:`~hespas_ml.learn.splits.make_split` (a given train index
        without a validation index gets a random ``val_fraction`` of its regions as validation).
        ``on_epoch(epoch, metrics)`` is called after every epoch; returning False stops training.
        """
        c = self.config
        if torch.get_num_threads() > c.threads:
            torch.set_num_threads(c.threads)
        t0 = time.perf_counter()
        rows = label_rows(dataset, c.fidelity, c.targets, c.max_noise)
        if train_index is None:
            train_index, split_val, _ = make_split(dataset, c, rows)
            val_index = split_val if val_index is None else val_index
        train_rows = rows[rows["pos"].isin(np.asarray(train_index))]
        if train_rows.empty:
            raise LearnError(f"{dataset.path}: the training index selects no usable {c.fidelity} labels")
        if val_index is None:
            rng = np.random.default_rng(c.seed + 1)
            regions = np.asarray(sorted(set(train_rows["hash"])))
            k = int(round(c.val_fraction * len(regions))) if len(regions) > 1 else 0
            held = set(rng.permutation(regions)[:k])
            val_rows = train_rows[train_rows["hash"].isin(held)]
            train_rows = train_rows[~train_rows["hash"].isin(held)]
        else:
            val_rows = rows[rows["pos"].isin(np.asarray(val_index))]
        overlap = set(train_rows["hash"]) & set(val_rows["hash"])
        if overlap:
            val_rows = val_rows[~val_rows["hash"].isin(overlap)]
        targets = dataset_targets(dataset)
        generator = seed_everything(c.seed)
        rng = np.random.default_rng(c.seed)
        train = region_dataset(train_rows, dataset.region_graph, targets, self.featuriser, self._columns, c.ensemble,
                               rng if c.bootstrap and c.ensemble > 1 else None, c.base or "roofline")
        val = region_dataset(val_rows, dataset.region_graph, targets, self.featuriser, self._columns, c.ensemble,
                             base=c.base or "roofline")
        self.net = self._new_net()
        fit_normalisers(self.net, train, c.base is not None)
        t1 = time.perf_counter()
        history = train_network(self.net, train, val, c, generator, on_epoch)
        t2 = time.perf_counter()
        calib_on = val if val else train
        members, y = predict_members(self.net, calib_on, c.base is not None)
        mean, std = member_stats(members)
        self.calibration = IntervalCalibration.fit(mean, std, y, c.interval)
        ape = np.abs(np.expm1(mean - y))
        self.metrics = {"history": history, "epochs_run": len(history),
                        "best_epoch": int(np.argmin([h.get("val_loss", h["train_loss"]) for h in history])),
                        "featurise_s": t1 - t0, "train_s": t2 - t1,
                        "calibrated_on": "validation" if val else "training",
                        "val_median_ape": float(np.median(ape)), "val_p90_ape": float(np.quantile(ape, 0.9)),
                        "n_train_rows": int(len(train_rows)), "n_val_rows": int(len(val_rows)),
                        "n_train_regions": len(train), "n_val_regions": len(val)}
        self.trained_on = {"dataset": Path(dataset.path).name, "fidelity": c.fidelity,   # no machine's paths
                           "targets": sorted(set(train_rows["target"])),
                           "families": sorted({f for fams in train_rows["families"] for f in fams})}
        learned = sorted(set(train_rows["hash"]) | set(val_rows["hash"]))
        self.domain = Domain.fit(self.featuriser.regions_for(learned, dataset.region_graph), self.featuriser.vocabulary,
                                 fitted_on=f"the {len(learned)} regions of {self.trained_on['dataset']} it trained "
                                           "and was calibrated on",
                                 label_options=label_options(dataset, c.fidelity),
                                 programs=learned_programs(dataset, learned))
        return self

    # ------------------------------------------------------------------ prediction

    def _require_net(self) -> SurrogateNet:
        if self.net is None:
            raise LearnError("this Surrogate is not fitted (call fit() or Surrogate.load())")
        return self.net

    def predict_log(self, records: Sequence[dict], target, chunk: int = 512
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(member-mean log-seconds, member spread, log roofline estimate) per record on ``target``."""
        self._require_net()
        return self._predict_arrays(self.featuriser.regions(records), resolve_target(target), chunk)

    @torch.inference_mode()
    def _predict_arrays(self, arrays: Sequence[RegionArrays], target: Target, chunk: int = 512
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        net = self._require_net()
        if torch.get_num_threads() > self.config.threads:
            torch.set_num_threads(self.config.threads)
        if net.training:
            net.eval()
        n = len(arrays)
        mean, std, base = np.zeros(n), np.zeros(n), np.zeros(n)
        for s in range(0, n, chunk):
            part = arrays[s:s + chunk]
            feats, est = self.featuriser.target_features(part, target)
            key = self.config.base or "roofline"
            batch = collate_arrays(part, feats[:, self._columns], est[key])
            out = net.to_log_seconds(net(batch).double(), torch.from_numpy(est[key]),
                                     self.config.base is not None).numpy()
            m, sd = member_stats(out)
            mean[s:s + len(part)], std[s:s + len(part)], base[s:s + len(part)] = m, sd, est["roofline"]
        return mean, std, base

    def predict_records(self, records: Sequence[dict], target) -> Prediction:
        """Predictions for region records (dicts as in ``graphs.parquet``) on ``target`` (a
        :class:`~hespas_ml.label.targets.Target`, a preset name or a target YAML path). Records with the
        same hash are predicted once."""
        records = list(records)
        if not records:
            return self.calibration.predict(np.zeros(0), np.zeros(0), np.zeros(0))
        keys = [r.get("hash") if isinstance(r, dict) else None for r in records]
        if any(not isinstance(r, dict) for r in records):
            raise LearnError("predict_records: every record must be a dict (a region record)")
        first: dict[Any, int] = {}
        unique: list[dict] = []
        where = np.empty(len(records), dtype=np.int64)
        for i, (k, r) in enumerate(zip(keys, records)):
            if k is None:
                where[i] = len(unique)
                unique.append(r)
                continue
            j = first.get(k)
            if j is None:
                j = first[k] = len(unique)
                unique.append(r)
            where[i] = j
        mean, std, base = self.predict_log(unique, target)
        return self.calibration.predict(mean[where], std[where], base[where])

    def predict_regions(self, regions: Sequence, target) -> Prediction:
        """Predictions for live compute regions (each carrying ``.graph``); identical regions (same
        :func:`~hespas_ml.split.signature.region_signature`) are featurised and predicted once, and a
        region featurised by an earlier call (another target, another program) is not recorded again."""
        from ..label.region_records import region_record
        from ..ingest.graph import program_users
        from ..split.signature import signature_parts

        self._require_net()
        if not regions:
            return self.calibration.predict(np.zeros(0), np.zeros(0), np.zeros(0))
        digests: list[str] = []
        first: dict[str, tuple] = {}           # digest -> (region, its program's users, canonical order, escapes)
        for r in regions:
            if getattr(r, "kind", "compute") != "compute":
                raise LearnError(f"region {getattr(r, 'name', '?')}: a {r.kind} region; surrogates predict "
                                 "compute regions only")
            graph = getattr(r, "graph", None)
            if graph is None:
                raise LearnError(f"region {getattr(r, 'name', '?')}: carries no op graph (region.graph)")
            users = program_users(graph)
            digest, order, escapes = signature_parts(r, users)
            digests.append(digest)
            first.setdefault(digest, (r, users, order, escapes))
        unique = list(first)
        arrays = self.featuriser.regions_for(unique, lambda h: region_record(first[h][0], h, *first[h][1:]))
        target = resolve_target(target)
        mean, std, base = self._predict_arrays(arrays, target)
        position = {h: i for i, h in enumerate(unique)}
        where = np.fromiter((position[h] for h in digests), dtype=np.int64, count=len(digests))
        pred = self.calibration.predict(mean[where], std[where], base[where])
        pred.hashes = digests
        outside = self.outside_domain(arrays, target)
        if outside is not None:
            pred.outside = [outside[i] for i in where.tolist()]
            self.domain.widen(pred)
        return pred

    def outside_domain(self, arrays: Sequence[RegionArrays], target) -> list[list[str]] | None:
        """Per region, why it lies outside what this model learned (its :class:`~hespas_ml.learn.domain.Domain`
        and the hardware vectors it saw; empty: inside), or None for a model saved without a domain."""
        if self.domain is None:
            return None
        outside = self.domain.outside(arrays, self.featuriser.vocabulary)
        # a profiling model's target is a measured machine, whose rates wobble from one measurement to the
        # next: SurrogateFidelity.caveat says when it is another machine than the one the model learned
        hardware = self.hardware_outside_training(target) if self.config.fidelity != "profiling" else {}
        if hardware:
            name = getattr(resolve_target(target), "name", str(target))
            note = f"target {name}: {', '.join(sorted(hardware))} outside the learned hardware"
            outside = [[*reasons, note] for reasons in outside]
        return outside

    def hardware_range(self) -> dict[str, tuple[float, float]]:
        """Per hardware-vector entry, the (lowest, highest) value the model saw in training, read from the
        row normaliser's bounds (so it works for any saved model; unbounded for models saved before the
        bounds were kept)."""
        norm = self._require_net().row_norm
        names = row_feature_names(self.config)
        return {f: (float(norm.lo[names.index(f)]), float(norm.hi[names.index(f)])) for f in HW_FEATURES}

    def hardware_outside_training(self, target, tolerance: float = 0.02) -> dict[str, tuple[float, float, float]]:
        """Hardware-vector entries of ``target`` outside :meth:`hardware_range` by more than ``tolerance``
        (0.02 on a log10 column is ~5 %): ``{feature: (value, lowest seen, highest seen)}``. The network
        answers such a target as the nearest one it knows."""
        vector = dict(zip(HW_FEATURES, hardware_vector(resolve_target(target)).tolist()))
        return {f: (vector[f], lo, hi) for f, (lo, hi) in self.hardware_range().items()
                if vector[f] < lo - tolerance or vector[f] > hi + tolerance}

    # ------------------------------------------------------------------ evaluation

    def predict_rows(self, dataset, index) -> tuple[Any, Prediction]:
        """(label rows, predictions) for label positions ``index`` of ``dataset`` (rows of any targets);
        rows outside the model's training domain are marked (``outside``) and their intervals widened."""
        self._require_net()
        rows = label_rows(dataset, self.config.fidelity, None, None)
        rows = rows[rows["pos"].isin(np.asarray(index))].reset_index(drop=True)
        targets = dataset_targets(dataset)
        hashes = rows["hash"].to_numpy()
        mean, std, base = np.zeros(len(rows)), np.zeros(len(rows)), np.zeros(len(rows))
        outside: list[list[str]] = [[] for _ in range(len(rows))]
        for name in pd.unique(rows["target"]):
            sel = np.flatnonzero(rows["target"].to_numpy() == name)
            arrays = self.featuriser.regions_for(hashes[sel], dataset.region_graph)
            mean[sel], std[sel], base[sel] = self._predict_arrays(arrays, targets[name])
            for i, reasons in zip(sel.tolist(), self.outside_domain(arrays, targets[name]) or []):
                outside[i] = reasons
        pred = self.calibration.predict(mean, std, base)
        if self.domain is not None:
            pred.outside = outside
            self.domain.widen(pred)
        return rows, pred

    def calibrate(self, dataset, index) -> "Surrogate":
        """Calibrate the interval again on label positions ``index`` of ``dataset`` (split-conformal, as at
        fit), e.g. on whole families the model never learned, so that its intervals hold on such families
        and not only on regions like its validation set's. The point predictions do not change."""
        rows, pred = self.predict_rows(dataset, index)
        if rows.empty:
            raise LearnError(f"{dataset.path}: the index selects no usable {self.config.fidelity} labels")
        y = np.log(rows["seconds"].to_numpy(dtype=np.float64))
        self.calibration = IntervalCalibration.fit(np.log(pred.seconds), pred.spread, y, self.calibration.coverage)
        return self

    def evaluate(self, dataset, index) -> dict[str, Any]:
        """Median / p90 APE, Kendall τ, interval coverage and n on label positions ``index``, overall,
        per family and per target (see :func:`hespas_ml.learn.evaluate.report`)."""
        from .evaluate import report
        rows, pred = self.predict_rows(dataset, index)
        if rows.empty:
            raise LearnError(f"{dataset.path}: the index selects no usable {self.config.fidelity} labels")
        return report(rows, pred.seconds, pred.lower, pred.upper)

    # ------------------------------------------------------------------ persistence

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write the surrogate into ``directory`` (created); returns it."""
        net = self._require_net()
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(net.state_dict(), out / WEIGHTS)
        meta = {"format": FORMAT, "kind": KIND, "config": self.config.to_dict(),
                "vocabulary": self.featuriser.vocabulary, "node_features": list(NODE_FEATURES),
                "edge_features": list(EDGE_FEATURES), "region_features": list(REGION_FEATURES),
                "row_features": row_feature_names(self.config), "base": self.config.base,
                "calibration": self.calibration.to_dict(),
                "trained_on": self.trained_on, "torch": torch.__version__,
                **({"domain": self.domain.to_dict()} if self.domain is not None else {})}
        (out / META).write_text(json.dumps(meta, indent=1))
        (out / METRICS).write_text(json.dumps(self.metrics, indent=1, default=float))
        return out

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> "Surrogate":
        """Read a surrogate written by :meth:`save`; any problem is one :class:`LearnError` naming the file."""
        folder = Path(directory)
        meta_path, weights_path = folder / META, folder / WEIGHTS
        if not folder.is_dir():
            raise LearnError(f"{folder}: no such surrogate directory")
        try:
            meta = json.loads(meta_path.read_text())
        except FileNotFoundError:
            raise LearnError(f"{meta_path}: missing (not a saved surrogate?)") from None
        except (OSError, ValueError) as exc:
            raise LearnError(f"{meta_path}: unreadable ({type(exc).__name__}: {exc})") from None
        if not isinstance(meta, dict) or meta.get("kind") != KIND:
            raise LearnError(f"{meta_path}: not a {KIND} file")
        if meta.get("format") != FORMAT:
            raise LearnError(f"{meta_path}: format {meta.get('format')!r}, this version reads format {FORMAT}")
        config = TrainConfig.from_dict(meta.get("config"), str(meta_path))
        if "base" in meta and meta["base"] != config.base:
            # residual_base "auto" resolved differently when it was trained: keep what the weights learned
            if meta["base"] not in (None, "roofline", "systolic", "calibrated"):
                raise LearnError(f"{meta_path}: unknown residual base {meta['base']!r}")
            config = dataclasses.replace(config, residual=meta["base"] is not None,
                                         residual_base=meta["base"] or "none")
        expected = {"node_features": list(NODE_FEATURES), "edge_features": list(EDGE_FEATURES),
                    "region_features": list(REGION_FEATURES), "row_features": row_feature_names(config)}
        for key, want in expected.items():
            if meta.get(key) != want:
                raise LearnError(f"{meta_path}: its {key.replace('_', ' ')} differ from this version's "
                                 "featuriser (retrain the surrogate)")
        vocab = meta.get("vocabulary")
        if not isinstance(vocab, list) or not all(isinstance(v, str) for v in vocab):
            raise LearnError(f"{meta_path}: 'vocabulary' must be a list of op kinds")
        self = cls(config)
        self.featuriser = Featuriser(vocab)
        self.calibration = IntervalCalibration.from_dict(meta.get("calibration") or {}, str(meta_path))
        self.trained_on = meta.get("trained_on") or {}
        self.domain = Domain.from_dict(meta["domain"], str(meta_path)) if meta.get("domain") else None
        try:
            state = torch.load(weights_path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise LearnError(f"{weights_path}: missing") from None
        except Exception as exc:  # noqa: BLE001 - torch raises many kinds on a corrupt file
            raise LearnError(f"{weights_path}: corrupt or not a weights file "
                             f"({type(exc).__name__}: {' '.join(str(exc).split())[:160]})") from None
        if not isinstance(state, dict):
            raise LearnError(f"{weights_path}: holds a {type(state).__name__}, not a state_dict")
        net = self._new_net()
        try:
            net.load_state_dict(state, strict=True)
        except (RuntimeError, KeyError, TypeError) as exc:
            first = " ".join(str(exc).split())[:200]
            raise LearnError(f"{weights_path}: does not match {meta_path.name}'s model ({first})") from None
        net.eval()
        self.net = net
        try:
            self.metrics = json.loads((folder / METRICS).read_text())
        except (OSError, ValueError):
            self.metrics = {}
        return self
