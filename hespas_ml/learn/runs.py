"""One tracked training run of a surrogate (MLflow): train, evaluate, log, register, promote.

One :func:`train_and_register` call is one MLflow run (in the store of
:func:`~hespas_ml.learn.tracking.setup_mlflow`): the configuration and dataset as parameters, the training
curve, accuracy per split / model family / target / op family, the baselines on the same split, a parity
plot and an error histogram by op family as artifacts (:mod:`.plots`), and the surrogate as an MLflow
logged model (:mod:`.registry`). The model is then registered as a new version of
``hespas-surrogate-<fidelity>``, and the alias (``champion``) moves to it only when it beats the aliased
version on the *same* held-out rows (the aliased model is re-evaluated on this run's test split; both
figures are logged).
"""
from __future__ import annotations

import copy
import json
import math
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..units import format_seconds
from .config import LearnError, TrainConfig
from .evaluate import op_families, split_report
from .plots import plot_error_histogram, plot_parity
from .registry import (CHAMPION, EXPERIMENT, LoadedModel, RegistryError, alias_version, load_surrogate,
                       log_surrogate, model_name, open_store, register_version)
from .surrogate import Surrogate
from .tables import in_program_labels

COMPARE_METRICS = ("median_ape", "p90_ape", "mean_ape", "log_rmse")
# TrainConfig fields that fix the network's shape: a warm start keeps them.
ARCH_FIELDS = ("fidelity", "hidden", "layers", "head_hidden", "pooling", "ensemble", "residual", "residual_base",
               "roofline_input", "systolic_input")


def config_params(config: TrainConfig) -> dict[str, str]:
    """The config as MLflow parameters (lists comma-joined)."""
    out = {}
    for k, v in config.to_dict().items():
        out[k] = ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)
    return out


_KEY_BAD = re.compile(r"[^\w\-./ ]")


def _key(*parts: str) -> str:
    return "/".join(_KEY_BAD.sub("_", str(p)) for p in parts if p != "")


def flat_metrics(report: dict[str, Any], prefix: str, groups: bool = True) -> dict[str, float]:
    """MLflow metrics of an :func:`~hespas_ml.learn.evaluate.report`: ``prefix/median_ape`` …, and with
    ``groups`` ``prefix/family/<f>/…``, ``prefix/target/<t>/…`` and any ``per_op`` entries (NaN dropped)."""
    out: dict[str, float] = {}
    for k, v in report.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
            out[_key(prefix, k)] = float(v)
    if groups:
        for group, label in (("per_family", "family"), ("per_target", "target"), ("per_op", "op")):
            for name, sub in (report.get(group) or {}).items():
                out.update(flat_metrics(sub, _key(prefix, label, name), groups=False))
    return out


def log_metrics(mlflow, metrics: dict[str, float], step: int | None = None, model_id: str | None = None) -> None:
    """Log many metrics in batches MLflow accepts."""
    items = list(metrics.items())
    for s in range(0, len(items), 500):
        mlflow.log_metrics(dict(items[s:s + 500]), step=step, model_id=model_id)


def better(new: dict[str, Any], old: dict[str, Any] | None, metric: str) -> bool:
    """Whether report ``new`` beats ``old`` on ``metric`` (lower is better; no old: True)."""
    if old is None:
        return True
    a, b = float(new.get(metric, math.inf)), float(old.get(metric, math.inf))
    if not math.isfinite(b):
        return math.isfinite(a)
    return a < b


def warm_config(previous: TrainConfig, overrides: dict[str, Any], origin: str) -> TrainConfig:
    """``previous`` with ``overrides`` applied; overrides of the architecture (:data:`ARCH_FIELDS`) that
    differ are refused (a warm start keeps the network's shape)."""
    prev = previous.to_dict()
    for k, v in overrides.items():
        if k in ARCH_FIELDS and v != prev.get(k):
            raise RegistryError(f"{origin}: a warm start keeps the model's {k} ({prev.get(k)!r}); "
                                f"the new configuration asks for {v!r}")
    prev.update(overrides)
    return TrainConfig.from_dict(prev, origin)


def warm_start(surrogate: Surrogate, previous: Surrogate) -> None:
    """Make ``surrogate.fit`` start from ``previous``'s weights and opcode vocabulary (the normalisers are
    refitted to the new data by ``fit``)."""
    from .features import Featuriser

    if previous.net is None:
        raise RegistryError("warm start: the previous surrogate is not fitted")
    surrogate.featuriser = Featuriser(previous.featuriser.vocabulary)
    state = copy.deepcopy(previous.net.state_dict())
    build = surrogate._new_net

    def new_net():
        net = build()
        net.load_state_dict(state, strict=True)
        return net

    surrogate._new_net = new_net          # type: ignore[method-assign]


