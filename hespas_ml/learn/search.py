"""Hyper-parameter search of a surrogate with Optuna: one study per model and dataset, trials pruned early.

A search space (``hespas_ml/learn/search_spaces/<fidelity>.yaml``) names :class:`~hespas_ml.learn.config.TrainConfig`
fields and their ranges::

    trial_epochs: 40                  # epochs per trial (the retrained best uses the config's epochs)
    pruner: {startup_trials: 2, warmup_epochs: 5}
    params:
      lr: {low: 3.0e-4, high: 1.0e-2, log: true}      # float (log scale)
      layers: {low: 2, high: 4}                        # int (both bounds integers)
      hidden: {choices: [32, 64, 96]}                  # categorical
      pooling: {choices: ["sum,mean,max", "sum,max"]}  # list fields as comma-separated choices

Every trial trains on the split's training rows and is scored by the validation median APE (the test rows
stay untouched for the final comparison). ``Surrogate.fit``'s ``on_epoch`` reports each epoch's
validation median APE to the trial, and Optuna's :class:`~optuna.pruners.MedianPruner` stops trials that
are worse than the median of earlier trials at the same epoch. Each trial is a nested MLflow run under
the calling run. The study lives in an RDB storage, by default SQLite ``optuna.db`` beside the MLflow
store, so a later search with the same study name continues it (``load_if_exists``). The first trial of a
new study is the base configuration itself, so a search never ends worse than not searching.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from ..units import format_seconds
from .config import LearnError, TrainConfig, read_yaml

# Fields a search may not change: they define the data and the split the trials are compared on.
FIXED_FIELDS = ("fidelity", "targets", "max_noise", "split", "holdout", "val_fraction", "test_fraction", "seed",
                "threads")
OBJECTIVE = "val_median_ape"


class SearchError(LearnError):
    """A search space or study problem (one line naming the file or study)."""


@dataclass
class Param:
    """One searched field: a float / int range (``log``, ``step``) or categorical ``choices``."""

    name: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: list[Any] | None = None

    def suggest(self, trial) -> Any:
        if self.choices is not None:
            return trial.suggest_categorical(self.name, self.choices)
        if isinstance(self.low, int) and isinstance(self.high, int) and not isinstance(self.step, float):
            return trial.suggest_int(self.name, self.low, self.high, step=self.step or 1, log=self.log)
        return trial.suggest_float(self.name, float(self.low), float(self.high), step=self.step, log=self.log)

    def contains(self, value: Any) -> bool:
        if self.choices is not None:
            return value in self.choices
        return isinstance(value, (int, float)) and not isinstance(value, bool) and self.low <= value <= self.high


@dataclass
class SearchSpace:
    """Parsed search space (see the module docstring)."""

    params: list[Param]
    trial_epochs: int | None = None
    startup_trials: int = 2
    warmup_epochs: int = 3
    origin: str = "search space"

    def to_config(self, base: TrainConfig, values: dict[str, Any], epochs: bool = True) -> TrainConfig:
        """``base`` with the sampled ``values`` (list fields from comma strings); ``epochs``: cap the epochs
        at ``trial_epochs``."""
        data = base.to_dict()
        for k, v in values.items():
            if isinstance(data.get(k), list) and isinstance(v, str):
                v = [p.strip() for p in v.split(",") if p.strip()]
            data[k] = v
        if epochs and self.trial_epochs:
            data["epochs"] = min(int(data["epochs"]), self.trial_epochs)
        return TrainConfig.from_dict(data, self.origin)

    def base_values(self, base: TrainConfig) -> dict[str, Any]:
        """The base configuration's values of the searched fields that lie inside the space."""
        out = {}
        for p in self.params:
            v = getattr(base, p.name)
            if isinstance(v, list):
                v = ",".join(map(str, v))
            if p.contains(v):
                out[p.name] = v
        return out


def _number(value: Any, where: str) -> float | int:
    if isinstance(value, bool):
        raise SearchError(f"{where}: expected a number, got {value!r}")
    if isinstance(value, (int, float)):
        return value
    try:
        return float(value)              # YAML 1.1 reads 1e-4 as a string
    except (TypeError, ValueError):
        raise SearchError(f"{where}: expected a number, got {value!r}") from None


