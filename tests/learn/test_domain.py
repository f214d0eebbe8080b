"""A surrogate knows what it learned: its training domain, fitted at fit, saved with it, checked per region;
outside it the interval widens, one line warns, and the fallback answers."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hespas_ml.ingest import load_program
from hespas_ml.label.fidelity import FidelityError, label_caveats
from hespas_ml.label.registry import get_labeller
from hespas_ml.label.targets import load_target
from hespas_ml.learn.config import LearnError
from hespas_ml.learn.domain import Domain
from hespas_ml.learn.fidelity import SurrogateFidelity
from hespas_ml.learn.surrogate import Surrogate
from hespas_ml.split.regions import split_program

INSIDE = "zoo:mlp?layers=2&width=64&batch=8&step=infer"          # a smoke-dataset program
FAR = "zoo:gemm?m=8192&n=8192&k=8192"                             # far larger than any smoke region


@pytest.fixture(scope="module")
def model(smoke_ds, tmp_path_factory):
    from hespas_ml.learn.config import TrainConfig
    cfg = TrainConfig(hidden=16, layers=2, head_hidden=32, epochs=4, batch_size=32, patience=4, ensemble=2,
                      split="random", seed=0)
    folder = tmp_path_factory.mktemp("domain-model") / "m"
    Surrogate(cfg).fit(smoke_ds).save(folder)
    return folder


def regions_of(spec: str):
    return split_program(load_program(spec), "fusion").compute_regions()


def test_a_fitted_model_keeps_the_domain_of_the_regions_it_learned(model, smoke_ds):
    loaded = Surrogate.load(model)
    domain = loaded.domain
    assert domain is not None and 0 < domain.regions <= len(smoke_ds.regions)
    assert {"dot_general", "add"} <= set(domain.ops) and "all_to_all" not in domain.ops
    lo, hi = domain.ranges["log_bytes"]
    assert lo < hi
    assert str(domain.regions) in domain.fitted_on
    assert json.loads((model / "surrogate.json").read_text())["domain"]["ops"] == domain.ops
    # every region of a program it learned from is inside
    inside = loaded.predict_regions(regions_of(INSIDE), "H100")
    assert inside.outside and not any(inside.outside)
    far = loaded.predict_regions(regions_of(FAR), "H100")
    assert any("log_matrix_flops" in r and "above the learned" in r for r in far.outside[0])


def test_outside_regions_get_a_wider_interval_a_warning_and_the_fallbacks_answer(model):
    far = regions_of(FAR)
    kept = SurrogateFidelity(str(model), fallback="off").label_regions(far, "H100")
    half = Surrogate.load(model).domain.ood_half_width
    for lab in kept:
        assert lab.meta["in_domain"] is False and lab.meta["outside"]
        assert lab.meta["lower_s"] <= lab.seconds * math.exp(-half) * (1 + 1e-9)
        assert lab.meta["upper_s"] >= lab.seconds * math.exp(half) * (1 - 1e-9)
    (line,) = label_caveats(kept)
    assert f"{len(far)} of {len(far)} regions lie outside what it learned" in line and "widened" in line
    # the fallback answers with the labeller the model learned (here the roofline) and keeps its own answer
    answered = SurrogateFidelity(str(model), fallback="auto").label_regions(far, "H100")
    truth = get_labeller("roofline").label_regions(far, load_target("H100"))
    assert [lab.seconds for lab in answered] == [t.seconds for t in truth]
    assert {lab.meta["bound"] for lab in answered} == {"fallback:roofline"}
    assert [lab.meta["surrogate_s"] for lab in answered] == [lab.seconds for lab in kept]
    assert "answered by the roofline" in label_caveats(answered)[0]
    # regions inside are the surrogate's own, whatever the fallback
    inside = SurrogateFidelity(str(model), fallback="auto").label_regions(regions_of(INSIDE), "H100")
    assert {lab.meta["bound"] for lab in inside} == {"learned"} and all(lab.meta["in_domain"] for lab in inside)
    assert label_caveats(inside) == []


def test_where_the_labeller_cannot_run_auto_takes_the_calibrated_roofline_else_the_roofline(model):
    """``labeller`` insists on the learned fidelity; ``auto`` takes the calibrated roofline where it cannot
    answer (the profiler times only the machine it runs on, never an H100) on a target measured for one, and
    the roofline on a target without."""
    fid = SurrogateFidelity(str(model), fallback="labeller")
    fid.fidelity = "profiling"                       # as a profiling model of several machines would be
    fid.trained_targets = {"H100", "TPUv4"}
    far = regions_of(FAR)
    with pytest.raises(FidelityError, match="--fallback labeller: .*H100"):
        fid.label_regions(far, "H100")
    fid.fallback = "auto"
    answered = fid.label_regions(far, "H100")
    assert {lab.meta["bound"] for lab in answered} == {"fallback:calibrated-roofline"}
    truth = get_labeller("calibrated-roofline").label_regions(far, load_target("H100"))
    assert [lab.seconds for lab in answered] == [t.seconds for t in truth]
    assert {lab.meta["bound"] for lab in fid.label_regions(far, "TPUv4")} == {"fallback:roofline"}


def test_bad_fallbacks_and_domains_are_one_line_errors(model):
    with pytest.raises(FidelityError, match="fallback must be one of auto, labeller, roofline, off"):
        SurrogateFidelity(str(model), fallback="sometimes")
    good = Domain(ops=["add"], ranges={"log_bytes": (1.0, 2.0)}).to_dict()
    assert Domain.from_dict(good, "x").ranges == {"log_bytes": (1.0, 2.0)}
    with pytest.raises(LearnError, match="m.json: bad training domain"):
        Domain.from_dict({**good, "ranges": {"log_bytes": [1.0]}}, "m.json")
    with pytest.raises(LearnError, match="bad training domain values"):
        Domain.from_dict({**good, "ood_half_width": 0}, "m.json")
    moved = {"log_low": 0.0, "log_mid": 0.5, "log_high": 1.5, "basis": "measured"}
    assert Domain.from_dict({**good, "mode_change": moved}, "x").to_dict()["mode_change"] == moved
    with pytest.raises(LearnError, match="m.json: bad training domain .*out of order"):
        Domain.from_dict({**good, "mode_change": {**moved, "log_mid": 2.0}}, "m.json")


def test_simulate_falls_back_by_default_and_says_so(model, capsys):
    from hespas_ml.cli.main import main

    def run(*extra: str) -> dict:
        assert main(["simulate", FAR, "--fidelity", f"surrogate:{model}", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    default, off = run(), run("--fallback", "off")
    roofline = get_labeller("roofline").label_regions(regions_of(FAR), load_target("H100"))
    assert default["step_time_s"] == pytest.approx(sum(lab.seconds for lab in roofline), rel=1e-3)
    assert any("outside what it learned" in w and "answered by the roofline" in w for w in default["warnings"])
    assert any("widened" in w for w in off["warnings"])
    lo, hi = off["step_time_interval_s"]
    assert lo < off["step_time_s"] < hi and np.isfinite([lo, hi]).all()


def test_a_scalesim_layer_the_default_labeller_simulates_in_more_detail_is_outside(model):
    """SCALE-Sim labels depend on the budget: a layer too slow to simulate in full within the learned
    labels' budget (2 s) was learned without its memory stalls, which the default labeller (30 s) simulates."""
    from hespas_ml.label.scalesim import ScaleSimFidelity

    tpu = load_target("TPUv4")
    big, small = regions_of("zoo:gemm?m=64&n=256&k=8192"), regions_of("zoo:gemm?m=128&n=128&k=128")
    assert ScaleSimFidelity.from_options({"budget_s": 2}).planned_modes(big, tpu) == [["compute-only"]]
    assert ScaleSimFidelity().planned_modes(big, tpu) == [["full"]]
    surrogate = Surrogate.load(model)
    surrogate.config.fidelity = "scalesim"             # as the shipped SCALE-Sim model
    surrogate.domain.label_options = {"budget_s": 2, "memory_gb": 2, "mode": "auto"}
    fid = SurrogateFidelity(surrogate, fallback="off")
    (lab,) = fid.label_regions(big, tpu)
    assert any(r.startswith("label mode compute-only -> full") for r in lab.meta["outside"])
    (lab,) = fid.label_regions(small, tpu)
    assert not any(r.startswith("label mode") for r in lab.meta.get("outside", []))
    # with what such a change was measured to do, the answer moves by the median ratio and the interval
    # reaches the 5th and 95th percentiles of it; a region whose mode does not change is left alone
    learned = fid.label_regions(big, tpu)[0].seconds
    small_before = fid.label_regions(small, tpu)[0]
    surrogate.domain.mode_change = {"log_low": math.log(1.1), "log_mid": math.log(2.0), "log_high": math.log(6.0)}
    (lab,) = fid.label_regions(big, tpu)
    assert lab.meta["learned_mode_s"] == pytest.approx(learned)
    assert lab.seconds == pytest.approx(2.0 * learned)
    assert lab.meta["lower_s"] <= 1.1 * learned and lab.meta["upper_s"] >= 6.0 * learned
    assert "x2.00 (x1.10 .. x6.00)" in lab.meta["caveat"] and "\n" not in lab.meta["caveat"]
    (lab,) = fid.label_regions(small, tpu)
    assert lab.seconds == small_before.seconds and "learned_mode_s" not in lab.meta
    surrogate.domain.mode_change = None
    surrogate.domain.label_options = None              # labeller options not known: nothing to compare
    (lab,) = fid.label_regions(big, tpu)
    assert not any(r.startswith("label mode") for r in lab.meta.get("outside", []))


