"""Benchmark of the dataset builder: dedup ratio, labels per second per fidelity, profiling noise, and the
estimated time of a full build of the main spec.

1. **Dedup** — every program of the spec is exported, ingested and split (no labelling) in worker
   processes; prints regions seen / unique regions, overall and per family, and the time the programs
   phase of a build would take (export times count only for programs not yet in the zoo cache).
2. **Rates** — a sample of the spec's programs (spread over its families) is built into a temporary folder
   with the spec's own fidelities, a fresh SCALE-Sim layer cache, and at most ``--max-regions`` regions per
   fidelity and target beyond roofline; prints labels per second per fidelity (from the time spent
   labelling).
3. **Noise** — of the sample's profiling labels: the median IQR as % of the median, over all regions and
   over regions slower than 100 µs (where it must stay under 5 %).
4. **Estimate** — the main build's time from (1) and (2).

    python eval/bench_dataset.py                        # datasets/main.yaml
    python eval/bench_dataset.py --spec datasets/smoke.yaml --sample 6
    python eval/bench_dataset.py --skip-dedup --sample 12 --max-regions 60
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hespas_ml.label.dataset_spec import DatasetSpec, load_spec  # noqa: E402


def _split_one(source: str, split: str, caps: dict) -> dict:
    from hespas_ml.ingest.zoo import is_zoo_spec, parse_zoo_spec
    from hespas_ml.ingest.zoo.cache import _read_entry, cache_dir, cache_key
    from hespas_ml import pipeline
    from hespas_ml.label.region_records import program_records

    cached = True
    if is_zoo_spec(source):
        family, params = parse_zoo_spec(source)
        cached = _read_entry(cache_dir(), cache_key(family, params)) is not None
    t0 = time.perf_counter()
    try:
        res = program_records(pipeline.split(pipeline.ingest(source), split), caps, with_records=False)
    except Exception as exc:  # noqa: BLE001 - counted as a failed program
        return {"source": source, "error": str(exc)[:300], "seconds": time.perf_counter() - t0, "cached": cached}
    return {"source": source, "seconds": time.perf_counter() - t0, "cached": cached,
            "n_regions": sum(e["occurrences"] for e in res["regions"].values()), "hashes": sorted(res["regions"])}


def dedup(spec: DatasetSpec, workers: int) -> dict:
    """Split every program of the spec; regions seen and unique, per family and overall."""
    from tqdm import tqdm

    family = {p.source: p.family for p in spec.programs}
    results = []
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = [pool.submit(_split_one, p.source, spec.split, spec.caps) for p in spec.programs]
        for fut in tqdm(cf.as_completed(futures), total=len(futures), desc="export+split", unit="prog"):
            results.append(fut.result())
    wall = time.perf_counter() - t0
    per_family: dict[str, dict] = {}
    overall: set[str] = set()
    seen = 0
    for r in results:
        f = per_family.setdefault(family[r["source"]], {"programs": 0, "failed": 0, "seen": 0, "unique": set()})
        f["programs"] += 1
        if "error" in r:
            f["failed"] += 1
            continue
        f["seen"] += r["n_regions"]
        f["unique"].update(r["hashes"])
        overall.update(r["hashes"])
        seen += r["n_regions"]
    print(f"\n== dedup over {len(results)} programs of {spec.path.name} (export+split wall {wall / 60:.1f} min, "
          f"{workers} workers)")
    print(f"  {'family':<14} {'programs':>8} {'failed':>6} {'seen':>8} {'unique':>8} {'ratio':>6}")
    for name, f in sorted(per_family.items()):
        n = len(f["unique"])
        print(f"  {name:<14} {f['programs']:>8} {f['failed']:>6} {f['seen']:>8} {n:>8} "
              f"{(f['seen'] / n if n else 0):>6.2f}")
    print(f"  {'all':<14} {len(results):>8} {sum(f['failed'] for f in per_family.values()):>6} {seen:>8} "
          f"{len(overall):>8} {(seen / len(overall) if overall else 0):>6.2f}")
    for r in results:
        if "error" in r:
            print(f"  failed: {r['source']}: {r['error']}")
    export = [r["seconds"] for r in results if not r["cached"]]
    split_only = [r["seconds"] for r in results if r["cached"]]
    print(f"  per program: {statistics.mean(split_only) if split_only else 0:.2f} s ingest+split (cached "
          f"export, {len(split_only)} programs), {statistics.mean(export) if export else 0:.2f} s with export "
          f"({len(export)} programs)")
    return {"unique": len(overall), "seen": seen, "wall_s": wall, "families": len(per_family),
            "split_s_total": sum(r["seconds"] for r in results), "with_export": len(export)}


def _sample(spec: DatasetSpec, n: int) -> list:
    """``n`` programs, round-robin over the families, each family's taken in a fixed shuffled order."""
    import random

    by_family: dict[str, list] = {}
    for p in spec.programs:
        by_family.setdefault(p.family, []).append(p)
    for progs in by_family.values():
        random.Random(0).shuffle(progs)
    picked: list = []
    while len(picked) < n and any(by_family.values()):
        for fam in sorted(by_family):
            if by_family[fam] and len(picked) < n:
                picked.append(by_family[fam].pop())
    return picked


