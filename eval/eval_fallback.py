"""A surrogate against its own labeller on one program, with and without its fallback outside what it learned.

    python eval/eval_fallback.py 'zoo:resnet?depth=50&batch=32' --target TPUv4 --fidelity scalesim

Prints the labeller's step time, then the shipped surrogate's with ``--fallback off`` (its own answers,
intervals widened outside its domain) and ``--fallback auto`` (regions outside answered by the labeller
where it runs here), each with its interval, its error against the labeller, how many regions were
outside, and the wall time. The labeller runs first, so the fallback's SCALE-Sim layers come from the
cache it filled (run ``--fallback auto`` alone on an empty cache for its cold cost).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hespas_ml import simulate  # noqa: E402
from hespas_ml.ingest.errors import HespasError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("program")
    ap.add_argument("--target", default="TPUv4")
    ap.add_argument("--fidelity", default="scalesim", help="the labeller; its shipped surrogate is compared")
    args = ap.parse_args(argv)
    rows = []
    try:
        for name, fidelity, options in ((args.fidelity, args.fidelity, None),
                                        ("surrogate, fallback off", f"surrogate:{args.fidelity}", {"fallback": "off"}),
                                        ("surrogate, fallback auto", f"surrogate:{args.fidelity}", {"fallback": "auto"})):
            t0 = time.perf_counter()
            res = simulate(args.program, target=args.target, fidelity=fidelity, fidelity_options=options)
            outside = sum(1 for r in res.regions if r.bound.startswith("fallback:"))
            flagged = next((w for w in res.warnings if "outside what it learned" in w), "")
            rows.append((name, res.step_time_s, res.step_time_interval_s, time.perf_counter() - t0, outside, flagged))
    except HespasError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    truth = rows[0][1]
    print(f"{args.program} on {args.target}")
    for name, step, interval, wall, answered, flagged in rows:
        iv = f"[{interval[0] * 1e3:.3f}, {interval[1] * 1e3:.3f}] ms" if interval else "-"
        inside = "" if not interval else ("  contains the labeller" if interval[0] <= truth <= interval[1]
                                          else "  misses the labeller")
        print(f"  {name:<26} {step * 1e3:9.3f} ms  {100 * (step / truth - 1):+7.2f} %  interval {iv}{inside}"
              f"  {wall:6.1f} s" + (f"  ({answered} regions answered by the fallback)" if answered else ""))
        if flagged:
            print(f"    {flagged}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
