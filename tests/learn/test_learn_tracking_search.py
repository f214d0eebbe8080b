"""Tracked training, the model registry and the Optuna search, on real MLflow / Optuna SQLite stores and
tiny surrogates trained on the smoke dataset."""
from __future__ import annotations


import numpy as np
import pytest

from hespas_ml.ingest.errors import HespasError
from hespas_ml.learn.config import LearnError
from hespas_ml.learn.registry import CHAMPION, RegistryError, load_surrogate, model_name, parse_model_ref
from hespas_ml.learn.runs import train_and_register
from hespas_ml.learn.search import SearchError, parse_space
from hespas_ml.learn.surrogate import Surrogate
from hespas_ml.learn.tracking import setup_mlflow

pytestmark = pytest.mark.slow   # exports programs, starts workers, builds datasets or trains

NAME = model_name("roofline")


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert msg and "\n" not in msg
    return msg


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("mlflow-store")


@pytest.fixture(scope="module")
def first(smoke_ds, store):
    """Version 1 of the roofline surrogate, trained and registered in the module's store."""
    from hespas_ml.learn.config import TrainConfig

    config = TrainConfig(hidden=16, layers=2, head_hidden=32, epochs=10, batch_size=16, patience=10, ensemble=3,
                         split="family", seed=0)
    return train_and_register(smoke_ds, config, tracking_uri=store)


