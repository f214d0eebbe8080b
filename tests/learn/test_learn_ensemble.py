"""Intervals from ensemble spread, the accuracy figures, and the baselines on the smoke dataset."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import kendalltau

from hespas_ml.learn.baselines import EstimateBaseline, GBMBaseline
from hespas_ml.learn.config import LearnError, TrainConfig
from hespas_ml.learn.ensemble import IntervalCalibration, member_stats
from hespas_ml.learn.evaluate import metrics, report
from hespas_ml.learn.splits import make_split
from hespas_ml.learn.tables import label_rows


def test_intervals_contain_the_mean_and_widen_with_disagreement():
    rng = np.random.default_rng(0)
    truth = rng.normal(-10, 2, 400)
    spread = rng.uniform(0.01, 0.5, 400)
    members = truth + rng.normal(0, 1, (5, 400)) * spread          # members disagree more where spread is big
    mean, std = member_stats(members)
    cal = IntervalCalibration.fit(mean, std, truth, 0.9)
    pred = cal.predict(mean, std)
    assert (pred.lower <= pred.seconds).all() and (pred.seconds <= pred.upper).all()
    assert np.allclose(pred.seconds, np.exp(mean))
    width = np.log(pred.upper / pred.lower)
    order = np.argsort(std)
    assert (np.diff(width[order]) >= -1e-12).all()                  # monotone in the members' spread
    assert np.mean((truth >= np.log(pred.lower)) & (truth <= np.log(pred.upper))) >= 0.9
    one = cal.predict(np.zeros(2), np.array([0.0, 1.0]))
    assert one.upper[1] / one.lower[1] > one.upper[0] / one.lower[0]
    with pytest.raises(LearnError):
        IntervalCalibration.fit(mean[:0], std[:0], truth[:0], 0.9)
    with pytest.raises(LearnError, match="bad interval calibration"):
        IntervalCalibration.from_dict({"scale": -1, "floor": 0.1, "coverage": 0.9, "n": 3}, "x.json")


def test_trained_ensemble_coverage_is_calibrated_on_validation(smoke_ds, tiny_config):
    from hespas_ml.learn.surrogate import Surrogate
    cfg = tiny_config(fidelity="scalesim", epochs=6)
    tr, va, te = make_split(smoke_ds, cfg)
    model = Surrogate(cfg).fit(smoke_ds, tr, va)
    rows, pred = model.predict_rows(smoke_ds, va)
    inside = (rows["seconds"] >= pred.lower) & (rows["seconds"] <= pred.upper)
    assert inside.mean() >= 0.9
    assert model.calibration.n == len(rows)


def test_metrics_match_their_definitions():
    true = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
    pred = true * np.array([1.1, 0.9, 1.0, 1.5, 1.2])
    m = metrics(pred, true, lower=pred * 0.95, upper=pred * 1.05)     # only the exact prediction covers
    ape = np.abs(pred - true) / true
    assert m["median_ape"] == pytest.approx(np.median(ape))
    assert m["p90_ape"] == pytest.approx(np.quantile(ape, 0.9))
    assert m["kendall_tau"] == pytest.approx(kendalltau(pred, true).statistic)
    assert m["coverage"] == pytest.approx(0.2)
    # tau within groups: two targets whose times differ by 1000x are not mixed
    groups = np.array(["a", "a", "b", "b", "b"])
    g = metrics(pred, true, groups=groups)
    expect = (2 * kendalltau(pred[:2], true[:2]).statistic + 3 * kendalltau(pred[2:], true[2:]).statistic) / 5
    assert g["kendall_tau"] == pytest.approx(expect)


def test_estimate_baseline_is_exact_for_roofline_and_a_report_has_families(smoke_ds):
    split = make_split(smoke_ds, TrainConfig(split="family", holdout=["resnet"]))
    out = EstimateBaseline("roofline").evaluate(smoke_ds, split[2])
    assert out["median_ape"] < 1e-9 and out["p90_ape"] < 1e-9
    assert "resnet" in out["per_family"] and out["n"] == len(split[2])
    sys = EstimateBaseline("scalesim", "systolic").evaluate(smoke_ds, make_split(smoke_ds, TrainConfig(
        fidelity="scalesim", split="random"))[2])
    assert sys["median_ape"] < 0.05                      # the fold estimate follows SCALE-Sim closely
    prof = EstimateBaseline("profiling", "roofline").evaluate(smoke_ds, label_rows(smoke_ds, "profiling")["pos"])
    assert prof["median_ape"] > 0.5                      # the roofline misses the host's per-kernel overhead


def test_gbm_baseline_trains_and_beats_a_constant(smoke_ds):
    cfg = TrainConfig(fidelity="roofline", split="random", residual=False, roofline_input=False)
    tr, va, te = make_split(smoke_ds, cfg)
    gbm = GBMBaseline(cfg, max_iter=200).fit(smoke_ds, tr, va)
    rows, pred = gbm.predict_rows(smoke_ds, te)
    true = rows["seconds"].to_numpy()
    train = label_rows(smoke_ds, "roofline").set_index("pos").loc[tr]
    const = rows["target"].map(train.groupby("target")["seconds"].median()).to_numpy()
    assert np.median(np.abs(np.log(pred / true))) < np.median(np.abs(np.log(const / true)))
    assert report(rows, pred)["n"] == len(te)