@dataclass
class TrainOutcome:
    """What :func:`train_and_register` did."""

    surrogate: Surrogate
    run_id: str
    experiment_id: str
    model_uri: str                    # models:/m-… (the logged model)
    name: str
    version: str | None               # registered version (None with register=False)
    alias: str
    promoted: bool
    test: dict[str, Any]              # the surrogate's report on the held-out rows
    splits: dict[str, Any]            # train / val / test reports
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)
    compared: dict[str, dict[str, Any]] = field(default_factory=dict)   # "champion" / "from": their reports
    compared_versions: dict[str, str] = field(default_factory=dict)
    split_sizes: dict[str, int] = field(default_factory=dict)
    search: Any = None                # search.SearchResult when trials were run
    timings: dict[str, float] = field(default_factory=dict)


def _dataset_params(dataset) -> dict[str, str]:
    m = dataset.manifest
    return {"dataset": str(dataset.path), "dataset.name": str((m.get("spec") or {}).get("name", "")),
            "dataset.created": str(m.get("created", "")), "dataset.regions": str(len(dataset.regions)),
            "dataset.labels": str(len(dataset.labels))}


def _evaluate_split(surrogate: Surrogate, dataset, index, ops_of) -> tuple[Any, Any, dict[str, Any]]:
    rows, pred = surrogate.predict_rows(dataset, index)
    if rows.empty:
        return rows, pred, {"n": 0}
    return rows, pred, split_report(rows, pred, ops_of(rows["hash"]))


def _baselines(dataset, config: TrainConfig, train, val, test, ops_of) -> dict[str, dict[str, Any]]:
    from .baselines import EstimateBaseline, GBMBaseline

    out = {}
    estimates = ["roofline"] + (["systolic"] if config.fidelity == "scalesim" else [])
    for est in estimates:
        rows, pred = EstimateBaseline(config.fidelity, est).predict_rows(dataset, test)
        out[est] = split_report(rows, pred, ops_of(rows["hash"]))
    gbm = GBMBaseline(config).fit(dataset, train, val)
    rows, pred = gbm.predict_rows(dataset, test)
    out["gbm"] = split_report(rows, pred, ops_of(rows["hash"]))
    return out


def _log_plots(mlflow, rows, pred, ops: np.ndarray, report: dict[str, Any], title: str) -> None:
    """The parity plot, the error histogram by op family and the report of the test rows, as artifacts."""
    with tempfile.TemporaryDirectory(prefix="hespas-plots-") as tmp:
        plot_parity(rows, pred.seconds, ops, Path(tmp) / "parity_test.png", title)
        plot_error_histogram(rows, pred.seconds, ops, Path(tmp) / "error_by_op_family_test.png", title)
        (Path(tmp) / "report_test.json").write_text(json.dumps(report, indent=1, default=float))
        mlflow.log_artifacts(tmp, artifact_path="plots")


def _compare(mlflow, client, name: str, alias: str, previous: LoadedModel | None, dataset, test, fidelity: str,
             ops_of, tracking_uri, say) -> tuple[Any, dict[str, dict[str, Any]], dict[str, str]]:
    """The aliased version and the model trained from, evaluated on ``test`` and logged as ``<alias>/test/…``
    and ``from/test/…``; returns (aliased version or None, reports, versions). A model that cannot be loaded
    or evaluated here (e.g. written by an older featuriser) is tagged and left out."""
    champion = alias_version(client, name, alias)
    candidates: list[tuple[str, Any]] = []
    if champion is not None:
        candidates.append((alias, f"models:/{name}/{champion.version}"))
    if previous is not None and not (champion is not None and previous.name == name
                                     and previous.version == str(champion.version)):
        candidates.append(("from", previous))
    reports: dict[str, dict[str, Any]] = {}
    versions: dict[str, str] = {}
    for label, ref in candidates:
        try:
            other = ref if isinstance(ref, LoadedModel) else load_surrogate(ref, tracking_uri)
            if other.surrogate.config.fidelity != fidelity:
                raise RegistryError(f"{other.describe()}: a {other.surrogate.config.fidelity} surrogate, not {fidelity}")
            _, _, rep = _evaluate_split(other.surrogate, dataset, test, ops_of)
        except LearnError as exc:
            mlflow.set_tag(f"hespas.compare.{label}", f"not evaluated: {exc}")
            say(f"{label}: cannot be evaluated ({exc}); it does not count")
            continue
        reports[label] = rep
        versions[label] = str(other.version or other.source)
        log_metrics(mlflow, flat_metrics(rep, f"{label}/test"))
        mlflow.log_param(f"{label}.version", versions[label])
    if previous is not None and "from" not in reports and alias in reports:
        reports["from"], versions["from"] = reports[alias], versions[alias]
    return champion, reports, versions