def test_calibrating_again_on_rows_makes_the_interval_hold_there(model, smoke_ds):
    """Split-conformal on given rows: at least the nominal share of those rows' labels fall inside, and
    the point predictions do not move."""
    from hespas_ml.learn.tables import label_rows

    surrogate = Surrogate.load(model)
    pos = label_rows(smoke_ds, "roofline", ["TPUv4"])["pos"].to_numpy()
    _, before = surrogate.predict_rows(smoke_ds, pos)
    surrogate.calibrate(smoke_ds, pos)
    rows, after = surrogate.predict_rows(smoke_ds, pos)
    truth = rows["seconds"].to_numpy()
    assert np.array_equal(before.seconds, after.seconds) and surrogate.calibration.n == len(pos)
    assert ((truth >= after.lower) & (truth <= after.upper)).mean() >= surrogate.calibration.coverage


def test_simulate_says_when_the_model_learned_the_program(model, smoke_ds, capsys):
    """A program of the training set is recognised by its fingerprint (the set of its regions), under any
    name; a program it never saw is not; a model without a domain does not say."""
    from hespas_ml import simulate
    from hespas_ml.learn.domain import program_fingerprint

    learned = Surrogate.load(model).domain.programs
    source = next(s for s in smoke_ds.programs["source"] if s.startswith("zoo:mlp") and s in learned.values())
    assert not any(s.startswith("/") for s in learned.values())           # no machine's folders
    fingerprint = program_fingerprint(smoke_ds.regions["hash"][smoke_ds.regions["programs"].str.contains(
        source, regex=False)])
    assert learned[fingerprint] == source
    seen = simulate(source, target="H100", fidelity=f"surrogate:{model}")
    assert seen.seen_in_training is True and seen.to_dict()["seen_in_training"] is True
    assert simulate(FAR, target="H100", fidelity=f"surrogate:{model}").seen_in_training is False
    assert simulate(source, target="H100", fidelity="roofline").seen_in_training is None


