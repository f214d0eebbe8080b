"""Benchmark of design sweeps: configurations per second, peak memory, and how the time grows from 1k to
10k to 100k configurations of ``eval/sweeps/large.yaml`` (default fidelity, embedded replay).

1. **Replay** — one program of the large spec, its traces replayed on a sample of the spec's systems by
   the embedded replay and by the sweep's fast replay (exactly equal step times are checked): ms per
   configuration each, and the speed-up.
2. **Growth** — sub-sweeps of the large spec with 1,000 (1 program), 10,000 (10 programs) and 100,000
   (all 100) configurations, each into a fresh folder: wall time, configurations per second, the
   programs phase (export + ingest + split, summed over workers; zoo exports are cached, so a size's
   programs already exported by a smaller size cost only their ingest), peak memory (driver; largest
   worker; driver + workers sampled every 0.5 s) and the load average seen.

    nice python eval/bench_sweep.py                       # replay figures, then 1k, 10k, 100k
    nice python eval/bench_sweep.py --sizes 1000,10000    # skip the 100k sweep
    nice python eval/bench_sweep.py --keep out/bench-sweep  # keep the results folders
"""
from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LARGE = ROOT / "eval" / "sweeps" / "large.yaml"
SUBSETS = {  # configurations -> what the large spec is cut down to (each program: 8 targets x 125 systems)
    1000: {"layers": [6], "d_model": [768], "parallelism": [{"devices": 8, "parallel": "fsdp"}]},
    10000: {"layers": [2, 4, 6, 8, 12], "d_model": [512, 1024], "parallelism": [{"devices": 8, "parallel": "fsdp"}]},
    100000: {},
}


def sub_spec(size: int, folder: Path) -> Path:
    """The large spec cut down to ``size`` configurations, written into ``folder``."""
    data = yaml.safe_load(LARGE.read_text())
    cut = SUBSETS[size]
    params = data["workloads"][0]["params"]
    for key in ("layers", "d_model"):
        if key in cut:
            params[key] = cut[key]
    if "parallelism" in cut:
        data["parallelism"] = cut["parallelism"]
    data["name"] = f"large-{size}"
    path = folder / f"large-{size}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


class MemorySampler:
    """Peak RSS of this process and its descendants, sampled every 0.5 s (needs psutil)."""

    def __init__(self):
        self.peak = 0
        self.stop = threading.Event()
        try:
            import psutil
            self.proc = psutil.Process()
        except ImportError:
            self.proc = None
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.wait(0.5):
            try:
                procs = [self.proc, *self.proc.children(recursive=True)]
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except Exception:  # noqa: BLE001 - a process that just ended
                        pass
                self.peak = max(self.peak, total)
            except Exception:  # noqa: BLE001
                pass

    def __enter__(self):
        if self.proc is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()


def replay_figures(n_systems: int) -> None:
    """Embedded vs fast replay of one program of the large spec on a sample of its systems."""
    from hespas_ml import pipeline
    from hespas_ml.replay.embedded import replay_embedded
    from hespas_ml.replay.system import load_system
    from hespas_ml.replay.fast import SystemContext, compile_plan, evaluate
    from hespas_ml.use.sweep_spec import load_sweep_spec

    spec = load_sweep_spec(LARGE)
    prog = next(p for p in spec.programs if p.params.get("layers") == 6 and p.params.get("d_model") == 768
                and p.parallel == "fsdp" and p.devices == 8)
    tgt = spec.target_objects["H100"]
    rg = pipeline.split(pipeline.ingest(prog.source, prog.devices), spec.split)
    times = pipeline.label(rg, spec.fidelity_objects[spec.fidelities[0]], tgt)
    traces = pipeline.trace(rg, times).point
    plan = compile_plan(traces.traces, traces.comm_groups)
    systems = random.Random(0).sample(spec.systems_for(prog), n_systems)
    cfgs = [load_system(s.name, local_mem_bw_gbps=tgt.mem_bw / 1e9) for s in systems]
    t = time.perf_counter()          # first pass: the per-process phase fits and collective shapes
    for cfg in cfgs:
        evaluate(plan, SystemContext(cfg))
    t_first = time.perf_counter() - t
    t_emb = t_fast = 0.0
    for s, cfg in zip(systems, cfgs):
        t = time.perf_counter()
        ref = replay_embedded(traces.traces, cfg, traces.comm_groups or None)
        t_emb += time.perf_counter() - t
        t = time.perf_counter()
        res = evaluate(plan, SystemContext(cfg))       # a fresh context: collective times not reused
        t_fast += time.perf_counter() - t
        assert res is not None and res.finish_ns == max(r.finish_ns for r in ref.ranks), s.name
    nodes = plan.n_nodes
    print(f"replay: {prog.workload} {prog.parallel}@{prog.devices}, {nodes} nodes/rank, "
          f"{len(plan.collectives)} distinct collectives, {n_systems} systems (each new to the replay: no "
          "collective-time reuse)")
    print(f"  embedded replay {t_emb / n_systems * 1e3:7.2f} ms/config   fast replay {t_fast / n_systems * 1e3:7.2f} "
          f"ms/config   speed-up {t_emb / max(t_fast, 1e-9):.1f}x   (step times equal on all {n_systems}; "
          f"first pass, with the one-time phase fits and shapes: {t_first / n_systems * 1e3:.2f} ms/config)")


