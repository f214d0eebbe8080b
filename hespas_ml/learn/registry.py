"""Tracked training of surrogates and the model registry (MLflow): log, register, promote, load.

One :func:`train_and_register` call is one MLflow run (in the store of
:func:`~hespas_ml.learn.tracking.setup_mlflow`): the configuration and dataset as parameters, the training
curve, accuracy per split / model family / target / op family, the baselines on the same split, a parity
plot and an error histogram by op family as artifacts, and the surrogate as an MLflow *logged model*. The
logged model's artifacts are the surrogate's own saved folder (``weights.pt`` read back with
``weights_only=True``, JSON beside it) plus a minimal ``MLmodel`` file of the ``hespas_surrogate`` flavour,
so nothing is ever pickled or unpickled. The model is then registered as a new version of
``hespas-surrogate-<fidelity>``, and the alias (``champion``) moves to it only when it beats the aliased
version on the *same* held-out rows (the aliased model is re-evaluated on this run's test split; both
figures are logged).

Model references (:func:`load_surrogate`, ``--model``, ``--from``, ``surrogate:<ref>``):

* ``roofline`` / ``scalesim`` / ``profiling``: the shipped model ``models/<fidelity>/`` (the folder beside
  the package; ``HESPAS_ML_MODELS`` names another);
* a folder written by :meth:`Surrogate.save`;
* ``NAME@alias`` / ``models:/NAME@alias``, ``models:/NAME/VERSION``, ``models:/m-<logged model id>`` and
  ``runs:/<run id>/<path>``: downloaded from the MLflow store (``--tracking-uri``, else
  ``$HESPAS_ML_TRACKING_URI``, else ``./mlruns``) and loaded with :meth:`Surrogate.load`.
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
from typing import Any, Callable, Iterable

import numpy as np

from .config import FIDELITIES, LearnError, TrainConfig
from .surrogate import FORMAT as SURROGATE_FORMAT
from .surrogate import Surrogate

MODEL_PREFIX = "hespas-surrogate-"
CHAMPION = "champion"
EXPERIMENT = "surrogates"
FLAVOR = "hespas_surrogate"
ARTIFACT_NAME = "surrogate"
COMPARE_METRICS = ("median_ape", "p90_ape", "mean_ape", "log_rmse")
# TrainConfig fields that fix the network's shape: a warm start keeps them.
ARCH_FIELDS = ("fidelity", "hidden", "layers", "head_hidden", "pooling", "ensemble", "residual", "residual_base",
               "roofline_input", "systolic_input")
_REF_FORMS = "a fidelity (roofline, scalesim, profiling), a saved surrogate folder, NAME@alias or models:/…"


class RegistryError(LearnError):
    """A model reference, a registry entry or the store is not what was asked for (one line)."""


def model_name(fidelity: str) -> str:
    """The registered-model name of a fidelity's surrogates, e.g. ``hespas-surrogate-roofline``."""
    return f"{MODEL_PREFIX}{fidelity}"


def models_dir() -> Path:
    """Where the shipped models live: ``$HESPAS_ML_MODELS`` or ``models/`` beside the package."""
    env = os.environ.get("HESPAS_ML_MODELS")
    if env:
        return Path(env).expanduser()
    import hespas_ml
    return Path(hespas_ml.__file__).resolve().parents[1] / "models"


# ------------------------------------------------------------------------------------------------ loading

@dataclass(frozen=True)
class ModelRef:
    """A parsed model reference: ``kind`` is ``path``, ``shipped`` or ``registry``; ``uri`` the folder
    (path, shipped) or the MLflow artifact URI (registry)."""

    text: str
    kind: str
    uri: str
    name: str | None = None
    alias: str | None = None
    version: str | None = None


def parse_model_ref(text: str | os.PathLike[str]) -> ModelRef:
    """Parse a model reference (see the module docstring); raises :class:`RegistryError` if it is none."""
    raw = str(text).strip()
    if not raw:
        raise RegistryError(f"empty model reference (give {_REF_FORMS})")
    if raw.startswith("models:/"):
        rest = raw[len("models:/"):].strip("/")
        m = re.fullmatch(r"([^@/]+)@([\w.-]+)", rest)
        if m:
            return ModelRef(raw, "registry", raw, name=m[1], alias=m[2])
        m = re.fullmatch(r"([^@/]+)/(\d+)", rest)
        if m:
            return ModelRef(raw, "registry", raw, name=m[1], version=m[2])
        if re.fullmatch(r"m-[0-9a-f]+", rest):
            return ModelRef(raw, "registry", raw)
        raise RegistryError(f"{raw}: not a model URI (models:/NAME@alias, models:/NAME/VERSION or models:/m-ID)")
    if raw.startswith("runs:/"):
        return ModelRef(raw, "registry", raw)
    path = Path(raw).expanduser()
    if path.exists():
        return ModelRef(raw, "path", str(path))
    if raw in FIDELITIES:
        return ModelRef(raw, "shipped", str(models_dir() / raw))
    m = re.fullmatch(r"([^@/\s]+)@([\w.-]+)", raw)
    if m:
        return ModelRef(raw, "registry", f"models:/{m[1]}@{m[2]}", name=m[1], alias=m[2])
    if os.sep in raw or raw.startswith("."):
        raise RegistryError(f"{raw}: no such surrogate folder")
    raise RegistryError(f"{raw}: unknown model reference (give {_REF_FORMS})")


