"""Calibrate a saved surrogate's interval again on whole families it never learned.

    python eval/recalibrate.py MODEL_DIR DATASET --families llama dlrm unet [--targets H100]

Split-conformal on the label rows of ``--families`` in ``DATASET`` (``Surrogate.calibrate``): the interval's
scale is set so that its nominal coverage holds on those rows. Families the model learned are refused:
calibrating on them says nothing about families it did not. Check the result on other left-out families
(``eval/eval_coverage.py``). Only ``surrogate.json``'s ``calibration`` changes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hespas_ml.ingest.errors import HespasError  # noqa: E402
from hespas_ml.label.dataset_tables import load_dataset  # noqa: E402
from hespas_ml.learn.surrogate import META, Surrogate  # noqa: E402
from hespas_ml.learn.tables import label_rows  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path, help="saved surrogate folder")
    ap.add_argument("dataset", type=Path, help="dataset folder with labels of the model's fidelity")
    ap.add_argument("--families", nargs="+", required=True, help="families to calibrate on (never learned)")
    ap.add_argument("--targets", nargs="+", help="only these targets' rows (default: all)")
    args = ap.parse_args(argv)
    try:
        surrogate = Surrogate.load(args.model)
        learned = set(surrogate.trained_on.get("families") or []) & set(args.families)
        if learned:
            raise HespasError(f"{args.model}: learned {', '.join(sorted(learned))}; calibrate on families it "
                              "never learned")
        ds = load_dataset(args.dataset)
        rows = label_rows(ds, surrogate.config.fidelity, args.targets)
        rows = rows[rows["families"].map(lambda fams: set(fams) <= set(args.families))]
        if rows.empty:
            raise HespasError(f"{args.dataset}: no {surrogate.config.fidelity} labels of {', '.join(args.families)}")
        before = surrogate.calibration.to_dict()
        surrogate.calibrate(ds, rows["pos"].to_numpy())
    except (HespasError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    meta_path = args.model / META
    meta = json.loads(meta_path.read_text())
    meta["calibration"] = surrogate.calibration.to_dict()
    meta_path.write_text(json.dumps(meta, indent=1))
    print(json.dumps({"model": str(args.model), "rows": int(len(rows)), "before": before,
                      "after": meta["calibration"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
