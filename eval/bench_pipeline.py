"""Benchmark: ingest + split + roofline + Chakra traces + embedded replay, per program, in a fresh process.

Prints, for each program: its size, the time of each stage, the pipeline's wall time (after imports), the
whole process's wall time (Python start and imports included), the peak memory (max RSS), and — as the
baseline measured in the same run — how long XLA itself takes just to compile the same program on this
machine's CPU backend (the cheapest thing one could do with the program short of our pipeline).

    python eval/bench_pipeline.py                  # ResNet-50 inference (../shared) + a >1 MB zoo llama FSDP train step
    python eval/bench_pipeline.py prog.mlir ...    # any programs (paths or zoo: specs)
    python eval/bench_pipeline.py --no-xla         # skip the XLA compile baseline
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = (ROOT / ".." / "shared").resolve()
DEFAULT_PROGRAMS = [
    (str(SHARED / "mlir" / "resnet_50_inference_step_4_devices_1024_batch.mlir"), "H100_80GB_4GPU"),
    ("zoo:llama?layers=16&d_model=1024&heads=16&kv_heads=4&seq=1024&batch=8&dtype=bf16&optimizer=adam"
     "&devices=4&parallel=fsdp", "ring:4x150"),
]

CHILD = r"""
import json, resource, sys, time
t_start = time.perf_counter()
from hespas_ml import pipeline, simulate
from hespas_ml.ingest.stablehlo import _mlir
_mlir()                                    # jax's MLIR bindings: counted with the imports, not with ingest
t_import = time.perf_counter()
program, system = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
graph = pipeline.ingest(program)
t_ingest = time.perf_counter() - t0
res = simulate(graph, target="H100", system=system, replay="embedded")
wall = time.perf_counter() - t0
timings = dict(res.timings); timings["ingest"] = t_ingest
print(json.dumps({"import_s": t_import - t_start, "pipeline_s": wall, "timings": timings,
                  "ops": len(graph.ops), "regions": len(res.regions), "n_comp_nodes": res.n_comp_nodes,
                  "n_comm_nodes": res.n_comm_nodes, "n_devices": res.n_devices, "step_time_s": res.step_time_s,
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

XLA_CHILD = r"""
import os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=%d" % int(sys.argv[2])
import numpy as np, jax
from jax.extend import backend as jeb
text = open(sys.argv[1], "rb").read()
be = jeb.get_backend("cpu"); devs = be.local_devices()
import re
head = text[:4000].decode("utf-8", "replace")
reps = int((re.search(r"mhlo.num_replicas = (\d+)", head) or [0, 1])[1])
parts = int((re.search(r"mhlo.num_partitions = (\d+)", head) or [0, 1])[1])
opts = jeb.get_compile_options(num_replicas=reps, num_partitions=parts,
                               device_assignment=np.array(devs[:reps * parts]).reshape(reps, parts))
t = time.perf_counter(); be.compile_and_load(text, devs[:reps * parts], opts); print(time.perf_counter() - t)
"""


def program_file(program: str) -> tuple[Path, int]:
    """The .mlir file behind a program (zoo programs are exported once and cached) and its device count."""
    sys.path.insert(0, str(ROOT))
    from hespas_ml import pipeline
    graph = pipeline.ingest(program)
    if program.startswith("zoo:"):
        import tempfile
        from hespas_ml.ingest.zoo import zoo_program
        data = zoo_program(program)
        path = Path(tempfile.mkdtemp(prefix="hespas-bench-")) / f"{graph.name}.mlir"
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        return path, graph.n_devices
    return Path(program), graph.n_devices


def run(cmd: list[str], timeout: float) -> tuple[str, float]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child failed: {proc.stderr.strip().splitlines()[-1:]}")
    return proc.stdout, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("programs", nargs="*", help="programs (paths or zoo: specs); system = ring:<n>x150")
    ap.add_argument("--no-xla", action="store_true", help="skip the XLA compile baseline")
    ap.add_argument("--repeats", type=int, default=3, help="runs per program (the median is shown)")
    args = ap.parse_args()
    cases = [(p, None) for p in args.programs] or DEFAULT_PROGRAMS
    print(f"{'program':<44} {'size':>8} {'ops':>7} {'nodes':>11} {'pipeline':>9} {'process':>8} "
          f"{'peak RSS':>9} {'XLA compile':>12} {'ratio':>6}")
    for program, system in cases:
        path, n_dev = program_file(program)
        if system is None:
            system = f"ring:{n_dev}x150" if n_dev > 1 else "none"
        if system and not system.startswith(("ring:", "switch:", "fc:", "none")):
            system = str(SHARED / "hespas-configs" / "systems" / system)
        runs = []
        for _ in range(args.repeats):
            out, proc_wall = run([sys.executable, "-c", CHILD, program, system if system != "none" else ""],
                                 timeout=600)
            rec = json.loads(out.strip().splitlines()[-1])
            rec["process_s"] = proc_wall
            runs.append(rec)
        runs.sort(key=lambda r: r["pipeline_s"])
        rec = runs[len(runs) // 2]
        xla = "-"
        ratio = "-"
        if not args.no_xla:
            try:
                out, _ = run([sys.executable, "-c", XLA_CHILD, str(path), str(n_dev)], timeout=900)
                xla_s = float(out.strip().splitlines()[-1])
                xla, ratio = f"{xla_s:.2f} s", f"{xla_s / rec['pipeline_s']:.1f}x"
            except (SystemExit, subprocess.TimeoutExpired) as exc:
                xla = f"failed ({str(exc)[:20]})"
        size = path.stat().st_size
        name = (program if len(program) <= 44 else "…" + program[-43:])
        print(f"{name:<44} {size / 1e6:>6.2f}MB {rec['ops']:>7} {rec['n_comp_nodes']:>5}+{rec['n_comm_nodes']:<5}"
              f" {rec['pipeline_s']:>8.2f}s {rec['process_s']:>7.2f}s {rec['maxrss_mb']:>7.0f}MB {xla:>12} {ratio:>6}")
        stages = ", ".join(f"{k} {v:.3f}s" for k, v in rec["timings"].items() if k != "total")
        print(f"    stages: {stages}; python+imports {rec['import_s']:.2f}s; "
              f"step time {rec['step_time_s'] * 1e3:.3f} ms on {rec['n_devices']} devices")
    print("pipeline = ingest+split+roofline+traces+embedded replay in-process; process = the same plus Python "
          "start-up and imports; ratio = XLA compile time / pipeline time (higher is better for us)")


if __name__ == "__main__":
    main()
