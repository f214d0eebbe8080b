"""Step times on real GPUs: every way hespas-ml can answer, against measured step times, in one run.

    python eval/eval_gpu_steps.py [--sources roofline@fusion roofline@merged roofline@linear measured@hespas …]
                                  [--measured eval/measured/gpu_steps.csv] [--json out/eval/gpu_steps.json]
                                  [--github DIR]

The measured step times (``eval/measured/gpu_steps.csv``: program, ASTRA-sim system folder under
``../shared/hespas-configs/systems``, target, seconds, and where the figure comes from) are evaluation
data only. A program is a path under ``../shared``, or ``github:OWNER/NAME@COMMIT:PATH`` for one that is
not there (the Hespas repository's ResNet-50 training step): it is read from the clone ``DIR/OWNER+NAME``
that ``--github DIR`` names, and reported unavailable without one. A source is ``FIDELITY@SPLIT``:
``roofline@fusion`` (the default answer), ``roofline@merged`` (elementwise producers recomputed in their
readers, as XLA's fusion merger does), ``calibrated-roofline@merged`` (the same at the efficiencies measured
on the H100, ``hespas_ml/label/calibration.py``), ``roofline@linear``, ``measured@hespas`` (labels measured on the GPU
itself for the program's Hespas compute blocks, ``datasets/measured/``), ``surrogate:…@fusion``. A source
that cannot answer a case is reported as unavailable with its reason, never guessed.

Prints per case the step time of each source and its error against the measurement, then per source and
program the mean |error| and the speed-up trend error: for each pair of consecutive GPUs (in the CSV's
order) the ratio of their step times, predicted against measured, |predicted ratio / measured ratio − 1|.
The published measurements are rounded to 0.01 s (the CSV's ``resolution_s``), so a measured 0.02 s step
is known to ±25 %: each figure is also printed beyond that rounding (the distance from the prediction to
the interval the published figure stands for, and for the trend to the range of ratios the two rounded
figures allow), which is the error the measurement can show.
"""
from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hespas_ml.ingest.errors import HespasError  # noqa: E402
from hespas_ml.pipeline import simulate  # noqa: E402

SHARED = (ROOT / ".." / "shared").resolve()
DEFAULT_SOURCES = ("roofline@fusion", "roofline@merged", "calibrated-roofline@merged", "roofline@linear",
                   "measured@hespas")


def read_cases(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    for i, row in enumerate(rows, start=2):
        for key in ("program", "system", "target", "runtime_s"):
            if not row.get(key):
                raise SystemExit(f"{path}:{i}: column {key} is empty")
        float(row["runtime_s"])
    return rows


def resolve(program: str, github: Path | None, tmp: Path) -> Path:
    """The file of a case's program: a path under ``../shared``, or ``github:OWNER/NAME@COMMIT:PATH`` read
    from the git repository ``github/OWNER+NAME`` (a clone, bare or not) at that commit, into ``tmp``."""
    if not program.startswith("github:"):
        return SHARED / program
    ref, _, path = program[len("github:"):].partition(":")
    repo, _, commit = ref.partition("@")
    if github is None:
        raise FileNotFoundError(f"{program}: not in ../shared; give --github DIR holding a clone of {repo} "
                                f"as DIR/{repo.replace('/', '+')}")
    done = subprocess.run(["git", "-C", str(github / repo.replace("/", "+")), "show", f"{commit}:{path}"],
                          capture_output=True)
    if done.returncode != 0:
        raise FileNotFoundError(f"{program}: {done.stderr.decode().strip().splitlines()[-1] if done.stderr else 'not found'}")
    out = tmp / Path(path).name
    out.write_bytes(done.stdout)
    return out


def run(cases: list[dict[str, str]], sources: list[str], github: Path | None = None) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="gpu-steps-") as tmp:
        return _run(cases, sources, github, Path(tmp))


def _run(cases: list[dict[str, str]], sources: list[str], github: Path | None, tmp: Path) -> list[dict]:
    results = []
    for case in cases:
        system = SHARED / "hespas-configs" / "systems" / case["system"]
        try:
            program = resolve(case["program"], github, tmp)
        except FileNotFoundError as exc:
            for source in sources:
                results.append({"program": case["program"], "system": case["system"], "target": case["target"],
                                "source": source, "measured_s": float(case["runtime_s"]),
                                "status": "unavailable", "reason": str(exc)})
            continue
        for source in sources:
            fidelity, _, split = source.rpartition("@")
            row = {"program": case["program"], "system": case["system"], "target": case["target"],
                   "source": source, "measured_s": float(case["runtime_s"]),
                   "resolution_s": float(case.get("resolution_s") or 0.0)}
            try:
                res = simulate(program, target=case["target"], system=system, fidelity=fidelity, split=split)
            except (HespasError, ValueError) as exc:
                row.update(status="unavailable", reason=str(exc).splitlines()[0][:200])
            else:
                row.update(status="ok", step_s=res.step_time_s, compute_s=res.compute_time_s,
                           exposed_comm_s=res.exposed_comm_s, error=res.step_time_s / row["measured_s"] - 1,
                           error_beyond_rounding=_beyond(res.step_time_s, *_rounding(row)) / row["measured_s"])
            results.append(row)
    return results


