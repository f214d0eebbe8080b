"""hespas-ml beside STAGE (the symbolic tensor graph generator of Chakra traces) on the configurations
STAGE's README documents: per-rank trace sizes, the step time the traces replay to, and each tool's own
wall time, measured in the same run on this machine.

    python eval/eval_stage.py --stage DIR [--stage-python PY] [--only NAME…] [--work DIR] [--json out.json]

``--stage`` is a checkout of STAGE made outside this project (never part of it), run with ``--stage-python``
(an interpreter with STAGE's own dependencies: numpy, sympy, graphviz, protobuf, pandas, tqdm). Without
``--stage`` the script says so and stops.

Both tools get the same workload: STAGE's default Llama (80 layers, d_model 8192, 64 heads with 8 key/value
heads, ffn 28672, vocabulary 32000, sequence 1024, batch 64, one microbatch per data-parallel rank, tensor
parallelism with sequence parallelism, no recomputation) under each README layout, and hespas-ml's zoo
``llama`` with the same sizes and layout (bf16, SGD). STAGE's traces carry FLOPs and tensor sizes for
ASTRA-sim's roofline mode, so they are replayed with the embedded replay in that mode (the target's peak
and memory bandwidth in system.json); hespas-ml's carry the roofline times of its fusion split. Both replay
on one flat switch of the layout's device count, so where each tool places its groups does not matter.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hespas_ml.label.targets import load_target  # noqa: E402
from hespas_ml.pipeline import simulate  # noqa: E402
from hespas_ml.replay import replay  # noqa: E402
from hespas_ml.replay.system import load_comm_groups, load_system  # noqa: E402

MODEL = {"layers": 80, "d_model": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672, "vocab": 32000, "seq": 1024,
         "batch": 64}

CONFIGS = (
    # name, STAGE's layout flags (its README's example commands), the same layout as a zoo mesh
    ("dp8-tp4-pp4", {"dp": 8, "tp": 4, "pp": 4, "sp": 1, "weight_sharded": 0}, "pp:4,dp:8,tp:4"),
    ("fsdp64", {"dp": 64, "tp": 1, "pp": 1, "sp": 1, "weight_sharded": 1}, "fsdp:64"),
    ("fsdp4-tp4-pp2-cp2", {"dp": 4, "tp": 4, "pp": 2, "sp": 2, "weight_sharded": 1}, "pp:2,fsdp:4,cp:2,tp:4"),
)
TARGET = "H100"
LINK_GBPS = 100


def devices(layout: dict[str, int]) -> int:
    return layout["dp"] * layout["tp"] * layout["pp"] * layout["sp"]


def zoo_spec(layout: dict[str, int], mesh: str) -> str:
    shards = layout["dp"]                   # STAGE's dp is FSDP when weight_sharded
    params = {**MODEL, "dtype": "bf16", "step": "train", "optimizer": "sgd", "mesh": mesh, "devices": devices(layout),
              "microbatch": MODEL["batch"] // shards, "scan": "true"}
    if layout["tp"] > 1:
        params["sp"] = "true"
    return "zoo:llama?" + "&".join(f"{k}={v}" for k, v in params.items())


def run_stage(stage: Path, python: str, layout: dict[str, int], out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [python, "main.py", "--output_dir", f"{out}/", "--output_name", "workload.%d.et",
           "--chakra_schema_version", "v0.0.4", "--dvocal", str(MODEL["vocab"]), "--dmodel", str(MODEL["d_model"]),
           "--dff", str(MODEL["ffn"]), "--batch", str(MODEL["batch"]), "--seq", str(MODEL["seq"]),
           "--head", str(MODEL["heads"]), "--kvhead", str(MODEL["kv_heads"]), "--num_stacks", str(MODEL["layers"]),
           *[x for k, v in layout.items() for x in (f"--{k}", str(v))]]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=stage, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:300], "wall_s": wall}
    sizes = [p.stat().st_size for p in out.glob("workload.*.et")]
    return {"wall_s": wall, "ranks": len(sizes), "trace_bytes_per_rank": sum(sizes) / max(1, len(sizes)),
            "trace_files": len(sizes)}


def replay_stage(out: Path, n: int) -> dict:
    target = load_target(TARGET)
    cfg = load_system(f"switch:{n}x{LINK_GBPS}", local_mem_bw_gbps=target.mem_bw / 1e9)
    cfg.system["roofline-enabled"] = 1
    cfg.system["peak-perf"] = target.peak_flops("bf16", "matrix") / 1e12
    groups = load_comm_groups(out / "workload.json", n) if (out / "workload.json").exists() else None
    t0 = time.perf_counter()
    res = replay(out / "workload", cfg, groups, backend="embedded")
    return {"step_s": res.step_time_s, "exposed_comm_s": res.exposed_comm_s, "replay_s": time.perf_counter() - t0}


def run_ours(spec: str, n: int, out: Path) -> dict:
    t0 = time.perf_counter()
    res = simulate(spec, TARGET, f"switch:{n}x{LINK_GBPS}", out=out)
    wall = time.perf_counter() - t0
    files = list((out / "et").glob("*.et"))
    sizes = [p.stat().st_size for p in files]
    return {"wall_s": wall, "step_s": res.step_time_s, "exposed_comm_s": res.exposed_comm_s,
            "trace_bytes_per_rank": sum(sizes) / max(1, len(sizes)), "trace_files": len(sizes),
            "nodes_per_rank": res.n_comp_nodes + res.n_comm_nodes, "peak_memory_bytes": res.peak_memory_bytes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stage", type=Path, help="a STAGE checkout (outside this project)")
    ap.add_argument("--stage-python", default=sys.executable, help="the interpreter that runs STAGE")
    ap.add_argument("--only", nargs="+", help="configurations whose name contains one of these")
    ap.add_argument("--work", type=Path, help="where both tools write their traces (default: a temporary folder)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.stage is None or not (args.stage / "main.py").is_file():
        print(f"error: --stage must name a STAGE checkout with main.py (got {args.stage})", file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="stage-vs-hespas-"))
    rows = []
    print(f"{'layout':<20}{'tool':<11}{'wall':>9}{'trace/rank':>12}{'files':>7}{'step time':>12}{'exposed':>10}")
    for name, layout, mesh in CONFIGS:
        if args.only and not any(o in name for o in args.only):
            continue
        n = devices(layout)
        stage = run_stage(args.stage, args.stage_python, layout, work / "stage" / name)
        if "error" not in stage:
            stage.update(replay_stage(work / "stage" / name, n))
        ours = run_ours(zoo_spec(layout, mesh), n, work / "hespas" / name)
        rows.append({"name": name, "devices": n, "stage_layout": layout, "mesh": mesh, "stage": stage, "hespas": ours})
        for tool, r in (("STAGE", stage), ("hespas-ml", ours)):
            if "error" in r:
                print(f"{name:<20}{tool:<11} failed: {r['error']}")
                continue
            print(f"{name:<20}{tool:<11}{r['wall_s']:8.1f}s{r['trace_bytes_per_rank'] / 1024:10.0f}KB"
                  f"{r['trace_files']:>7}{r['step_s'] * 1e3:10.1f}ms{r['exposed_comm_s'] * 1e3:8.1f}ms", flush=True)
    print(f"\n{TARGET}, one switch at {LINK_GBPS} GB/s per device; traces under {work}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
