"""Single-device step times measured on a GPU by this project's device runs, against every way hespas-ml answers.

    python eval/eval_device_steps.py [--measured datasets/measured] [--sources roofline measured roofline@merged …] [--json OUT]

Reads the ``steps.csv`` of every measured folder (``datasets/measured/*/steps.csv``, written by
``eval/device/collect.py``: whole programs timed on the device with the same worker as the region labels) and
simulates each program on its target with each source, in this run: ``roofline`` (the default answer),
``measured`` (the regions' own labels from those folders, each less its dispatch overhead), ``surrogate:…``;
``FIDELITY@SPLIT`` splits the program another way (``roofline@merged``: elementwise producers recomputed in
their readers).
A source that cannot answer a program (``measured`` without all its regions) is reported with its reason,
never guessed. Prints per program the step time of each source and its error, then per source and phase
(``steps``: corpus families, ``held_out``: families kept out of training) the median |error|.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hespas_ml.ingest.errors import HespasError  # noqa: E402
from hespas_ml.pipeline import simulate  # noqa: E402


def read_steps(folder: Path) -> list[dict]:
    rows = []
    for path in sorted(folder.glob("*/steps.csv")):
        with open(path, newline="") as fh:
            for row in csv.DictReader(fh):
                if row["status"] == "ok" and row.get("phase") in ("steps", "held_out"):   # device runs' rows
                    rows.append({**row, "folder": path.parent.name, "step_s": float(row["step_s"])})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", type=Path, default=ROOT / "datasets" / "measured", help="measured folders")
    ap.add_argument("--sources", nargs="+", default=["roofline", "measured"])
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    rows = read_steps(args.measured)
    if not rows:
        print(f"error: {args.measured}: no steps.csv with a timed program", file=sys.stderr)
        return 2
    results = []
    for row in rows:
        out = {"program": row["source"], "family": row["family"], "phase": row["phase"], "target": row["target"],
               "folder": row["folder"], "measured_s": row["step_s"], "indices": row.get("indices") or "",
               "sources": {}}
        for source in args.sources:
            fidelity, _, split = source.partition("@")
            options = {"folders": [args.measured]} if fidelity == "measured" else None
            try:
                res = simulate(row["source"], target=row["target"], fidelity=fidelity, split=split or "fusion",
                               fidelity_options=options)
            except HespasError as exc:
                out["sources"][source] = {"error": str(exc).split(";")[0][:160]}
                continue
            out["sources"][source] = {"step_s": res.step_time_s, "error": res.step_time_s / row["step_s"] - 1.0,
                                      "interval_s": res.step_time_interval_s}
        results.append(out)
    for r in results:
        print(f"{r['target']} {r['phase']:<8} {r['program'][:96]}")
        few = ("; its gather/scatter indices were all in [1, 4): contended, not a real step"
               if r["indices"] == "1-3" else "")
        print(f"    {'timed':<8} {r['measured_s'] * 1e3:9.3f} ms  (on the device: {r['folder']}{few})")
        for source, s in r["sources"].items():
            if "step_s" in s:
                iv = s.get("interval_s")
                holds = (f"  interval {iv[0] * 1e3:.3f} .. {iv[1] * 1e3:.3f} ms "
                         f"{'holds' if iv[0] <= r['measured_s'] <= iv[1] else 'misses'} the timed step" if iv else "")
                print(f"    {source:<8} {s['step_s'] * 1e3:9.3f} ms  {100 * s['error']:+7.1f} %{holds}")
            else:
                print(f"    {source:<8} unavailable: {s['error']}")
    print()
    for source in args.sources:
        for phase in ("steps", "held_out"):
            mine = [r for r in results if r["phase"] == phase and "step_s" in r["sources"].get(source, {})]
            errors = [abs(r["sources"][source]["error"]) for r in mine]
            few = sum(1 for r in mine if r["indices"] == "1-3")
            if errors:
                held = [r for r in mine if r["sources"][source].get("interval_s")]
                inside = sum(1 for r in held if r["sources"][source]["interval_s"][0] <= r["measured_s"]
                             <= r["sources"][source]["interval_s"][1])
                print(f"{source:<10} {phase:<9} median |error| {100 * statistics.median(errors):6.1f} %  "
                      f"over {len(errors)} program(s)" + (f", {few} of them with indices in [1, 4)" if few else "")
                      + (f"; {inside} of {len(held)} intervals hold the timed step" if held else ""))
            spread = [abs(r["sources"][source]["error"]) for r in mine if r["indices"] != "1-3"]
            if few and spread:
                print(f"{source:<10} {phase:<9} median |error| {100 * statistics.median(spread):6.1f} %  "
                      f"over the {len(spread)} timed with their indices spread")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
