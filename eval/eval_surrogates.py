"""Evaluate the learned surrogates and their baselines on a built dataset; print tables, write a CSV.

    python eval/eval_surrogates.py DATASET --out out/eval/surrogates.csv
        [--fidelities roofline scalesim profiling] [--splits family size array]
        [--models gnn gnn-noest gnn-direct gbm gbm-noest estimate] [--folds llama vit ...]
        [--epochs 40] [--hidden 32] [--ensemble 5] [--seed 0]

For every fidelity and split kind, every fold (family: each model family held out in turn; size: the
largest 20 % of regions; array: each systolic target in turn, SCALE-Sim only) is split by region
(:func:`hespas_ml.learn.splits.make_split`) and every model is fitted on train (+ validation) and scored
on test:

``gnn``         the surrogate as configured by default (``residual_base=auto``: residual over the roofline,
                over the systolic estimate for SCALE-Sim, direct for profiling; estimates as input)
``gnn-direct``  the GNN predicting log-seconds directly, estimates as input (no residual)
``gnn-residual`` the GNN as a residual over the roofline estimate, whatever the fidelity
``gnn-noest``   the GNN with neither the estimate as input nor the residual (hardware vector only)
``gbm``         HistGradientBoosting on flat features, residual over the estimate, estimates as input
``gbm-noest``   HistGradientBoosting without the estimates
``estimate``    the analytical estimate itself (roofline; for SCALE-Sim also the systolic fold estimate)

Each fold's test predictions are kept under ``<out>.preds/`` (so a run can be resumed: finished
experiments are skipped) and the CSV gets one row per (fidelity, split, fold, model, scope) with n,
median / p90 APE, Kendall τ (within target), interval coverage and fit seconds; ``scope`` is
``overall``, ``family:<name>`` or ``target:<name>``. ``fold=pooled`` rows pool a split's folds.
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hespas_ml.label.dataset_tables import load_dataset  # noqa: E402
from hespas_ml.learn.baselines import EstimateBaseline, GBMBaseline  # noqa: E402
from hespas_ml.learn.config import LearnError, TrainConfig  # noqa: E402
from hespas_ml.learn.evaluate import TARGETS, report, table  # noqa: E402
from hespas_ml.learn.splits import make_split  # noqa: E402
from hespas_ml.learn.surrogate import Surrogate  # noqa: E402
from hespas_ml.learn.tables import MODEL_FAMILIES, label_rows  # noqa: E402

MODELS = ("gnn", "gnn-direct", "gnn-residual", "gnn-noest", "gbm", "gbm-noest", "estimate")
COLUMNS = ["fidelity", "split", "fold", "model", "scope", "n", "median_ape", "p90_ape", "kendall_tau",
           "kendall_tau_pooled", "coverage", "median_width", "fit_s", "epochs"]


def folds_for(ds, fidelity: str, split: str, only: list[str] | None) -> list[list[str]]:
    rows = label_rows(ds, fidelity)
    if split == "family":
        present = {f for fams in rows["families"] for f in fams}
        folds = [[f] for f in MODEL_FAMILIES if f in present]
    elif split == "array":
        systolic = sorted(set(rows["target"])) if fidelity == "scalesim" else []
        folds = [[t] for t in systolic] if len(systolic) > 1 else []
    elif split == "size":
        folds = [["0.2"]]
    else:
        folds = [[]]
    if only:
        folds = [f for f in folds if f and f[0] in only]
    return folds


def config_for(model: str, base: TrainConfig) -> TrainConfig:
    kw = base.to_dict()
    if model in ("gnn-noest", "gbm-noest"):
        kw.update(residual=False, roofline_input=False)
    elif model == "gnn-direct":
        kw.update(residual=False, roofline_input=True)
    elif model == "gnn-residual":
        kw.update(residual=True, roofline_input=True, residual_base="roofline")
    return TrainConfig(**kw)


def output_names(model: str, fidelity: str) -> list[str]:
    """The result names one model produces (the estimate baseline: one per analytical estimate)."""
    if model == "estimate":
        return ["estimate-roofline", "estimate-systolic"] if fidelity == "scalesim" else ["estimate-roofline"]
    return [model]


def run_one(ds, model: str, cfg: TrainConfig, split) -> list[tuple]:
    """Fit one model on a split; returns [(name, rows, info, pred, lower, upper)] in the order of
    :func:`output_names`."""
    tr, va, te = split
    t0 = time.perf_counter()
    if model == "estimate":
        out = []
        for name in output_names(model, cfg.fidelity):
            rows, pred = EstimateBaseline(cfg.fidelity, name.split("-")[1]).predict_rows(ds, te)
            out.append((name, rows, {"fit_s": 0.0, "epochs": 0}, pred, None, None))
        return out
    if model.startswith("gbm"):
        gbm = GBMBaseline(config_for(model, cfg)).fit(ds, tr, va)
        fit_s = time.perf_counter() - t0
        rows, pred = gbm.predict_rows(ds, te)
        return [(model, rows, {"fit_s": fit_s, "epochs": int(gbm.model.n_iter_)}, pred, None, None)]
    sur = Surrogate(config_for(model, cfg)).fit(ds, tr, va)
    fit_s = time.perf_counter() - t0
    rows, pred = sur.predict_rows(ds, te)
    return [(model, rows, {"fit_s": fit_s, "epochs": sur.metrics["epochs_run"]}, pred.seconds, pred.lower,
             pred.upper)]


def csv_rows(key: dict, rows: pd.DataFrame, pred, lower, upper, info: dict) -> list[dict]:
    rep = report(rows, pred, lower, upper)
    out = [{**key, "scope": "overall", **{c: rep.get(c) for c in COLUMNS if c in rep}, **info}]
    for kind in ("family", "target"):
        for name, part in rep[f"per_{kind}"].items():
            out.append({**key, "scope": f"{kind}:{name}", **{c: part.get(c) for c in COLUMNS if c in part}})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset")
    ap.add_argument("--out", default="out/eval/surrogates.csv")
    ap.add_argument("--fidelities", nargs="+", default=["roofline", "scalesim", "profiling"])
    ap.add_argument("--splits", nargs="+", default=["family", "size", "array"])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--folds", nargs="+", default=None, help="only these holdouts (families / targets)")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--patience", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--head-hidden", type=int, default=64)
    ap.add_argument("--ensemble", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-noise", type=float, default=None, help="profiling: drop labels noisier than this")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    ds = load_dataset(args.dataset)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    preds_dir = out.with_suffix(".preds")
    preds_dir.mkdir(exist_ok=True)
    results: list[dict] = []
    for fidelity in args.fidelities:
        try:
            label_rows(ds, fidelity)
        except LearnError as exc:
            print(f"skip {fidelity}: {exc}")
            continue
        for split in args.splits:
            pooled: dict[str, list] = {}
            for fold in folds_for(ds, fidelity, split, args.folds):
                base = TrainConfig(fidelity=fidelity, split=split, holdout=fold or None, epochs=args.epochs,
                                   patience=args.patience, hidden=args.hidden, head_hidden=args.head_hidden,
                                   ensemble=args.ensemble, seed=args.seed,
                                   max_noise=args.max_noise if fidelity == "profiling" else None)
                try:   # split on every label; --max-noise only filters what the models train on
                    split_idx = make_split(ds, TrainConfig(**{**base.to_dict(), "max_noise": None}))
                except LearnError as exc:
                    print(f"skip {fidelity}/{split}/{fold}: {exc}")
                    continue
                fold_name = "+".join(fold) or "-"
                for model in args.models:
                    names = output_names(model, fidelity)
                    paths = [preds_dir / f"{fidelity}__{split}__{fold_name}__{n}.parquet" for n in names]
                    if all(p.exists() for p in paths):
                        frames = [pd.read_parquet(p) for p in paths]
                    else:
                        t0 = time.perf_counter()
                        frames = []
                        for name, rows, info, pred, lower, upper in run_one(ds, model, base, split_idx):
                            df = rows[["pos", "hash", "target", "seconds", "family"]].copy()
                            df["pred"] = pred
                            if lower is not None:
                                df["lower"], df["upper"] = lower, upper
                            df["fit_s"], df["epochs"] = info["fit_s"], info["epochs"]
                            df.to_parquet(preds_dir / f"{fidelity}__{split}__{fold_name}__{name}.parquet")
                            frames.append(df)
                        print(f"  {fidelity}/{split}/{fold_name}/{model}: {time.perf_counter() - t0:.0f} s", flush=True)
                    for name, df in zip(names, frames):
                        lower = df["lower"].to_numpy() if "lower" in df else None
                        upper = df["upper"].to_numpy() if "upper" in df else None
                        info = {"fit_s": float(df["fit_s"].iloc[0]), "epochs": int(df["epochs"].iloc[0])}
                        key = {"fidelity": fidelity, "split": split, "fold": fold_name, "model": name}
                        results += csv_rows(key, df, df["pred"].to_numpy(), lower, upper, info)
                        pooled.setdefault(name, []).append((df, df["pred"].to_numpy(), lower, upper))
            for name, parts in pooled.items():
                if len(parts) < 2:
                    continue
                rows = pd.concat([p[0] for p in parts], ignore_index=True)
                pred = np.concatenate([p[1] for p in parts])
                has_iv = all(p[2] is not None for p in parts)
                lower = np.concatenate([p[2] for p in parts]) if has_iv else None
                upper = np.concatenate([p[3] for p in parts]) if has_iv else None
                key = {"fidelity": fidelity, "split": split, "fold": "pooled", "model": name}
                results += csv_rows(key, rows, pred, lower, upper, {})
            _write(out, results)
    _write(out, results)
    _print(results)
    return 0


def _write(path: Path, results: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(results)
    tmp.replace(path)


def _print(results: list[dict]) -> None:
    overall = [r for r in results if r["scope"] == "overall"]
    for fidelity in dict.fromkeys(r["fidelity"] for r in overall):
        goal = TARGETS[fidelity]
        print(f"\n== {fidelity} (targets on held-out families: median APE <= {goal[0]:.0%}, p90 <= {goal[1]:.0%}, "
              f"tau >= {goal[2]})")
        rows = [r for r in overall if r["fidelity"] == fidelity]
        print(table(rows, ["split", "fold", "model", "n", "median_ape", "p90_ape", "kendall_tau", "coverage",
                           "fit_s"]))


if __name__ == "__main__":
    sys.exit(main())
