"""Calibrate a saved surrogate's interval on whole families, each left out of a model trained without it.

    python eval/crossfit_interval.py MODEL_DIR DATASET --config CONFIG.yaml --families vit resnet unet …

``eval/recalibrate.py`` calibrates on families the saved model never learned; a model that learned every family
it has labels of (the held-out ones aside) has none left. Here each of ``--families`` is left out in turn: a model
of ``CONFIG`` (the saved model's own configuration file) is trained on the dataset without that family (and
without the config's held-out families), and scores the left-out family's labels with split-conformal scores
``|y - mu| / (sigma + sigma0)`` (:class:`~hespas_ml.learn.ensemble.IntervalCalibration`). The pooled scores set
the saved model's interval scale at its nominal coverage; its own spread floor stays (rows outside the training
domain are widened further when answered, as before). The held-out families
of the config stay untouched, so the model's held-out figures still say how the interval does on families neither
the model nor its calibration saw. The same left-out rows' |log error| at the nominal coverage becomes the
half-width of the interval of a region outside the training domain (``domain.ood_half_width``: what left-out
families showed) where that is wider than the one the model has. Only ``surrogate.json`` changes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hespas_ml.ingest.errors import HespasError  # noqa: E402
from hespas_ml.label.dataset_tables import load_dataset  # noqa: E402
from hespas_ml.learn.config import TrainConfig  # noqa: E402
from hespas_ml.learn.ensemble import IntervalCalibration  # noqa: E402
from hespas_ml.learn.splits import make_split  # noqa: E402
from hespas_ml.learn.surrogate import META, Surrogate  # noqa: E402
from hespas_ml.learn.tables import in_program_labels, label_rows  # noqa: E402


def fold_scores(dataset, config: TrainConfig, family: str) -> tuple[np.ndarray, np.ndarray, dict]:
    """Conformal scores and |log errors| of ``family``'s labels under a model trained without it (and without
    the config's held-out families), and the fold's figures."""
    fold = dataclasses.replace(config, split="family", holdout=sorted({family, *(config.holdout or [])}))
    train, val, test = make_split(dataset, fold)
    model = Surrogate(fold).fit(dataset, train, val)
    rows, pred = model.predict_rows(dataset, test)
    mine = rows["families"].map(lambda fams: family in fams and not set(fams) & set(config.holdout or [])).to_numpy()
    y = np.log(rows["seconds"].to_numpy(dtype=np.float64))[mine]
    mean = np.log(pred.seconds)[mine]
    half = 0.5 * (np.log(pred.upper) - np.log(pred.lower))[mine]         # widened outside the domain
    scores = np.abs(y - mean) / (pred.spread[mine] + model.calibration.floor)
    ape = np.abs(np.expm1(mean - y))
    return scores, np.abs(y - mean), {"family": family, "rows": int(mine.sum()),
                    "median_ape": float(np.median(ape)) if len(ape) else None,
                    "coverage_before": float(np.mean(np.abs(y - mean) <= half)) if len(y) else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path, help="saved surrogate folder (its interval is what changes)")
    ap.add_argument("dataset", type=Path, help="the dataset it was trained on")
    ap.add_argument("--config", type=Path, required=True, help="its training configuration (YAML)")
    ap.add_argument("--families", nargs="+", required=True, help="families to leave out one at a time")
    ap.add_argument("--dry-run", action="store_true", help="print the figures; leave the model as it is")
    args = ap.parse_args(argv)
    try:
        config = TrainConfig.from_dict(yaml.safe_load(args.config.read_text()), str(args.config))
        surrogate = Surrogate.load(args.model)
        held = set(config.holdout or []) & set(args.families)
        if held:
            raise HespasError(f"{args.config}: {', '.join(sorted(held))} is held out of the model; leave it out "
                              "of --families so that its figures stay out of sample")
        dataset = load_dataset(args.dataset)
        if config.in_program:
            dataset = in_program_labels(dataset)
        label_rows(dataset, config.fidelity, config.targets, config.max_noise)    # a clear error when none
        pooled, errors, folds = [], [], []
        for i, family in enumerate(args.families, 1):
            t0 = time.perf_counter()
            scores, error, figures = fold_scores(dataset, config, family)
            pooled.append(scores)
            errors.append(error)
            folds.append({**figures, "seconds": round(time.perf_counter() - t0, 1)})
            print(f"[{i}/{len(args.families)}] {json.dumps(folds[-1])}", file=sys.stderr, flush=True)
    except (HespasError, OSError, yaml.YAMLError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    scores = np.concatenate(pooled)
    if not len(scores):
        print(f"error: {args.dataset}: no labels of {', '.join(args.families)}", file=sys.stderr)
        return 2
    before = surrogate.calibration.to_dict()
    coverage = surrogate.calibration.coverage
    level = min(1.0, math.ceil((len(scores) + 1) * coverage) / len(scores))
    after = IntervalCalibration(scale=float(np.quantile(scores, level, method="higher")),
                                floor=surrogate.calibration.floor, coverage=coverage, n=int(len(scores)))
    shown = float(np.quantile(np.concatenate(errors), coverage, method="higher"))
    domain = surrogate.domain
    ood = max(shown, domain.ood_half_width) if domain is not None else None
    report = {"model": args.model.name, "rows": int(len(scores)), "folds": folds, "before": before,
              "after": after.to_dict(), "left_out_log_error_at_coverage": shown,
              "ood_half_width": {"before": domain.ood_half_width if domain is not None else None, "after": ood},
              "basis": f"cross-fitted on left-out families {', '.join(args.families)}"}
    if not args.dry_run:
        meta_path = args.model / META
        meta = json.loads(meta_path.read_text())
        meta["calibration"] = after.to_dict()
        if ood is not None:
            meta["domain"]["ood_half_width"] = ood
        meta_path.write_text(json.dumps(meta, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
