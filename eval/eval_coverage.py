"""How honest the shipped surrogates' intervals are on whole families they never learned.

    python eval/eval_coverage.py DATASET [--models roofline scalesim profiling] [--json OUT]

DATASET is a build of ``datasets/leave-family-out.yaml`` (families none of the models learned, labelled with
each model's own labeller options). For every model and every target it has labels of, on the rows of
those families: median and p90 APE, and the interval coverage (the share of labels inside the interval)
overall, per family, and for the rows inside and outside the model's training domain; beside it the
coverage the same intervals would have without the widening outside the domain. A model's nominal
coverage is 90 %; the issue asks for 85 % at least on left-out families.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hespas_ml.ingest.errors import HespasError  # noqa: E402
from hespas_ml.label.dataset_tables import load_dataset  # noqa: E402
from hespas_ml.learn.domain import reason_kind  # noqa: E402
from hespas_ml.learn.fidelity import load_model  # noqa: E402
from hespas_ml.learn.tables import label_rows  # noqa: E402

MODELS = ("roofline", "scalesim", "profiling")


def _figures(truth: np.ndarray, pred: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> dict[str, float]:
    ape = np.abs(pred / truth - 1.0)
    inside = (truth >= lower) & (truth <= upper)
    return {"rows": int(len(truth)), "median_ape": float(np.median(ape)), "p90_ape": float(np.quantile(ape, 0.9)),
            "coverage": float(inside.mean())}


def evaluate(model: str, dataset) -> dict:
    surrogate = load_model(model).surrogate
    fidelity = surrogate.config.fidelity
    learned = set(surrogate.trained_on.get("families") or [])
    rows = label_rows(dataset, fidelity)
    rows = rows[rows["families"].map(lambda fams: not learned & set(fams))]
    if rows.empty:
        raise HespasError(f"{dataset.path}: no {fidelity} labels of a family {model} did not learn")
    got, pred = surrogate.predict_rows(dataset, rows["pos"].to_numpy())
    truth = got["seconds"].to_numpy()
    outside = np.asarray([bool(r) for r in pred.outside], dtype=bool) if pred.outside else np.zeros(len(got), bool)
    # the intervals as the calibration alone gives them (no widening outside the domain)
    plain = surrogate.calibration.predict(np.log(pred.seconds), pred.spread)
    out = {"model": model, "fidelity": fidelity, "domain": surrogate.domain is not None,
           "ood_half_width": surrogate.domain.ood_half_width if surrogate.domain is not None else None,
           "all": _figures(truth, pred.seconds, pred.lower, pred.upper),
           "all_without_widening": _figures(truth, plain.seconds, plain.lower, plain.upper),
           "outside_share": float(outside.mean()), "by_family": {}, "by_target": {}, "reasons": {}}
    for part, mask in (("inside", ~outside), ("outside", outside)):
        if mask.any():
            out[part] = _figures(truth[mask], pred.seconds[mask], pred.lower[mask], pred.upper[mask])
    for key, column in (("by_family", "family"), ("by_target", "target")):
        for value in sorted(set(got[column])):
            mask = (got[column] == value).to_numpy()
            out[key][value] = _figures(truth[mask], pred.seconds[mask], pred.lower[mask], pred.upper[mask])
    for reasons in pred.outside or []:
        for reason in reasons:
            kind = reason_kind(reason)
            out["reasons"][kind] = out["reasons"].get(kind, 0) + 1
    return out


def _line(name: str, f: dict) -> str:
    return (f"  {name:<22} {f['rows']:>6} rows  median APE {f['median_ape'] * 100:6.2f} %  p90 {f['p90_ape'] * 100:7.2f} %"
            f"  coverage {f['coverage'] * 100:6.2f} %")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dataset", type=Path, help="a build of datasets/leave-family-out.yaml")
    ap.add_argument("--models", nargs="+", default=list(MODELS), help="model references (default: the shipped ones)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    try:
        dataset = load_dataset(args.dataset)
        results = []
        for model in args.models:
            try:
                results.append(evaluate(model, dataset))
            except HespasError as exc:
                print(f"{model}: skipped ({exc})")
    except HespasError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for r in results:
        print(f"{r['model']} ({r['fidelity']} labels; domain {'known' if r['domain'] else 'unknown'}"
              + (f", outside: interval ±{np.expm1(r['ood_half_width']) * 100:.3g} %" if r["domain"] else "") + ")")
        print(_line("all", r["all"]))
        print(_line("all, not widened", r["all_without_widening"]))
        for part in ("inside", "outside"):
            if part in r:
                print(_line(f"{part} the domain", r[part]))
        for key in ("by_family", "by_target"):
            for value, f in r[key].items():
                print(_line(f"{key[3:]} {value}", f))
        if r["reasons"]:
            print("  outside because: " + "; ".join(f"{k} ({n})" for k, n in
                                                  sorted(r["reasons"].items(), key=lambda kv: -kv[1])[:6]))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
