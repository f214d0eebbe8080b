"""The timing steadiness check: reference kernels timed in rounds by the profiling labeller."""
from __future__ import annotations

import json

import numpy as np
import pytest

from hespas_ml.label.fidelity import FidelityError
from hespas_ml.label.profiling import ProfilingFidelity
from hespas_ml.label.steadiness import STEADY_P90, Steadiness, check_steadiness, deviations, reference_modules

pytestmark = pytest.mark.slow   # exports programs, starts workers, builds datasets or trains


def test_deviations_are_distances_from_each_kernels_own_median():
    dev = deviations({"a": [1.0, 1.0, 1.0, 2.0], "b": [10.0, 12.0, 8.0]})
    assert np.allclose(sorted(dev), sorted([0, 0, 0, 1.0, 0, 0.2, 0.2]))


def test_figures_of_steady_and_unsteady_rounds():
    steady = Steadiness.from_times({"a": [1.0, 1.01, 0.99, 1.0], "b": [2.0, 2.02, 1.98, 2.0]}, 4.0, 0.01)
    assert steady.steady and steady.p90_dev <= 0.011 and abs(steady.drift) < 0.02 and steady.rounds == 4
    assert "steady" in steady.summary() and "UNSTEADY" not in steady.summary()
    # a machine that slows down by 30 % half way: spread and drift show it
    rounds = {"a": [1.0, 1.0, 1.0, 1.3, 1.3, 1.3], "b": [2.0, 2.0, 2.0, 2.6, 2.6, 2.6]}
    slowing = Steadiness.from_times(rounds, 6.0, 0.01)
    assert not slowing.steady and slowing.p90_dev > STEADY_P90 and slowing.drift == pytest.approx(0.3)
    assert "UNSTEADY" in slowing.summary() and "quieter machine" in slowing.summary()
    assert "statistic: min" in slowing.summary() and "statistic: min" not in slowing.summary("min")
    assert json.loads(json.dumps(slowing.to_dict()))["steady"] is False


def test_reference_kernels_are_timed_by_the_labeller_in_rounds():
    with ProfilingFidelity(cache=False) as fid:
        report = check_steadiness(1.0, fid)
    assert report.rounds >= 3 and set(report.kernels) == set(reference_modules())
    assert all(len(t) == report.rounds and min(t) > 0 for t in report.times.values())
    assert report.median_dev == pytest.approx(float(np.median(deviations(report.times))))
    assert report.p90_dev >= report.median_dev >= 0 and report.within >= 0
    assert "pinned" in report.device          # timed as a region is: the labeller's pinned core


def test_a_module_that_cannot_compile_is_a_clear_error():
    bad = "func.func @main(%a: tensor<4xf32>) -> tensor<4xf32> {\n  %0 = stablehlo.frobnicate %a\n}\n"
    with ProfilingFidelity(cache=False) as fid, pytest.raises(FidelityError, match="profiling: "):
        fid.time_module(bad)
    with pytest.raises(FidelityError, match="seconds must be positive"):
        check_steadiness(0)
