"""Where MLflow keeps runs, models and the registry: one convention for training, searches and studies.

The default store is ``./mlruns`` (its contents are git-ignored): a SQLite backend ``mlruns/mlflow.db``
(MLflow 3.17 refuses the plain file store) with artifacts beside it in ``mlruns/artifacts``. Any other
tracking URI (``sqlite:///…``, ``http://…``, a folder) is accepted; a folder means the same layout there.
"""
from __future__ import annotations

import os
from pathlib import Path

DEFAULT_STORE = Path("mlruns")


def _quiet() -> None:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "true")


def resolve_uri(uri: str | os.PathLike[str] | None = None) -> tuple[str, str | None]:
    """(tracking URI, artifact root or None) for ``uri``: None means ``./mlruns``; a folder path means a
    SQLite store inside it; a URI with a scheme is used as given (its server decides the artifacts)."""
    if uri is None:
        uri = os.environ.get("HESPAS_ML_TRACKING_URI") or DEFAULT_STORE
    text = str(uri)
    if "://" in text or text.startswith("sqlite:"):
        return text, None
    folder = Path(text).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'mlflow.db'}", (folder / "artifacts").as_uri()


def setup_mlflow(uri: str | os.PathLike[str] | None = None, experiment: str | None = None):
    """Point MLflow at the store and (optionally) select ``experiment``, creating it with artifacts in the
    store's artifact folder. Returns the ``mlflow`` module, imported here (it takes ~2 s)."""
    _quiet()
    import mlflow

    tracking, artifacts = resolve_uri(uri)
    mlflow.set_tracking_uri(tracking)
    mlflow.set_registry_uri(tracking)
    if experiment is not None:
        client = mlflow.MlflowClient(tracking)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            exp_id = client.create_experiment(experiment, artifact_location=
                                              f"{artifacts}/{experiment}" if artifacts else None)
        else:
            exp_id = found.experiment_id
        mlflow.set_experiment(experiment_id=exp_id)
    return mlflow