def test_a_run_logs_params_metrics_plots_and_the_model_and_registers_it(first, store, smoke_ds):
    mlflow = setup_mlflow(store)
    client = mlflow.MlflowClient()
    run = client.get_run(first.run_id)
    p, m = run.data.params, run.data.metrics
    assert p["fidelity"] == "roofline" and p["hidden"] == "16" and p["split"] == "family"
    assert p["dataset"] == str(smoke_ds.path) and int(p["rows.test"]) == first.split_sizes["test"] > 0
    # per split, per family (the held-out family is llama), per target, per op family, and the baselines
    for key in ("train/median_ape", "val/median_ape", "test/median_ape", "test/p90_ape", "test/kendall_tau",
                "test/coverage", "test/family/llama/median_ape", "test/target/H100/median_ape",
                "test/op/dot/median_ape", "baseline/roofline/test/median_ape", "baseline/gbm/test/median_ape"):
        assert key in m, key
    assert m["test/median_ape"] == pytest.approx(first.test["median_ape"])
    assert m["baseline/roofline/test/median_ape"] == pytest.approx(0.0, abs=1e-9)   # the roofline is exact
    # the training curve, one point per epoch
    curve = client.get_metric_history(first.run_id, "train_loss")
    assert [x.step for x in curve] == list(range(first.surrogate.metrics["epochs_run"]))
    # plots are PNG artifacts
    arts = {a.path for a in client.list_artifacts(first.run_id, "plots")}
    assert {"plots/parity_test.png", "plots/error_by_op_family_test.png", "plots/report_test.json"} <= arts
    local = mlflow.artifacts.download_artifacts(run_id=first.run_id, artifact_path="plots/parity_test.png")
    with open(local, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    # the model: a logged model of our flavour (no pyfunc pickle), registered, aliased
    model_dir = mlflow.artifacts.download_artifacts(artifact_uri=first.model_uri)
    import os
    import yaml
    files = set(os.listdir(model_dir))
    assert {"MLmodel", "weights.pt", "surrogate.json", "metrics.json"} <= files
    assert not any(f.endswith((".pkl", ".pickle")) for f in files)
    flavors = yaml.safe_load(open(os.path.join(model_dir, "MLmodel")))["flavors"]
    assert list(flavors) == ["hespas_surrogate"]
    assert first.version == "1" and first.promoted
    assert str(client.get_model_version_by_alias(NAME, CHAMPION).version) == "1"
    mv = client.get_model_version(NAME, "1")
    assert mv.run_id == first.run_id and float(mv.tags["test_median_ape"]) == pytest.approx(first.test["median_ape"],
                                                                                             rel=1e-5)


def test_registry_model_predicts_exactly_like_the_in_memory_one(first, store, smoke_ds):
    records = [smoke_ds.region_graph(h) for h in smoke_ds.regions["hash"]]
    mem = first.surrogate.predict_records(records, "H100")
    for ref in (f"{NAME}@{CHAMPION}", f"models:/{NAME}/1", first.model_uri):
        loaded = load_surrogate(ref, store)
        got = loaded.surrogate.predict_records(records, "H100")
        np.testing.assert_array_equal(got.seconds, mem.seconds)
        np.testing.assert_array_equal(got.lower, mem.lower)
        np.testing.assert_array_equal(got.upper, mem.upper)
    assert load_surrogate(f"{NAME}@{CHAMPION}", store).version == "1"


def test_a_worse_model_is_registered_but_the_alias_stays(first, store, smoke_ds):
    from hespas_ml.learn.config import TrainConfig

    # learning nothing (tiny lr, no roofline input) is far worse on the same held-out rows
    bad = TrainConfig(hidden=16, layers=2, head_hidden=32, epochs=2, batch_size=16, ensemble=2, split="family",
                      seed=0, lr=1e-6, residual=False, roofline_input=False)
    out = train_and_register(smoke_ds, bad, tracking_uri=store, baselines=False, plots=False)
    assert out.version == "2" and not out.promoted
    # the champion was re-evaluated on this run's test rows: the same rows as its own run (same split)
    assert out.compared[CHAMPION]["median_ape"] == pytest.approx(first.test["median_ape"], rel=1e-9)
    assert out.test["median_ape"] > out.compared[CHAMPION]["median_ape"]
    client = setup_mlflow(store).MlflowClient()
    assert str(client.get_model_version_by_alias(NAME, CHAMPION).version) == "1"
    m = client.get_run(out.run_id).data.metrics
    assert m["champion/test/median_ape"] == pytest.approx(first.test["median_ape"]) and m["promoted"] == 0.0


def test_retrain_from_a_registered_model_warm_starts_and_compares(first, store, smoke_ds):
    out = train_and_register(smoke_ds, first.surrogate.config, tracking_uri=store, warm_from=f"{NAME}@{CHAMPION}",
                             config_overrides={"epochs": 3, "lr": 1e-3}, baselines=False, plots=False)
    assert out.name == NAME and int(out.version) >= 2
    assert out.surrogate.config.epochs == 3 and out.surrogate.config.hidden == first.surrogate.config.hidden
    assert out.compared_versions[CHAMPION] == "1" and "from" in out.compared
    # warm: its first epoch starts from the trained weights, far below a cold start's first epoch
    warm0 = out.surrogate.metrics["history"][0]["train_loss"]
    cold0 = first.surrogate.metrics["history"][0]["train_loss"]
    assert warm0 < 0.5 * cold0
    client = setup_mlflow(store).MlflowClient()
    run = client.get_run(out.run_id)
    assert run.data.params["from"] == f"{NAME}@{CHAMPION}" and run.data.params["from.version"] == "1"
    assert "champion/test/median_ape" in run.data.metrics and "test/median_ape" in run.data.metrics
    holder = str(client.get_model_version_by_alias(NAME, CHAMPION).version)
    assert holder == (out.version if out.promoted else "1")
    assert out.promoted == (out.test["median_ape"] < out.compared[CHAMPION]["median_ape"])
    # a warm start keeps the architecture
    with pytest.raises(RegistryError) as err:
        train_and_register(smoke_ds, first.surrogate.config, tracking_uri=store, warm_from=f"{NAME}@{CHAMPION}",
                           config_overrides={"hidden": 32})
    assert "hidden" in _one_line(err.value)


def test_same_seed_same_model(smoke_ds, tiny_config):
    a = Surrogate(tiny_config(epochs=3)).fit(smoke_ds)
    b = Surrogate(tiny_config(epochs=3)).fit(smoke_ds)
    records = [smoke_ds.region_graph(h) for h in list(smoke_ds.regions["hash"])[:20]]
    np.testing.assert_array_equal(a.predict_records(records, "TPUv4").seconds,
                                  b.predict_records(records, "TPUv4").seconds)


def test_search_stores_trials_prunes_a_bad_one_nests_runs_and_registers_the_best(smoke_ds, tmp_path):
    import optuna

    from hespas_ml.learn.config import TrainConfig

    store = tmp_path / "store"
    base = TrainConfig(hidden=16, layers=2, head_hidden=32, epochs=6, batch_size=16, patience=12, ensemble=2,
                       split="random", seed=0, residual=False, roofline_input=False)
    space = parse_space({"trial_epochs": 5, "pruner": {"startup_trials": 1, "warmup_epochs": 1},
                         "params": {"lr": {"low": 1e-7, "high": 1e-2, "log": True},
                                    "hidden": {"choices": [16, 24]}}}, "test space")
    from hespas_ml.learn import search

    # trial 0 is the base configuration; trial 1 (enqueued) cannot learn and is pruned against trial 0
    said: list[str] = []
    out = train_and_register(smoke_ds, base, tracking_uri=store, trials=3, space=space, baselines=False,
                             plots=False, enqueue=[{"lr": 1e-7, "hidden": 16}], progress=said.append)
    res = out.search
    trial_lines = [m for m in said if m.startswith("  trial ")]
    assert [line.split("[")[1].split(",")[0] for line in trial_lines] == ["1/3", "2/3", "3/3"]
    assert all("left]" in line for line in trial_lines) and "pruned" in trial_lines[1]
    assert (store / "optuna.db").is_file() and res.storage == f"sqlite:///{(store / 'optuna.db').resolve()}"
    study = optuna.load_study(study_name=res.study_name, storage=res.storage)
    states = [t.state for t in study.trials]
    assert len(states) == 3
    assert states[0] == optuna.trial.TrialState.COMPLETE and states[1] == optuna.trial.TrialState.PRUNED
    assert study.trials[1].params["lr"] == pytest.approx(1e-7)
    assert study.best_trial.number != 1
    # each trial is a run nested under the training run
    client = setup_mlflow(store).MlflowClient()
    for number, run_id in res.trial_runs.items():
        run = client.get_run(run_id)
        assert run.data.tags["mlflow.parentRunId"] == out.run_id
        assert run.data.tags["optuna.trial"] == str(number)
        assert run.data.tags["optuna.state"] == study.trials[number].state.name
    pruned_run = client.get_run(res.trial_runs[1])
    assert pruned_run.info.status == "KILLED" and "pruned_at_epoch" in pruned_run.data.metrics
    # the best configuration was retrained with the full epochs and registered
    assert out.surrogate.config.lr == pytest.approx(study.best_params["lr"]) and out.surrogate.config.epochs == 6
    assert out.version == "1" and out.promoted
    assert client.get_run(out.run_id).data.metrics["search/trials_pruned"] == float(
        sum(s == optuna.trial.TrialState.PRUNED for s in states))
    # a second search continues the same study
    again = search.run_search(smoke_ds, base, space, 1, tracking_uri=store)
    assert again.study_name == res.study_name and sum(again.states.values()) == 4


@pytest.mark.parametrize("space, needle", [
    ({"params": {"warp": {"low": 1, "high": 2}}}, "params.warp: not a TrainConfig field"),
    ({"params": {"split": {"choices": ["family"]}}}, "params.split: fixed during a search"),
    ({"params": {"lr": {"low": 0.1, "high": 0.01}}}, "params.lr: needs low < high"),
    ({"params": {"lr": {"low": 0, "high": 0.1, "log": True}}}, "low > 0 on a log scale"),
    ({"params": {}}, "non-empty 'params'"),
    ({"params": {"lr": {"low": 1e-4, "high": 1e-2}}, "epochs": 3}, "unknown key 'epochs'"),
])
def test_bad_search_spaces_are_one_line_errors(space, needle):
    with pytest.raises(SearchError) as err:
        parse_space(space, "space.yaml")
    assert needle in _one_line(err.value) and "space.yaml" in str(err.value)


def test_references_and_loading_errors_are_one_line(first, store, tmp_path):
    assert parse_model_ref(f"{NAME}@{CHAMPION}").kind == "registry"
    assert parse_model_ref("roofline").kind == "shipped"
    assert parse_model_ref(f"models:/{NAME}/3").version == "3"
    cases = [(f"{NAME}@nope", "has no alias 'nope'"), ("nobody@champion", "no registered model 'nobody'"),
             (f"models:/{NAME}/99", "has no version 99"), ("nothing", "unknown model reference"),
             ("./missing/model", "no such surrogate folder")]
    for ref, needle in cases:
        with pytest.raises(HespasError) as err:
            load_surrogate(ref, store)
        assert needle in _one_line(err.value), ref
    with pytest.raises(RegistryError) as err:
        load_surrogate(f"{NAME}@{CHAMPION}", tmp_path / "no-store")
    assert "no MLflow store" in _one_line(err.value)
    assert not (tmp_path / "no-store").exists()              # loading never creates a store
    # a corrupt checkpoint: a saved model whose weights are garbage
    saved = first.surrogate.save(tmp_path / "model")
    (saved / "weights.pt").write_bytes(b"\x00not a checkpoint" * 10)
    with pytest.raises(LearnError) as err:
        load_surrogate(saved)
    assert "weights.pt" in _one_line(err.value) and "corrupt" in str(err.value)
    (saved / "surrogate.json").write_text("{")
    with pytest.raises(LearnError) as err:
        load_surrogate(saved)
    assert "surrogate.json" in _one_line(err.value)
