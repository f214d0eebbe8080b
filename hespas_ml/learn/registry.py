"""The model registry of surrogates (MLflow): model references, loading, logging a surrogate as an MLflow
model, registering versions and reading aliases.

A surrogate is logged as an MLflow *logged model* whose artifacts are the surrogate's own saved folder
(``weights.pt`` read back with ``weights_only=True``, JSON beside it) plus a minimal ``MLmodel`` file of the
``hespas_surrogate`` flavour, so nothing is ever pickled or unpickled. Versions are registered under
``hespas-surrogate-<fidelity>``; the tracked training run that decides whether the alias (``champion``)
moves is :func:`hespas_ml.learn.runs.train_and_register`.

Model references (:func:`load_surrogate`, ``--model``, ``--from``, ``surrogate:<ref>``):

* ``roofline`` / ``scalesim`` / ``profiling``: the shipped model ``hespas_ml/models/<fidelity>/`` (package data
  the package; ``HESPAS_ML_MODELS`` names another); ``<fidelity>-<name>`` a shipped model beside it (e.g.
  ``profiling-h100``: profiling timings learned on another machine, :func:`shipped_models`);
* a folder written by :meth:`Surrogate.save`;
* ``NAME@alias`` / ``models:/NAME@alias``, ``models:/NAME/VERSION``, ``models:/m-<logged model id>`` and
  ``runs:/<run id>/<path>``: downloaded from the MLflow store (``--tracking-uri``, else
  ``$HESPAS_ML_TRACKING_URI``, else ``./mlruns``) and loaded with :meth:`Surrogate.load`.
"""
from __future__ import annotations

import os
import re
import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .config import FIDELITIES, LearnError
from .surrogate import FORMAT as SURROGATE_FORMAT
from .surrogate import Surrogate

MODEL_PREFIX = "hespas-surrogate-"
CHAMPION = "champion"
EXPERIMENT = "surrogates"
FLAVOR = "hespas_surrogate"
ARTIFACT_NAME = "surrogate"
_REF_FORMS = "a fidelity (roofline, scalesim, profiling), a saved surrogate folder, NAME@alias or models:/…"


class RegistryError(LearnError):
    """A model reference, a registry entry or the store is not what was asked for (one line)."""


def model_name(fidelity: str) -> str:
    """The registered-model name of a fidelity's surrogates, e.g. ``hespas-surrogate-roofline``."""
    return f"{MODEL_PREFIX}{fidelity}"


def models_dir() -> Path:
    """Where the shipped models live: ``$HESPAS_ML_MODELS``, or the package's data (``hespas_ml/models``,
    found with :mod:`importlib.resources`, so an installed wheel has them too)."""
    env = os.environ.get("HESPAS_ML_MODELS")
    if env:
        return Path(env).expanduser()
    return Path(str(resources.files("hespas_ml") / "models"))


def shipped_models(fidelity: str) -> list[str]:
    """The references of the shipped models of ``fidelity``: ``<fidelity>`` first, then every
    ``<fidelity>-<name>`` folder beside it, sorted."""
    root = models_dir()
    extra = sorted(p.name for p in root.glob(f"{fidelity}-*") if (p / "surrogate.json").is_file()) \
        if root.is_dir() else []
    return [fidelity, *extra]


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
    if raw in FIDELITIES or (raw.partition("-")[0] in FIDELITIES and (models_dir() / raw).is_dir()):
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
