"""The shipped surrogates (``hespas_ml/models/<fidelity>/``, and ``profiling-h100/`` beside them): they load fast,
predict sane intervals, carry a model card, and ``surrogate:<fidelity>`` uses them by default in the pipeline."""
from __future__ import annotations

import json
import math
import shutil
import time

import numpy as np
import pytest

from hespas_ml.ingest.errors import HespasError
from hespas_ml.learn.registry import load_surrogate, models_dir

FIDELITIES = ("roofline", "scalesim", "profiling")
SHIPPED = (*FIDELITIES, "profiling-h100")
TARGETS = {"roofline": ["H100", "TPUv4", "B200"], "scalesim": ["TPUv4", "TPUv3"], "profiling": ["host-cpu"],
           "profiling-h100": ["H100"]}
PROGRAM = "zoo:mlp?layers=2&width=64&batch=16&step=train"


@pytest.fixture(scope="module")
def regions():
    from hespas_ml.ingest import load_program
    from hespas_ml.split.regions import split_program

    return split_program(load_program(PROGRAM), "fusion").compute_regions()


@pytest.mark.parametrize("shipped", SHIPPED)
def test_shipped_model_loads_fast_and_predicts_sane_intervals(shipped, regions):
    folder = models_dir() / shipped
    assert (folder / "surrogate.json").is_file(), f"no shipped {shipped} surrogate in {folder}"
    load_surrogate(folder)                                   # warm the imports
    t = time.perf_counter()
    loaded = load_surrogate(shipped)                          # by its name: the shipped folder
    assert time.perf_counter() - t < 1.0
    model = loaded.surrogate
    assert loaded.source == str(folder) and model.config.fidelity == shipped.partition("-")[0]
    if model.config.fidelity == "profiling":                 # a profiling model learned its machines only
        assert sorted(model.trained_on["targets"]) == TARGETS[shipped]
    for target in TARGETS[shipped]:
        pred = model.predict_regions(regions, target)
        assert len(pred) == len(regions)
        for arr in (pred.seconds, pred.lower, pred.upper):
            assert np.isfinite(arr).all() and (arr > 0).all()
        assert (pred.lower <= pred.seconds).all() and (pred.seconds <= pred.upper).all()
        assert (pred.upper > pred.lower).all()


@pytest.mark.parametrize("shipped", SHIPPED)
def test_shipped_model_is_small_and_has_a_model_card(shipped):
    fidelity = shipped.partition("-")[0]
    folder = models_dir() / shipped
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    assert size < 5e6
    card = (folder / "MODEL_CARD.md").read_text()
    for needle in ("## Data", "## Split", "## Metrics on the held-out test rows", "median APE", "## Reproduce",
                   "hespas-ml train", f"--fidelity {fidelity}"):
        assert needle in card, needle
    assert not list(folder.glob("*.pkl"))


def test_simulate_with_the_shipped_roofline_surrogate_gives_an_interval():
    from hespas_ml.pipeline import simulate

    res = simulate(PROGRAM.replace("step=train", "step=train&devices=2"), target="H100", system="ring:2x100",
                   fidelity="surrogate:roofline")
    lo, hi = res.step_time_interval_s
    assert res.fidelity == "surrogate:roofline" and 0 < lo <= res.step_time_s <= hi and math.isfinite(hi)
    assert res.to_dict()["step_time_interval_s"] == [lo, hi]
    roof = simulate(PROGRAM.replace("step=train", "step=train&devices=2"), target="H100", system="ring:2x100")
    assert roof.step_time_interval_s is None
    # the roofline surrogate reproduces the roofline it learned closely on a simple MLP
    assert res.step_time_s == pytest.approx(roof.step_time_s, rel=0.1)


def test_surrogates_refuse_targets_their_fidelity_cannot_answer_for(regions):
    """As the labellers do: SCALE-Sim needs systolic arrays, profiling measures only the machine it runs on
    (the shipped profiling surrogates learned host-cpu's and the H100's timings and nothing else)."""
    from hespas_ml.fidelities import get_fidelity

    with pytest.raises(HespasError, match="H100 has no systolic arrays") as err:
        get_fidelity("surrogate:scalesim").label_regions(regions, "H100")
    assert "\n" not in str(err.value)
    profiling = get_fidelity("surrogate:profiling")
    with pytest.raises(HespasError, match="timings of H100, host-cpu only, not of A100-40GB") as err:
        profiling.label_regions(regions, "A100-40GB")
    assert "\n" not in str(err.value)
    assert all(lab.status == "ok" for lab in profiling.label_regions(regions, "host-cpu"))
    assert len(get_fidelity("surrogate:scalesim").label_regions(regions, "TPUv3")) == len(regions)


