"""``layouts``: every pp × dp × fsdp × tp (× ep with experts) layout of a zoo program on N devices, timed and
ranked."""
from __future__ import annotations

import json
import sys

from ..split.regions import SPLITS
from ..units import format_bytes, format_seconds


def register(sub) -> None:
    p = sub.add_parser("layouts", help="rank every pp x dp x fsdp x tp (x ep with experts) layout of a zoo "
                                       "program on N devices",
                       description="Lay a zoo program out every way its family accepts on N devices (meshes "
                                   "pp:P,dp:D,fsdp:F,tp:T, and ep:E for a family with experts), leave out those "
                                   "that do not fit the target's memory, time the rest on one system and rank them.")
    p.add_argument("program", help="a zoo spec without devices, parallel or mesh, e.g. 'zoo:llama?layers=8&batch=64'")
    p.add_argument("--devices", type=int, required=True, help="devices the layouts span")
    p.add_argument("--system", required=True, help="a system of that many NPUs (a folder or a spec such as "
                                                    "switch:8x450,switch:4x50)")
    p.add_argument("--target", default="H100", help="hardware target preset or YAML file (default: H100)")
    p.add_argument("--fidelity", default="roofline", help="how compute regions are timed (default: roofline)")
    p.add_argument("--split", default="fusion", choices=SPLITS,
                   help="how each program is cut into compute regions (default: fusion; merged goes with "
                        "--fidelity calibrated-roofline)")
    p.add_argument("--replay", default="auto", choices=["auto", "embedded", "astra-sim"])
    p.add_argument("--pipeline", default="lockstep", choices=["lockstep", "stages"],
                   help="pipelined layouts as one lock-step program (default) or from each stage's own programs "
                        "(pp, dp, fsdp and tp meshes)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", help="also write DIR/layouts.json (the --json object) and DIR/layouts.png (the "
                                 "ranking drawn: step time, exposed communication, bubble, memory)")
    p.set_defaults(func=cmd_layouts)


def cmd_layouts(args) -> int:
    from ..pipeline import Question
    from ..use.layouts import LayoutError, rank_layouts

    if args.devices < 1:
        raise LayoutError(f"--devices must be at least 1, got {args.devices}")
    question = Question.resolve(None, args.target, args.system, fidelity=args.fidelity, split=args.split,
                               replay=args.replay)
    ranked = rank_layouts(args.program, args.devices, question, progress=not args.json and sys.stderr.isatty(),
                          stages=args.pipeline == "stages")
    report = {"program": args.program, "devices": args.devices, "target": question.target.name,
              "system": question.system.source, "fidelity": question.fidelity.name, "split": question.split,
              "pipeline": args.pipeline,
              "layouts": [lay.to_dict() for lay in ranked]}
    if args.out:
        from pathlib import Path

        from ..use.layouts import plot_layouts

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "layouts.json").write_text(json.dumps(report, indent=1))
        plot_layouts(out / "layouts.png", ranked, f"{args.program} on {args.devices} x {question.target.name}, "
                     f"{question.system.source}, {question.fidelity.name} ({question.split} split)",
                     question.target.mem_capacity)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    w = sys.stdout.write
    how = "; pipelines from their stages' programs" if args.pipeline == "stages" else ""
    w(f"{args.program} on {args.devices} x {question.target.name}, {question.system.source}, "
      f"{question.fidelity.name} ({question.split} split){how}\n\n")
    w(f"  {'rank':>4}  {'mesh':<20} {'step':>10}  {'exposed comm':>12}  {'memory':>10}  {'util':>6}  {'bubble':>6}\n")
    for i, lay in enumerate(ranked, 1):
        mem = format_bytes(lay.peak_memory_bytes) if lay.peak_memory_bytes else "-"
        bubble = f"{lay.bubble:6.1%}" if lay.bubble else f"{'-':>6}"
        if lay.status == "ok":
            w(f"  {i:>4}  {lay.mesh:<20} {format_seconds(lay.step_time_s):>10}  "
              f"{format_seconds(lay.exposed_comm_s):>12}  {mem:>10}  {lay.utilisation:6.1%}  {bubble}\n")
        else:
            w(f"  {'-':>4}  {lay.mesh:<20} {lay.status:>10}  {'':>12}  {mem:>10}  {'':>6}  {bubble}  "
              f"{lay.reason[:90]}\n")
    if args.out:
        w(f"\nlayouts.json and layouts.png written to {args.out}\n")
    return 0
