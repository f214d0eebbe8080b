"""``simulate``, ``analyze`` and ``replay``: the pipeline's commands."""
from __future__ import annotations

import json
import sys

from ..label.targets import load_target
from ..split.regions import SPLITS
from ..units import format_bytes, format_seconds

MANY_RANKS = 64       # from this many devices simulate says whether the replay used the ranks' symmetry


def register(sub) -> None:
    p = sub.add_parser("simulate", help="program -> regions -> labels -> Chakra traces -> replayed step time",
                       description="Simulate one step of a StableHLO program on a system of accelerators.")
    p.add_argument("program", help="a .mlir file (text or bytecode) or a zoo spec such as zoo:mlp?layers=4")
    p.add_argument("--target", default="H100", help="hardware target preset or YAML file (default: H100)")
    p.add_argument("--system", help="ASTRA-sim system folder, or a spec such as ring:4x150 or "
                                    "switch:8x400,ring:4x50 (npus x GB/s per dimension); "
                                    "may be left out for a one-device program")
    p.add_argument("--fidelity", default="roofline", help="how compute regions are timed (default: roofline)")
    p.add_argument("--split", default="fusion", choices=SPLITS,
                   help="how the program is cut into compute regions (default: fusion)")
    p.add_argument("--fallback", default="auto", choices=["auto", "labeller", "roofline", "off"],
                   help="with --fidelity surrogate:…, who answers regions outside what the model learned: "
                        "its labeller where it runs here, else the calibrated roofline where the target has one, "
                        "else the roofline (auto, the default); the labeller; "
                        "the roofline; or the surrogate itself with a widened interval (off)")
    p.add_argument("--replay", default="auto", choices=["auto", "embedded", "astra-sim"],
                   help="network replay: the real ASTRA-sim binary if found (auto), or our embedded one")
    p.add_argument("--astra-sim-bin", help="path to AstraSim_Analytical_Congestion_Unaware (or _Aware)")
    p.add_argument("--out", help="keep Chakra traces, comm_group.json, the system files, regions.csv and a timeline "
                                 "picture (timeline.png) here")
    p.add_argument("--top", type=int, default=10, help="how many of the most expensive regions to list")
    p.add_argument("--pipeline", default="lockstep", choices=["lockstep", "stages"],
                   help="a pipelined zoo step (mesh=pp:P,…): one SPMD program whose stages run in lock-step "
                        "(lockstep, the default), or each stage's own programs replayed in its schedule's order "
                        "(stages: pp, dp, fsdp and tp meshes)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("analyze", help="op statistics, FLOPs, bytes and unmodelled ops of a program",
                       description="Count the ops of a program and its FLOPs and bytes per device.")
    p.add_argument("program", help="a .mlir file or a zoo spec")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_analyze)

    p = sub.add_parser("replay", help="replay existing Chakra traces (<prefix>.<rank>.et) on a system",
                       description="Replay Chakra execution traces with ASTRA-sim's analytical network model.")
    p.add_argument("prefix", help="trace path prefix (<prefix>.0.et, <prefix>.1.et, … must exist), or a folder "
                                  "holding one set of traces (simulate --out's et/)")
    p.add_argument("--system", required=True, help="ASTRA-sim system folder or a spec such as ring:4x150")
    p.add_argument("--comm-group", help="communicator-group JSON (comm_group.json)")
    p.add_argument("--replay", default="auto", choices=["auto", "embedded", "astra-sim"])
    p.add_argument("--astra-sim-bin", help="path to an ASTRA-sim analytical binary")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("host-cpu", help="this machine's host-cpu target: its measured rates, or measure them again",
                       description="Show the host-cpu target (this machine's rates, measured once through XLA and "
                                   "cached), or re-measure it: a measurement taken while the machine was busy "
                                   "reads low, and profiling surrogates compare machines by these rates.")
    p.add_argument("--measure", action="store_true", help="measure again now (run it on a quiet machine)")
    p.add_argument("--steadiness", action="store_true",
                   help="also check how well timings repeat here (the profiling labeller's floor; run it "
                        "before a long profiling build)")
    p.add_argument("--seconds", type=float, default=20.0, help="length of the steadiness check (default 20)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_host_cpu)


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def cmd_simulate(args) -> int:
    from ..pipeline import simulate

    if args.pipeline == "stages":
        return _simulate_stages(args)

    from ..fidelities import surrogate_model

    learned = surrogate_model(args.fidelity) is not None
    progress = not args.json and sys.stderr.isatty()
    res = simulate(args.program, target=args.target, system=args.system, fidelity=args.fidelity,
                   split=args.split, replay=args.replay, astra_sim_bin=args.astra_sim_bin, out=args.out,
                   fidelity_options={"fallback": args.fallback, "progress": progress} if learned else None,
                   progress=progress)
    if args.json:
        print(json.dumps(res.to_dict(top=args.top), indent=2))
        return 0
    w = sys.stdout.write
    w(f"program       {res.program}  ({res.n_devices} device{'s' if res.n_devices > 1 else ''})\n")
    w(f"target        {res.target}   fidelity {res.fidelity} ({res.split} split)\n")
    if res.fidelity == "calibrated-roofline":
        cal = load_target(args.target).calibration
        rates = " / ".join(f"{100 * e:.0f} % ({d})" for d, e in cal.matrix_efficiency.items())
        floors = "".join(f", a {kind.replace('_general', '')} at least {format_seconds(s)}"
                         for kind, s in cal.kernel_floor_s.items())
        w(f"calibrated    matrix at {rates} of peak, memory at {100 * cal.memory_efficiency:.0f} % of its bandwidth, "
          f"{format_seconds(cal.kernel_overhead_s)} per kernel{floors}: measured on {cal.measured_on} ({cal.source})\n")
    how = ""
    if res.n_devices >= MANY_RANKS:              # at scale, say whether the replay could use the symmetry
        how = ("   (ranks alike: one rank simulated for all)" if res.replay_engine in ("fast", "symmetric") else
               "   (ranks differ: every rank simulated)" if res.replay_engine == "full" else "")
    w(f"system        {res.system}   replay {res.replay}{how}\n")
    interval = res.step_time_interval_s
    w(f"step time     {format_seconds(res.step_time_s)}"
      + (f"   (interval {format_seconds(interval[0])} .. {format_seconds(interval[1])})" if interval else "") + "\n")
    if res.seen_in_training:
        w("learned       the model learned this program's regions: its figures for it are not out of sample\n")
    w(f"compute time  {format_seconds(res.compute_time_s)}   ({_si(res.flops, 'FLOP')}; "
      f"{_si(res.kernel_bytes, 'B')} moved by the {res.split} split's kernels, {_si(res.bytes, 'B')} op by op; "
      f"per device)\n")
    w(f"exposed comm  {format_seconds(res.exposed_comm_s)}\n")
    if res.pipeline_bubble:
        w(f"pipeline      bubble {res.pipeline_bubble:.1%} of the ticks: a stage idles, its lock-step program "
          "running its work on nothing (in the step time)\n")
    m = res.memory
    held = [(m[k], k.replace("_", " ")) for k in ("parameters", "optimizer_state", "batch") if k in m] \
        or [(m["arguments"], "arguments")]
    w(f"memory        {format_bytes(res.peak_memory_bytes)} at the peak per device "
      f"({', '.join(f'{format_bytes(v)} {what}' for v, what in held)}, "
      f"{format_bytes(m['intermediates'] + m['collective_buffers'])} intermediates, {format_bytes(m['outputs'])} "
      f"outputs); "
      f"{'fits' if res.fits else 'does NOT fit'} in {res.target}'s {format_bytes(res.memory_capacity_bytes)}\n")
    w(f"nodes         {res.n_comp_nodes} compute, {res.n_comm_nodes} communication (per device)\n")
    top = res.top_regions(args.top)
    if top:
        w(f"\nmost expensive compute regions (of {sum(1 for r in res.regions if r.kind == 'compute')}):\n")
        w(f"  {'region':>7}  {'ops':<34} {'count':>5}  {'time/exec':>10}  {'total':>10}  {'share':>6}  bound\n")
        total = max(res.compute_time_s, 1e-30)
        for r in top:
            w(f"  {r.id:>7}  {r.name[:34]:<34} {r.count:>5}  {format_seconds(r.seconds):>10}  {format_seconds(r.total_seconds):>10}"
              f"  {100 * r.total_seconds / total:5.1f}%  {r.bound}\n")
    if res.unmodelled:
        w("\nunmodelled ops: " + ", ".join(f"{k} x{v}" for k, v in sorted(res.unmodelled.items())) + "\n")
    for msg in res.warnings:
        print(f"warning: {msg}", file=sys.stderr)
    if res.out_dir:
        w(f"\ntraces, system files, regions.csv and timeline.png written to {res.out_dir}\n")
    return 0


def _simulate_stages(args) -> int:
    from ..pipeline_stages import simulate_stages

    res = simulate_stages(args.program, args.target, args.system, fidelity=args.fidelity, split=args.split,
                          replay_backend=args.replay, out=args.out, progress=not args.json and sys.stderr.isatty())
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
        return 0
    w = sys.stdout.write
    split = f" (dp {res.replicas // res.fsdp} x fsdp {res.fsdp})" if res.fsdp > 1 else ""
    w(f"program       {res.program}  ({res.stages} stages x {res.replicas} replica{'s' if res.replicas > 1 else ''}"
      f"{split}{f' x tp {res.tp}' if res.tp > 1 else ''})\n")
    w(f"target        {res.target}   fidelity {res.fidelity} ({res.split} split), each stage's own programs\n")
    w(f"system        {res.system}   replay {res.replay_engine}\n")
    w(f"schedule      {res.schedule}: {res.microbatches} microbatches a replica, {res.chunks} chunk"
      f"{'s' if res.chunks > 1 else ''} a stage"
      + (f"; optimizer state sharded over the {res.optimizer_shards} replicas" if res.optimizer_shards > 1 else "")
      + "\n")
    w(f"step time     {format_seconds(res.step_time_s)}   (the busiest stage idle {res.bubble:.1%} of it)\n")
    for s, (busy, idle, flight, mem) in enumerate(zip(res.busy_s, res.idle, res.in_flight, res.memory)):
        w(f"{'stages' if s == 0 else '':<14}stage {s}: busy {format_seconds(busy)} (idle {idle:.1%}), "
          f"{flight} unit{'s' if flight != 1 else ''} in flight, {format_bytes(mem['peak'])} at the peak\n")
    fullest = max(res.memory, key=lambda m: m["peak"])
    w(f"memory        {format_bytes(res.peak_memory_bytes)} at the peak on the fullest stage ("
      + ", ".join(f"{format_bytes(v)} {k.replace('_', ' ')}" for k, v in fullest.items() if k != "peak" and v)
      + f"); {'fits' if res.fits else 'does NOT fit'} in {res.target}'s {format_bytes(res.memory_capacity_bytes)}\n")
    w("units         " + ", ".join(f"{spec.rsplit('role=', 1)[-1].split('&')[0]} {format_seconds(t)}"
                                   for spec, t in res.units.items()) + "\n")
    for msg in res.warnings:
        print(f"warning: {msg}", file=sys.stderr)
    if args.out:
        w(f"\ntraces ({res.replay_engine}), comm_group.json, the system files, result.json and timeline.png "
          f"written to {args.out}\n")
    return 0


def cmd_analyze(args) -> int:
    from .. import pipeline
    from ..costs import graph_cost

    graph = pipeline.ingest(args.program)
    totals = graph_cost(graph)
    rg = pipeline.split(graph, "fusion")
    fused_bytes = sum(r.bytes * r.count for r in rg.compute_regions())
    collectives: dict[str, dict[str, float]] = {}
    for r in rg.collectives():
        c = collectives.setdefault(r.collective.kind, {"count": 0, "bytes": 0})
        c["count"] += r.count
        c["bytes"] += r.collective.comm_bytes * r.count
    ops = dict(sorted(graph.op_counts().items(), key=lambda kv: -kv[1]))
    out = {
        "program": graph.source or graph.name, "n_devices": graph.n_devices, "per_device": True,
        "flops": totals["flops"], "transcendentals": totals["transcendentals"], "bytes": totals["bytes"],
        "bytes_fused": fused_bytes, "ops": ops, "unmodelled": totals["unmodelled"],
        "collectives": collectives, "n_kernels": len(rg.compute_regions()),
        "loops": [{"trip_count": lp.trip_count, "derived": lp.derived} for lp in graph.loops],
        "warnings": graph.warnings,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    w = sys.stdout.write
    w(f"program      {out['program']}  ({graph.n_devices} device{'s' if graph.n_devices > 1 else ''})\n")
    w(f"FLOPs        {_si(out['flops'], 'FLOP')} per device ({_si(out['transcendentals'], '')} transcendental)\n")
    w(f"bytes        {_si(out['bytes'], 'B')} op by op, {_si(fused_bytes, 'B')} at fusion boundaries "
      f"({out['n_kernels']} kernels)\n")
    w(f"ops          {sum(ops.values())} executions of {len(ops)} kinds\n")
    for name, n in list(ops.items())[:25]:
        w(f"  {name:<28} {n:>8}\n")
    if len(ops) > 25:
        w(f"  … {len(ops) - 25} more kinds (--json lists all)\n")
    if collectives:
        w("collectives\n")
        for k, c in collectives.items():
            w(f"  {k:<28} {int(c['count']):>8}  {_si(c['bytes'], 'B')}\n")
    if out["unmodelled"]:
        w("unmodelled   " + ", ".join(f"{k} x{v}" for k, v in out["unmodelled"].items()) + "\n")
    else:
        w("unmodelled   none\n")
    for msg in graph.warnings:
        print(f"warning: {msg}", file=sys.stderr)
    return 0


def cmd_replay(args) -> int:
    from ..replay import replay, trace_prefix
    from ..replay.system import load_comm_groups, load_system

    cfg = load_system(args.system)
    groups = load_comm_groups(args.comm_group) if args.comm_group else None
    prefix = trace_prefix(args.prefix)
    res = replay(prefix, cfg, groups, backend=args.replay, binary=args.astra_sim_bin)
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
        return 0
    w = sys.stdout.write
    w(f"traces        {prefix}.<0..{len(res.ranks) - 1}>.et\n")
    w(f"system        {cfg.source}   replay {res.backend}\n")
    w(f"step time     {format_seconds(res.step_time_s)}\n")
    w(f"exposed comm  {format_seconds(res.exposed_comm_s)} (on the rank that finishes last)\n")
    w(f"\n  {'rank':>5}  {'finish':>12}  {'exposed comm':>12}  {'compute':>12}  {'comm':>12}\n")
    for r in res.ranks:
        w(f"  {r.rank:>5}  {format_seconds(r.finish_ns * 1e-9):>12}  {format_seconds(r.exposed_comm_ns * 1e-9):>12}  "
          f"{format_seconds(r.gpu_ns * 1e-9):>12}  {format_seconds(r.comm_ns * 1e-9):>12}\n")
    return 0


def cmd_host_cpu(args) -> int:
    from ..label.targets import host_cpu_cache_path, measure_host_cpu

    target = measure_host_cpu(force=args.measure)
    m = dict(target.measured)
    path = host_cpu_cache_path()
    steadiness = None
    if args.steadiness:
        from ..label.steadiness import check_steadiness

        steadiness = check_steadiness(args.seconds, progress=not args.json and sys.stdout.isatty())
    if args.json:
        print(json.dumps({"cache": str(path) if m else None, "matrix_flops": target.matrix_flops,
                          "vector_flops": target.vector_flops, "mem_bw": target.mem_bw, "measured": m,
                          **({"steadiness": steadiness.to_dict()} if steadiness else {})}, indent=2))
        return 0 if steadiness is None or steadiness.steady else 1
    if not m:
        print(f"host-cpu: not measured (the measurement failed); fallback values of {target.name}")
    else:
        load = m.get("load_average")
        print(f"host-cpu: {m.get('cpu_model')}, {m.get('cores')} cores, jax {m.get('jax_version')}; measured "
              f"{m.get('measured_at')}" + (f" at a 1-minute load of {load:.2f}" if load is not None else ""))
    rates = ", ".join(f"{dtype} matrix {_si(v, 'FLOP/s')}" for dtype, v in sorted(target.matrix_flops.items()))
    print(f"  {rates}, f32 vector {_si(target.vector_flops.get('f32', 0.0), 'FLOP/s')}, "
          f"memory {_si(target.mem_bw, 'B/s')}")
    if m:
        print(f"  cached in {path}" + ("" if args.measure else " (measure again: hespas-ml host-cpu --measure)"))
    if steadiness is not None:
        print(steadiness.summary())
        return 0 if steadiness.steady else 1
    return 0
