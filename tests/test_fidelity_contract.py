"""The fidelity contract (``hespas_ml/label/fidelity.py``), checked on every fidelity hespas_ml names: each
labeller and each shipped surrogate. A fidelity added to :mod:`hespas_ml.fidelities` without a case here
fails the first test."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hespas_ml.fidelities import FIDELITIES, get_fidelity
from hespas_ml.ingest import parse_file
from hespas_ml.label.fidelity import FidelityError
from hespas_ml.label.scalesim_worker import Budget
from hespas_ml.label.targets import load_target
from hespas_ml.learn.registry import models_dir
from hespas_ml.split.regions import split_program
from tests.conftest import PROJECT_ROOT, eval_script

# A GEMM with its bias and activation (one fused kernel) and an elementwise chain beside it.
PROGRAM = """
func.func @main(%a: tensor<128x256xf32>, %b: tensor<256x128xf32>, %c: tensor<128xf32>, %e: tensor<512x512xf32>)
    -> (tensor<128x128xf32>, tensor<512x512xf32>) {
  %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<128x256xf32>, tensor<256x128xf32>) -> tensor<128x128xf32>
  %1 = stablehlo.broadcast_in_dim %c, dims = [1] : (tensor<128xf32>) -> tensor<128x128xf32>
  %2 = stablehlo.add %0, %1 : tensor<128x128xf32>
  %3 = stablehlo.tanh %2 : tensor<128x128xf32>
  %4 = stablehlo.exponential %e : tensor<512x512xf32>
  %5 = stablehlo.multiply %4, %e : tensor<512x512xf32>
  return %3, %5 : tensor<128x128xf32>, tensor<512x512xf32>
}
"""
# One NeuSight bmm the H100 measured (datasets/measured/neusight-db1fdc9): what the measured fidelity knows.
MEASURED_BMM = eval_script("import_neusight").module_text("bmm", (12, 196, 196, 64))
MEASURED = PROJECT_ROOT / "datasets" / "measured"


def options(name: str, tmp: Path) -> dict:
    """Options that keep a fidelity quick here."""
    return {"scalesim": {"budget": Budget(seconds=10), "mode": "compute-only"},
            "profiling": {"cache": tmp / "profiling", "cache_max_noise": 1e9, "measure_s": 0.05},
            "measured": {"folders": [MEASURED]}}.get(name, {})


# name -> (a target it answers for, a target it refuses (None: it answers for every one), program)
CASES = {
    "roofline": ("H100", None, PROGRAM),
    "calibrated-roofline": ("H100", "TPUv3", PROGRAM),
    "scalesim": ("TPUv4", "H100", PROGRAM),
    "profiling": ("host-cpu", "H100", PROGRAM),
    "measured": ("H100", "TPUv3", MEASURED_BMM),
    "surrogate:roofline": ("H100", None, PROGRAM),
    "surrogate:scalesim": ("TPUv4", "H100", PROGRAM),
    "surrogate:profiling": ("host-cpu", "A100-40GB", PROGRAM),      # the H100 answered by profiling-h100
    "surrogate:profiling-h100": ("H100", "host-cpu", PROGRAM),
}
SLOW = {"scalesim", "profiling"}            # they start worker processes


def shipped_surrogates() -> set[str]:
    return {f"surrogate:{p.name}" for p in models_dir().iterdir() if (p / "surrogate.json").is_file()}


def test_every_fidelity_has_a_case():
    assert set(CASES) == set(FIDELITIES) | shipped_surrogates()


@pytest.fixture(scope="module", params=[pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else [])
                                        for n in CASES])
def case(request, tmp_path_factory):
    name = request.param
    target, refused, text = CASES[name]
    tmp = tmp_path_factory.mktemp(name.replace(":", "-"))
    fid = get_fidelity(name, **options(name, tmp))
    (tmp / "contract.mlir").write_text(text)           # profiling cuts regions out of their program's file
    regions = split_program(parse_file(tmp / "contract.mlir")).compute_regions()
    yield name, fid, load_target(target), refused and load_target(refused), regions
    close = getattr(fid, "close", None)
    if close is not None:
        close()


def test_it_answers_for_its_target_and_refuses_others_in_one_line(case):
    name, fid, target, refused, _ = case
    assert fid.name == name
    fid.check_target(target)
    if refused is None:
        fid.check_target(load_target("TPUv3"))
        return
    with pytest.raises(FidelityError) as err:
        fid.check_target(refused)
    assert "\n" not in str(err.value) and refused.name in str(err.value)


def test_one_label_per_region_in_order_ok_or_failed_with_a_reason(case):
    _, fid, target, _, regions = case
    assert fid.label_regions([], target) == []
    labels = fid.label_regions(regions, target)
    assert len(labels) == len(regions)
    for label in labels:
        assert label.status in ("ok", "failed")
        if label.status == "ok":
            assert math.isfinite(label.seconds) and label.seconds >= 0
            if "interval" in label.meta:
                lower, upper = label.meta["interval"]
                assert lower <= label.seconds <= upper
        else:
            assert math.isnan(label.seconds) and isinstance(label.meta.get("reason"), str)
    assert any(label.status == "ok" for label in labels)
    # one region alone gets the label it got in the batch (to rounding: a network predicts it in another batch)
    alone = fid.label(regions[-1], target)
    assert alone.status == labels[-1].status
    assert alone.seconds == pytest.approx(labels[-1].seconds, rel=1e-6, nan_ok=True)


def test_a_refused_target_is_refused_when_labelling_too(case):
    _, fid, _, refused, regions = case
    if refused is None:
        pytest.skip("answers for every target")
    with pytest.raises(FidelityError):
        fid.label_regions(regions, refused)


def test_provenance_says_what_answers_as_json(case):
    name, fid, target, _, _ = case
    prov = fid.provenance(target)
    assert prov["fidelity"] == name and prov["target"] == target.name
    json.dumps(prov)