@dataclass
class LoadedModel:
    """A loaded surrogate and where it came from."""

    surrogate: Surrogate
    ref: ModelRef
    source: str                       # the folder or the registry entry it was read from
    name: str | None = None
    version: str | None = None
    load_s: float = 0.0

    def describe(self) -> str:
        if self.name and self.version:
            return f"{self.name} version {self.version}" + (f" (@{self.ref.alias})" if self.ref.alias else "")
        return self.source


def open_store(tracking_uri: str | os.PathLike[str] | None = None, must_exist: bool = True,
               experiment: str | None = None):
    """(mlflow module, client, tracking URI) of the MLflow store (``experiment`` selected if given); a
    folder store that holds no database yet is an error when ``must_exist`` (loading never creates one)."""
    from .tracking import DEFAULT_STORE, resolve_uri, setup_mlflow

    uri = tracking_uri if tracking_uri is not None else os.environ.get("HESPAS_ML_TRACKING_URI") or DEFAULT_STORE
    text = str(uri)
    if must_exist and "://" not in text and not text.startswith("sqlite:"):
        folder = Path(text).expanduser()
        if not (folder / "mlflow.db").is_file():
            raise RegistryError(f"{folder}: no MLflow store there (nothing was trained into it; give "
                                "--tracking-uri or set HESPAS_ML_TRACKING_URI)")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    mlflow = setup_mlflow(uri, experiment)
    return mlflow, mlflow.MlflowClient(), resolve_uri(uri)[0]


def _registry_version(client, ref: ModelRef, store: str):
    """The model version a registry reference names (None for logged-model and run URIs)."""
    from mlflow.exceptions import MlflowException

    if ref.name is None:
        return None
    try:
        client.get_registered_model(ref.name)
    except MlflowException:
        raise RegistryError(f"{ref.text}: no registered model '{ref.name}' in {store}") from None
    try:
        if ref.alias is not None:
            return client.get_model_version_by_alias(ref.name, ref.alias)
        return client.get_model_version(ref.name, ref.version)
    except MlflowException:
        what = f"alias '{ref.alias}'" if ref.alias is not None else f"version {ref.version}"
        known = sorted((client.get_registered_model(ref.name).aliases or {}).keys())
        hint = f" (aliases: {', '.join(known)})" if known else " (it has no aliases)"
        raise RegistryError(f"{ref.text}: model '{ref.name}' has no {what} in {store}"
                            + (hint if ref.alias is not None else "")) from None


