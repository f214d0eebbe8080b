"""Prepare a measurement plan for a lent device, here on the CPU (minutes; resumable).

    python eval/device/plan.py eval/device/h100.yaml --out .device/plan --work out/device-work

Exports, ingests and splits the plan spec's programs (the training corpus, the step programs and the
held-out programs) through the dataset builder in --work, chooses the regions to time and writes --out
(see hespas_ml/use/device_plan.py). Carry --out to the device and run eval/device/measure.py there.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hespas_ml.ingest.errors import HespasError  # noqa: E402
from hespas_ml.use.device_plan import build_plan  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("spec", help="plan spec (YAML), e.g. eval/device/h100.yaml")
    ap.add_argument("--out", required=True, help="plan folder to write")
    ap.add_argument("--work", required=True, help="dataset build folder of every program (resumable)")
    ap.add_argument("--workers", type=int, default=None, help="processes for exporting programs")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    try:
        counts = build_plan(args.spec, args.out, args.work, workers=args.workers, progress=not args.quiet)
    except HespasError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
