"""``dataset build`` and ``dataset info``: labelled region datasets for the learned surrogate."""
from __future__ import annotations

import json
import sys


def register(sub) -> None:
    p = sub.add_parser("dataset", help="build or inspect a labelled region dataset",
                       description="Build labelled datasets of unique compute regions from a YAML spec.")
    dsub = p.add_subparsers(dest="dataset_command", metavar="ACTION")
    dsub.required = True

    b = dsub.add_parser("build", help="build (or resume) a dataset from a spec",
                        description="Export, split and dedupe the spec's programs, then label every unique "
                                    "region on every (target, fidelity) of the spec. Resumable: run it again "
                                    "after an interruption and it continues where it stopped.")
    b.add_argument("spec", help="dataset spec YAML (see datasets/README.md)")
    b.add_argument("--out", help="output folder (created; reused to resume); required unless --dry-run")
    b.add_argument("--workers", type=int, help="worker processes (default: half the cores)")
    b.add_argument("--retry-failed", action="store_true", help="retry programs and labels that failed before")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    b.add_argument("--dry-run", action="store_true", help="validate the spec and print what it expands to")
    b.set_defaults(func=cmd_build)

    s = dsub.add_parser("snapshot", help="tables of what a build (even a running or killed one) has so far",
                        description="Write the tables of everything a build has labelled so far into another "
                                    "folder, without disturbing the build.")
    s.add_argument("spec", help="the dataset spec YAML the build runs")
    s.add_argument("build", help="the build's folder (its --out)")
    s.add_argument("--out", required=True, help="folder for the snapshot's tables")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.set_defaults(func=cmd_snapshot)

    i = dsub.add_parser("info", help="counts per family, fidelity, target and status of a built dataset")
    i.add_argument("dir", help="a dataset folder written by 'dataset build'")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.set_defaults(func=cmd_info)


def cmd_snapshot(args) -> int:
    from ..use.dataset import snapshot_dataset

    summary = snapshot_dataset(args.spec, args.build, args.out, progress=not args.no_progress)
    c = summary["counts"]
    print(f"{args.out}: snapshot of {args.build}: {c['regions_unique']} unique regions, {c['labels']} labels")
    for fid, statuses in c["labels_by_fidelity"].items():
        print(f"  {fid:<10} " + ", ".join(f"{k} {v}" for k, v in sorted(statuses.items())))
    return 0


def cmd_build(args) -> int:
    from ..use.dataset import build_dataset
    from ..label.dataset_spec import load_spec

    if args.dry_run:
        spec = load_spec(args.spec)
        families: dict[str, int] = {}
        for prog in spec.programs:
            families[prog.family] = families.get(prog.family, 0) + 1
        w = sys.stdout.write
        w(f"spec        {spec.path} ({spec.name}, {spec.split} split)\n")
        w(f"programs    {len(spec.programs)}: " + ", ".join(f"{k} {v}" for k, v in families.items()) + "\n")
        for fs in spec.fidelities:
            cap = f", only regions of {', '.join(fs.families)}" if fs.families else ""
            cap += f", at most {fs.max_regions} regions per target" if fs.max_regions else ""
            w(f"{fs.name:<11} {len(fs.targets)} target(s): {', '.join(t.ref for t in fs.targets)}{cap}\n")
        return 0
    if not args.out:
        from ..label.dataset_cache import DatasetError
        raise DatasetError(f"{args.spec}: give the output folder with --out DIR")
    summary = build_dataset(args.spec, args.out, workers=args.workers, retry_failed=args.retry_failed,
                            progress=not args.no_progress)
    c = summary["counts"]
    ratio = f"{c['dedup_ratio']:.1f}" if c["dedup_ratio"] else "-"
    print(f"{args.out}: {c['programs_ok']}/{c['programs']} programs, {c['regions_unique']} unique regions "
          f"({c['regions_seen']} seen, dedup {ratio}x), {c['labels']} labels in "
          f"{summary['timings']['total_s']:.1f} s")
    for fid, statuses in c["labels_by_fidelity"].items():
        print(f"  {fid:<10} " + ", ".join(f"{k} {v}" for k, v in sorted(statuses.items())))
    if c["programs_failed"]:
        print(f"  {c['programs_failed']} program(s) failed: see 'hespas-ml dataset info {args.out}'")
    return 0


