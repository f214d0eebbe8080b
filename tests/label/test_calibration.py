"""The calibrated roofline: efficiencies fitted on the region labels measured on a GPU (the committed H100
measurements), and the fidelity that charges them."""
from __future__ import annotations

import dataclasses
import statistics

import pytest

from conftest import PROJECT_ROOT, eval_script
from hespas_ml.fidelities import get_fidelity
from hespas_ml.ingest.stablehlo import parse_module
from hespas_ml.label.calibration import CalibrationError, fit_calibration
from hespas_ml.label.fidelity import FidelityError
from hespas_ml.label.roofline import RooflineFidelity, kernel_seconds, matrix_efficiency
from hespas_ml.label.targets import load_target
from hespas_ml.split.regions import split_program

H100_LABELS = PROJECT_ROOT / "datasets" / "measured" / "h100-2026-11-27"

GEMM_AND_SCALE = """
func.func @main(%a: tensor<2048x2048xbf16>, %b: tensor<2048x2048xbf16>, %e: tensor<4096x4096xf32>)
    -> (tensor<2048x2048xbf16>, tensor<4096x4096xf32>) {
  %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<2048x2048xbf16>, tensor<2048x2048xbf16>) -> tensor<2048x2048xbf16>
  %1 = stablehlo.multiply %e, %e : tensor<4096x4096xf32>
  return %0, %1 : tensor<2048x2048xbf16>, tensor<4096x4096xf32>
}
"""


def test_the_h100_preset_holds_what_its_measured_labels_give():
    h100 = load_target("H100")
    fitted = fit_calibration(H100_LABELS, h100)
    assert h100.calibration == fitted
    # kernels reach part of the peaks, and each costs something of its own
    assert all(0 < e < 1 for e in fitted.matrix_efficiency.values())
    assert 0 < fitted.memory_efficiency < 1 and fitted.kernel_overhead_s > 0
    assert set(fitted.matrix_efficiency) >= {"bf16", "tf32"}
    assert all(n >= 5 for n in fitted.labels.values())
    assert fitted.measured_on == "NVIDIA H100 80GB HBM3"
    # a cuDNN convolution costs tens of µs however little it computes, a cuBLAS dot less, any kernel its overhead
    floors = fitted.kernel_floor_s
    assert set(floors) == {"convolution", "dot_general"}
    assert floors["convolution"] > floors["dot_general"] > fitted.kernel_overhead_s
    # the eval script prints the block and checks the preset against the labels
    script = eval_script("calibrate_roofline")
    assert script.main([str(H100_LABELS), "--target", "H100", "--check"]) == 0


def test_labels_of_held_out_families_never_calibrate(tmp_path):
    """Every convolution label marked held out: the fit has no convolution floor left (too few labels), and
    the figures it fits on the rest are those of the preset."""
    import json

    import pandas as pd

    labels = pd.read_parquet(H100_LABELS / "labels.parquet")
    regions = pd.read_parquet(H100_LABELS / "regions.parquet")
    convs = set(regions.loc[regions["op_counts"].str.contains('"convolution"'), "hash"])
    marked = labels["hash"].isin(convs) & (labels["fidelity"] == "profiling")
    assert marked.sum() > 100
    labels.loc[marked, "meta"] = [json.dumps({**json.loads(m), "phase": "held_out"}) for m in labels.loc[marked, "meta"]]
    labels.to_parquet(tmp_path / "labels.parquet")
    regions.to_parquet(tmp_path / "regions.parquet")
    fitted = fit_calibration(tmp_path, load_target("H100"))
    preset = load_target("H100").calibration
    assert "convolution" not in fitted.kernel_floor_s
    assert fitted.kernel_floor_s["dot_general"] == preset.kernel_floor_s["dot_general"]
    assert fitted.matrix_efficiency == preset.matrix_efficiency


def test_fitting_needs_looped_labels_of_the_target(tmp_path):
    with pytest.raises(CalibrationError, match="not a measured dataset folder"):
        fit_calibration(tmp_path, load_target("H100"))
    with pytest.raises(CalibrationError, match="fewer than 5 looped"):
        fit_calibration(H100_LABELS, load_target("A100-40GB"))       # nothing there was measured on an A100


