"""``generate traces``: synthetic Chakra traces that follow the statistics of given ones; ``generate regions``
and ``generate programs``: synthetic StableHLO modules drawn from a generator fitted on a dataset's region
graphs."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from ..units import format_bytes, format_seconds


def register(sub) -> None:
    p = sub.add_parser("generate", help="synthetic workloads: traces and region programs like given ones",
                       description="Write synthetic workloads drawn from the statistics of real ones.")
    what = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    t = what.add_parser("traces", help="Chakra traces whose compute and communication follow given traces",
                        description="Fit the order of compute and collective nodes, their durations and sizes "
                                    "and their dependencies on one rank of the given traces, and draw new traces "
                                    "for every rank from them (hespas_ml.replay.synthetic).")
    t.add_argument("--like", required=True, help="the trace prefix to follow (<prefix>.<rank>.et), e.g. the "
                                                 "et/ folder's prefix that simulate --out writes")
    t.add_argument("--ranks", type=int, required=True, help="ranks to write traces for")
    t.add_argument("--out", required=True, help="folder to write: et/synthetic.<rank>.et, comm_group.json, "
                                                "synthetic.json (replaced as a whole)")
    t.add_argument("--seed", type=int, default=0, help="random seed: the same seed writes the same traces")
    t.add_argument("--nodes", type=int, help="nodes per rank (default: as many as the source's)")
    t.add_argument("--comm-group", help="the source's communicator groups (comm_group.json; default: the one "
                                        "beside its et/ folder, if any)")
    t.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    t.set_defaults(func=cmd_generate_traces)
    for what_kind in ("regions", "programs"):
        _generated(what, what_kind)
    k = what.add_parser("lookalike", help="a stand-in for a program one cannot share: same FLOPs, bytes, "
                                          "collective volume and step time on a target and system",
                        description="Write a synthetic module with the per-device FLOPs, kernel bytes, collective "
                                    "bytes and roofline step time of PROGRAM on TARGET and SYSTEM (a matrix product "
                                    "and an element-wise chain sized to carry its compute-bound and memory-bound "
                                    "kernels; one collective per kind and device groups for as many as it ran, "
                                    "moving what they moved, with as much of the compute beside them as hides the "
                                    "same communication; hespas_ml.use.lookalike), simulate both and say how far "
                                    "apart they are.")
    k.add_argument("program", help="a .mlir file or a zoo: spec")
    k.add_argument("--target", default="H100", help="the target it must match on (default H100)")
    k.add_argument("--system", help="the system it must match on, for a program of several devices (a folder or "
                                    "a spec such as switch:8x450,switch:4x50; default ring:Nx100)")
    k.add_argument("--out", required=True, help="the .mlir file to write")
    k.add_argument("--tolerance", type=float, default=0.05,
                   help="largest relative difference allowed in FLOPs, bytes and step time (default 0.05); "
                        "beyond it the command fails, after writing the module")
    k.add_argument("--json", action="store_true", help="print the comparison as one JSON object")
    k.set_defaults(func=cmd_generate_lookalike, out_is_file=True)


def cmd_generate_lookalike(args) -> int:
    from ..label.targets import load_target
    from ..learn.config import LearnError
    from ..replay import load_system
    from ..use.lookalike import make_lookalike

    if not 0 < args.tolerance < 1:
        raise LearnError(f"--tolerance: must be between 0 and 1, got {args.tolerance}")
    target = load_target(args.target)
    system = load_system(args.system, local_mem_bw_gbps=target.mem_bw / 1e9) if args.system else None
    text, report = make_lookalike(args.program, target, system)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    worst = max(abs(report[k]["error"]) for k in ("flops", "kernel_bytes", "comm_bytes", "step_time_s"))
    report.update(out=str(out), tolerance=args.tolerance, within=worst <= args.tolerance)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        w = sys.stdout.write
        on = f"{target.name}" + (f", {report['system']}" if report["devices"] > 1 else "")
        w(f"written       {out} (stands in for {args.program} on {on})\n\n")
        w(f"  {'per device':<24} {'program':>14} {'lookalike':>14} {'error':>8}\n")
        for key, label, fmt in (("flops", "FLOPs", lambda v: f"{v:.4g}"),
                                ("kernel_bytes", "bytes (kernels)", format_bytes),
                                ("comm_bytes", "bytes (collectives)", format_bytes),
                                ("step_time_s", "step time (roofline)", format_seconds)):
            r = report[key]
            w(f"  {label:<24} {fmt(r['program']):>14} {fmt(r['lookalike']):>14} {r['error']:>+8.2%}\n")
        if report["comm_bytes"]["program"]:
            e = report["exposed_comm_s"]
            w(f"  {'exposed communication':<24} {format_seconds(e['program']):>14} "
              f"{format_seconds(e['lookalike']):>14}   ({report['beside']:.0%} of the compute beside the "
              f"collectives)\n")
    if not report["within"]:
        print(f"hespas-ml: error: {out}: the lookalike is {worst:.1%} off, beyond --tolerance {args.tolerance}",
              file=sys.stderr)
        return 1
    return 0


def _generated(what, kind: str) -> None:
    if kind == "regions":
        r = what.add_parser("regions", help="StableHLO region programs drawn like a dataset's region graphs",
                            description="Fit a layerwise generator of region graphs (hespas_ml.learn.layer_dag) on "
                                        "a dataset's region graphs, draw graphs, give them shapes and element types "
                                        "by construction and write those that MLIR verifies and the pipeline "
                                        "ingests and splits as .mlir modules (hespas_ml.use.generate). A run that "
                                        "stops part-way resumes: graphs already in the folder's manifest are not "
                                        "drawn again.")
    else:
        r = what.add_parser("programs", help="whole StableHLO programs of generated region graphs",
                            description="As generate regions, but each program draws its size from the op counts "
                                        "of the dataset's programs and chains generated graphs until it is that "
                                        "large, each graph reading earlier graphs' results (one module each).")
    r.add_argument("--like", required=True, help="a dataset folder (graphs.parquet, regions.parquet"
                                                 + (", programs.parquet" if kind == "programs" else "")
                                                 + "), e.g. eval/device/plans/h100 or a folder dataset build wrote")
    r.add_argument("--n", type=int, required=True, help=f"{kind} to draw")
    r.add_argument("--out", required=True, help=f"folder for {kind[:-1]}-NNNNN.mlir, manifest.jsonl and the "
                                                "fitted generator (generator.pt)")
    r.add_argument("--seed", type=int, default=0, help="random seed: the same seed writes the same modules")
    r.add_argument("--families", help="only these families, comma-separated")
    r.add_argument("--exclude-families", help="leave these families out, comma-separated")
    r.add_argument("--generator", choices=("layerdag", "random"), default="layerdag",
                   help="layerdag: the learned layerwise generator (default); random: the baseline")
    r.add_argument("--epochs", type=int, default=6, help="layerdag: passes over the graphs when fitting")
    r.add_argument("--max-graphs", type=int, default=1500, help="fit on at most this many graphs (drawn by "
                                                                "--seed)")
    if kind == "programs":
        r.add_argument("--max-ops", type=int, default=2000, help="ops per program at most")
    r.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    r.set_defaults(func=cmd_generate_modules, kind=kind)


def _names(text: str | None) -> set[str] | None:
    return {x.strip() for x in text.split(",") if x.strip()} if text else None


def cmd_generate_modules(args) -> int:
    import numpy as np

    from ..learn.config import LearnError
    from ..units import progress_bar
    from ..use.generate import (RealGraphs, fit_generator, generate_programs, generate_regions, load_or_fit,
                                program_sizes, real_graphs)

    if args.n < 1:
        raise LearnError(f"--n: must be at least 1, got {args.n}")
    if args.epochs < 0 or args.max_graphs < 1:
        raise LearnError("--epochs must be at least 0 and --max-graphs at least 1")
    every = real_graphs(args.like)
    keep, drop = _names(args.families), _names(args.exclude_families)
    wanted = lambda f: (keep is None or f in keep) and (drop is None or f not in drop)  # noqa: E731
    graphs = every.only(wanted)
    if args.kind == "programs":
        if args.max_ops < 1:
            raise LearnError(f"--max-ops: must be at least 1, got {args.max_ops}")
        sizes = program_sizes(args.like, wanted)
    if not graphs.records:
        raise LearnError(f"{args.like}: no region graph of the families asked for "
                         f"(it has: {', '.join(sorted(set(every.families)))})")
    if len(graphs.records) > args.max_graphs:
        pick = np.random.default_rng(args.seed).choice(len(graphs.records), args.max_graphs, replace=False)
        graphs = RealGraphs([graphs.records[i] for i in pick], [graphs.families[i] for i in pick])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shown = not args.json and sys.stderr.isatty()
    if args.generator == "random":
        generator = fit_generator(graphs, "random", seed=args.seed)
    else:
        with progress_bar(args.epochs, "fitting", "epoch", shown) as bar:
            def step(epoch, epochs, nll):
                bar.update(1)
                bar.set_postfix(nll=f"{nll:.2f}")
            generator = load_or_fit(out / "generator.pt", graphs, progress=step, epochs=args.epochs,
                                    seed=args.seed)
    with progress_bar(args.n, "drawing", args.kind[:-1], shown) as bar:
        def drawn(done, total):
            bar.n = done
            bar.refresh()
        if args.kind == "programs":
            counts = generate_programs(generator, graphs, sizes, args.n, out, seed=args.seed,
                                       max_ops=args.max_ops, progress=drawn)
        else:
            counts = generate_regions(generator, graphs, args.n, out, seed=args.seed, progress=drawn)
    report = {"like": str(args.like), "graphs": len(graphs.records), "generator": args.generator,
              "seed": args.seed, **counts}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    w = sys.stdout.write
    w(f"fitted on     {len(graphs.records)} region graphs of {args.like} ({args.generator})\n")
    w(f"drawn         {counts['drawn']} {args.kind} (seed {args.seed}): {counts['valid']} valid, "
      f"{counts['invalid']} refused (manifest.jsonl says why)\n")
    w(f"written       {out}/{args.kind[:-1]}-NNNNN.mlir: {counts['regions']} distinct regions after the "
      f"fusion split\n")
    return 0


def cmd_generate_traces(args) -> int:
    from ..replay import chakra, trace_prefix
    from ..replay.synthetic import TraceModel, generate_traces, summary
    from ..replay.system import load_comm_groups, write_comm_groups

    prefix = trace_prefix(args.like)
    source = chakra.read_traces(prefix)
    group_file = Path(args.comm_group) if args.comm_group else Path(prefix).parent.parent / "comm_group.json"
    groups = load_comm_groups(group_file) if (args.comm_group or group_file.is_file()) else None
    model = TraceModel.fit(source, groups, source=str(prefix))
    traces, out_groups = generate_traces(model, args.ranks, seed=args.seed, nodes=args.nodes)
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    chakra.write_traces(tmp / "et" / "synthetic", traces)
    if out_groups:
        write_comm_groups(out_groups, tmp / "comm_group.json")
    report = {"source": str(prefix), "source_ranks": len(source), "ranks": args.ranks, "seed": args.seed,
              "fitted": model.summary(), "generated": summary(traces)}
    (tmp / "synthetic.json").write_text(json.dumps(report, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    w = sys.stdout.write
    w(f"source        {prefix}.<0..{len(source) - 1}>.et\n")
    w(f"written       {out / 'et' / 'synthetic'}.<0..{args.ranks - 1}>.et (seed {args.seed})"
      + (f", {out / 'comm_group.json'}" if out_groups else "") + "\n\n")
    w(f"  {'per rank':<14} {'source':>14} {'synthetic':>14}\n")
    fit, gen = report["fitted"], report["generated"]
    for key, label, fmt in (("nodes", "nodes", str), ("comp_nodes", "compute nodes", str),
                            ("coll_nodes", "collectives", str),
                            ("comp_us", "compute time", lambda v: format_seconds(v * 1e-6)),
                            ("comm_bytes", "collective bytes", format_bytes)):
        w(f"  {label:<14} {fmt(fit[key]):>14} {fmt(gen[key]):>14}\n")
    if fit["unmodelled"]:
        w(f"\nnot reproduced: {', '.join(f'{n} {k}' for k, n in fit['unmodelled'].items())}\n")
    return 0