def _register(mlflow, client, name: str, alias: str, model_uri: str, run_id: str, champion, test: dict[str, Any],
              champion_report: dict[str, Any] | None, metric: str, tags: dict[str, str], say) -> tuple[str, bool]:
    """Register ``model_uri`` as a new version of ``name``; move ``alias`` to it if it beats the aliased
    version's report on the same rows. Returns (version, promoted)."""
    promoted = better(test, champion_report, metric)
    value = test.get(metric, float("nan"))
    desc = f"{tags.get('fidelity')} surrogate trained on {tags.get('dataset')}; held-out {metric} {value:.4g}"
    mv = register_version(client, name, model_uri, run_id, description=desc, tags={
        **tags, f"test_{metric}": f"{value:.6g}",
        "compared_with": f"{alias}=v{champion.version}" if champion is not None else "none"})
    version = str(mv.version)
    if promoted:
        client.set_registered_model_alias(name, alias, version)
    mlflow.set_tags({"hespas.registered": f"{name}/{version}", "hespas.promoted": str(promoted).lower()})
    mlflow.log_metric("promoted", float(promoted))
    say(f"registered {name} version {version}; " + (f"@{alias} -> version {version}" if promoted else
                                                     f"@{alias} stays on version {champion.version}"))
    return version, promoted