def parse_space(data: Any, origin: str = "search space") -> SearchSpace:
    """A :class:`SearchSpace` from its mapping form; every problem names ``origin`` and the key."""
    if not isinstance(data, dict) or not isinstance(data.get("params"), dict) or not data["params"]:
        raise SearchError(f"{origin}: expected a mapping with a non-empty 'params' mapping")
    unknown = sorted(set(data) - {"params", "trial_epochs", "pruner"})
    if unknown:
        raise SearchError(f"{origin}: unknown key '{unknown[0]}' (params, trial_epochs, pruner)")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    params = []
    for name, spec in data["params"].items():
        where = f"{origin}: params.{name}"
        if name not in fields:
            raise SearchError(f"{where}: not a TrainConfig field")
        if name in FIXED_FIELDS:
            raise SearchError(f"{where}: fixed during a search (it changes the data or the split)")
        if not isinstance(spec, dict):
            raise SearchError(f"{where}: expected {{low, high[, log, step]}} or {{choices: [...]}}")
        bad = sorted(set(spec) - {"low", "high", "log", "step", "choices"})
        if bad:
            raise SearchError(f"{where}: unknown key '{bad[0]}'")
        if "choices" in spec:
            choices = spec["choices"]
            if not isinstance(choices, list) or not choices or not all(
                    c is None or isinstance(c, (bool, int, float, str)) for c in choices):
                raise SearchError(f"{where}.choices: expected a non-empty list of numbers, strings or booleans")
            params.append(Param(name, choices=list(choices)))
            continue
        if "low" not in spec or "high" not in spec:
            raise SearchError(f"{where}: give low and high (or choices)")
        low, high = _number(spec["low"], f"{where}.low"), _number(spec["high"], f"{where}.high")
        step = _number(spec["step"], f"{where}.step") if spec.get("step") is not None else None
        log = spec.get("log", False)
        if not isinstance(log, bool):
            raise SearchError(f"{where}.log: expected true or false")
        if not low < high or (log and low <= 0):
            raise SearchError(f"{where}: needs low < high" + (" and low > 0 on a log scale" if log else ""))
        params.append(Param(name, low, high, log, step))
    out = SearchSpace(params, origin=origin)
    if data.get("trial_epochs") is not None:
        te = data["trial_epochs"]
        if not isinstance(te, int) or isinstance(te, bool) or te < 1:
            raise SearchError(f"{origin}: trial_epochs must be a positive integer, got {te!r}")
        out.trial_epochs = te
    pruner = data.get("pruner") or {}
    if not isinstance(pruner, dict) or set(pruner) - {"startup_trials", "warmup_epochs"}:
        raise SearchError(f"{origin}: pruner takes startup_trials and warmup_epochs")
    for key, attr in (("startup_trials", "startup_trials"), ("warmup_epochs", "warmup_epochs")):
        if key in pruner:
            v = pruner[key]
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise SearchError(f"{origin}: pruner.{key} must be a non-negative integer, got {v!r}")
            setattr(out, attr, v)
    return out


def load_space(path: str | os.PathLike[str]) -> SearchSpace:
    """Read a search-space YAML file."""
    return parse_space(read_yaml(path, "search-space", SearchError), str(Path(path)))


def default_space_path(fidelity: str) -> Path:
    """The shipped search space of ``fidelity``: ``hespas_ml/learn/search_spaces/<fidelity>.yaml`` (package
    data)."""
    return Path(str(resources.files("hespas_ml.learn") / "search_spaces" / f"{fidelity}.yaml"))


def optuna_storage(tracking_uri: str | os.PathLike[str] | None = None) -> str:
    """The study storage beside the MLflow store: ``<folder>/optuna.db`` for a folder store, the same folder
    as a ``sqlite:///…`` database, else ``./optuna.db``."""
    from .tracking import DEFAULT_STORE

    uri = tracking_uri if tracking_uri is not None else os.environ.get("HESPAS_ML_TRACKING_URI") or DEFAULT_STORE
    text = str(uri)
    if text.startswith("sqlite:///"):
        return f"sqlite:///{Path(text[len('sqlite:///'):]).parent / 'optuna.db'}"
    if "://" in text:
        return f"sqlite:///{Path.cwd() / 'optuna.db'}"
    folder = Path(text).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'optuna.db'}"


@dataclass
class SearchResult:
    """The outcome of :func:`run_search`."""

    study_name: str
    storage: str
    best_config: TrainConfig
    best_value: float
    best_trial: int
    states: dict[str, int] = field(default_factory=dict)     # COMPLETE / PRUNED / FAIL counts of the study
    trial_runs: dict[int, str] = field(default_factory=dict)  # trial number -> nested MLflow run id (this call)

    def metrics(self) -> dict[str, float]:
        out = {"search/best_val_median_ape": self.best_value, "search/best_trial": float(self.best_trial)}
        out.update({f"search/trials_{k.lower()}": float(v) for k, v in self.states.items()})
        return out


