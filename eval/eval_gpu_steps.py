"""Step times on real GPUs: every way hespas-ml can answer, against measured step times, in one run.

    python eval/eval_gpu_steps.py [--sources roofline@fusion roofline@linear measured@hespas …]
                                  [--measured eval/measured/gpu_steps.csv] [--json out/eval/gpu_steps.json]

The measured step times (``eval/measured/gpu_steps.csv``: program under ``../shared``, ASTRA-sim system folder
under ``../shared/hespas-configs/systems``, target, seconds, and where the figure comes from) are evaluation
data only. A source is ``FIDELITY@SPLIT``: ``roofline@fusion`` (the default answer), ``roofline@linear``,
``measured@hespas`` (labels measured on the GPU itself for the program's Hespas compute blocks,
``datasets/measured/``), ``surrogate:…@fusion``. A source that cannot answer a case is reported as
unavailable with its reason, never guessed.

Prints per case the step time of each source and its error against the measurement, then per source the
mean |error| and the speed-up trend error: for each pair of consecutive GPUs (in the CSV's order) the
ratio of their step times, predicted against measured, |predicted ratio / measured ratio − 1|. The
published measurements are rounded to 0.01 s, so a measured 0.02 s step is known to ±25 %: the CSV's note
says so, and the figures here inherit it.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hespas_ml.ingest.errors import HespasError  # noqa: E402
from hespas_ml.pipeline import simulate  # noqa: E402

SHARED = (ROOT / ".." / "shared").resolve()
DEFAULT_SOURCES = ("roofline@fusion", "roofline@linear", "measured@hespas")


def read_cases(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    for i, row in enumerate(rows, start=2):
        for key in ("program", "system", "target", "runtime_s"):
            if not row.get(key):
                raise SystemExit(f"{path}:{i}: column {key} is empty")
        float(row["runtime_s"])
    return rows


def run(cases: list[dict[str, str]], sources: list[str]) -> list[dict]:
    results = []
    for case in cases:
        program = SHARED / case["program"]
        system = SHARED / "hespas-configs" / "systems" / case["system"]
        for source in sources:
            fidelity, _, split = source.rpartition("@")
            row = {"program": case["program"], "system": case["system"], "target": case["target"],
                   "source": source, "measured_s": float(case["runtime_s"])}
            try:
                res = simulate(program, target=case["target"], system=system, fidelity=fidelity, split=split)
            except (HespasError, ValueError) as exc:
                row.update(status="unavailable", reason=str(exc).splitlines()[0][:200])
            else:
                row.update(status="ok", step_s=res.step_time_s, compute_s=res.compute_time_s,
                           exposed_comm_s=res.exposed_comm_s, error=res.step_time_s / row["measured_s"] - 1)
            results.append(row)
    return results


def summary(results: list[dict], sources: list[str]) -> dict[str, dict]:
    out = {}
    for source in sources:
        mine = [r for r in results if r["source"] == source]
        ok = [r for r in mine if r["status"] == "ok"]
        entry = {"cases": len(mine), "ok": len(ok)}
        if ok and len(ok) == len(mine):
            entry["mean_abs_error"] = sum(abs(r["error"]) for r in ok) / len(ok)
            trends = [abs((b["step_s"] / a["step_s"]) / (b["measured_s"] / a["measured_s"]) - 1)
                      for a, b in zip(ok, ok[1:]) if a["program"] == b["program"]]
            if trends:
                entry["mean_trend_error"] = sum(trends) / len(trends)
        out[source] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sources", nargs="+", default=list(DEFAULT_SOURCES))
    ap.add_argument("--measured", type=Path, default=ROOT / "eval" / "measured" / "gpu_steps.csv")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    args = ap.parse_args(argv)
    if not SHARED.is_dir():
        print(f"error: {SHARED}: the reference material beside the project is absent", file=sys.stderr)
        return 2
    cases = read_cases(args.measured)
    results = run(cases, args.sources)
    print(f"{'program':<38} {'target':<10} {'measured':>9} " + " ".join(f"{s:>22}" for s in args.sources))
    for case in cases:
        mine = {r["source"]: r for r in results if r["program"] == case["program"] and r["target"] == case["target"]}
        cells = []
        for s in args.sources:
            r = mine[s]
            cells.append(f"{r['step_s'] * 1e3:9.2f} ms {r['error']:+7.1%}" if r["status"] == "ok" else
                         f"{'unavailable':>22}")
        print(f"{case['program']:<38} {case['target']:<10} {float(case['runtime_s']) * 1e3:6.0f} ms " + " ".join(cells))
    figures = summary(results, args.sources)
    print()
    for source, entry in figures.items():
        if "mean_abs_error" in entry:
            trend = entry.get("mean_trend_error")
            print(f"{source:<22} mean |error| {entry['mean_abs_error']:6.1%}   speed-up trend error "
                  + (f"{trend:6.1%}" if trend is not None else "   n/a"))
        else:
            reasons = sorted({r["reason"] for r in results if r["source"] == source and r["status"] != "ok"})
            print(f"{source:<22} answered {entry['ok']} of {entry['cases']}: {reasons[0] if reasons else ''}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"results": results, "summary": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