def run_size(size: int, folder: Path, workers: int | None) -> dict:
    from hespas_ml.use.sweep import run_sweep

    spec = sub_spec(size, folder)
    out = folder / f"out-{size}"
    shutil.rmtree(out, ignore_errors=True)
    load0 = os.getloadavg()
    t = time.perf_counter()
    with MemorySampler() as mem:
        manifest = run_sweep(spec, out, workers=workers, progress=sys.stderr.isatty())
    wall = time.perf_counter() - t
    load1 = os.getloadavg()
    self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    child_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    st, tm = manifest["stats"], manifest["timings_s"]
    return {"size": manifest["configs"], "wall": wall, "rate": manifest["configs"] / wall, "prepare": tm["prepare_s"],
            "label": tm["label_s"], "chunks": tm["chunks_s"], "driver_mb": self_rss, "worker_mb": child_rss,
            "total_mb": mem.peak / 2**20, "load": (load0, load1), "stats": st}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000", help="comma-separated: of 1000, 10000, 100000")
    ap.add_argument("--workers", type=int, help="worker processes (default: cores)")
    ap.add_argument("--replay-systems", type=int, default=20, help="systems in the replay comparison (0: skip)")
    ap.add_argument("--keep", help="write the specs and results here (default: a temporary folder, removed)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in SUBSETS]
    if bad:
        ap.error(f"sizes must be among {', '.join(map(str, SUBSETS))}")
    print(f"machine: {os.cpu_count()} cores, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
          f"niceness {os.nice(0)}")
    if args.replay_systems:
        replay_figures(args.replay_systems)
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="hespas-bench-sweep-"))
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for size in sizes:
            r = run_size(size, folder, args.workers)
            rows.append(r)
            st = r["stats"]
            print(f"{r['size']:>7} configs: {r['wall']:8.1f} s  {r['rate']:7.1f} cfg/s   programs phase "
                  f"{r['prepare']:6.1f} s (worker time)  chunks {r['chunks']:7.1f} s (worker time)  labels "
                  f"{r['label']:5.1f} s   peak RSS driver {r['driver_mb']:.0f} MB, largest worker "
                  f"{r['worker_mb']:.0f} MB, all {r['total_mb']:.0f} MB   load {r['load'][0][0]:.2f} -> "
                  f"{r['load'][1][0]:.2f}", flush=True)
            print(f"          shared: {st['programs_prepared']} programs, {st['regions_unique']} unique / "
                  f"{st['regions_seen']} regions, {st['labels_computed']} labels, {st['systems_built']} system "
                  f"configs, {st['trace_sets_built']} trace sets, replays {st['replays_fast']} fast / "
                  f"{st['replays_embedded']} embedded, {st['configs_failed']} failed", flush=True)
        if len(rows) > 1:
            base = rows[0]
            print("growth: " + ", ".join(f"{r['size']} configs {r['wall'] / base['wall']:.1f}x the time of "
                                         f"{base['size']}" for r in rows[1:]))
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
