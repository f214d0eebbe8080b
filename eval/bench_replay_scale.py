"""Benchmark: replaying one data-parallel step on every rank of the 1,024-GPU Hespas system.

The per-device trace of a ResNet-50 step split for 4 devices (``zoo:resnet?depth=50&…&parallel=dp``, the
fusion split, A100-40GB roofline times) is given to each of the 1,024 ranks of
``../shared/hespas-configs/systems/A100_SXM_40GB_8GPU_32_4`` (switches of 8, 32 and 4), its all-reduces over
all ranks. Prints, for the training step (gradient all-reduces) and the inference step (no collective):
the embedded replay as ``replay_embedded`` chooses its engine (``auto``), the fast replay the sweeps use,
and, as the baseline measured in the same run, the full engine that simulates every rank (for the
inference step, what ``auto`` chose before it counted every rank's nodes; for the training step only with
``--full``: it takes minutes). Step times must agree to the nanosecond; peak memory is the process's.

With ``--llama-ranks N`` (a multiple of 8) it also times a data-parallel Llama training step on N ranks
(``switch:8x450,switch:<N/8>x50``): ``replay()``'s path (the fast replay) against the embedded replay's
symmetric engine, in the same run. With ``--mesh70b MESH`` (e.g. ``dp:256,tp:8``) it times every stage of a
Llama-3-70B-shaped training step (80 layers, scanned, bf16, 4,096 tokens per sequence, one sequence per data
parallel rank) on that mesh's devices, and its replay against the symmetric engine's. A mesh with ``pp``
gives the issue's pipelined step instead (8,192 tokens per sequence, 16 sequences per data-parallel rank in
microbatches of one, full recomputation), checked against the full engine (every rank) up to 256 ranks.

    python eval/bench_replay_scale.py [--full] [--repeat 3] [--llama-ranks 4096] [--mesh70b dp:256,tp:8]
    python eval/bench_replay_scale.py --mesh70b pp:16,dp:128,tp:8 --mesh70b pp:4,dp:2,tp:8
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hespas_ml import pipeline  # noqa: E402
from hespas_ml.replay import load_system  # noqa: E402
from hespas_ml.replay.embedded import replay_embedded  # noqa: E402
from hespas_ml.replay.fast import SystemContext, replay_fast  # noqa: E402

SYSTEM = (Path(__file__).resolve().parents[2] / "shared" / "hespas-configs" / "systems"
          / "A100_SXM_40GB_8GPU_32_4")
PROGRAM = "zoo:resnet?depth=50&batch=32&step={step}&parallel=dp&devices=4"
LLAMA = ("zoo:llama?layers=4&d_model=512&heads=8&vocab=4096&seq=256&batch={n}&step=train&parallel=dp&devices={n}"
         "&scan=true&dtype=bf16")


def rank_trace(step: str):
    q = pipeline.Question.resolve(PROGRAM.format(step=step), "A100-40GB", "ring:4x100")
    regions = pipeline.split(pipeline.ingest(q.program, q.system), q.split)
    times = pipeline.label(regions, q.fidelity, q.target)
    return pipeline.trace(regions, times).point.traces[0]


def peak_mb() -> float:
    """The process's peak memory so far (max RSS), MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(fn, repeat: int):
    best, result = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t)
    return best, result


def llama_figures(n: int) -> None:
    from hespas_ml.replay import replay

    q = pipeline.Question.resolve(LLAMA.format(n=n), "H100", f"switch:8x450,switch:{n // 8}x50")
    regions = pipeline.split(pipeline.ingest(q.program, q.system), q.split)
    traces = pipeline.trace(regions, pipeline.label(regions, q.fidelity, q.target)).point
    print(f"data-parallel Llama step on {n} ranks ({q.system.source}), {len(traces.traces[0])} nodes per rank")
    results = []
    for name, fn in (("replay()", lambda: replay(traces.traces, q.system, traces.comm_groups or None)),
                     ("embedded, symmetric (baseline)", lambda: replay_embedded(traces.traces, q.system,
                                                                                traces.comm_groups or None))):
        seconds, res = timed(fn, 1)
        results.append([(r.finish_ns, r.exposed_comm_ns) for r in res.ranks])
        print(f"  {name:<31} {seconds:8.2f} s   engine {res.details.get('engine')}   step {res.step_time_s * 1e3:.6f} ms")
    print(f"  every rank's finish and exposed time equal: {'yes' if results[0] == results[1] else 'NO'}\n")


LLAMA_70B = ("zoo:llama?layers=80&d_model=8192&heads=64&kv_heads=8&ffn=28672&vocab=128256&seq=4096&batch={batch}"
             "&step=train&mesh={mesh}&devices={n}&dtype=bf16&scan=true")


LLAMA_70B_PIPELINE = ("zoo:llama?layers=80&d_model=8192&heads=64&kv_heads=8&ffn=28672&vocab=128256&seq=8192"
                      "&batch={batch}&microbatch=1&dtype=bf16&step=train&remat=full&mesh={mesh}&devices={n}")
