"""How well the profiling labeller repeats itself: the floor under any profiling surrogate's error.

    python eval/eval_profiling_repeatability.py DATASET [--regions 68] [--runs 2] [--max-seconds 0.2]
        [--json out/eval/profiling_repeatability.json]

Takes a fixed pseudo-random sample of the dataset's ok profiling labels (regions under ``--max-seconds``),
finds each region again in the first program the dataset names for it, and times the sample ``--runs``
times, uncached, with the profiling options the dataset was labelled with (its manifest). Prints, for
every run against the dataset's labels and for consecutive runs against each other, the median and 90th
percentile of |ratio - 1| and the median ratio (a systematic drift shows there). A surrogate cannot be
checked to a tighter error than the labeller's disagreement with itself.

Zoo programs are exported again when they are not in the cache (``HESPAS_ML_CACHE``); point it at the cache
the dataset was built with to skip that.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hespas_ml.use.dataset_labels import program_regions  # noqa: E402
from hespas_ml.label.dataset_spec import COMMON_FIDELITY_KEYS  # noqa: E402
from hespas_ml.label.dataset_tables import load_dataset  # noqa: E402
from hespas_ml.label.profiling import ProfilingFidelity  # noqa: E402
from hespas_ml.label.targets import load_target  # noqa: E402
from hespas_ml.learn.tables import label_rows  # noqa: E402

def agreement(new: np.ndarray, old: np.ndarray) -> dict[str, float]:
    ok = np.isfinite(new) & np.isfinite(old) & (old > 0)
    r = new[ok] / old[ok]
    dev = np.abs(r - 1)
    return {"n": int(ok.sum()), "median_abs_dev": float(np.median(dev)), "p90_abs_dev": float(np.quantile(dev, 0.9)),
            "median_ratio": float(np.median(r))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset")
    ap.add_argument("--regions", type=int, default=68, help="regions in the sample (default 68)")
    ap.add_argument("--runs", type=int, default=2, help="timings of the whole sample (default 2)")
    ap.add_argument("--max-seconds", type=float, default=0.2, help="only labels below this (default 0.2 s)")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args()

    ds = load_dataset(args.dataset)
    spec = ds.manifest.get("spec", {})
    entry = (spec.get("fidelities") or {}).get("profiling") or {}
    options = {k: v for k, v in entry.items() if k not in COMMON_FIDELITY_KEYS}    # the fidelity's own options
    rows = label_rows(ds, "profiling", ["host-cpu"])
    rows = rows[rows["seconds"] < args.max_seconds]
    rng = np.random.default_rng(args.seed)
    rows = rows.iloc[np.sort(rng.permutation(len(rows))[:args.regions])]
    sources = ds.regions.set_index("hash")["programs"]
    wanted: dict[str, set[str]] = {}
    for digest in rows["hash"]:
        wanted.setdefault(json.loads(sources[digest])[0], set()).add(digest)
    found: dict[str, object] = {}
    for source, digests in wanted.items():
        found.update(program_regions(source, ds.manifest.get("split", "fusion"), digests))
    rows = rows[rows["hash"].isin(found)]
    regions = [found[h] for h in rows["hash"]]
    print(f"{len(regions)} regions of {args.dataset} (labels below {args.max_seconds:g} s), profiling options "
          f"{options or 'defaults'}", flush=True)

    target = load_target("host-cpu")
    old = rows["seconds"].to_numpy(dtype=float)
    runs = []
    for i in range(args.runs):
        t = time.perf_counter()
        with ProfilingFidelity(cache=False, **options) as fidelity:
            labels = fidelity.label_regions(regions, target)
        runs.append(np.array([lab.seconds for lab in labels], dtype=float))
        a = agreement(runs[-1], old)
        print(f"run {i + 1} ({time.perf_counter() - t:.0f} s) vs the dataset's labels: median |ratio - 1| "
              f"{100 * a['median_abs_dev']:.1f}%, p90 {100 * a['p90_abs_dev']:.1f}%, median ratio "
              f"{a['median_ratio']:.3f} ({a['n']} regions)", flush=True)
    pairs = [agreement(runs[i + 1], runs[i]) for i in range(len(runs) - 1)]
    for i, a in enumerate(pairs):
        print(f"run {i + 2} vs run {i + 1}: median |ratio - 1| {100 * a['median_abs_dev']:.1f}%, p90 "
              f"{100 * a['p90_abs_dev']:.1f}%, median ratio {a['median_ratio']:.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"options": options, "hashes": list(rows["hash"]),
                                               "dataset_s": old.tolist(), "runs_s": [r.tolist() for r in runs],
                                               "vs_dataset": [agreement(r, old) for r in runs],
                                               "consecutive": pairs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