def test_no_answer_goes_beyond_the_range_of_what_it_learned(smoke_ds, tiny_config):
    """A region far outside (a GEMM thousands of times larger than any learned) is answered within the range
    of the targets the network learned (here host-cpu log-seconds) widened by their deviation, and a model saved
    before that range was kept loads unbounded."""
    import torch

    surrogate = Surrogate(tiny_config(fidelity="profiling", epochs=4, ensemble=2)).fit(smoke_ds)
    net = surrogate.net
    labels = smoke_ds.labels[(smoke_ds.labels["fidelity"] == "profiling") & (smoke_ds.labels["status"] == "ok")]
    assert float(net.y_lo) >= math.log(labels["seconds"].min()) - 1e-6
    assert float(net.y_hi) <= math.log(labels["seconds"].max()) + 1e-6
    lo, hi = float(net.y_lo - net.y_std), float(net.y_hi + net.y_std)          # one deviation beyond
    pred = surrogate.predict_regions(regions_of(FAR), "host-cpu")
    assert ((np.log(pred.seconds) >= lo - 1e-6) & (np.log(pred.seconds) <= hi + 1e-6)).all()
    out = torch.full((2, 1), 1e6, dtype=torch.float64)               # far beyond any standardised target
    zero = torch.zeros(1, dtype=torch.float64)
    assert float(net.to_log_seconds(out, zero, False)[0, 0]) == pytest.approx(hi)
    assert float(net.to_log_seconds(-out, zero, False)[0, 0]) == pytest.approx(lo)
    state = {k: v for k, v in net.state_dict().items() if k not in ("y_lo", "y_hi")}
    net.load_state_dict(state, strict=True)
    assert float(net.y_lo) == -math.inf and float(net.y_hi) == math.inf
    assert float(net.to_log_seconds(out, zero, False)[0, 0]) > hi