def dataset_info(path) -> dict:
    """Counts of a built dataset: programs, regions per family, labels per fidelity/target/status."""
    from ..label.dataset_tables import load_dataset

    ds = load_dataset(path)
    regions, labels, programs = ds.regions, ds.labels, ds.programs
    per_family: dict[str, dict[str, int]] = {}
    for fam, prog_status in zip(programs["family"], programs["status"]):
        entry = per_family.setdefault(fam, {"programs": 0, "programs_failed": 0, "regions": 0})
        entry["programs"] += 1
        entry["programs_failed"] += int(prog_status != "ok")
    for fams in regions["families"]:
        for fam in json.loads(fams):
            per_family.setdefault(fam, {"programs": 0, "programs_failed": 0, "regions": 0})["regions"] += 1
    per_label: dict[str, dict[str, dict[str, int]]] = {}
    for fid, tgt, status in zip(labels["fidelity"], labels["target"], labels["status"]):
        cell = per_label.setdefault(fid, {}).setdefault(tgt, {})
        cell[status] = cell.get(status, 0) + 1
    failures = [{"source": s, "reason": r} for s, st, r in zip(programs["source"], programs["status"],
                                                               programs["reason"]) if st != "ok"]
    reasons: dict[str, int] = {}
    for fid, status, reason in zip(labels["fidelity"], labels["status"], labels["reason"]):
        if status != "ok":
            key = f"{fid}: {str(reason)[:120]}"
            reasons[key] = reasons.get(key, 0) + 1
    checks = ds.steadiness()
    return {"path": str(ds.path), "counts": ds.manifest.get("counts", {}), "families": per_family,
            "labels": per_label, "failed_programs": failures,
            "label_failures": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:20]),
            "steadiness": [{k: v for k, v in c.items() if k != "times"} for c in checks]}


def cmd_info(args) -> int:
    info = dataset_info(args.dir)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    w = sys.stdout.write
    c = info["counts"]
    w(f"dataset     {info['path']}\n")
    ratio = f"{c['dedup_ratio']:.2f}" if c.get("dedup_ratio") else "-"
    w(f"programs    {c.get('programs_ok', 0)} ok, {c.get('programs_failed', 0)} failed\n")
    w(f"regions     {c.get('regions_unique', 0)} unique of {c.get('regions_seen', 0)} seen (dedup {ratio}x)\n")
    w("\nfamily               programs  failed   regions\n")
    for fam, e in sorted(info["families"].items()):
        w(f"  {fam:<18} {e['programs']:>8} {e['programs_failed']:>7} {e['regions']:>9}\n")
    w("\nfidelity    target                 ok   failed\n")
    for fid, per_target in info["labels"].items():
        for tgt, statuses in sorted(per_target.items()):
            other = sum(v for k, v in statuses.items() if k != "ok")
            w(f"  {fid:<9} {tgt:<18} {statuses.get('ok', 0):>6} {other:>8}\n")
    if "profiling" in info["labels"]:
        from ..label.steadiness import describe_log
        w(f"\nprofiling machine's timing steadiness: {describe_log(info['steadiness'])}\n")
    if info["failed_programs"]:
        w("\nfailed programs\n")
        for f in info["failed_programs"]:
            w(f"  {f['source']}: {f['reason']}\n")
    if info["label_failures"]:
        w("\nlabel failures (most common reasons)\n")
        for reason, n in info["label_failures"].items():
            w(f"  {n:>6}  {reason}\n")
    return 0
