"""Whole-program step time through a shipped surrogate + replay, against the same program through the
labeller the surrogate learned (same split, same traces, same replay).

    python eval/eval_step_time.py [--fidelities roofline scalesim profiling] [--json out/eval/step_time.json]
                                  [--model PATH_OR_NAME] [--spec DATASET_SPEC]

The programs are llama steps: the family every shipped model held out of its training (``split: family``,
see the model cards), so no region of them was trained on. The labellers run with the options the main
dataset used (``datasets/main.yaml``: SCALE-Sim budget and mode; profiling measurement and sample time and
pinned cores). Prints, per
case, both step times, the surrogate's error and whether the labeller's step time lies inside the
surrogate's step-time interval; the target is |error| <= 5 %.

Profiling is a measurement, so it is not the same twice: it is run ``--labeller-runs`` times (default 3,
its disk cache off so that every run times every region again), the surrogate is compared with the median
run, and the labeller's own spread ((slowest - fastest) / median) is printed beside the error: the
surrogate cannot be held closer to the labeller than the labeller is to itself.

``--model`` evaluates another surrogate than the shipped one (a folder ``Surrogate.save`` wrote, or a
registered ``NAME@alias``), for one fidelity: the one it learned, e.g. a profiling model retrained on this
machine's labels; ``--spec`` takes the labeller's options from the dataset spec it learned (for example
``statistic: min``) instead of ``datasets/main.yaml``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hespas_ml.label.dataset_spec import COMMON_FIDELITY_KEYS  # noqa: E402
from hespas_ml.pipeline import simulate  # noqa: E402

LLAMA = "zoo:llama?layers=2&vocab=8192"
CASES = {
    "roofline": [
        (f"{LLAMA}&d_model=512&heads=8&seq=256&batch=8&step=train&parallel=fsdp", "H100", "ring:4x150"),
        (f"{LLAMA}&d_model=768&heads=12&kv_heads=4&seq=512&batch=8&step=infer", "B200", None),
        (f"{LLAMA}&d_model=512&heads=8&seq=256&batch=8&step=train&parallel=tp", "MI300X", "fc:4x300"),
    ],
    "scalesim": [
        (f"{LLAMA}&d_model=512&heads=8&seq=256&batch=8&step=train&parallel=fsdp", "TPUv4", "ring:4x100"),
        (f"{LLAMA}&d_model=256&heads=4&seq=128&batch=2&step=infer", "TPUv3", None),
    ],
    "profiling": [
        (f"{LLAMA}&d_model=256&heads=4&seq=128&batch=2&step=infer", "host-cpu", None),
        (f"{LLAMA}&d_model=256&heads=4&seq=128&batch=2&step=train", "host-cpu", None),
    ],
}


def labeller_options(fidelity: str, spec_path: Path = ROOT / "datasets" / "main.yaml") -> dict:
    """The labeller's constructor options as a dataset spec (default: the main one) sets them."""
    spec = yaml.safe_load(Path(spec_path).read_text())["fidelities"].get(fidelity) or {}
    if fidelity == "scalesim":
        from hespas_ml.label.scalesim_worker import Budget
        return {"budget": Budget(seconds=float(spec.get("budget_s", 30.0)),
                                 memory_bytes=int(float(spec.get("memory_gb", 2.0)) * 2**30)),
                "mode": spec.get("mode", "auto")}
    if fidelity == "profiling":
        return {k: v for k, v in spec.items() if k not in COMMON_FIDELITY_KEYS}
    return {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fidelities", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--labeller-runs", type=int, default=3,
                    help="runs of the profiling labeller per program (uncached; the median is compared)")
    ap.add_argument("--model", default=None,
                    help="surrogate to evaluate instead of the shipped one (a saved model folder or NAME@alias); "
                         "give the one fidelity it learned with --fidelities")
    ap.add_argument("--spec", default=str(ROOT / "datasets" / "main.yaml"),
                    help="dataset spec whose labeller options to run (default: datasets/main.yaml)")
    args = ap.parse_args()
    if args.model:
        from hespas_ml.learn.fidelity import SurrogateFidelity
        learned = SurrogateFidelity(args.model).fidelity
        if args.fidelities != [learned]:
            ap.error(f"--model {args.model} learned {learned} labels: give --fidelities {learned}")

    rows = []
    for fidelity in args.fidelities:
        options = labeller_options(fidelity, args.spec)
        runs = 1
        if fidelity == "profiling":               # a measurement: several uncached runs
            runs, options = max(1, args.labeller_runs), {**options, "cache": False}
        for program, target, system in CASES[fidelity]:
            t = time.perf_counter()
            truths = sorted((simulate(program, target, system, fidelity=fidelity, fidelity_options=options)
                             for _ in range(runs)), key=lambda r: r.step_time_s)
            label_s = (time.perf_counter() - t) / runs
            truth = truths[len(truths) // 2]
            steps = [r.step_time_s for r in truths]
            spread = (steps[-1] - steps[0]) / truth.step_time_s
            t = time.perf_counter()
            pred = simulate(program, target, system, fidelity=f"surrogate:{args.model or fidelity}")
            pred_s = time.perf_counter() - t
            lo, hi = pred.step_time_interval_s or (float("nan"), float("nan"))
            row = {"fidelity": fidelity, "program": program, "target": target, "system": system or "1 device",
                   "labeller_step_s": truth.step_time_s, "surrogate_step_s": pred.step_time_s,
                   "error_pct": 100 * (pred.step_time_s / truth.step_time_s - 1),
                   "labeller_runs_s": steps, "labeller_spread_pct": 100 * spread,
                   "interval_s": [lo, hi], "inside": bool(lo <= truth.step_time_s <= hi),
                   "labeller_wall_s": label_s, "surrogate_wall_s": pred_s}
            rows.append(row)
            print(f"{fidelity:9s} {target:8s} {row['system']:10s} labeller {truth.step_time_s * 1e3:10.4f} ms "
                  f"({label_s:6.1f} s)  surrogate {pred.step_time_s * 1e3:10.4f} ms ({pred_s:5.2f} s)  "
                  f"error {row['error_pct']:+7.2f}%  interval [{lo * 1e3:.4f}, {hi * 1e3:.4f}] ms "
                  f"{'contains' if row['inside'] else 'misses'} the labeller", flush=True)
            if runs > 1:
                print(f"          labeller runs {' / '.join(f'{x * 1e3:.4f}' for x in steps)} ms: "
                      f"spread {100 * spread:.2f}% of the median", flush=True)
            print(f"          {program}", flush=True)
    worst = max(abs(r["error_pct"]) for r in rows)
    print(f"\nworst |error| {worst:.2f}% over {len(rows)} programs (target <= 5%); "
          f"{sum(r['inside'] for r in rows)}/{len(rows)} labeller step times inside the surrogate's interval")
    spreads = [r["labeller_spread_pct"] for r in rows if len(r["labeller_runs_s"]) > 1]
    if spreads:
        print(f"profiling labeller's own spread over {args.labeller_runs} runs: up to {max(spreads):.2f}% "
              "of its median step time")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
