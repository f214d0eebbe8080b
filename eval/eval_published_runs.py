"""Published training runs against hespas-ml's step time, each with the layout the run used.

    python eval/eval_published_runs.py [--runs eval/measured/published_runs.csv] [--fidelity roofline] [--split fusion]
                                       [--also '&schedule=interleaved:6'] [--pipeline stages] [--only NAME…]
                                       [--json out.json]

``eval/measured/published_runs.csv`` holds one row per run: its name, the target and system it ran on (as a
``--system`` spec: 8 GPUs per node on NVLink, the nodes on InfiniBand at the HCA rate per GPU), the zoo spec
of its model and layout, the published figure and where it comes from (repository at a commit and file, or
paper and table), and what the spec cannot say the way the run did. The figure is either ``step_s``
(seconds per training step, as published) or ``tflops_eq3`` (TFLOP/s per GPU counted with equation 3 of
Narayanan et al., SC21: ``F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))`` per step, which assumes activation
recomputation; the published step time is then ``F / (X · GPUs)``).

Prints, run by run as each finishes (with its wall time), the published step time, the predicted one and
its error, and where the predicted time goes: matrix-unit-bound kernels, memory-bound kernels, exposed
communication, and the peak memory per device. Then the median |error| over the runs. ``--also SUFFIX``
predicts each run a second time with SUFFIX added to its spec (a schedule, a remat), where the layout
takes it. ``--pipeline stages`` predicts the pipelined runs from each stage's own programs
(:mod:`hespas_ml.pipeline_stages`), the others as before. A run whose spec cannot be simulated is reported
with its one-line reason, never guessed.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hespas_ml.ingest.errors import HespasError  # noqa: E402
from hespas_ml.ingest.zoo.checks import parse_mesh  # noqa: E402
from hespas_ml.ingest.zoo.specs import parse_zoo_spec  # noqa: E402
from hespas_ml.pipeline import simulate  # noqa: E402
from hespas_ml.pipeline_stages import simulate_stages  # noqa: E402

FIGURES = ("step_s", "tflops_eq3")


def read_runs(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    for i, row in enumerate(rows, start=2):
        if row.get("figure") not in FIGURES:
            raise ValueError(f"{path}:{i}: figure must be one of {', '.join(FIGURES)}, got {row.get('figure')!r}")
        try:
            float(row["value"])
        except (TypeError, ValueError):
            raise ValueError(f"{path}:{i}: value {row.get('value')!r} is not a number") from None
    return rows


def eq3_flops(p: dict) -> float:
    """Equation 3 of Narayanan et al. (SC21): the FLOPs of a GPT training step with recomputation."""
    b, s, l, h, v = p["batch"], p["seq"], p["layers"], p["d_model"], p["vocab"]
    return 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))


def published_step_s(row: dict[str, str], params: dict) -> float:
    value = float(row["value"])
    if row["figure"] == "step_s":
        return value
    return eq3_flops(params) / (value * 1e12 * params["devices"])


def breakdown(res) -> dict[str, float]:
    """Seconds per device by what bounds each compute region, summed over its executions."""
    out = {"compute": 0.0, "memory": 0.0}
    for r in res.regions:
        if r.kind == "compute":
            key = "compute" if r.bound == "compute" else "memory"
            out[key] += r.total_seconds
    return out


def predict(row: dict[str, str], spec: str, fidelity: str, split: str = "fusion", pipeline: str = "lockstep") -> dict:
    """One run's prediction; ``pipeline="stages"``: a pipelined run from its stages' own programs
    (``simulate --pipeline stages``), its compute not broken down by bound."""
    t0 = time.perf_counter()
    try:
        if pipeline == "stages" and parse_mesh(parse_zoo_spec(spec)[1]["mesh"]).get("pp", 1) > 1:
            staged = simulate_stages(spec, row["target"], row["system"], fidelity=fidelity, split=split)
            return {"step_s": staged.step_time_s, "compute_bound_s": math.nan, "memory_bound_s": math.nan,
                    "exposed_comm_s": math.nan, "peak_memory_bytes": staged.peak_memory_bytes, "fits": staged.fits,
                    "bubble": staged.bubble, "wall_s": time.perf_counter() - t0}
        res = simulate(spec, target=row["target"], system=row["system"], fidelity=fidelity, split=split)
    except HespasError as exc:
        return {"error": str(exc).splitlines()[0][:240], "wall_s": time.perf_counter() - t0}
    parts = breakdown(res)
    return {"step_s": res.step_time_s, "compute_bound_s": parts["compute"], "memory_bound_s": parts["memory"],
            "exposed_comm_s": res.exposed_comm_s, "peak_memory_bytes": res.peak_memory_bytes, "fits": res.fits,
            "flops_per_device": res.flops, "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=Path, default=ROOT / "eval" / "measured" / "published_runs.csv")
    ap.add_argument("--fidelity", default="roofline")
    ap.add_argument("--split", default="fusion", help="how programs are split into kernels (fusion, merged, …)")
    ap.add_argument("--also", help="predict each run again with this added to its spec")
    ap.add_argument("--pipeline", default="lockstep", choices=["lockstep", "stages"],
                    help="pipelined runs as one lock-step program (default) or from each stage's own programs")
    ap.add_argument("--only", nargs="+", help="runs whose name contains one of these")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    try:
        rows = read_runs(args.runs)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.only:
        rows = [r for r in rows if any(o in r["name"] for o in args.only)]
    results = []
    for row in rows:
        params = parse_zoo_spec(row["spec"])[1]
        published = published_step_s(row, params)
        out = {"name": row["name"], "target": row["target"], "system": row["system"], "spec": row["spec"],
               "source": row["source"], "published_step_s": published, "figure": row["figure"],
               "value": float(row["value"]), "predicted": {}}
        variants = [("as listed", row["spec"])] + ([(args.also, row["spec"] + args.also)] if args.also else [])
        print(f"{row['name']}  ({row['source']})")
        print(f"    published {published:9.3f} s per step" +
              (f"  ({row['value']} TFLOP/s per GPU by equation 3)" if row["figure"] == "tflops_eq3" else ""))
        for label, spec in variants:
            got = predict(row, spec, args.fidelity, args.split, args.pipeline)
            out["predicted"][label] = got
            if "error" in got:
                print(f"    {label:<10} unavailable: {got['error']}")
                continue
            got["relative_error"] = got["step_s"] / published - 1.0
            mem = got["peak_memory_bytes"] / 2**30
            how = (f"from its stages' programs, the busiest stage idle {100 * got['bubble']:.1f} %" if "bubble" in got
                   else f"matrix-bound {got['compute_bound_s']:.2f} s, memory-bound {got['memory_bound_s']:.2f} s, "
                        f"exposed comm {got['exposed_comm_s']:.2f} s")
            print(f"    {label:<10}{got['step_s']:9.3f} s per step  {100 * got['relative_error']:+7.1f} %   "
                  f"{how}; {mem:.1f} GiB per device"
                  f"{'' if got['fits'] else ' (does not fit)'}; {got['wall_s']:.0f} s to simulate", flush=True)
        results.append(out)
    print()
    labels = ["as listed"] + ([args.also] if args.also else [])
    for label in labels:
        errors = [abs(r["predicted"][label]["relative_error"]) for r in results
                  if "relative_error" in r["predicted"].get(label, {})]
        if errors:
            print(f"{args.fidelity} ({label}): median |error| {100 * statistics.median(errors):.1f} % over "
                  f"{len(errors)} run(s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