def rates(spec: DatasetSpec, sample: int, max_regions: int, workers: int) -> dict:
    """Build a sample of the spec in a temporary folder and time each fidelity."""
    from hespas_ml.ingest.zoo.cache import cache_dir as zoo_dir
    from hespas_ml.label.dataset_tables import load_dataset
    from hespas_ml.host import cache_dir

    progs = _sample(spec, sample)
    with tempfile.TemporaryDirectory(prefix="bench-dataset-") as tmp:
        tmp = Path(tmp)
        cache = tmp / "cache"
        cache.mkdir()
        (cache / "zoo").symlink_to(zoo_dir())
        for f in cache_dir().glob("host-cpu-*.yaml"):          # keep the measured host-cpu figures
            (cache / f.name).symlink_to(f)
        fids = {}
        for name, opts in spec.raw["fidelities"].items():
            opts = dict(opts or {})
            if "targets" in opts and not isinstance(opts["targets"], str):
                opts["targets"] = [t if not str(t).endswith((".yaml", ".yml")) else str(spec.path.parent / t)
                                   for t in opts["targets"]]
            if name != "roofline":
                opts["max_regions"] = min(max_regions, opts.get("max_regions") or max_regions)
            fids[name] = opts
        entries = [{"zoo": p.source[len("zoo:"):], "family": p.family} if p.is_zoo else
                   {"mlir": p.source, "family": p.family} for p in progs]
        raw = {"name": "bench-sample", "split": spec.split, "programs": entries, "fidelities": fids,
               "caps": spec.raw.get("caps", {})}
        if "targets" in spec.raw:
            raw["targets"] = spec.raw["targets"]
        spec_file = tmp / "sample.json"          # JSON is YAML
        spec_file.write_text(json.dumps(raw))
        env = {**os.environ, "HESPAS_ML_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
        out = tmp / "out"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "hespas_ml.cli.main", "dataset", "build", str(spec_file), "--out",
                        str(out), "--workers", str(workers)], env=env, check=True)
        wall = time.perf_counter() - t0
        ds = load_dataset(out)
    labels = ds.labels
    print(f"\n== label rates on a sample of {len(progs)} programs ({len(ds.regions)} unique regions; "
          f"build wall {wall:.0f} s)")
    print(f"  {'fidelity':<10} {'labels':>7} {'failed':>6} {'label s':>9} {'labels/s':>9} {'wall s':>7}")
    out_rates = {}
    for fid, group in labels.groupby("fidelity"):
        spent = float(group["label_s"].sum())
        wall_f = ds.manifest["timings"].get(f"label_{fid}_s", spent)
        rate = len(group) / max(wall_f, 1e-9)
        out_rates[fid] = rate
        print(f"  {fid:<10} {len(group):>7} {int((group['status'] != 'ok').sum()):>6} {spent:>9.1f} {rate:>9.1f} "
              f"{wall_f:>7.1f}")
    noise(labels)
    return {"rates": out_rates, "regions": len(ds.regions), "programs": len(progs)}


def noise(labels) -> None:
    prof = labels[(labels["fidelity"] == "profiling") & (labels["status"] == "ok")]
    if prof.empty:
        print("\n== profiling noise: no profiling labels in the sample")
        return
    slow = prof[prof["seconds"] > 100e-6]
    print(f"\n== profiling noise (IQR / median): median {100 * prof['noise'].median():.2f} % over {len(prof)} "
          f"regions")
    if not slow.empty:
        over = int((slow["noise"] >= 0.05).sum())
        print(f"  regions > 100 µs: {len(slow)}, median {100 * slow['noise'].median():.2f} %, "
              f"p90 {100 * slow['noise'].quantile(0.9):.2f} %, {over} at or above 5 %  "
              f"[{'PASS' if slow['noise'].median() < 0.05 else 'FAIL'}: median < 5 %]")


def estimate(spec: DatasetSpec, unique: int, res: dict, split_s: float, workers: int) -> None:
    print(f"\n== estimated build of {spec.path.name}: {unique} unique regions")
    total = split_s / workers
    print(f"  programs   {split_s / workers / 60:7.1f} min  (measured export+split time / {workers} workers)")
    for fs in spec.fidelities:
        n = min(unique, fs.max_regions or unique) * len(fs.targets)
        rate = res["rates"].get(fs.name)
        if not rate:
            print(f"  {fs.name:<10} {n} labels, no rate measured")
            continue
        t = n / rate
        total += t
        print(f"  {fs.name:<10} {t / 60:7.1f} min  ({n} labels at {rate:.1f}/s)")
    print(f"  total      {total / 60:7.1f} min")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default=str(ROOT / "datasets" / "main.yaml"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sample", type=int, default=16, help="programs in the rate sample")
    ap.add_argument("--max-regions", type=int, default=150, help="regions per target for non-roofline fidelities")
    ap.add_argument("--skip-dedup", action="store_true")
    ap.add_argument("--skip-rates", action="store_true")
    args = ap.parse_args()
    spec = load_spec(args.spec)
    d = dedup(spec, args.workers) if not args.skip_dedup else None
    r = rates(spec, args.sample, args.max_regions, args.workers) if not args.skip_rates else None
    if d and r:
        estimate(spec, d["unique"], r, d["split_s_total"], args.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
