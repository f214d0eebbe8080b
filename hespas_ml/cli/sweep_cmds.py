"""``sweep``: run a design sweep from a YAML spec, and ``sweep report``: Pareto fronts, best configs, plots.

    hespas-ml sweep SPEC --out DIR [--engine local|dask] [--workers N] [--address ADDR] [--dry-run]
    hespas-ml sweep report RESULTS [--out DIR] [--x devices|cost_per_step|COLUMN] [--top N] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys

USAGE = ("usage: hespas-ml sweep SPEC --out DIR [--engine {local,dask}] [--workers N] [--address ADDR] "
         "[--no-progress] [--dry-run]\n"
         "       hespas-ml sweep report RESULTS [--out DIR] [--x COLUMN] [--top N] [--json]\n")


def register(sub) -> None:
    # Every argument after "sweep" is handed to run_parser() or report_parser() (prefix_chars="+" keeps
    # argparse from reading "--out" or "--help" here), so that both "sweep SPEC" and "sweep report" work.
    p = sub.add_parser("sweep", add_help=False, prefix_chars="+",
                       help="run a design sweep from a YAML spec, or report on its results",
                       usage=USAGE.removeprefix("usage: "))
    p.add_argument("argv", nargs="*")
    p.set_defaults(func=cmd_sweep)


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hespas-ml sweep", description=(
        "Simulate every configuration of a sweep spec (workloads x parallelism x targets x fidelities x "
        "systems) into DIR: chunk files as they finish, then results.parquet. Run it again with the same "
        "--out to resume after an interruption. See eval/sweeps/smoke.yaml for the spec format."))
    p.add_argument("spec", help="sweep spec YAML (e.g. eval/sweeps/smoke.yaml)")
    p.add_argument("--out", help="results folder (created; reused to resume); required unless --dry-run")
    p.add_argument("--engine", default="local", choices=["local", "dask"],
                   help="local worker processes (default) or a Dask cluster")
    p.add_argument("--workers", type=int, help="worker processes (local, or a Dask LocalCluster); default: cores")
    p.add_argument("--address", help="Dask scheduler to connect to (tcp://host:8786); default: a local cluster")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--dry-run", action="store_true", help="check the spec and print what it expands to")
    return p


def report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hespas-ml sweep report", description=(
        "Pareto fronts (step time vs devices, or vs a cost column) and the best configurations per workload "
        "of a sweep's results; with --out, PNG plots too."))
    p.add_argument("results", help="a sweep folder, its results.parquet, or any parquet of sweep rows")
    p.add_argument("--out", help="write the plots (PNG) and report.json here")
    p.add_argument("--x", default=None, help="what the front trades step time against: devices (default) or a "
                                             "cost column such as cost_per_step")
    p.add_argument("--top", type=int, default=3, help="best configurations listed per workload (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return p


def cmd_sweep(args) -> int:
    argv = list(args.argv)
    if not argv:
        sys.stderr.write(USAGE + "hespas-ml sweep: error: give a sweep spec (or 'report RESULTS')\n")
        return 2
    if argv[0] in ("-h", "--help"):
        sys.stdout.write(run_parser().format_help() + "\n" + report_parser().format_help())
        return 0
    if argv[0] == "report":
        return cmd_report(report_parser().parse_args(argv[1:]))
    return cmd_run(run_parser().parse_args(argv))


def cmd_run(args) -> int:
    from ..use.sweep import SweepError, run_sweep
    from ..use.sweep_spec import load_sweep_spec

    if args.dry_run:
        spec = load_sweep_spec(args.spec)
        w = sys.stdout.write
        w(f"spec        {spec.path} ({spec.name}, {spec.split} split)\n")
        families: dict[str, int] = {}
        for p in spec.programs:
            families[p.family] = families.get(p.family, 0) + 1
        bad = sum(1 for p in spec.programs if p.error)
        w(f"programs    {len(spec.programs)}: " + ", ".join(f"{k} {v}" for k, v in families.items())
          + (f" ({bad} rejected by the zoo: their configurations will be recorded as failed)" if bad else "") + "\n")
        w(f"targets     {', '.join(spec.targets)}\n")
        w(f"fidelities  {', '.join(spec.fidelities)}   replay {', '.join(spec.replays)}\n")
        w("systems     " + ", ".join(f"{len(v)} for {k} device{'s' if k > 1 else ''}"
                                     for k, v in sorted(spec.systems.items())) + "\n")
        w(f"configs     {spec.n_configs()} in {len(spec.chunks())} chunks of at most {spec.chunk_size}\n")
        for note in spec.notes:
            w(f"note        {note}\n")
        return 0
    if not args.out:
        raise SweepError(f"{args.spec}: give the results folder with --out DIR")
    if args.workers is not None and args.workers < 1:
        raise SweepError(f"--workers must be at least 1, got {args.workers}")
    m = run_sweep(args.spec, args.out, engine=args.engine, workers=args.workers, address=args.address,
                  progress=not args.no_progress)
    st, t = m["stats"], m["timings_s"]
    failed, total, ran = st.get("configs_failed", 0), t.get("total_s", 0.0), st.get("configs_evaluated", 0)
    print(f"{args.out}: {m['configs']} configurations" + (
        f"; {ran} evaluated in {total:.1f} s ({ran / max(total, 1e-9):.0f} cfg/s), {failed} of them failed"
        if ran else " (already complete)"))
    if ran:
        print(f"  shared work: {st['programs_prepared']} programs prepared ({st['programs_failed']} failed), "
              f"{st['regions_unique']} unique of {st['regions_seen']} regions, {st['labels_computed']} labels, "
              f"{st['systems_built']} system configs, {st['trace_sets_built']} trace sets; replays "
              f"{st['replays_fast']} fast, {st['replays_embedded']} embedded, {st['replays_other']} other")
    for note in m.get("notes", []):
        print(f"  note: {note}")
    print(f"  results: {args.out}/results.parquet   (hespas-ml sweep report {args.out})")
    return 0


def cmd_report(args) -> int:
    from ..use.sweep_report import load_results, make_report, print_report, write_plots

    df = load_results(args.results)
    rep = make_report(df, x=args.x, top=args.top)
    if args.out:
        rep["plots"] = write_plots(df, rep, args.out)
    if args.json:
        print(json.dumps(rep, indent=1, default=str))
    else:
        print_report(rep, sys.stdout)
    return 0