def test_surrogate_profiling_answers_the_h100_from_the_model_that_learned_its_timings(regions):
    """``surrogate:profiling`` on the H100 is answered by the shipped model of H100 measurements beside the
    host-cpu one: its labels, provenance and interval are that model's, and host-cpu stays with its own."""
    from hespas_ml.fidelities import get_fidelity
    from hespas_ml.learn.registry import shipped_models

    assert shipped_models("profiling") == ["profiling", "profiling-h100"]
    h100_model = load_surrogate("profiling-h100")
    profiling = get_fidelity("surrogate:profiling")
    labels = profiling.label_regions(regions, "H100")
    own = h100_model.surrogate.predict_regions(regions, "H100")
    assert [lab.seconds for lab in labels] == pytest.approx(own.seconds.tolist(), rel=1e-9)
    assert all(lab.meta["model"] == h100_model.source and lab.meta["seen_target"] is True for lab in labels)
    prov = profiling.provenance("H100")
    assert prov["fidelity"] == "surrogate:profiling" and prov["targets_learned"] == ["H100"]
    assert profiling.provenance("host-cpu")["targets_learned"] == ["host-cpu"]
    host = profiling.label_regions(regions, "host-cpu")
    assert all(lab.meta["model"] == str(models_dir() / "profiling") for lab in host)


def test_predict_names_the_model_that_answered_the_target(capsys):
    from hespas_ml.cli.main import main

    for target, folder in (("H100", "profiling-h100"), ("host-cpu", "profiling")):
        assert main(["predict", PROGRAM, "--fidelity", "profiling", "--target", target, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["model"] == str(models_dir() / folder) and out["target"] == target


def test_the_profiling_surrogate_says_when_host_cpu_is_not_the_machine_it_learned(regions, fast_host, capsys):
    """host-cpu is whatever machine runs the code; the shipped profiling surrogate learned one machine's
    timings. On that machine its labels carry no caveat; on another (same name, other measured rates) every
    label, the pipeline's warnings and ``predict`` say that the times are the other machine's."""
    import dataclasses

    from hespas_ml.cli.main import main
    from hespas_ml.fidelities import get_fidelity
    from hespas_ml.label.targets import VECTOR_DTYPES, load_target
    from hespas_ml.learn.features import HW_FEATURES
    from hespas_ml.learn.surrogate import row_feature_names
    from hespas_ml.pipeline import simulate

    profiling = get_fidelity("surrogate:profiling")
    model = profiling.surrogate
    names = row_feature_names(model.config)
    seen = {f: float(model.net.row_norm.lo[names.index(f)]) for f in HW_FEATURES}   # the machine it learned
    learned = dataclasses.replace(
        load_target("host-cpu"), clock_hz=seen["clock_ghz"] * 1e9, mem_bw=10 ** seen["log10_mem_bw"],
        mem_capacity=10 ** seen["log10_mem_capacity"], onchip_mem=10 ** seen["log10_onchip_mem"],
        **{f"{unit}_flops": {d: 10 ** seen[f"log10_{unit}_flops_{d}"] for d in VECTOR_DTYPES}
           for unit in ("matrix", "vector")})
    assert model.hardware_outside_training(learned) == {}
    labels = profiling.label_regions(regions, learned)
    assert all("caveat" not in lab.meta and lab.meta["seen_target"] is True for lab in labels)

    path = fast_host
    labels = profiling.label_regions(regions, str(path))
    caveat = labels[0].meta["caveat"]
    assert all(lab.meta.get("caveat") == caveat and lab.meta["seen_target"] is False for lab in labels)
    assert "another machine" in caveat and "100,000 GFLOP/s" in caveat and "\n" not in caveat
    assert model.hardware_outside_training(str(path))["log10_mem_bw"][0] == pytest.approx(13.0)
    assert caveat in simulate(PROGRAM, target=str(path), fidelity="surrogate:profiling").warnings
    capsys.readouterr()
    assert main(["predict", PROGRAM, "--fidelity", "profiling", "--target", str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["warnings"] == [caveat] and err.strip() == f"warning: {caveat}"
    assert "cores" not in caveat                       # no core counts measured: nothing said about pinning

    pinned = path.with_name("pinned-host.yaml")        # the same, measured by a process pinned to 1 of 2 cores
    pinned.write_text(path.read_text() + "measured: {cores: 1, cpu_count: 2}\n")
    said = profiling.caveat(str(pinned))
    assert said.startswith(caveat) and "measured on 1 of this machine's 2 cores" in said and "taskset" in said
    unpinned = path.with_name("unpinned-host.yaml")
    unpinned.write_text(path.read_text() + "measured: {cores: 2, cpu_count: 2}\n")
    assert profiling.caveat(str(unpinned)) == caveat


def test_models_folder_can_be_moved_with_HESPAS_ML_MODELS(tmp_path, monkeypatch, regions):
    from hespas_ml.fidelities import get_fidelity

    shutil.copytree(models_dir() / "roofline", tmp_path / "roofline")
    monkeypatch.setenv("HESPAS_ML_MODELS", str(tmp_path))
    fid = get_fidelity("surrogate:roofline")
    assert fid.source == str(tmp_path / "roofline")
    assert len(fid.label_regions(regions, "H100")) == len(regions)
    with pytest.raises(HespasError) as err:
        get_fidelity("surrogate:scalesim")
    msg = str(err.value)
    assert "\n" not in msg and "no shipped model" in msg and str(tmp_path / "scalesim") in msg
