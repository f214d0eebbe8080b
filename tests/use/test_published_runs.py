"""The published runs the step time is checked against (``eval/measured/published_runs.csv``): every row
is a layout the zoo can export, and its published figure converts to a step time as its source says."""
from __future__ import annotations

import math

import pytest

from hespas_ml.ingest.zoo.checks import mesh_of
from hespas_ml.ingest.zoo.specs import parse_zoo_spec
from hespas_ml.label.targets import load_target
from hespas_ml.replay import load_system
from tests.conftest import PROJECT_ROOT, eval_script

published = eval_script("eval_published_runs")
RUNS = published.read_runs(PROJECT_ROOT / "eval" / "measured" / "published_runs.csv")


@pytest.mark.parametrize("row", RUNS, ids=[r["name"] for r in RUNS])
def test_each_run_is_a_layout_the_zoo_exports_on_its_system(row):
    _, params = parse_zoo_spec(row["spec"])            # raises with one line on a layout it cannot export
    assert load_target(row["target"])
    system = load_system(row["system"])
    assert system.n_npus == params["devices"] == math.prod(mesh_of(params).values())
    assert row["source"] and row["note"]


def test_equation_3_gives_the_papers_aggregate_throughput():
    """Table 1 of Narayanan et al.: 137 TFLOP/s per GPU on 32 GPUs is 4.4 PFLOP/s in all; the step time
    that figure stands for is equation 3's FLOPs over that rate."""
    row = next(r for r in RUNS if r["name"].startswith("GPT 1.7B"))
    params = parse_zoo_spec(row["spec"])[1]
    step = published.published_step_s(row, params)
    assert published.eq3_flops(params) / step / 1e15 == pytest.approx(4.4, abs=0.05)
    # and the parameter count of equation 2 is the table's 1.7 billion
    h, l, v, s = params["d_model"], params["layers"], params["vocab"], params["seq"]
    assert 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h)) / 1e9 == pytest.approx(1.7, abs=0.05)


def test_a_bad_row_is_one_line_naming_the_file_and_line(tmp_path):
    bad = tmp_path / "runs.csv"
    bad.write_text("name,target,system,spec,figure,value,source,note\nx,H100,ring:2x100,zoo:gpt,mfu,0.5,s,n\n")
    with pytest.raises(ValueError, match=r"runs.csv:2: figure must be one of step_s, tflops_eq3, got 'mfu'"):
        published.read_runs(bad)