def summary(results: list[dict], sources: list[str]) -> dict[str, dict[str, dict]]:
    """Per source, per program: the mean |error| and speed-up trend error over its GPUs."""
    out: dict[str, dict[str, dict]] = {}
    for source in sources:
        for program in dict.fromkeys(r["program"] for r in results):
            entry = _summary([r for r in results if r["source"] == source and r["program"] == program])
            out.setdefault(source, {})[program] = entry
    return out


def _rounding(row: dict) -> tuple[float, float]:
    """The interval a published step time stands for: its value ± half the step it was rounded to."""
    half = row.get("resolution_s", 0.0) / 2
    return row["measured_s"] - half, row["measured_s"] + half


def _beyond(value: float, lo: float, hi: float) -> float:
    """How far ``value`` lies outside [lo, hi] (0 inside)."""
    return max(lo - value, 0.0, value - hi)


def _summary(mine: list[dict]) -> dict:
    ok = [r for r in mine if r["status"] == "ok"]
    entry = {"cases": len(mine), "ok": len(ok)}
    if ok and len(ok) == len(mine):
        entry["mean_abs_error"] = sum(abs(r["error"]) for r in ok) / len(ok)
        entry["mean_abs_error_beyond_rounding"] = sum(r["error_beyond_rounding"] for r in ok) / len(ok)
        entry["mean_rounding"] = sum((r["resolution_s"] / 2) / r["measured_s"] for r in ok) / len(ok)
        trends, trends_beyond = [], []
        for a, b in zip(ok, ok[1:]):
            measured = b["measured_s"] / a["measured_s"]
            predicted = b["step_s"] / a["step_s"]
            trends.append(abs(predicted / measured - 1))
            (alo, ahi), (blo, bhi) = _rounding(a), _rounding(b)
            trends_beyond.append(_beyond(predicted, blo / ahi, bhi / alo) / measured)
        if trends:
            entry["mean_trend_error"] = sum(trends) / len(trends)
            entry["mean_trend_error_beyond_rounding"] = sum(trends_beyond) / len(trends_beyond)
    return entry


def _short(program: str) -> str:
    """A case's program as the table names it: its path under ../shared, or the file name of one elsewhere."""
    return Path(program.rpartition(":")[2]).name if program.startswith("github:") else program


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sources", nargs="+", default=list(DEFAULT_SOURCES))
    ap.add_argument("--measured", type=Path, default=ROOT / "eval" / "measured" / "gpu_steps.csv")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    ap.add_argument("--github", type=Path, default=None,
                    help="folder of git clones (OWNER+NAME) for the cases whose program is not in ../shared")
    args = ap.parse_args(argv)
    if not SHARED.is_dir():
        print(f"error: {SHARED}: the reference material beside the project is absent", file=sys.stderr)
        return 2
    cases = read_cases(args.measured)
    results = run(cases, args.sources, args.github)
    print(f"{'program':<38} {'target':<10} {'measured':>9} " + " ".join(f"{s:>22}" for s in args.sources))
    for case in cases:
        mine = {r["source"]: r for r in results if r["program"] == case["program"] and r["target"] == case["target"]}
        cells = []
        for s in args.sources:
            r = mine[s]
            cells.append(f"{r['step_s'] * 1e3:9.2f} ms {r['error']:+7.1%}" if r["status"] == "ok" else
                         f"{'unavailable':>22}")
        print(f"{_short(case['program']):<38} {case['target']:<10} {float(case['runtime_s']) * 1e3:6.0f} ms " + " ".join(cells))
    figures = summary(results, args.sources)
    for source, programs in figures.items():
        print()
        for program, entry in programs.items():
            name = f"{source:<18} {_short(program)[:40]:<40}"
            if "mean_abs_error" in entry:
                trend = entry.get("mean_trend_error")
                print(f"{name} mean |error| {entry['mean_abs_error']:6.1%}   speed-up trend error "
                      + (f"{trend:6.1%}" if trend is not None else "   n/a"))
                if entry["mean_rounding"]:
                    beyond = entry.get("mean_trend_error_beyond_rounding")
                    print(f"{'':<59} beyond the published rounding (± {entry['mean_rounding']:.1%} on average): "
                          f"{entry['mean_abs_error_beyond_rounding']:6.1%}   trend "
                          + (f"{beyond:6.1%}" if beyond is not None else "   n/a"))
            else:
                reasons = sorted({r["reason"] for r in results
                                  if r["source"] == source and r["program"] == program and r["status"] != "ok"})
                print(f"{name} answered {entry['ok']} of {entry['cases']}: {reasons[0] if reasons else ''}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"results": results, "summary": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
