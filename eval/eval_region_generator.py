"""How close generated region graphs come to real ones (issue 29, point 1).

    python eval/eval_region_generator.py [--data eval/device/plans/h100] [--epochs 6] [--n 300] [--seed 0]

Fits the layerwise generator (``hespas_ml.learn.layer_dag.LayerDAGGenerator``) and the random baseline on
80 % of the corpus families' region graphs of a dataset (the device plan's by default: it is committed; the
held-out families of ``datasets/leave-family-out.yaml`` are left out), draws ``--n`` graphs from each, turns
them into StableHLO modules and takes them through the pipeline (MLIR verifier, ingest, fusion split), then
prints the validity rate and the squared MMD of every statistic between the regions they split into and the
other 20 % of the real graphs. The first row is the floor: ``--n`` real training graphs against the same 20 %.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hespas_ml.host import machine_name  # noqa: E402
from hespas_ml.learn.graph_distance import STATISTICS, distances, graph_statistics  # noqa: E402
from hespas_ml.use.generate import fit_generator, generate_regions, real_graphs, records_of  # noqa: E402

HELD_OUT = ("mobilenet", "convnext", "efficientnet", "swin")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(Path(__file__).resolve().parent / "device" / "plans" / "h100"))
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-train", type=int, default=1500, help="training graphs at most (drawn at random)")
    args = ap.parse_args()
    graphs = real_graphs(args.data).only(lambda f: f not in HELD_OUT)
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(graphs.records))
    cut = int(0.8 * len(order))
    train = type(graphs)([graphs.records[i] for i in order[:cut]], [graphs.families[i] for i in order[:cut]])
    test = [graph_statistics(graphs.records[i]) for i in order[cut:]]
    fit_on = train
    if len(train.records) > args.max_train:
        pick = rng.choice(len(train.records), args.max_train, replace=False)
        fit_on = type(graphs)([train.records[i] for i in pick], [train.families[i] for i in pick])
    print(f"{len(graphs.records)} region graphs of {len(set(graphs.families))} corpus families in {args.data}; "
          f"generators fitted on {len(fit_on.records)}, compared with {len(test)} others "
          f"({machine_name()})")
    floor = [graph_statistics(train.records[i]) for i in rng.choice(len(train.records), args.n, replace=False)]
    rows = [("real (floor)", "-", distances(test, floor), 0.0)]
    for kind in ("random", "layerdag"):
        t = time.perf_counter()
        options = {"seed": args.seed} if kind == "random" else {"seed": args.seed, "epochs": args.epochs}
        gen = fit_generator(fit_on, kind, progress=lambda e, n, nll: print(f"  epoch {e}/{n}: nll {nll:.2f}",
                                                                             flush=True), **options)
        fit_s = time.perf_counter() - t
        with tempfile.TemporaryDirectory() as out:
            counts = generate_regions(gen, train, args.n, out, seed=args.seed)
            stats = [graph_statistics(r) for r in records_of(out)]
        validity = f"{counts['valid']}/{counts['drawn']} ({counts['valid'] / counts['drawn']:.1%})"
        rows.append((kind, validity, distances(test, stats), fit_s))
        print(f"{kind}: {validity} valid, {counts['regions']} regions, {counts['rewired']} slots rewired, "
              f"fitted in {fit_s:.0f} s", flush=True)
    print()
    print(f"{'generator':<14} {'valid':<16} " + " ".join(f"{s:>10}" for s in STATISTICS))
    for name, validity, dist, _ in rows:
        print(f"{name:<14} {validity:<16} " + " ".join(f"{dist[s]:>10.4f}" for s in STATISTICS))
    print("(squared MMD against the real graphs left out of fitting; lower is closer)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
