"""Fit a target's roofline calibration on the region labels measured on it, or check a preset's.

    python eval/calibrate_roofline.py datasets/measured/h100-2026-11-27 --target H100 [--check]

Prints the ``calibration`` block for the target file (``hespas_ml/label/calibration.py`` says what is
fitted on which labels). ``--check`` exits 1 when the preset's block differs from what the labels give
now (after a new device run, paste the printed block into the preset, and into the presets that borrow it).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hespas_ml.ingest.errors import HespasError  # noqa: E402
from hespas_ml.label.calibration import fit_calibration  # noqa: E402
from hespas_ml.label.targets import load_target  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("measured", type=Path, help="a measured dataset folder (datasets/measured/…)")
    ap.add_argument("--target", required=True, help="the target the labels were measured on")
    ap.add_argument("--check", action="store_true", help="exit 1 where the preset's calibration differs")
    args = ap.parse_args(argv)
    try:
        target = load_target(args.target)
        fitted = fit_calibration(args.measured, target)
    except HespasError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(yaml.safe_dump({"calibration": fitted.to_mapping()}, sort_keys=False), end="")
    if args.check and target.calibration != fitted:
        print(f"{target.name}: its calibration differs from what {args.measured} gives now", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
