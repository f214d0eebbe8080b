"""A small plan cut from a plan and an earlier run's results: the first regions and programs it timed.

    python eval/device/subplan.py --plan eval/device/plans/h100 --from RESULTS --regions 24 --out DIR

Timing the same modules again under another setting (XLA flags, say) and comparing with
``eval/device/compare.py`` shows what that setting changes before a whole run uses it. The cut plan keeps
the plan's target and options under the name ``<plan>-check``.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hespas_ml.label.device_run import read_jsonl_gz  # noqa: E402
from hespas_ml.label.device_run import read_lines  # noqa: E402


def cut(plan_dir: Path, results: Path, regions: int, out: Path) -> dict[str, int]:
    timed = [r["hash"] for r in read_lines(results / "labels.jsonl") if r.get("status") == "ok"][:regions]
    ran = {r["id"] for r in read_lines(results / "steps.jsonl") if r.get("status") == "ok"}
    keep = set(timed)
    chosen = [r for r in read_jsonl_gz(plan_dir / "regions.jsonl.gz") if r["hash"] in keep]
    programs = [p for p in read_jsonl_gz(plan_dir / "steps.jsonl.gz") if p["id"] in ran]
    plan = json.loads((plan_dir / "plan.json").read_text())
    plan["name"] = f"{plan['name']}-check"
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan, indent=1))
    for name, rows in (("regions.jsonl.gz", chosen), ("steps.jsonl.gz", programs)):
        with gzip.open(out / name, "wt") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    return {"regions": len(chosen), "programs": len(programs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", required=True, type=Path, help="the plan the results belong to")
    ap.add_argument("--from", dest="results", required=True, type=Path, help="results folder of an earlier run")
    ap.add_argument("--regions", type=int, default=24, help="regions to keep (the first timed; default 24)")
    ap.add_argument("--out", required=True, type=Path, help="folder of the cut plan")
    args = ap.parse_args(argv)
    if not (args.plan / "plan.json").is_file():
        print(f"error: {args.plan}: not a measurement plan (no plan.json)", file=sys.stderr)
        return 2
    if not (args.results / "labels.jsonl").is_file():
        print(f"error: {args.results}: no labels.jsonl (not a results folder of a device run)", file=sys.stderr)
        return 2
    print(json.dumps(cut(args.plan, args.results, args.regions, args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
