"""``study``: fidelity cross-validation studies (HTML report, CSV tables, one MLflow run)."""
from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("study", help="cross-validate fidelities over workloads x targets (HTML report)",
                       description="Run a study spec (see eval/studies/README.md): every workload x target "
                                   "(x system) through every fidelity, against measured step times where given. "
                                   "Writes report.html and CSV tables into --out and logs one MLflow run. "
                                   "Resumable: finished configurations are cached in OUT/cache.")
    p.add_argument("spec", help="study spec YAML (e.g. eval/studies/smoke.yaml)")
    p.add_argument("--out", help="output folder (created; reused to resume)")
    p.add_argument("--tracking-uri", help="MLflow store: a folder or a URI (default: ./mlruns or "
                                          "$HESPAS_ML_TRACKING_URI)")
    p.add_argument("--experiment", default="studies", help="MLflow experiment (default: studies)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log the study to MLflow")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--other-machine", action="store_true",
                   help="compare with host-cpu step times measured on another machine (the report says so)")
    p.add_argument("--dry-run", action="store_true", help="validate the spec and print its configurations")
    p.add_argument("--measure-host-cpu", metavar="CSV",
                   help="instead of a study: measure the spec's one-device workloads on this machine's CPU "
                        "(whole program, XLA:CPU) and write the measured CSV")
    p.add_argument("--measure-s", type=float, default=3.0, help="seconds of sampling per program and round "
                                                                 "(--measure-host-cpu)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per program; the lowest round median is kept "
                                                         "(--measure-host-cpu)")
    p.set_defaults(func=cmd_study)


def cmd_study(args) -> int:
    from ..use.study import StudyError, run_study
    from ..use.study_spec import load_spec

    if args.dry_run:
        spec = load_spec(args.spec)
        w = sys.stdout.write
        n = sum(len(wl.systems) * len(s.targets) for wl in spec.workloads for s in spec.sources)
        w(f"study       {spec.name} ({spec.path}), {spec.split} split, {n} configurations\n")
        w(f"workloads   {', '.join(f'{x.name} [{len(x.systems)} system(s)]' for x in spec.workloads)}\n")
        for s in spec.sources:
            w(f"{s.name:<24} {', '.join(s.targets) or '-'}{'  (optional)' if s.optional else ''}\n")
        w(f"reference   {' -> '.join(spec.reference)}\n")
        w(f"measured    {spec.measured or 'none'}\n")
        return 0
    if args.measure_host_cpu:
        from ..use.study_measure import measure_host_cpu

        spec = load_spec(args.spec, read_measured_csv=False)
        rows = measure_host_cpu(spec, args.measure_host_cpu, measure_s=args.measure_s, rounds=args.rounds,
                                progress=not args.no_progress)
        for r in rows:
            print(f"{r['workload']:<20} {float(r['runtime_s']) * 1e3:9.3f} ms  (IQR {float(r['iqr_s']) * 1e3:.3f} ms, "
                  f"{r['repeats']} samples)")
        print(f"wrote {args.measure_host_cpu}")
        return 0
    if not args.out:
        raise StudyError(f"{args.spec}: give the output folder with --out DIR")
    res = run_study(args.spec, args.out, progress=not args.no_progress, mlflow=not args.no_mlflow,
                    tracking_uri=args.tracking_uri, experiment=args.experiment, other_machine=args.other_machine)
    m = res.summary["metrics"]
    print(f"{res.report}: {int(m['configs_ok'])}/{int(m['configs'])} configurations timed "
          f"({int(m['configs_cached'])} from the cache) in {m['wall_s']:.1f} s")
    for r in res.tables["error_summary"].itertuples(index=False):
        print(f"  {r.source:<22} vs {r.reference:<10} mean abs error {r.mean_abs_pct_error:8.1f} %  (n={r.n})")
    for r in res.tables["speedup_summary"].itertuples(index=False):
        print(f"  {r.source:<22} vs {r.reference:<10} mean speedup error {r.mean_speedup_error:6.3f}  (n={r.n})")
    if res.run_id:
        print(f"  MLflow run {res.run_id}")
    return 0
