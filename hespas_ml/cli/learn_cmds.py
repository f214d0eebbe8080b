"""``train`` and ``predict``: learned surrogates, tracked in MLflow, searched with Optuna, used per region."""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from typing import Any

from ..split.regions import SPLITS
from ..units import format_seconds

FIDELITIES = ("roofline", "scalesim", "profiling")


def register(sub) -> None:
    p = sub.add_parser("train", help="train a surrogate of a fidelity on a dataset (MLflow run + registry)",
                       description="Train a learned surrogate of one fidelity on a built dataset. The run is "
                                   "logged to MLflow (parameters, metrics per split / family / target, the "
                                   "baselines, plots, the model) and registered as a new version of "
                                   "hespas-surrogate-<fidelity>; the alias (champion) moves to it only if it "
                                   "beats the aliased version on the same held-out rows.")
    p.add_argument("--dataset", required=True, help="a dataset folder written by 'hespas-ml dataset build'")
    p.add_argument("--fidelity", required=True, choices=FIDELITIES, help="which labels to learn")
    p.add_argument("--targets", nargs="+", metavar="TARGET", help="learn only these targets' labels")
    p.add_argument("--config", help="training configuration YAML (TrainConfig fields; e.g. training/roofline.yaml)")
    p.add_argument("--epochs", type=int, help="override the configuration's epochs")
    p.add_argument("--seed", type=int, help="seed of the split, the initialisation, the data order and the search")
    p.add_argument("--trials", type=int, default=0, help="run an Optuna search of N trials first (default: none)")
    p.add_argument("--search-space", help="search-space YAML (default: the shipped hespas_ml/learn/search_spaces/<fidelity>.yaml)")
    p.add_argument("--study", help="Optuna study name (default: <model name>.<dataset name>.<split>)")
    p.add_argument("--storage", help="Optuna storage URL (default: SQLite optuna.db beside the MLflow store)")
    p.add_argument("--from", dest="warm_from", metavar="MODEL",
                   help="retrain from a registered or saved model (NAME@alias, models:/…, a folder): its weights "
                        "and configuration, on this dataset; compared with it on the same held-out rows")
    p.add_argument("--tracking-uri", help="MLflow store: a folder or a URI (default: ./mlruns or "
                                          "$HESPAS_ML_TRACKING_URI)")
    p.add_argument("--experiment", default="surrogates", help="MLflow experiment (default: surrogates)")
    p.add_argument("--name", help="registered model name (default: hespas-surrogate-<fidelity>, or --from's)")
    p.add_argument("--alias", default="champion", help="alias of the best version (default: champion)")
    p.add_argument("--metric", default="median_ape", choices=["median_ape", "p90_ape", "mean_ape", "log_rmse"],
                   help="held-out metric the alias is decided on (lower is better; default: median_ape)")
    p.add_argument("--no-baselines", action="store_true", help="skip the roofline / GBM baselines")
    p.add_argument("--no-plots", action="store_true", help="skip the parity and error-histogram plots")
    p.add_argument("--no-register", action="store_true", help="log the run but do not register the model")
    p.add_argument("--save", metavar="DIR", help="also save the surrogate into DIR with a MODEL_CARD.md")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("predict", help="per-region times of a program from a learned surrogate, with intervals",
                       description="Predict the time of every compute region of a program on a target with a "
                                   "learned surrogate (identical regions predicted once).")
    p.add_argument("program", help="a .mlir file or a zoo spec such as zoo:mlp?layers=4")
    p.add_argument("--fidelity", choices=FIDELITIES,
                   help="which fidelity's surrogate (its shipped model unless --model is given)")
    p.add_argument("--target", default="H100", help="hardware target preset or YAML file (default: H100)")
    p.add_argument("--model", help="NAME@alias, models:/NAME/VERSION, or a saved surrogate folder")
    p.add_argument("--tracking-uri", help="MLflow store of --model (default: ./mlruns or $HESPAS_ML_TRACKING_URI)")
    p.add_argument("--split", default="fusion", choices=SPLITS,
                   help="how the program is cut into compute regions (default: fusion)")
    p.add_argument("--devices", type=int, help="devices of a zoo program (default: the spec's)")
    p.add_argument("--top", type=int, default=15, help="how many of the most expensive regions to list")
    p.add_argument("--json", action="store_true", help="print one JSON object (every region)")
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("ui", help="the MLflow UI on the project's store: training runs, searches, the registry",
                       description="Start the MLflow UI on the store training writes to (./mlruns: a SQLite "
                                   "database and the artifacts beside it) and print its address; Ctrl-C stops it.")
    p.add_argument("--tracking-uri", help="MLflow store (default: ./mlruns or $HESPAS_ML_TRACKING_URI)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=5000, help="port (default: 5000)")
    p.set_defaults(func=cmd_ui)


def cmd_ui(args) -> int:
    import subprocess

    from ..learn.tracking import resolve_uri

    tracking, artifacts = resolve_uri(args.tracking_uri)
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking, "--host", args.host,
               "--port", str(args.port)]
    if artifacts:
        command += ["--default-artifact-root", artifacts]
    print(f"MLflow UI of {tracking} at http://{args.host}:{args.port} (Ctrl-C stops it)", flush=True)
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
    try:
        return subprocess.call(command, env=env)
    except KeyboardInterrupt:
        return 0