def train_and_register(dataset, config: TrainConfig, *, tracking_uri: str | os.PathLike[str] | None = None,
                       experiment: str = EXPERIMENT, name: str | None = None, alias: str = CHAMPION,
                       warm_from: str | None = None, config_overrides: dict[str, Any] | None = None,
                       trials: int = 0, space: Any = None, storage: str | None = None, study_name: str | None = None,
                       enqueue: list[dict[str, Any]] | None = None,
                       baselines: bool = True, plots: bool = True, register: bool = True,
                       metric: str = "median_ape", run_name: str | None = None,
                       progress: Callable[[str], None] | None = None) -> TrainOutcome:
    """Train a surrogate on ``dataset`` in one MLflow run, log everything, register it as a new version
    of ``name`` (default ``hespas-surrogate-<fidelity>``) and move ``alias`` to it if it beats the aliased
    version on this run's held-out rows by ``metric`` (lower is better; an aliased version that cannot be
    evaluated does not count).

    ``warm_from``: a model reference to retrain from (its weights, vocabulary and configuration, updated
    with ``config_overrides``; ``config`` is then ignored); it is evaluated on the same held-out rows and
    logged as ``from/…``. ``trials`` > 0 first runs an Optuna search (see :mod:`hespas_ml.learn.search`)
    over ``space`` with each trial a nested run (``storage``, ``study_name``, ``enqueue``: see
    :func:`~hespas_ml.learn.search.run_search`), then trains the best configuration here.
    """
    from .splits import make_split

    if metric not in COMPARE_METRICS:
        raise RegistryError(f"comparison metric '{metric}' is not one of {', '.join(COMPARE_METRICS)}")
    say = progress or (lambda _msg: None)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    previous: LoadedModel | None = None
    if warm_from is not None:
        if trials > 0:
            raise RegistryError(f"{warm_from}: a retrain (--from) keeps its configuration; it cannot be combined "
                                "with a search (--trials)")
        previous = load_surrogate(warm_from, tracking_uri)
        config = warm_config(previous.surrogate.config, dict(config_overrides or {}), str(warm_from))
        say(f"warm start from {previous.describe()}")
    name = name or (previous.name if previous is not None and previous.name else model_name(config.fidelity))
    mlflow, client, _ = open_store(tracking_uri, must_exist=False, experiment=experiment)
    ops_cache: dict[str, str] = {}

    def ops_of(hashes) -> np.ndarray:
        missing = [h for h in dict.fromkeys(hashes) if h not in ops_cache]
        if missing:
            ops_cache.update(zip(missing, op_families(dataset, missing)))
        return np.asarray([ops_cache[h] for h in hashes], dtype=object)

    def lap(key: str, since: float) -> None:
        timings[key] = time.perf_counter() - since

    with mlflow.start_run(run_name=run_name) as run:
        run_id, exp_id = run.info.run_id, run.info.experiment_id
        mlflow.set_tags({"hespas.kind": "train", "hespas.fidelity": config.fidelity, "hespas.model_name": name,
                         "hespas.from": str(warm_from or "")})
        search_result = None
        if trials > 0:
            from .search import run_search
            say(f"search: {trials} Optuna trial(s)")
            t = time.perf_counter()
            search_result = run_search(dataset, config, space, trials, storage=storage, study_name=study_name,
                                       tracking_uri=tracking_uri, model=name, experiment=experiment, enqueue=enqueue,
                                       progress=say)
            config = search_result.best_config
            lap("search_s", t)
            log_metrics(mlflow, search_result.metrics())
            mlflow.set_tags({"optuna.study": search_result.study_name, "optuna.storage": search_result.storage})

        if config.in_program:
            dataset = in_program_labels(dataset)
        train, val, test = make_split(dataset, config)
        sizes = {"train": len(train), "val": len(val), "test": len(test)}
        mlflow.log_params({**config_params(config), **_dataset_params(dataset),
                           **{f"rows.{k}": str(v) for k, v in sizes.items()}, "from": str(warm_from or ""),
                           "from.version": str(previous.version or "") if previous else "",
                           "compare_metric": metric, "alias": alias})
        say(f"split {config.split}: {sizes['train']} train, {sizes['val']} validation, {sizes['test']} test rows")

        surrogate = Surrogate(config)
        if previous is not None:
            warm_start(surrogate, previous.surrogate)

        spent: list[float] = []

        def on_epoch(epoch: int, m: dict[str, float]) -> bool:
            log_metrics(mlflow, {("epoch_s" if k == "seconds" else k): v for k, v in m.items()
                                 if k != "epoch" and math.isfinite(v)}, step=epoch)
            val = f", validation median APE {100 * m['val_median_ape']:.3f}%" if "val_median_ape" in m else ""
            spent.append(float(m.get("seconds", 0.0)))
            left = (config.epochs - len(spent)) * sum(spent) / len(spent)
            say(f"  epoch {epoch + 1}/{config.epochs}: train loss {m['train_loss']:.4g}{val} ({spent[-1]:.1f} s; "
                f"at most {format_seconds(left)} left, less if validation stops improving)")
            return True

        t = time.perf_counter()
        surrogate.fit(dataset, train, val, on_epoch=on_epoch)
        lap("fit_s", t)
        say(f"trained {surrogate.metrics.get('epochs_run')} epochs in {timings['fit_s']:.1f} s")

        t = time.perf_counter()
        splits: dict[str, Any] = {}
        for split_name, index in (("train", train), ("val", val), ("test", test)):
            rows, pred, splits[split_name] = _evaluate_split(surrogate, dataset, index, ops_of)
            log_metrics(mlflow, flat_metrics(splits[split_name], split_name, groups=split_name != "train"))
        lap("evaluate_s", t)
        say(f"test: median APE {100 * splits['test'].get('median_ape', float('nan')):.2f}% on "
            f"{splits['test'].get('n', 0)} held-out rows")
        if plots and not rows.empty:                       # rows, pred: the test split's
            _log_plots(mlflow, rows, pred, ops_of(rows["hash"]), splits["test"],
                       f"{name}: held-out test rows ({config.split} split)")

        base_reports: dict[str, dict[str, Any]] = {}
        if baselines:
            t = time.perf_counter()
            base_reports = _baselines(dataset, config, train, val, test, ops_of)
            for bname, rep in base_reports.items():
                log_metrics(mlflow, flat_metrics(rep, f"baseline/{bname}/test"))
            lap("baselines_s", t)

        champion, compared, compared_versions = None, {}, {}
        if register or previous is not None:
            champion, compared, compared_versions = _compare(
                mlflow, client, name, alias, previous, dataset, test, config.fidelity, ops_of, tracking_uri, say)

        tags = {"fidelity": config.fidelity, "split": config.split, "dataset": str(dataset.path)}
        model = log_surrogate(mlflow, client, surrogate, run_id, params=config_params(config), tags=tags)
        model_uri = f"models:/{model.model_id}"
        log_metrics(mlflow, flat_metrics(splits["test"], "test", groups=False), model_id=model.model_id)
        version, promoted = None, False
        if register:
            version, promoted = _register(mlflow, client, name, alias, model_uri, run_id, champion, splits["test"],
                                          compared.get(alias) if champion is not None else None, metric, tags, say)
        lap("total_s", t0)
        log_metrics(mlflow, {f"time/{k}": v for k, v in timings.items()})
    return TrainOutcome(surrogate, run_id, exp_id, model_uri, name, version, alias, promoted, splits["test"], splits,
                        base_reports, compared, compared_versions, sizes, search_result, timings)
