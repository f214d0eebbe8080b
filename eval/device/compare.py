"""Compare two device runs region by region and program by program (the same plan's modules).

    python eval/device/compare.py BASE OTHER

BASE and OTHER are results folders of ``eval/device/measure.py`` (or a measured folder's ``raw/``). Prints,
for every region and program timed in both, OTHER's time over BASE's and both compile times, then the
median and geometric mean of the ratios; for regions, also both times less the launch overhead their
labels record (as ``--fidelity measured`` counts them; a region timed in a loop pays a share of it per
pass). Used to check what a change of XLA flags, of the timing (``--option loop=K``) or of the machine does
to the times before a run with it is trusted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hespas_ml.label.device_run import read_lines  # noqa: E402
from hespas_ml.label.measured_fidelity import in_program  # noqa: E402


def _ok(folder: Path, name: str, key: str) -> dict[str, dict]:
    rows = {}
    for row in read_lines(folder / name):
        if row.get("status") == "ok":
            row["meta"] = json.loads(row.get("meta") or "{}")
            rows[row[key]] = row
    return rows


def _flags(rows: dict[str, dict]) -> str:
    return ", ".join(sorted({r["meta"].get("xla_flags") or "(none)" for r in rows.values()})) or "-"


def compare(base: Path, other: Path, out=sys.stdout) -> dict[str, float]:
    figures: dict[str, float] = {}
    for name, key, label in (("labels.jsonl", "hash", "region"), ("steps.jsonl", "id", "program")):
        a, b = _ok(base, name, key), _ok(other, name, key)
        both = [k for k in a if k in b]
        if not both:
            print(f"{label}s: none timed in both", file=out)
            continue
        print(f"{label}s timed in both: {len(both)} (XLA_FLAGS base {_flags(a)}; other {_flags(b)})", file=out)
        print(f"{'':<4}{'base (us)':>12} {'other (us)':>12} {'ratio':>7} {'compile base/other (s)':>24}  what", file=out)
        ratios, inside = [], []
        for k in both:
            ra, rb = a[k], b[k]
            ratio = rb["seconds"] / ra["seconds"]
            ratios.append(ratio)
            if label == "region":
                less = [in_program(r["seconds"], json.dumps(r["meta"])) for r in (ra, rb)]
                if less[0] > 0 and less[1] > 0:
                    inside.append(less[1] / less[0])
            ca = ra["meta"].get("compile_s") or ra.get("compile_s") or float("nan")
            cb = rb["meta"].get("compile_s") or rb.get("compile_s") or float("nan")
            what = ra.get("family") or ra.get("source", "")[:70]
            print(f"{'':<4}{ra['seconds'] * 1e6:>12.1f} {rb['seconds'] * 1e6:>12.1f} {ratio:>7.2f} "
                  f"{ca:>11.2f} / {cb:<10.2f}  {what}", file=out)
        figures[f"{label}_median_ratio"] = statistics.median(ratios)
        figures[f"{label}_geomean_ratio"] = statistics.geometric_mean(ratios)
        print(f"{label}s: other / base median {figures[f'{label}_median_ratio']:.2f}, geometric mean "
              f"{figures[f'{label}_geomean_ratio']:.2f}, range {min(ratios):.2f}-{max(ratios):.2f}", file=out)
        if inside:
            figures[f"{label}_in_program_median_ratio"] = statistics.median(inside)
            print(f"{label}s less their launch overhead: other / base median {statistics.median(inside):.2f}, "
                  f"range {min(inside):.2f}-{max(inside):.2f} over {len(inside)} (those left above zero)", file=out)
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("other", type=Path)
    args = ap.parse_args(argv)
    for folder in (args.base, args.other):
        if not (folder / "labels.jsonl").is_file() and not (folder / "steps.jsonl").is_file():
            print(f"error: {folder}: no labels.jsonl or steps.jsonl (not a results folder of a device run)",
                  file=sys.stderr)
            return 2
    compare(args.base, args.other)
    return 0


if __name__ == "__main__":
    sys.exit(main())
