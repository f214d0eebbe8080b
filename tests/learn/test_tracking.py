"""The MLflow store convention: SQLite backend with artifacts beside it, inside the folder given."""
from __future__ import annotations

import pytest

from hespas_ml.learn.tracking import resolve_uri, setup_mlflow


@pytest.mark.slow
def test_folder_store_gets_sqlite_backend_and_artifacts_beside_it(tmp_path):
    store = tmp_path / "runs"
    mlflow = setup_mlflow(store, experiment="unit")
    with mlflow.start_run() as run:
        mlflow.log_param("seed", 3)
        mlflow.log_metric("mape", 0.5)
        (tmp_path / "note.txt").write_text("hello")
        mlflow.log_artifact(str(tmp_path / "note.txt"))
    assert (store / "mlflow.db").is_file()
    logged = list((store / "artifacts" / "unit").rglob("note.txt"))
    assert len(logged) == 1 and logged[0].read_text() == "hello"
    got = mlflow.get_run(run.info.run_id)
    assert got.data.params["seed"] == "3" and got.data.metrics["mape"] == 0.5
    # the same experiment is found again, not created twice
    setup_mlflow(store, experiment="unit")
    assert len(mlflow.search_experiments(filter_string="name = 'unit'")) == 1


def test_uris_with_a_scheme_are_used_as_given():
    assert resolve_uri("sqlite:////x/y.db") == ("sqlite:////x/y.db", None)
    assert resolve_uri("http://127.0.0.1:5000") == ("http://127.0.0.1:5000", None)