def run_search(dataset, base: TrainConfig, space: SearchSpace | str | os.PathLike[str] | None, trials: int, *,
               storage: str | None = None, study_name: str | None = None,
               tracking_uri: str | os.PathLike[str] | None = None, model: str | None = None,
               experiment: str = "surrogates", enqueue: list[dict[str, Any]] | None = None,
               progress: Callable[[str], None] | None = None) -> SearchResult:
    """Run ``trials`` Optuna trials around ``base`` (see the module docstring) and return the best
    configuration with the full epoch budget of ``base``. Each trial is an MLflow run nested in the active
    run (top-level runs of ``experiment`` if none is active). ``enqueue``: parameter sets to try first (Optuna's
    ``enqueue_trial``), after the base configuration."""
    import optuna

    from .splits import make_split
    from .surrogate import Surrogate
    from .tracking import setup_mlflow

    if trials < 1:
        raise SearchError(f"--trials must be at least 1, got {trials}")
    if space is None:
        space = default_space_path(base.fidelity)
    if not isinstance(space, SearchSpace):
        space = load_space(space)
    say = progress or (lambda _msg: None)
    import mlflow as active

    mlflow = active if active.active_run() is not None else setup_mlflow(tracking_uri, experiment)
    storage = storage or optuna_storage(tracking_uri)
    ds_name = str((dataset.manifest.get("spec") or {}).get("name", Path(str(dataset.path)).name))
    study_name = study_name or f"{model or 'hespas-surrogate-' + base.fidelity}.{ds_name}.{base.split}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.create_study(
            study_name=study_name, storage=storage, direction="minimize", load_if_exists=True,
            sampler=optuna.samplers.TPESampler(seed=base.seed),
            pruner=optuna.pruners.MedianPruner(n_startup_trials=space.startup_trials,
                                               n_warmup_steps=space.warmup_epochs))
    except Exception as exc:  # noqa: BLE001 - storage errors come in many kinds
        raise SearchError(f"{storage}: cannot open study '{study_name}' "
                          f"({type(exc).__name__}: {' '.join(str(exc).split())[:160]})") from None
    fresh = not study.trials
    if fresh:
        study.enqueue_trial(space.base_values(base), skip_if_exists=True)
    for values in enqueue or []:
        study.enqueue_trial(values, skip_if_exists=True)
    train, val, _ = make_split(dataset, base)
    runs: dict[int, str] = {}
    parent = mlflow.active_run()
    spent: list[float] = []

    def progress_of(began: float) -> str:
        """``k/N`` trials of this call and about how long the rest take, at this call's mean so far."""
        spent.append(time.perf_counter() - began)
        left = (trials - len(spent)) * sum(spent) / len(spent)
        return f"[{len(spent)}/{trials}, {spent[-1]:.0f} s; about {format_seconds(left)} left]"

    def objective(trial: "optuna.Trial") -> float:
        began = time.perf_counter()
        values = {p.name: p.suggest(trial) for p in space.params}
        config = space.to_config(base, values)
        run = mlflow.start_run(run_name=f"trial-{trial.number}", nested=parent is not None)
        runs[trial.number] = run.info.run_id
        status = "FAILED"
        try:
            mlflow.set_tags({"hespas.kind": "optuna-trial", "optuna.study": study_name,
                             "optuna.trial": str(trial.number)})
            mlflow.log_params({k: (",".join(map(str, v)) if isinstance(v, list) else str(v))
                               for k, v in config.to_dict().items()})
            pruned = []

            def on_epoch(epoch: int, m: dict[str, float]) -> bool:
                finite = {("epoch_s" if k == "seconds" else k): v for k, v in m.items()
                          if k != "epoch" and math.isfinite(v)}
                mlflow.log_metrics(finite, step=epoch)
                value = m.get(OBJECTIVE, m.get("train_loss"))
                trial.report(float(value), epoch)
                if trial.should_prune():
                    pruned.append(epoch)
                    return False
                return True

            surrogate = Surrogate(config).fit(dataset, train, val, on_epoch=on_epoch)
            if pruned:
                mlflow.set_tag("optuna.state", "PRUNED")
                mlflow.log_metric("pruned_at_epoch", pruned[0])
                status = "KILLED"
                say(f"  trial {trial.number}: pruned at epoch {pruned[0]}  {progress_of(began)}")
                raise optuna.TrialPruned()
            value = float(surrogate.metrics["val_median_ape"])
            mlflow.log_metric("objective", value)
            mlflow.set_tag("optuna.state", "COMPLETE")
            status = "FINISHED"
            say(f"  trial {trial.number}: validation median APE {100 * value:.3f}%  {values}  {progress_of(began)}")
            return value
        finally:
            mlflow.end_run(status=status)

    study.optimize(objective, n_trials=trials, catch=(LearnError,), gc_after_trial=False)
    states: dict[str, int] = {}
    for t in study.trials:
        states[t.state.name] = states.get(t.state.name, 0) + 1
    try:
        best = study.best_trial
    except ValueError:
        raise SearchError(f"study '{study_name}' in {storage}: no trial completed "
                          f"({', '.join(f'{k} {v}' for k, v in states.items())})") from None
    best_config = space.to_config(base, best.params, epochs=False)
    say(f"search: best trial {best.number} (validation median APE {100 * best.value:.3f}%), "
        + ", ".join(f"{k.lower()} {v}" for k, v in sorted(states.items())))
    return SearchResult(study_name, storage, best_config, float(best.value), best.number, states, runs)
