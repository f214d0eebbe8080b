"""Import a device run's results as a measured dataset (datasets/measured/<name>/), with provenance.

    python eval/device/collect.py --plan .device/plan RESULTS [RESULTS …] --out datasets/measured/h100-<date>

RESULTS are results folders of eval/device/measure.py (later ones win where a region was timed twice).
The output folder is a dataset folder (hespas_ml.label.dataset_tables.load_dataset reads it) plus steps.csv,
provenance.json and README.md; it is replaced as a whole.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hespas_ml.ingest.errors import HespasError  # noqa: E402
from hespas_ml.label.measured import import_run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", help="results folders of eval/device/measure.py")
    ap.add_argument("--plan", required=True, help="the plan folder the results belong to")
    ap.add_argument("--out", required=True, help="measured dataset folder to write (replaced)")
    ap.add_argument("--command", default="", help="the device command, written into the README")
    args = ap.parse_args(argv)
    command = "\n".join(c for c in (args.command, "python eval/device/collect.py " +
                                    " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))) if c)
    try:
        counts = import_run(args.plan, args.results, args.out, command=command)
    except HespasError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
