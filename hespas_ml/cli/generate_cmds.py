"""``generate traces``: synthetic Chakra traces that follow the statistics of given ones."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from ..units import format_bytes, format_seconds


def register(sub) -> None:
    p = sub.add_parser("generate", help="synthetic workloads: traces that follow given ones",
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