def load_surrogate(ref: str | os.PathLike[str] | ModelRef, tracking_uri: str | os.PathLike[str] | None = None
                   ) -> LoadedModel:
    """Load the surrogate a reference names (see the module docstring). Registry models are downloaded
    into a temporary folder and read with :meth:`Surrogate.load` (no pickle)."""
    t0 = time.perf_counter()
    ref = ref if isinstance(ref, ModelRef) else parse_model_ref(ref)
    if ref.kind in ("path", "shipped"):
        folder = Path(ref.uri)
        if ref.kind == "shipped" and not folder.is_dir():
            raise RegistryError(f"{folder}: no shipped {ref.text} surrogate (train one with 'hespas-ml train "
                                f"--fidelity {ref.text}' and use surrogate:{model_name(ref.text)}@{CHAMPION})")
        return LoadedModel(Surrogate.load(folder), ref, str(folder), load_s=time.perf_counter() - t0)
    mlflow, client, store = open_store(tracking_uri)
    from mlflow.exceptions import MlflowException

    mv = _registry_version(client, ref, store)
    uri = f"models:/{mv.name}/{mv.version}" if mv is not None else ref.uri
    with tempfile.TemporaryDirectory(prefix="hespas-model-") as tmp:
        try:
            local = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=tmp)
        except MlflowException as exc:
            raise RegistryError(f"{ref.text}: cannot download from {store} "
                                f"({' '.join(str(exc).split())[:160]})") from None
        local_path = Path(local)
        if not (local_path / "surrogate.json").is_file() and (local_path / ARTIFACT_NAME).is_dir():
            local_path = local_path / ARTIFACT_NAME
        try:
            surrogate = Surrogate.load(local_path)
        except LearnError as exc:
            msg = str(exc).replace(str(local_path), uri)
            raise RegistryError(f"{ref.text}: {msg}") from None
    return LoadedModel(surrogate, ref, uri, name=mv.name if mv is not None else None,
                       version=str(mv.version) if mv is not None else None, load_s=time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------------ logging

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


OP_FAMILIES = ("conv", "matmul", "gather-scatter", "reduction", "data-movement", "elementwise", "custom")
_GATHER = {"gather", "scatter", "dynamic_slice", "dynamic_update_slice", "sort", "select_and_scatter"}
_MOVE = {"broadcast_in_dim", "reshape", "transpose", "concatenate", "slice", "pad", "copy", "convert", "iota",
         "constant", "reverse", "bitcast_convert", "get_tuple_element", "tuple"}


def op_family(op_counts: dict[str, Any]) -> str:
    """The kind of kernel a region is, from its op counts: the heaviest op class present wins."""
    kinds = set(op_counts)
    if "convolution" in kinds:
        return "conv"
    if "dot_general" in kinds or "dot" in kinds:
        return "matmul"
    if kinds & _GATHER:
        return "gather-scatter"
    if kinds & {"custom_call"}:
        return "custom"
    if kinds & {"reduce", "reduce_window"}:
        return "reduction"
    if kinds <= _MOVE:
        return "data-movement"
    return "elementwise"


def op_families(dataset, hashes: Iterable[str]) -> np.ndarray:
    """:func:`op_family` of each region hash of ``dataset``."""
    table = dataset.regions.set_index("hash")["op_counts"]
    cache: dict[str, str] = {}
    out = []
    for h in hashes:
        fam = cache.get(h)
        if fam is None:
            raw = table.get(h)
            counts = json.loads(raw) if isinstance(raw, str) else (raw or {})
            fam = cache[h] = op_family(counts)
        out.append(fam)
    return np.asarray(out, dtype=object)


def split_report(rows, pred, ops: np.ndarray) -> dict[str, Any]:
    """:func:`~hespas_ml.learn.evaluate.report` plus ``per_op`` (op family) figures."""
    from .evaluate import metrics, report

    lower, upper = getattr(pred, "lower", None), getattr(pred, "upper", None)
    seconds = getattr(pred, "seconds", pred)
    out = report(rows, seconds, lower, upper)
    true, tg = rows["seconds"].to_numpy(dtype=np.float64), rows["target"].to_numpy()
    out["per_op"] = {}
    for fam in sorted(set(ops)):
        sel = ops == fam
        out["per_op"][fam] = metrics(seconds[sel], true[sel], None if lower is None else lower[sel],
                                     None if upper is None else upper[sel], tg[sel])
    return out


def plot_parity(rows, seconds: np.ndarray, ops: np.ndarray, path: Path, title: str) -> Path:
    """Predicted against true seconds (log-log), coloured by op family, with the ±10 % band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    true = rows["seconds"].to_numpy(dtype=np.float64)
    fig, ax = plt.subplots(figsize=(6, 6), dpi=110)
    for fam in OP_FAMILIES:
        sel = ops == fam
        if sel.any():
            ax.scatter(true[sel], seconds[sel], s=6, alpha=0.6, label=f"{fam} ({int(sel.sum())})")
    lo = float(min(true.min(), seconds.min())) / 1.5
    hi = float(max(true.max(), seconds.max())) * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", lw=0.8)
    ax.fill_between([lo, hi], [lo / 1.1, hi / 1.1], [lo * 1.1, hi * 1.1], color="grey", alpha=0.15, lw=0)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="label (s)", ylabel="predicted (s)",
           title=title)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_error_histogram(rows, seconds: np.ndarray, ops: np.ndarray, path: Path, title: str) -> Path:
    """Histograms of the signed error ``predicted / label − 1`` (log-spaced) per op family."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    err = np.log10(seconds / rows["seconds"].to_numpy(dtype=np.float64))
    fams = [f for f in OP_FAMILIES if (ops == f).any()]
    fig, axes = plt.subplots(len(fams), 1, figsize=(6, 1.4 * len(fams) + 0.8), dpi=110, sharex=True,
                             squeeze=False)
    span = max(float(np.quantile(np.abs(err), 0.99)) if len(err) else 0.0, 1e-3)
    bins = np.linspace(-span, span, 41)
    for ax, fam in zip(axes[:, 0], fams):
        e = err[ops == fam]
        ax.hist(np.clip(e, -span, span), bins=bins, color="tab:blue")
        ax.axvline(0.0, color="black", lw=0.8)
        med = float(np.median(np.abs(np.expm1(e * np.log(10)))))
        ax.set_ylabel(fam, rotation=0, ha="right", fontsize=8)
        ax.text(0.99, 0.8, f"n={len(e)}  median |err| {100 * med:.2f}%", transform=ax.transAxes, ha="right",
                fontsize=7)
    ticks = axes[-1, 0].get_xticks()
    axes[-1, 0].set_xticks(ticks, [f"{100 * (10 ** t - 1):+.0f}%" for t in ticks])
    axes[-1, 0].set_xlim(-span, span)
    axes[-1, 0].set_xlabel("predicted / label − 1")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def mlmodel_text(model_id: str | None, run_id: str, surrogate: Surrogate) -> str:
    """A minimal ``MLmodel`` file of the ``hespas_surrogate`` flavour (no python_function flavour: MLflow's
    pyfunc loader has nothing to unpickle; load with :func:`load_surrogate`)."""
    import mlflow
    import yaml

    data = {
        "artifact_path": ARTIFACT_NAME,
        "flavors": {FLAVOR: {"format": SURROGATE_FORMAT,
                             "loader": "hespas_ml.learn.registry.load_surrogate",
                             "files": ["surrogate.json", "weights.pt", "metrics.json"],
                             "fidelity": surrogate.config.fidelity,
                             "weights": "torch state_dict, read with torch.load(weights_only=True)"}},
        "mlflow_version": mlflow.__version__,
        "model_id": model_id,
        "run_id": run_id,
        "utc_time_created": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    return yaml.safe_dump(data, sort_keys=False)


def log_surrogate(mlflow, client, surrogate: Surrogate, run_id: str, params: dict[str, str] | None = None,
                  tags: dict[str, str] | None = None):
    """Log ``surrogate`` as an MLflow logged model of ``run_id`` (its saved folder + an ``MLmodel`` file);
    returns the :class:`~mlflow.entities.LoggedModel` (URI ``models:/<model_id>``)."""
    model = mlflow.initialize_logged_model(name=ARTIFACT_NAME, source_run_id=run_id, model_type=FLAVOR,
                                           params=params, tags=tags)
    try:
        with tempfile.TemporaryDirectory(prefix="hespas-log-") as tmp:
            folder = surrogate.save(Path(tmp) / ARTIFACT_NAME)
            (folder / "MLmodel").write_text(mlmodel_text(model.model_id, run_id, surrogate))
            client.log_model_artifacts(model.model_id, str(folder))
    except BaseException:
        mlflow.finalize_logged_model(model.model_id, "FAILED")
        raise
    mlflow.finalize_logged_model(model.model_id, "READY")
    return model


# ------------------------------------------------------------------------------------------------ registry

def register_version(client, name: str, model_uri: str, run_id: str, tags: dict[str, str] | None = None,
                     description: str | None = None):
    """Register ``model_uri`` as a new version of ``name`` (the registered model is created if new)."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description=f"hespas-ml learned surrogates ({name})")
    return client.create_model_version(name, source=model_uri, run_id=run_id, tags=tags, description=description)


def alias_version(client, name: str, alias: str):
    """The model version ``name@alias`` points at, or None."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def better(new: dict[str, Any], old: dict[str, Any] | None, metric: str) -> bool:
    """Whether report ``new`` beats ``old`` on ``metric`` (lower is better; no old: True)."""
    if old is None:
        return True
    a, b = float(new.get(metric, math.inf)), float(old.get(metric, math.inf))
    if not math.isfinite(b):
        return math.isfinite(a)
    return a < b


# ------------------------------------------------------------------------------------------------ training

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

        def on_epoch(epoch: int, m: dict[str, float]) -> bool:
            log_metrics(mlflow, {("epoch_s" if k == "seconds" else k): v for k, v in m.items()
                                 if k != "epoch" and math.isfinite(v)}, step=epoch)
            val = f", validation median APE {100 * m['val_median_ape']:.3f}%" if "val_median_ape" in m else ""
            say(f"  epoch {epoch}: train loss {m['train_loss']:.4g}{val} ({m.get('seconds', 0):.1f} s)")
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
