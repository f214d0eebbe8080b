"""Time a measurement plan on the device this runs on (the lent GPU machine, or this CPU for a check).

    PYTHONPATH=. python eval/device/measure.py --plan .device/plan --out "$OUT" --budget-s 450

Nothing to install: it needs jax, numpy and pyyaml (no mlflow, optuna, scalesim or torch). Results go to
--out as they are taken (``labels.jsonl``, ``steps.jsonl``, ``runs.jsonl``, ``log.txt``); whatever is
already there is kept and skipped, so copying an earlier call's results into --out continues that call.
Exit status 2 with one line on stderr for a bad plan or a device that is not the plan's target.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hespas_ml.ingest.errors import HespasError  # noqa: E402
from hespas_ml.label.device_run import PHASES  # noqa: E402
from hespas_ml.label.device_run import run_plan  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", required=True, help="plan folder written by eval/device/plan.py")
    ap.add_argument("--out", required=True, help="results folder (kept and continued)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="seconds of measuring for this call (default 450)")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"phases in order (default {','.join(PHASES)})")
    ap.add_argument("--retry-failed", action="store_true", help="time again what failed before")
    ap.add_argument("--target", help="time on this target instead of the plan's (a rehearsal, e.g. host-cpu)")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=JSON",
                    help="override a profiling option of the plan, e.g. measure_s=0.2")
    ap.add_argument("--retime-unlooped", type=int, default=0, metavar="N",
                    help="with --option loop=K: time again, looped and first, the first N regions of the "
                         "regions phase that were timed one execution at a time")
    args = ap.parse_args(argv)
    try:
        options = {}
        for item in args.option:
            key, _, value = item.partition("=")
            options[key] = json.loads(value)
        record = run_plan(args.plan, args.out, budget_s=args.budget_s,
                          phases=tuple(p for p in args.phases.split(",") if p), retry_failed=args.retry_failed,
                          options=options, target=args.target, retime_unlooped=args.retime_unlooped)
    except (HespasError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"left": record.get("left"), "done": record.get("done"), "wall_s": round(record["wall_s"], 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
