"""Does training on synthetic regions make a surrogate better on families it never saw? (issue 29, point 3)

    python eval/eval_synthetic_training.py --fidelity roofline|scalesim|profiling --target T [--seeds 0 1 2]
        [--corpus 1200] [--test 600] [--synthetic 600] [--epochs 40] [--work out/eval/synthetic]
        [--table eval/results/synthetic_training.csv]

The corpus and the left-out families are the committed device plan's regions (``eval/device/plans/h100``:
region graphs and standalone modules of the corpus families and of MobileNet, ConvNeXt, EfficientNet and
Swin, which none of the shipped surrogates learned). ``--corpus`` regions of the corpus families and
``--test`` of the left-out ones are drawn once (seed 0). Two generators are fitted on the corpus regions'
graphs: the layerwise one (``hespas_ml.learn.layer_dag``) and the random baseline; each draws graphs
(``hespas-ml generate regions``, kept in ``--work``) until ``--synthetic`` new regions are found. Every region
is labelled with ``--fidelity`` on ``--target`` (roofline, scalesim: from the region's graph; profiling: timed
here, through the profiling cache, so a second run does not time again). Then for every seed the fidelity's
surrogate is trained on (a) the corpus, (b) the corpus and the layerwise generator's regions, (c) the corpus
and the random generator's regions (the same count), with the same validation share of the corpus, and
scored on the left-out families: median and p90 APE and the interval coverage. Each training is an MLflow
run of the experiment ``synthetic-regions``; the table prints each variant's mean and spread (standard
deviation) over the seeds, and ``--work``/results.csv keeps every run (``--table`` merges them into a CSV
that keeps every fidelity's).
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hespas_ml.fidelities import get_fidelity  # noqa: E402
from hespas_ml.host import machine_name  # noqa: E402
from hespas_ml.ingest.graph import program_users  # noqa: E402
from hespas_ml.ingest.stablehlo import parse_file  # noqa: E402
from hespas_ml.label.dataset_tables import FORMAT_VERSION, Dataset, load_dataset  # noqa: E402
from hespas_ml.label.device_run import read_jsonl_gz  # noqa: E402
from hespas_ml.label.profiling import ProfilingFidelity, extract_region_modules  # noqa: E402
from hespas_ml.label.region_records import region_features, region_from_record, region_record  # noqa: E402
from hespas_ml.label.targets import load_target  # noqa: E402
from hespas_ml.learn.config import TrainConfig  # noqa: E402
from hespas_ml.learn.evaluate import report  # noqa: E402
from hespas_ml.learn.surrogate import Surrogate  # noqa: E402
from hespas_ml.learn.tables import label_rows  # noqa: E402
from hespas_ml.learn.tracking import setup_mlflow  # noqa: E402
from hespas_ml.split.regions import split_program  # noqa: E402
from hespas_ml.split.signature import signature_parts  # noqa: E402
from hespas_ml.use.generate import RealGraphs, fit_generator, generate_regions  # noqa: E402

PLAN = ROOT / "eval" / "device" / "plans" / "h100"
HELD_OUT = {"mobilenet", "convnext", "efficientnet", "swin"}
VARIANTS = ("corpus", "corpus+layerdag", "corpus+random")


def synthetic_regions(folder: Path, generator, graphs: RealGraphs, count: int, known: set[str], seed: int):
    """``[(hash, record, module text or None)]``: the first ``count`` new regions the generator's modules
    split into (drawing more graphs while fewer are found)."""
    found: dict[str, tuple[dict, str | None]] = {}
    n = max(8, count // 2)
    while True:
        generate_regions(generator, graphs, n, folder, seed=seed)
        rows = [json.loads(x) for x in (folder / "manifest.jsonl").read_text().splitlines()]
        for row in sorted(rows, key=lambda r: r["index"]):
            if not row.get("valid") or row["index"] >= n:
                continue
            if all(h in found or h in known for h in row["regions"]):
                continue
            graph = parse_file(folder / row["file"])
            users = program_users(graph)
            regions = [r for r in split_program(graph).compute_regions()]
            texts = extract_region_modules(regions)
            for region, text in zip(regions, texts):
                digest, order, escapes = signature_parts(region, users)
                if digest in found or digest in known:
                    continue
                found[digest] = (region_record(region, digest, users, order, escapes),
                                 text if isinstance(text, str) else None)
            if len(found) >= count:
                return [(h, rec, text) for h, (rec, text) in list(found.items())[:count]]
        if n > 50 * count:
            return [(h, rec, text) for h, (rec, text) in found.items()]
        n *= 2


def label_all(fidelity: str, target, items: list[tuple[str, dict, str | None]], measure_s: float) -> dict[str, dict]:
    """``hash -> label row`` of every item."""
    out: dict[str, dict] = {}
    t0 = time.time()
    if fidelity != "profiling":                  # labelled from the region graph itself
        fid = get_fidelity(fidelity)
        for done, (h, rec, _) in enumerate(items, start=1):
            out[h] = _row(h, target.name, fidelity, fid.label(region_from_record(rec), target))
            if done % 200 == 0 or done == len(items):
                left = (time.time() - t0) / done * (len(items) - done)
                print(f"  labelled {done}/{len(items)} ({time.time() - t0:.0f} s, about {left:.0f} s left)", flush=True)
        return out
    with ProfilingFidelity(measure_s=measure_s) as fid:
        todo = [(h, text) for h, _, text in items if text]
        for start in range(0, len(todo), 64):
            part = todo[start:start + 64]
            for (h, _), lab in zip(part, fid.label_modules([t for _, t in part], target)):
                out[h] = _row(h, target.name, fidelity, lab)
            done = start + len(part)
            left = (time.time() - t0) / done * (len(todo) - done)
            print(f"  labelled {done}/{len(todo)} ({time.time() - t0:.0f} s, about {left:.0f} s left)", flush=True)
    return out


def _row(h: str, target: str, fidelity: str, lab) -> dict:
    meta = dict(lab.meta or {})
    noise = meta.get("rel_iqr")
    return {"hash": h, "target": target, "fidelity": fidelity, "seconds": lab.seconds, "noise": noise,
            "status": lab.status, "reason": None if lab.status == "ok" else str(meta.get("reason")),
            "meta": json.dumps(meta, default=str), "label_s": 0.0, "finished_at": time.time()}


def region_row(h: str, rec: dict, family: str) -> dict:
    return {"hash": h, "family": family, "families": json.dumps([family]), "programs": "[]", "n_programs": 1,
            "occurrences": 1, "executions": 1, **region_features(rec)}


def dataset(work: Path, name: str, regions: list[dict], labels: list[dict], graphs: dict[str, str], target) -> Dataset:
    targets = pd.DataFrame([{"target": target.name, "ref": target.name, "fidelities": "[]",
                             **target.to_vector()}])
    return Dataset(work / name, pd.DataFrame(regions), pd.DataFrame(labels), pd.DataFrame(), targets,
                   {"format": FORMAT_VERSION, "name": name}, graphs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fidelity", choices=("roofline", "scalesim", "profiling"), default="profiling")
    ap.add_argument("--target", default="host-cpu")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--corpus", type=int, default=1200)
    ap.add_argument("--test", type=int, default=600)
    ap.add_argument("--synthetic", type=int, default=600)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--generator-epochs", type=int, default=6)
    ap.add_argument("--measure-s", type=float, default=0.2)
    ap.add_argument("--work", default="out/eval/synthetic")
    ap.add_argument("--tracking-uri", default=None)
    ap.add_argument("--table", type=Path, help="merge every run into this CSV (replacing the rows of the same "
                                              "fidelity and target), e.g. eval/results/synthetic_training.csv")
    args = ap.parse_args()
    work = Path(args.work) / f"{args.fidelity}-{args.target}"
    work.mkdir(parents=True, exist_ok=True)
    target = load_target(args.target)
    plan = load_dataset(PLAN)
    texts = {r["hash"]: r["text"] for r in read_jsonl_gz(PLAN / "regions.jsonl.gz")}
    fams = {h: set(json.loads(f) if isinstance(f, str) else f) for h, f in zip(plan.regions["hash"],
                                                                                plan.regions["families"])}
    rng = np.random.default_rng(0)
    corpus_pool = sorted(h for h, f in fams.items() if not f & HELD_OUT and h in texts)
    test_pool = sorted(h for h, f in fams.items() if f and f <= HELD_OUT and h in texts)
    corpus = [corpus_pool[i] for i in rng.choice(len(corpus_pool), min(args.corpus, len(corpus_pool)), replace=False)]
    test = [test_pool[i] for i in rng.choice(len(test_pool), min(args.test, len(test_pool)), replace=False)]
    records = {h: plan.region_graph(h) for h in corpus + test}
    family_of = dict(zip(plan.regions["hash"], plan.regions["family"]))
    print(f"corpus {len(corpus)} regions of {len(corpus_pool)}, left-out families {len(test)} of {len(test_pool)}; "
          f"{args.fidelity} on {target.name}; {machine_name()}", flush=True)
    graphs = RealGraphs([records[h] for h in corpus], [family_of[h] for h in corpus])
    made = {}
    for kind in ("layerdag", "random"):
        t0 = time.time()
        options = {"seed": 0, "epochs": args.generator_epochs} if kind == "layerdag" else {"seed": 0}
        gen = fit_generator(graphs, kind, **options)
        made[kind] = synthetic_regions(work / kind, gen, graphs, args.synthetic, set(records), seed=0)
        print(f"{kind}: {len(made[kind])} new regions in {time.time() - t0:.0f} s", flush=True)
    items = [(h, records[h], texts[h]) for h in corpus + test] + made["layerdag"] + made["random"]
    labels = label_all(args.fidelity, target, items, args.measure_s)

    def usable(h: str) -> bool:
        row = labels.get(h)
        return row is not None and row["status"] == "ok" and row["seconds"] > 0

    made = {k: [m for m in v if usable(m[0])] for k, v in made.items()}    # the same count of labelled ones
    count = min(len(made["layerdag"]), len(made["random"]))
    made = {k: v[:count] for k, v in made.items()}
    graph_text = {h: json.dumps(rec) for h, rec, _ in items}
    base_regions = [plan.regions.set_index("hash").loc[h].to_dict() | {"hash": h} for h in corpus + test]
    variants = {"corpus": [], "corpus+layerdag": made["layerdag"], "corpus+random": made["random"]}
    mlflow = setup_mlflow(args.tracking_uri, "synthetic-regions")
    results = []
    for seed in args.seeds:
        for name in VARIANTS:
            extra = variants[name]
            regions = base_regions + [region_row(h, rec, name.split("+")[1]) for h, rec, _ in extra]
            hashes = corpus + test + [h for h, _, _ in extra]
            rows = [labels[h] for h in hashes if h in labels]
            ds = dataset(work, name, regions, rows, graph_text, target)
            lr = label_rows(ds, args.fidelity, [target.name])
            in_test = lr["hash"].isin(test).to_numpy()
            train_hashes = [h for h in corpus + [h for h, _, _ in extra] if h in set(lr["hash"])]
            pick = np.random.default_rng(seed).permutation(len(corpus))
            val = {corpus[i] for i in pick[: int(0.15 * len(corpus))]}
            pos = lr["pos"].to_numpy()
            tr = np.sort(pos[lr["hash"].isin([h for h in train_hashes if h not in val]).to_numpy()])
            va = np.sort(pos[lr["hash"].isin(val).to_numpy()])
            te = np.sort(pos[in_test])
            cfg = TrainConfig(fidelity=args.fidelity, targets=[target.name], epochs=args.epochs, seed=seed)
            t0 = time.time()
            sur = Surrogate(cfg).fit(ds, tr, va)
            fit_s = time.time() - t0
            rows_te, pred = sur.predict_rows(ds, te)
            rep = report(rows_te, pred.seconds, pred.lower, pred.upper)
            row = {"fidelity": args.fidelity, "target": target.name, "machine": machine_name(), "variant": name,
                   "seed": seed, "corpus_regions": len(corpus), "synthetic_regions": count,
                   "train_regions": len(set(ds.labels.iloc[tr]["hash"])), "test_rows": len(rows_te),
                   "median_ape": rep["median_ape"], "p90_ape": rep["p90_ape"], "coverage": rep.get("coverage"),
                   "fit_s": fit_s, "epochs": sur.metrics["epochs_run"]}
            row.update({f"median_ape:{f}": part["median_ape"] for f, part in rep["per_family"].items()})
            results.append(row)
            with mlflow.start_run(run_name=f"{args.fidelity}-{name}-seed{seed}"):
                mlflow.log_params({k: row[k] for k in ("fidelity", "target", "variant", "seed", "train_regions")}
                                  | {"machine": machine_name(), "synthetic": count})
                mlflow.log_metrics({k: float(v) for k, v in row.items()
                                    if k.startswith(("median_ape", "p90_ape", "coverage", "fit_s")) and v is not None})
            print(f"{name:<16} seed {seed}: median APE {row['median_ape']:.3f}, p90 {row['p90_ape']:.3f}, "
                  f"coverage {row['coverage']:.3f} ({row['train_regions']} regions, {fit_s:.0f} s)", flush=True)
    with open(work / "results.csv", "w", newline="") as fh:
        keys = sorted({k for r in results for k in r}, key=lambda k: (k.startswith("median_ape:"), k))
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(results)
    frame = pd.DataFrame(results)
    if args.table:
        kept = pd.read_csv(args.table) if args.table.is_file() else pd.DataFrame()
        if len(kept):
            kept = kept[~((kept["fidelity"] == args.fidelity) & (kept["target"] == target.name))]
        args.table.parent.mkdir(parents=True, exist_ok=True)
        pd.concat([kept, frame], ignore_index=True).to_csv(args.table, index=False)
    print(f"\n{args.fidelity} on {target.name}: left-out families ({', '.join(sorted(HELD_OUT))}), "
          f"{len(args.seeds)} seeds, {count} synthetic regions per variant; mean ± standard deviation, in %")
    print(f"{'variant':<18} {'median APE':>16} {'p90 APE':>16} {'coverage':>16}")
    for name in VARIANTS:
        part = frame[frame["variant"] == name]
        cells = [f"{100 * part[c].mean():.3g} ± {100 * part[c].std(ddof=0):.2g} %"
                 for c in ("median_ape", "p90_ape", "coverage")]
        print(f"{name:<18} " + " ".join(f"{c:>16}" for c in cells))
    print(f"(every run: {work / 'results.csv'}; MLflow experiment synthetic-regions)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
