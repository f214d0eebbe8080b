"""``hespas-ml train`` / ``predict`` / ``simulate --fidelity surrogate:…`` end to end: a tiny surrogate
trained on the smoke dataset into a temporary MLflow store, then used through the registry."""
from __future__ import annotations

import contextlib
import io
import json
import re
import math

import pytest

from hespas_ml.cli.main import main
from hespas_ml.learn.fidelity import SurrogateFidelity
from hespas_ml.learn.registry import model_name
from tests.conftest import in_project, readme_command

pytestmark = pytest.mark.slow   # exports programs, starts workers, builds datasets or trains

NAME = model_name("roofline")
MLP = "zoo:mlp?layers=2&width=64&batch=16"
TINY = """# a configuration that trains in a second or two
hidden: 16
layers: 2
head_hidden: 32
epochs: 8
batch_size: 16
patience: 8
ensemble: 3
split: family
lr: 3e-3
"""


def run(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def one_line_error(code: int, err: str) -> str:
    assert code == 2
    lines = [x for x in err.splitlines() if x.startswith("hespas-ml: error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def trained(smoke_ds, tmp_path_factory):
    root = tmp_path_factory.mktemp("learn-cli")
    (root / "tiny.yaml").write_text(TINY)
    code, out, err = run("train", "--dataset", smoke_ds.path, "--fidelity", "roofline", "--config", root / "tiny.yaml",
                         "--tracking-uri", root / "store", "--save", root / "saved", "--json")
    assert code == 0, err
    return {"root": root, "store": root / "store", "saved": root / "saved", "result": json.loads(out),
            "log": err}


def test_train_registers_a_version_and_saves_a_model_card(trained):
    res = trained["result"]
    assert res["name"] == NAME and res["version"] == "1" and res["promoted"] and res["alias"] == "champion"
    assert res["config"]["hidden"] == 16 and res["config"]["lr"] == 3e-3           # YAML's 3e-3 read as a number
    assert res["split_rows"]["test"] > 0 and 0 <= res["splits"]["test"]["median_ape"] < 0.05
    assert set(res["baselines"]) == {"roofline", "gbm"}
    assert "llama" in res["splits"]["test"]["per_family"]                           # the held-out family
    assert re.search(r"epoch 1/\d+: train loss .*at most .* left", trained["log"])     # progress went to stderr
    card = (trained["saved"] / "MODEL_CARD.md").read_text()
    for needle in ("# Learned surrogate of the `roofline` fidelity", "## Data", "## Split", "held-out test rows",
                   "| **surrogate** |", "baseline: gbm", "## Reproduce", "hespas-ml", "llama"):
        assert needle in card, needle
    assert (trained["saved"] / "weights.pt").is_file() and (trained["saved"] / "surrogate.json").is_file()


def test_a_profiling_model_card_says_how_steady_the_labelling_machine_was(trained, smoke_ds):
    root = trained["root"]
    code, out, err = run("train", "--dataset", smoke_ds.path, "--fidelity", "profiling", "--config", root / "tiny.yaml",
                         "--tracking-uri", root / "store", "--save", root / "profiling", "--json")
    assert code == 0, err
    card = (root / "profiling" / "MODEL_CARD.md").read_text()
    assert "* labelling machine's timing steadiness: not checked" in card       # the smoke build is too short
    assert "timing steadiness" not in (trained["saved"] / "MODEL_CARD.md").read_text()   # roofline: no machine


def test_predict_from_the_registry_matches_the_saved_model(trained):
    code, out, err = run("predict", MLP, "--fidelity", "roofline", "--model", f"{NAME}@champion", "--target", "H100",
                         "--tracking-uri", trained["store"], "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["fidelity"] == "surrogate:roofline" and res["target"] == "H100"
    assert 0 < res["n_unique"] < res["n_regions"] == len(res["regions"])           # repeated regions predicted once
    for r in res["regions"]:
        assert math.isfinite(r["seconds"]) and 0 < r["lower_s"] <= r["seconds"] <= r["upper_s"]
    assert res["total_interval_s"][0] <= res["total_s"] <= res["total_interval_s"][1]
    assert res["total_s"] == pytest.approx(sum(r["seconds"] * r["count"] for r in res["regions"]))
    # whether each region lies inside what the model learned (the smoke MLP's do, all of them)
    assert all(r["in_domain"] is True and r["outside"] == [] for r in res["regions"])
    assert res["n_outside_domain"] == 0
    # the registered model is the saved one
    code, out2, _ = run("predict", MLP, "--model", trained["saved"], "--target", "H100", "--json")
    assert code == 0
    assert [r["seconds"] for r in json.loads(out2)["regions"]] == [r["seconds"] for r in res["regions"]]
    code, text, _ = run("predict", MLP, "--model", trained["saved"], "--target", "TPUv4", "--top", "3")
    assert code == 0 and "most expensive regions" in text and "unique" in text and "TPUv4" in text


def test_simulate_with_a_registered_surrogate_reports_an_interval(trained, monkeypatch):
    monkeypatch.setenv("HESPAS_ML_TRACKING_URI", str(trained["store"]))
    for fidelity in (f"surrogate:{NAME}@champion", f"surrogate:{trained['saved']}"):
        code, out, err = run("simulate", MLP + "&devices=2", "--system", "ring:2x100", "--fidelity", fidelity,
                             "--json")
        assert code == 0, err
        res = json.loads(out)
        lo, hi = res["step_time_interval_s"]
        assert res["fidelity"] == fidelity and 0 < lo <= res["step_time_s"] <= hi
    # the human-readable summary shows the interval beside the step time
    code, out, err = run("simulate", MLP + "&devices=2", "--system", "ring:2x100", "--fidelity",
                         f"surrogate:{trained['saved']}")
    assert code == 0, err
    step_line = next(line for line in out.splitlines() if line.startswith("step time"))
    assert "(interval " in step_line and " .. " in step_line
    # analytical fidelities give no interval
    code, out, _ = run("simulate", MLP, "--json")
    assert code == 0 and json.loads(out)["step_time_interval_s"] is None
    code, out, _ = run("simulate", MLP)
    assert code == 0 and "interval" not in next(line for line in out.splitlines() if line.startswith("step time"))


def test_retrain_from_the_champion_creates_a_version_and_compares(trained, smoke_ds):
    code, out, err = run("train", "--dataset", smoke_ds.path, "--fidelity", "roofline", "--from", f"{NAME}@champion",
                         "--epochs", "2", "--tracking-uri", trained["store"], "--no-baselines", "--no-plots", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["version"] == "2" and res["config"]["epochs"] == 2 and res["config"]["hidden"] == 16
    assert res["compared_versions"]["champion"] == "1"
    old, new = res["compared"]["champion"]["median_ape"], res["splits"]["test"]["median_ape"]
    assert res["promoted"] == (new < old)


def test_a_search_through_the_cli(trained, smoke_ds):
    space = trained["root"] / "space.yaml"
    space.write_text("trial_epochs: 2\nparams:\n  lr: {low: 1e-3, high: 1e-2, log: true}\n")
    code, out, err = run("train", "--dataset", smoke_ds.path, "--fidelity", "roofline", "--config",
                         trained["root"] / "tiny.yaml", "--epochs", "3", "--trials", "2", "--search-space", space,
                         "--tracking-uri", trained["root"] / "search-store", "--no-baselines", "--no-plots", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["search"]["states"] == {"COMPLETE": 2} and res["version"] == "1"
    assert (trained["root"] / "search-store" / "optuna.db").is_file()


def test_bad_input_is_one_line(trained, tmp_path, smoke_ds):
    cases = [
        (("predict", MLP, "--model", f"{NAME}@nope", "--tracking-uri", trained["store"]), "has no alias 'nope'"),
        (("predict", MLP, "--model", "ghost@champion", "--tracking-uri", trained["store"]), "no registered model"),
        (("predict", MLP), "give --fidelity"),
        (("predict", MLP, "--fidelity", "scalesim", "--model", trained["saved"]), "not of --fidelity scalesim"),
        (("simulate", MLP, "--fidelity", "surrogate:/no/such/model"), "no such surrogate folder"),
        (("simulate", MLP, "--fidelity", "surrogate:nothing"), "unknown model reference"),
        (("train", "--dataset", tmp_path / "nope", "--fidelity", "roofline"), "no such dataset folder"),
    ]
    bad_cfg = tmp_path / "bad.yaml"
    bad_cfg.write_text("hidden: 16\nwarp: 9\n")
    cases.append((("train", "--dataset", smoke_ds.path, "--fidelity", "roofline", "--config", bad_cfg),
                  "unknown TrainConfig field 'warp'"))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for f in ("surrogate.json", "metrics.json"):
        (corrupt / f).write_bytes((trained["saved"] / f).read_bytes())
    (corrupt / "weights.pt").write_bytes(b"garbage" * 50)
    cases.append((("predict", MLP, "--model", corrupt), "weights.pt: corrupt"))
    cases.append((("simulate", MLP, "--fidelity", f"surrogate:{corrupt}"), "weights.pt: corrupt"))
    for argv, needle in cases:
        code, _, err = run(*argv)
        assert needle in one_line_error(code, err), (argv, err)


def test_surrogate_fidelity_labels_carry_the_interval(trained):
    from hespas_ml.ingest import load_program
    from hespas_ml.split.regions import split_program

    fid = SurrogateFidelity(str(trained["saved"]))
    regions = split_program(load_program(MLP), "fusion").compute_regions()
    labels = fid.label_regions(regions, "H100")
    assert len(labels) == len(regions) and fid.label_regions([], "H100") == []
    for lab in labels:
        assert lab.status == "ok" and lab.meta["interval"] == (lab.meta["lower_s"], lab.meta["upper_s"])
        assert lab.meta["lower_s"] <= lab.seconds <= lab.meta["upper_s"] and lab.meta["coverage"] == 0.9
        assert lab.meta["seen_target"] is True and lab.meta["roofline_s"] > 0
    assert fid.label(regions[0], "H100").seconds == pytest.approx(labels[0].seconds, rel=1e-6)   # float32 batches


def test_the_readmes_train_and_retrain_lines(smoke_ds, tmp_path):
    """The README's two train lines as written (on the smoke dataset, into a store of their own): the
    first registers a champion, the second warm-starts from it."""
    store = ["--tracking-uri", str(tmp_path / "store"), "--no-plots"]
    with in_project():
        first = readme_command("hespas-ml train --dataset out/datasets/smoke", {"out/datasets/smoke": str(smoke_ds.path)})
        code, out, err = run(*first, *store, "--json")
        assert code == 0, err
        res = json.loads(out)
        assert res["version"] == "1" and res["promoted"] and res["config"]["epochs"] == 80
        again = readme_command("hespas-ml train --dataset NEW_DATA", {"NEW_DATA": str(smoke_ds.path)})
        code, out, err = run(*again, *store, "--json")
        assert code == 0, err
        res = json.loads(out)
        assert res["version"] == "2" and res["compared_versions"]["champion"] == "1"
