"""What a SCALE-Sim mode change does to a region's time, measured, for a surrogate that learned the other mode.

    python eval/fit_mode_change.py 'zoo:vit?batch=32' 'zoo:swin?batch=32' … [--target TPUv4] [--write MODEL_DIR]

A scalesim surrogate learned labels taken with its dataset's budget (``label_options`` in its domain), under which
a large layer is simulated without memory stalls (``compute-only``); the default labeller simulates the same
layer in full. For every region of the given programs whose mode changes so (the regions the surrogate fidelity
marks ``label mode … -> …``), this labels the region both ways (the learned labels' options, and the default
labeller) and prints the distribution of log(default / learned). ``--write`` stores its 5th, 50th and 95th
percentiles in the model's domain (``mode_change``): such a region is then answered at its prediction times the
median ratio, with an interval reaching from the 5th to the 95th percentile (widened, never narrowed). Keep the
programs a figure is reported for out of the fit. Both labellers run here with their layer cache: cold, a
ResNet-sized program takes minutes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hespas_ml.ingest import load_program  # noqa: E402
from hespas_ml.ingest.errors import HespasError  # noqa: E402
from hespas_ml.label.scalesim import ScaleSimFidelity  # noqa: E402
from hespas_ml.label.targets import load_target  # noqa: E402
from hespas_ml.learn.surrogate import META, Surrogate  # noqa: E402
from hespas_ml.split.regions import split_program  # noqa: E402

QUANTILES = (5, 50, 95)


def mode_ratios(program: str, target, learned: dict) -> np.ndarray:
    """log(default labeller / learned options' labeller) of the regions of ``program`` whose mode changes."""
    regions = split_program(load_program(program), "fusion").compute_regions()
    default = ScaleSimFidelity()
    changed = [r for r, deeper in zip(regions, default.deeper_modes(regions, target, learned)) if deeper]
    if not changed:
        return np.zeros(0)
    learned_labels = ScaleSimFidelity.from_options(learned).label_regions(changed, target)
    default_labels = default.label_regions(changed, target)
    return np.asarray([np.log(d.seconds / lab.seconds) for lab, d in zip(learned_labels, default_labels)
                       if lab.status == "ok" and d.status == "ok" and lab.seconds > 0 and d.seconds > 0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("programs", nargs="+")
    ap.add_argument("--target", default="TPUv4")
    ap.add_argument("--model", default="scalesim", help="the scalesim surrogate whose label options are learned "
                                                         "(a saved folder or a shipped name; default: scalesim)")
    ap.add_argument("--write", action="store_true", help="store the fitted ratios in the model's domain")
    args = ap.parse_args(argv)
    from hespas_ml.learn.registry import parse_model_ref

    try:
        folder = Path(parse_model_ref(args.model).uri)
        surrogate = Surrogate.load(folder)
        if surrogate.config.fidelity != "scalesim" or surrogate.domain is None or not surrogate.domain.label_options:
            raise HespasError(f"{folder}: not a scalesim surrogate that knows its labels' options")
        target = load_target(args.target)
        per_program, ratios = {}, []
        for i, program in enumerate(args.programs, 1):
            t0 = time.perf_counter()
            r = mode_ratios(program, target, surrogate.domain.label_options)
            ratios.append(r)
            per_program[program] = {"regions": int(len(r)),
                                    "median_ratio": float(np.exp(np.median(r))) if len(r) else None,
                                    "max_ratio": float(np.exp(r.max())) if len(r) else None,
                                    "seconds": round(time.perf_counter() - t0, 1)}
            print(f"[{i}/{len(args.programs)}] {program}: {json.dumps(per_program[program])}", file=sys.stderr,
                  flush=True)
    except (HespasError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    pooled = np.concatenate(ratios)
    if not len(pooled):
        print("error: no region of these programs changes label mode on " + args.target, file=sys.stderr)
        return 2
    low, mid, high = (float(np.percentile(pooled, q)) for q in QUANTILES)
    fitted = {"log_low": low, "log_mid": mid, "log_high": high, "regions": int(len(pooled)),
              "basis": f"{len(pooled)} regions of {', '.join(args.programs)} on {args.target}, each labelled with "
                       "the learned options and the default labeller (eval/fit_mode_change.py)"}
    if args.write:
        meta_path = folder / META
        meta = json.loads(meta_path.read_text())
        meta["domain"]["mode_change"] = fitted
        meta_path.write_text(json.dumps(meta, indent=1))
    print(json.dumps({"model": folder.name, "programs": per_program, "ratio_5_50_95": [float(np.exp(v)) for v in
                                                                                      (low, mid, high)],
                      "fitted": fitted, "written": bool(args.write)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