# ------------------------------------------------------------------------------------------------ train

def _overrides(args) -> dict[str, Any]:
    from ..learn.config import LearnError, read_config_file

    data = read_config_file(args.config) if args.config else {}
    if data.get("fidelity", args.fidelity) != args.fidelity:
        raise LearnError(f"{args.config}: configures fidelity '{data['fidelity']}', not --fidelity {args.fidelity}")
    data["fidelity"] = args.fidelity
    for key in ("targets", "seed", "epochs"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    return data


def _fmt_report(name: str, rep: dict[str, Any]) -> dict[str, Any]:
    return {"model": name, **{k: rep.get(k, float("nan")) for k in
                              ("median_ape", "p90_ape", "kendall_tau", "coverage", "n")}}


def cmd_train(args) -> int:
    from ..label.dataset_tables import load_dataset
    from ..learn.config import TrainConfig
    from ..learn.evaluate import table
    from ..learn.runs import train_and_register

    overrides = _overrides(args)
    origin = args.config or "command line"
    config = TrainConfig.from_dict(overrides, origin)
    dataset = load_dataset(args.dataset)
    say = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    out = train_and_register(
        dataset, config, tracking_uri=args.tracking_uri, experiment=args.experiment, name=args.name,
        alias=args.alias, warm_from=args.warm_from, config_overrides=overrides, trials=args.trials,
        space=args.search_space, storage=args.storage, study_name=args.study, baselines=not args.no_baselines,
        plots=not args.no_plots, register=not args.no_register, metric=args.metric, progress=say)
    command = "hespas-ml " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else "hespas-ml train"
    if args.save:
        from ..learn.model_card import save_with_card
        save_with_card(out, dataset, args.save, command)
    if args.json:
        print(json.dumps({"run_id": out.run_id, "experiment_id": out.experiment_id, "model_uri": out.model_uri,
                          "name": out.name, "version": out.version, "alias": out.alias, "promoted": out.promoted,
                          "splits": out.splits, "baselines": out.baselines, "compared": out.compared,
                          "compared_versions": out.compared_versions, "split_rows": out.split_sizes,
                          "config": out.surrogate.config.to_dict(), "timings_s": out.timings,
                          "search": None if out.search is None else {
                              "study": out.search.study_name, "storage": out.search.storage,
                              "best_trial": out.search.best_trial, "best_value": out.search.best_value,
                              "states": out.search.states},
                          "saved": args.save}, indent=1, default=float))
        return 0
    records = [_fmt_report("surrogate", out.test)]
    records += [_fmt_report(f"baseline {k}", v) for k, v in out.baselines.items()]
    records += [_fmt_report(f"{k} (v{out.compared_versions.get(k, '?')})", v) for k, v in out.compared.items()]
    print(f"\nheld-out ({config.split} split) test rows:")
    print(table(records, ["model", "median_ape", "p90_ape", "kendall_tau", "coverage", "n"]))
    fams = [{"family": f, **r} for f, r in out.test.get("per_family", {}).items()]
    if fams:
        print("\nper family (test):")
        print(table(fams, ["family", "median_ape", "p90_ape", "kendall_tau", "coverage", "n"]))
    print(f"\nMLflow run {out.run_id} (experiment {args.experiment})")
    if out.version is not None:
        print(f"registered {out.name} version {out.version}; "
              + (f"@{out.alias} now points at it" if out.promoted else f"@{out.alias} unchanged"))
    if args.save:
        print(f"saved to {args.save} (with MODEL_CARD.md)")
    return 0


# ------------------------------------------------------------------------------------------------ predict

def cmd_predict(args) -> int:
    from .. import pipeline
    from ..ingest import check_program
    from ..label.targets import load_target
    from ..learn.config import LearnError
    from ..learn.fidelity import SurrogateFidelity

    if args.model is None and args.fidelity is None:
        raise LearnError("predict: give --fidelity (its shipped model) or --model")
    target = load_target(args.target)
    check_program(args.program, args.devices)
    t0 = time.perf_counter()
    fid = SurrogateFidelity(args.model or args.fidelity, tracking_uri=args.tracking_uri)
    if args.fidelity is not None and fid.fidelity != args.fidelity:
        raise LearnError(f"{args.model}: a surrogate of {fid.fidelity}, not of --fidelity {args.fidelity}")
    t_load = time.perf_counter() - t0
    graph = pipeline.ingest(args.program, args.devices)
    rg = pipeline.split(graph, args.split)
    compute = rg.compute_regions()
    t = time.perf_counter()
    times = pipeline.label(rg, fid, target)
    t_pred = time.perf_counter() - t
    labels = times.labels
    n_unique = len(times.distinct)
    rows = []
    for r, lab in zip(compute, labels):
        rows.append({"id": r.id, "name": rg.describe(r), "count": r.count, "seconds": lab.seconds,
                     "lower_s": lab.meta["lower_s"], "upper_s": lab.meta["upper_s"],
                     "roofline_s": lab.meta.get("roofline_s"), "total_s": lab.seconds * r.count,
                     "in_domain": lab.meta.get("in_domain"), "outside": lab.meta.get("outside", [])})
    total = sum(x["total_s"] for x in rows)
    low = sum(x["lower_s"] * x["count"] for x in rows)
    high = sum(x["upper_s"] * x["count"] for x in rows)
    roof = sum((x["roofline_s"] or 0.0) * x["count"] for x in rows)
    model = fid.provenance(target)["model"]                 # the model that answered this target
    result = {"program": str(graph.source or graph.name), "n_devices": graph.n_devices, "target": target.name,
              "fidelity": f"surrogate:{fid.fidelity}", "model": model, "coverage": labels[0].meta["coverage"]
              if labels else None, "n_regions": len(compute), "n_unique": n_unique, "total_s": total,
              "total_interval_s": [low, high], "roofline_total_s": roof,
              "n_outside_domain": sum(1 for x in rows if x["in_domain"] is False),
              "timings_s": {"load_model": t_load, "predict": t_pred}, "regions": rows,
              "warnings": times.caveats}
    for msg in result["warnings"]:
        print(f"warning: {msg}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    w = sys.stdout.write
    w(f"program    {result['program']}  ({graph.n_devices} device{'s' if graph.n_devices > 1 else ''})\n")
    w(f"target     {target.name}   fidelity surrogate:{fid.fidelity} ({args.split} split)\n")
    w(f"model      {model}  (interval {100 * (result['coverage'] or 0):.0f}% nominal)\n")
    w(f"regions    {len(compute)} compute regions, {n_unique} unique, predicted in {1e3 * t_pred:.1f} ms "
      f"(model loaded in {1e3 * t_load:.0f} ms)\n")
    w(f"total      {format_seconds(total)}  [{format_seconds(low)}, {format_seconds(high)}]  (sum of region bounds; roofline "
      f"{format_seconds(roof)})\n")
    top = sorted(rows, key=lambda x: -x["total_s"])[:args.top]
    if top:
        w(f"\nmost expensive regions (of {len(rows)}):\n")
        w(f"  {'region':>6}  {'ops':<32} {'count':>5}  {'time/exec':>10}  {'interval':>23}  {'total':>10}  "
          f"{'share':>6}  {'roofline':>10}\n")
        for x in top:
            iv = f"[{format_seconds(x['lower_s'])}, {format_seconds(x['upper_s'])}]"
            w(f"  {x['id']:>6}  {x['name'][:32]:<32} {x['count']:>5}  {format_seconds(x['seconds']):>10}  {iv:>23}  "
              f"{format_seconds(x['total_s']):>10}  {100 * x['total_s'] / max(total, 1e-30):5.1f}%  "
              f"{format_seconds(x['roofline_s'] or 0.0):>10}\n")
    return 0
