"""Benchmark of the learned surrogates against the fidelities they replace, side by side in one run.

1. **Load** — ``Surrogate.load`` of each shipped model (``hespas_ml/models/<fidelity>/``) in this process (modules
   already imported) and in a fresh Python process (import + load, reported separately). Target: < 1 s.
2. **Batched inference** — region records (distinct regions of a dataset, e.g. the main snapshot) →
   predictions on CPU with the whole ensemble, featurisation included (every timing starts from a freshly
   loaded model, so nothing is cached), in regions per second. Target: ≥ 5,000 regions/s.
3. **Per region, same regions** — the compute regions of one program, labelled by SCALE-Sim (TPUv4, no
   layer cache) and by profiling (host-cpu XLA, no cache), and predicted by the ``scalesim`` and
   ``profiling`` surrogates (live regions: signature, record, featurisation, prediction — the path of
   ``simulate --fidelity surrogate:…``; the program's op users are computed once by its split, as in
   ``simulate``). The surrogate is loaded once (as in a sweep) and takes the best of
   ``--surrogate-repeats`` calls, its featuriser cache emptied before each; the labellers run once
   (SCALE-Sim's time includes starting its worker process, ~0.14 s, as every ``label_regions`` call does;
   profiling's worker, which lives across calls, is started before the timing).
   Targets: ≥ 1,000× faster than SCALE-Sim, ≥ 100× faster than profiling. Also printed: the surrogate on
   regions it featurised before (a sweep's later points, another target): signature and network only.

    python eval/bench_surrogate.py                                   # the shipped models, records from the smoke spec
    python eval/bench_surrogate.py --dataset /path/to/main-snapshot --regions 5000
    python eval/bench_surrogate.py --program 'zoo:resnet?depth=18&width=0.5&image=32&batch=4' --sample 16
    python eval/bench_surrogate.py --json out/bench_surrogate.json

torch runs with ``--threads`` intra-op threads (default 1, as the models are configured).
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hespas_ml.learn.registry import models_dir  # noqa: E402
from hespas_ml.units import format_seconds  # noqa: E402

_fmt = functools.partial(format_seconds, digits=2)

FIDELITIES = ("roofline", "scalesim", "profiling")
TARGET_OF = {"roofline": "H100", "scalesim": "TPUv4", "profiling": "host-cpu"}
DEFAULT_PROGRAM = "zoo:resnet?depth=18&width=0.5&image=32&batch=4&classes=100&step=train"


def load_times(models: Path, repeats: int) -> dict:
    """In-process and fresh-process load times of each shipped model."""
    from hespas_ml.learn.surrogate import Surrogate

    out = {}
    for fid in FIDELITIES:
        folder = models / fid
        if not (folder / "surrogate.json").is_file():
            continue
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            Surrogate.load(folder)
            times.append(time.perf_counter() - t)
        code = ("import time; t0 = time.perf_counter(); from hespas_ml.learn.surrogate import Surrogate; "
                "t1 = time.perf_counter(); Surrogate.load(%r); t2 = time.perf_counter(); "
                "print(t1 - t0, t2 - t1)" % str(folder))
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
        imp, load = map(float, res.stdout.split())
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        out[fid] = {"load_s": min(times), "load_median_s": statistics.median(times), "fresh_import_s": imp,
                    "fresh_load_s": load, "size_bytes": size}
    return out


def dataset_records(path: str | None, n: int) -> tuple[list[dict], str]:
    """``n`` distinct region records of a dataset (the smoke dataset built into a temporary folder if none)."""
    from hespas_ml.use.dataset import build_dataset, load_dataset

    if path is None:
        tmp = Path(tempfile.mkdtemp(prefix="bench-surrogate-")) / "smoke"
        build_dataset(ROOT / "datasets" / "smoke.yaml", tmp, progress=False)
        path = str(tmp)
    ds = load_dataset(path)
    hashes = list(ds.regions["hash"])[:n]
    return [ds.region_graph(h) for h in hashes], path


def throughput(models: Path, records: list[dict], repeats: int) -> dict:
    """Regions per second of batched prediction from records, featurisation included (fresh model each time)."""
    from hespas_ml.label.targets import load_target
    from hespas_ml.learn.surrogate import Surrogate

    out = {}
    for fid in FIDELITIES:
        folder = models / fid
        if not (folder / "surrogate.json").is_file():
            continue
        target = load_target(TARGET_OF[fid])
        best = float("inf")
        for _ in range(repeats):
            model = Surrogate.load(folder)            # empty featuriser cache
            t = time.perf_counter()
            pred = model.predict_records(records, target)
            best = min(best, time.perf_counter() - t)
            assert len(pred) == len(records)
        out[fid] = {"regions": len(records), "seconds": best, "regions_per_s": len(records) / best,
                    "ensemble": model.config.ensemble, "target": TARGET_OF[fid]}
    return out


def unique_regions(program: str, sample: int) -> list:
    """Up to ``sample`` structurally distinct compute regions of ``program`` (largest work first, so the
    comparison is not dominated by trivial kernels; then spread over the rest)."""
    from hespas_ml import pipeline
    from hespas_ml.split.signature import region_signature

    graph = pipeline.ingest(program)
    users = graph.users()
    seen, regions = set(), []
    for r in pipeline.split(graph, "fusion").compute_regions():
        sig = region_signature(r, users)
        if sig not in seen and r.flops + r.bytes > 0:
            seen.add(sig)
            regions.append(r)
    regions.sort(key=lambda r: -(r.flops + r.bytes))
    if len(regions) <= sample:
        return regions
    half = sample // 2
    rest = regions[half:]
    step = len(rest) / (sample - half)
    return regions[:half] + [rest[int(i * step)] for i in range(sample - half)]


def per_region(models: Path, regions: list, repeats: int, skip: set[str]) -> dict:
    """Seconds per region of SCALE-Sim, profiling and their surrogates on the same regions. The surrogate
    (milliseconds a call) is loaded once, as in a sweep, and takes the best of ``repeats`` calls, as timeit
    does, each with its featuriser cache emptied first (so every call hashes, records, featurises and
    predicts every region); a labeller (seconds a region) is run once, uncached."""
    from hespas_ml.label.targets import load_target
    from hespas_ml.learn.surrogate import Surrogate

    out: dict = {"n_regions": len(regions)}
    for fid, target in (("scalesim", "TPUv4"), ("profiling", "host-cpu")):
        folder = models / fid
        entry: dict = {"target": target}
        tgt = load_target(target)                                  # once, as simulate and sweeps do
        if (folder / "surrogate.json").is_file():
            model = Surrogate.load(folder)
            model.predict_regions(regions, tgt)                    # first-call costs outside the timing
            best = single = float("inf")
            for _ in range(repeats):
                model.featuriser.clear_cache()
                t = time.perf_counter()
                model.predict_regions(regions, tgt)
                best = min(best, time.perf_counter() - t)
                model.featuriser.clear_cache()
                t = time.perf_counter()
                model.predict_regions(regions[:1], tgt)
                single = min(single, time.perf_counter() - t)
            entry["surrogate_s_per_region"] = best / len(regions)
            entry["surrogate_single_region_s"] = single
            warm = float("inf")                                   # regions featurised by the call before
            for _ in range(repeats):
                t = time.perf_counter()
                model.predict_regions(regions, tgt)
                warm = min(warm, time.perf_counter() - t)
            entry["surrogate_warm_s_per_region"] = warm / len(regions)
        if fid not in skip:
            if fid == "scalesim":
                from hespas_ml.label.scalesim import LayerCache, ScaleSimFidelity
                from hespas_ml.label.scalesim_worker import Budget
                fidelity = ScaleSimFidelity(budget=Budget(seconds=30.0, memory_bytes=2 * 2**30), workers=1,
                                            cache=LayerCache(disk=False))
            else:
                from hespas_ml.label.profiling import ProfilingFidelity
                fidelity = ProfilingFidelity(cache=False, measure_s=0.5)
                fidelity.label_regions(regions[:1], tgt)           # start the worker outside the timing
            t = time.perf_counter()
            labels = fidelity.label_regions(regions, tgt)
            entry["labeller_s_per_region"] = (time.perf_counter() - t) / len(regions)
            entry["labeller_ok"] = sum(lab.status == "ok" for lab in labels)
            close = getattr(fidelity, "close", None)
            if callable(close):
                close()
        if "surrogate_s_per_region" in entry and "labeller_s_per_region" in entry:
            entry["speedup"] = entry["labeller_s_per_region"] / entry["surrogate_s_per_region"]
        out[fid] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=str(models_dir()),
                    help="folder of the shipped models (default: $HESPAS_ML_MODELS or the package's)")
    ap.add_argument("--dataset", help="dataset folder for the records (default: the smoke spec, built now)")
    ap.add_argument("--regions", type=int, default=5000, help="records for the throughput (default 5000)")
    ap.add_argument("--program", default=DEFAULT_PROGRAM, help="program of the per-region comparison")
    ap.add_argument("--sample", type=int, default=16, help="distinct regions of it to compare on (default 16)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of the load and throughput timings")
    ap.add_argument("--surrogate-repeats", type=int, default=20,
                    help="repeats of the per-region surrogate timing (best taken; default 20)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["scalesim", "profiling"],
                    help="labellers not to run")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args(argv)

    import torch
    torch.set_num_threads(args.threads)
    models = Path(args.models)
    w = sys.stdout.write
    res: dict = {"models": str(models), "threads": args.threads}

    res["load"] = load_times(models, args.repeats)
    w(f"model load ({models}):\n")
    for fid, r in res["load"].items():
        ok = "ok" if r["load_s"] < 1.0 else "SLOW"
        w(f"  {fid:<10} {_fmt(r['load_s']):>9}  (fresh process: import {_fmt(r['fresh_import_s'])} + load "
          f"{_fmt(r['fresh_load_s'])}; {r['size_bytes'] / 1e6:.2f} MB)  target < 1 s: {ok}\n")

    records, used = dataset_records(args.dataset, args.regions)
    res["dataset"] = used
    res["throughput"] = throughput(models, records, args.repeats)
    w(f"\nbatched CPU inference, {len(records)} distinct regions of {used} (featurisation included):\n")
    for fid, r in res["throughput"].items():
        ok = "ok" if r["regions_per_s"] >= 5000 else "BELOW"
        w(f"  {fid:<10} {r['regions_per_s']:>10,.0f} regions/s  ({r['ensemble']}-member ensemble, {r['target']}, "
          f"{_fmt(r['seconds'])})  target >= 5,000/s: {ok}\n")

    regions = unique_regions(args.program, args.sample)
    res["program"] = args.program
    res["per_region"] = per_region(models, regions, args.surrogate_repeats, set(args.skip))
    w(f"\nper region, the same {len(regions)} distinct regions of {args.program}:\n")
    for fid, goal in (("scalesim", 1000), ("profiling", 100)):
        e = res["per_region"].get(fid, {})
        sur, lab = e.get("surrogate_s_per_region"), e.get("labeller_s_per_region")
        line = f"  {fid:<10} on {e.get('target')}: "
        line += f"labeller {_fmt(lab)}/region ({e.get('labeller_ok')} ok)" if lab else "labeller skipped"
        line += f", surrogate {_fmt(sur)}/region (single region {_fmt(e['surrogate_single_region_s'])})" \
            if sur else ", no shipped surrogate"
        if "speedup" in e:
            line += f"  ->  {e['speedup']:,.0f}x  (target >= {goal:,}x: {'ok' if e['speedup'] >= goal else 'BELOW'})"
        w(line + "\n")
        if sur:
            warm = e["surrogate_warm_s_per_region"]
            w(f"  {'':<10} regions featurised before (a sweep's later points): {_fmt(warm)}/region"
              + (f"  ->  {lab / warm:,.0f}x" if lab else "") + "\n")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