def test_calibrated_roofline_charges_the_measured_efficiencies_and_overheads():
    h100 = load_target("H100")
    cal = h100.calibration
    regions = split_program(parse_module(GEMM_AND_SCALE, "gemm_and_scale")).compute_regions()
    plain = RooflineFidelity().label_regions(regions, h100)
    calibrated = get_fidelity("calibrated-roofline").label_regions(regions, h100)
    gemm, scale = regions
    (gk,), (sk,) = gemm.kernels, scale.kernels
    c, m = kernel_seconds(gk, h100)
    assert c > m                                         # the GEMM is compute-bound
    assert calibrated[0].seconds == pytest.approx(c / cal.matrix_efficiency["bf16"] + cal.kernel_overhead_s)
    c, m = kernel_seconds(sk, h100)
    assert m > c                                         # the multiply is memory-bound
    assert calibrated[1].seconds == pytest.approx(m / cal.memory_efficiency + cal.kernel_overhead_s)
    assert all(cl.seconds > pl.seconds for cl, pl in zip(calibrated, plain))
    assert calibrated[0].meta["calibrated_on"] == cal.measured_on


SMALL_CONV = """
func.func @main(%x: tensor<1x8x8x16xf32>, %w: tensor<3x3x16x16xf32>) -> tensor<1x8x8x16xf32> {
  %0 = stablehlo.convolution(%x, %w) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f],
       window = {pad = [[1, 1], [1, 1]]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64}
       : (tensor<1x8x8x16xf32>, tensor<3x3x16x16xf32>) -> tensor<1x8x8x16xf32>
  return %0 : tensor<1x8x8x16xf32>
}
"""


def test_a_small_convolution_takes_the_measured_floor_and_says_so():
    h100 = load_target("H100")
    (region,) = split_program(parse_module(SMALL_CONV, "small_conv")).compute_regions()
    (label,) = get_fidelity("calibrated-roofline").label_regions([region], h100)
    (k,) = region.kernels
    c, m = kernel_seconds(k, h100)
    assert max(c, m) + h100.calibration.kernel_overhead_s < h100.calibration.kernel_floor_s["convolution"]
    assert label.seconds == h100.calibration.kernel_floor_s["convolution"]
    assert label.meta["bound"] == "floor" and label.meta["floored_kernels"] == 1
    # a calibration without floors charges the work and the overhead alone
    bare = dataclasses.replace(h100, calibration=dataclasses.replace(h100.calibration, kernel_floor_s={}))
    (label,) = get_fidelity("calibrated-roofline").label_regions([region], bare)
    assert label.seconds < h100.calibration.kernel_floor_s["convolution"] and label.meta["floored_kernels"] == 0


def test_calibrated_roofline_refuses_a_target_without_a_calibration():
    fid = get_fidelity("calibrated-roofline")
    with pytest.raises(FidelityError, match="V100-32GB has no calibration") as err:
        fid.check_target(load_target("V100-32GB"))
    assert "\n" not in str(err.value)
    # a user's copy of a calibrated target without its block is refused too
    bare = dataclasses.replace(load_target("H100"), calibration=None)
    with pytest.raises(FidelityError):
        fid.label_regions(split_program(parse_module(GEMM_AND_SCALE, "g")).compute_regions(), bare)


def test_a_type_the_calibration_did_not_measure_borrows_from_one_at_the_same_rate():
    h100 = load_target("H100")
    cal = h100.calibration
    assert "f16" not in cal.matrix_efficiency
    assert matrix_efficiency(h100, "f16") == cal.matrix_efficiency["bf16"]      # the same Tensor Core rate
    # fp8 runs at twice the rate of any measured type: the median of the measured efficiencies
    assert matrix_efficiency(h100, "f8E4M3FN") == statistics.median(cal.matrix_efficiency.values())


def test_a_calibrated_answer_carries_its_basis():
    """simulate's result (and so --json) holds the calibration it charged; other fidelities' hold none."""
    from hespas_ml.pipeline import simulate

    graph = parse_module(GEMM_AND_SCALE, "gemm_and_scale")
    calibrated = simulate(graph, target="H100", fidelity="calibrated-roofline").to_dict()
    assert calibrated["calibration"] == load_target("H100").calibration.to_mapping()
    assert calibrated["calibration"]["kernel_floor_s"]["convolution"] > 0
    assert simulate(graph, target="H100").to_dict()["calibration"] is None