FULL_ENGINE_RANKS = 256          # up to this many ranks a pipeline's replay is checked against every rank's


def mesh_figures(mesh: str) -> None:
    from math import prod
    sizes = {k: int(v) for k, v in (part.split(":") for part in mesh.split(","))}
    n = prod(sizes.values())
    if sizes.get("pp", 1) > 1:      # the 70B step: 16 sequences per data-parallel rank, microbatches of 1
        spec = LLAMA_70B_PIPELINE.format(batch=16 * sizes.get("dp", 1) * sizes.get("fsdp", 1), mesh=mesh, n=n)
    else:
        spec = LLAMA_70B.format(batch=sizes.get("dp", 1) * sizes.get("fsdp", 1), mesh=mesh, n=n)
    t = time.perf_counter()
    q = pipeline.Question.resolve(spec, "H100", f"switch:8x450,switch:{n // 8}x50")
    stages = {"resolve": time.perf_counter() - t}
    t = time.perf_counter()
    graph = pipeline.ingest(q.program, q.system)
    stages["ingest"] = time.perf_counter() - t          # the export is cached after a first run
    t = time.perf_counter()
    regions = pipeline.split(graph, q.split)
    stages["split"] = time.perf_counter() - t
    t = time.perf_counter()
    times = pipeline.label(regions, q.fidelity, q.target)
    stages["label"] = time.perf_counter() - t
    t = time.perf_counter()
    traces = pipeline.trace(regions, times)
    stages["trace"] = time.perf_counter() - t
    t = time.perf_counter()
    step = pipeline.replay(traces, q.system, "embedded")
    stages["replay"] = time.perf_counter() - t
    print(f"Llama-3-70B-shaped training step on {mesh} ({n} ranks, {q.system.source}), "
          f"{len(traces.point.traces[0])} nodes per rank")
    print("  " + "   ".join(f"{k} {v:.2f} s" for k, v in stages.items()) + f"   engine {step.engine}"
          f"   step {step.step_time_s:.4f} s   peak memory {peak_mb():.0f} MB")
    if sizes.get("pp", 1) > 1:      # send/recv: the symmetric engine does not apply, the full engine does
        if n > FULL_ENGINE_RANKS:
            print(f"  (the full engine is run up to {FULL_ENGINE_RANKS} ranks: e.g. --mesh70b pp:4,dp:2,tp:8)\n")
            return
        engine, name = "full", "full, every rank"
    else:
        engine, name = "symmetric", "symmetric"
    seconds, ref = timed(lambda: replay_embedded(traces.point.traces, q.system, traces.point.comm_groups or None,
                                                 engine=engine), 1)
    same = [(r.finish_ns, r.exposed_comm_ns) for r in ref.ranks] == \
           [(r.finish_ns, r.exposed_comm_ns) for r in step.result.ranks]
    print(f"  embedded, {name} (baseline) {seconds:.2f} s   step {ref.step_time_s * 1e3:.6f} ms; replay() "
          f"{step.step_time_s * 1e3:.6f} ms; every rank's finish and exposed time equal: {'yes' if same else 'NO'}\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="also time the full engine on the training step (minutes)")
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs (default 3; the full engine once)")
    ap.add_argument("--llama-ranks", type=int, default=0, help="also a data-parallel Llama step on this many ranks")
    ap.add_argument("--mesh70b", metavar="MESH", action="append", default=[],
                    help="also every stage of a 70B-shaped Llama step on this mesh (repeatable)")
    args = ap.parse_args()
    if args.llama_ranks:
        llama_figures(args.llama_ranks)
    for mesh in args.mesh70b:
        mesh_figures(mesh)
    system = load_system(SYSTEM)
    print(f"system {SYSTEM.name}: {system.n_npus} ranks")
    for step in ("train", "infer"):
        trace = rank_trace(step)
        traces = [list(trace) for _ in range(system.n_npus)]
        comm = sum(1 for n in trace if n.type != 4)
        print(f"\nResNet-50 {step} step, data parallel: {len(trace)} nodes per rank ({comm} communication)")
        rows = [("embedded, auto", lambda: replay_embedded(traces, system), args.repeat),
                ("fast replay", lambda: replay_fast(traces, SystemContext(system), None), args.repeat)]
        if step == "infer" or args.full:
            rows.append(("embedded, full (baseline)", lambda: replay_embedded(traces, system, engine="full"), 1))
        steps = set()
        for name, fn, repeat in rows:
            seconds, res = timed(fn, repeat)
            steps.add(max(r.finish_ns for r in res.ranks))
            print(f"  {name:<27} {seconds:8.3f} s   engine {res.details.get('engine')}   step {res.step_time_s * 1e3:.6f} ms")
        print(f"  same step time to the nanosecond: {'yes' if len(steps) == 1 else 'NO: ' + str(sorted(steps))}")
    print(f"\npeak memory (max RSS) {peak_mb():.0f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
