"""A stand-in for a program one cannot share (issue 29, point 4): the same per-device FLOPs, kernel bytes,
collective volume and roofline step time on its target and system, and none of the program's structure."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hespas_ml.ingest.stablehlo import parse_module
from hespas_ml.split.regions import split_program
from hespas_ml.use.lookalike import make_lookalike
from tests.conftest import shared_path

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = ["zoo:resnet?depth=18&batch=8&image=64&classes=100&step=train",
            "zoo:mlp?layers=4&width=1024&batch=256&dtype=bf16&step=train&optimizer=adam"]


@pytest.mark.parametrize("program", PROGRAMS)
def test_the_lookalike_matches_flops_bytes_and_step_time_within_five_percent(program):
    text, report = make_lookalike(program, "H100")
    for key in ("flops", "kernel_bytes", "step_time_s"):
        assert abs(report[key]["error"]) <= 0.05, (key, report[key])
        assert report[key]["program"] > 0
    # nothing of the program's graph: at most two kernels, of a matrix product and element-wise ops
    regions = split_program(parse_module(text, "<lookalike>")).compute_regions()
    assert sum(len(r.kernels) for r in regions) <= 2
    assert set(re.findall(r'"stablehlo\.(\w+)"', text)) <= {"dot_general", "multiply", "negate", "constant",
                                                             "broadcast_in_dim"}


@pytest.mark.parametrize("program, system", [
    (str(shared_path("mlir", "maxtext", "llama3-100m-4dev.mlir")), "switch:4x450"),
    ("zoo:llama?layers=4&d_model=256&heads=4&kv_heads=2&vocab=1024&seq=128&batch=8&step=train&mesh=pp:2,dp:2"
     "&devices=4&microbatch=1", "switch:2x450,switch:2x50"),
])
def test_a_program_with_collectives_gets_a_stand_in_that_moves_and_hides_as_much(program, system):
    """The stand-in runs as many collectives of each kind as the original, on the same device groups, moving
    what they moved per device, and hides as much of that communication behind its compute."""
    text, report = make_lookalike(program, "H100", system)
    for key in ("flops", "kernel_bytes", "comm_bytes", "step_time_s"):
        assert abs(report[key]["error"]) <= 0.05, (key, report[key])
        assert report[key]["program"] > 0
    exposed = report["exposed_comm_s"]
    assert exposed["lookalike"] == pytest.approx(exposed["program"], rel=0.05) and exposed["program"] > 0
    assert 0 < report["beside"] < 1
    from hespas_ml.ingest import load_program
    original, stand_in = split_program(load_program(program)), split_program(parse_module(text, "<lookalike>"))

    def runs(rg):
        out = {}
        for r in rg.collectives():
            key = (r.collective.kind, str(r.collective.groups), str(r.collective.pairs))
            out[key] = out.get(key, 0) + r.count
        return out

    assert runs(stand_in) == runs(original)
    assert sum(len(r.kernels) for r in stand_in.compute_regions()) <= 4
    assert set(re.findall(r'"stablehlo\.(\w+)"', text)) <= {
        "dot_general", "multiply", "negate", "constant", "broadcast_in_dim", "optimization_barrier", "add", "return",
        "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute"}


def test_generate_lookalike_command(tmp_path):
    out = tmp_path / "stand-in.mlir"
    cmd = [sys.executable, "-m", "hespas_ml.cli.main", "generate", "lookalike", PROGRAMS[0], "--out", str(out),
           "--target", "H100", "--json"]
    got = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert got.returncode == 0, got.stderr
    report = json.loads(got.stdout)
    assert report["within"] and out.is_file() and out.read_text().startswith("module @lookalike")
    strict = subprocess.run(cmd[:-1] + ["--tolerance", "0.0001"], capture_output=True, text=True, cwd=ROOT)
    assert strict.returncode == 1 and "beyond --tolerance" in strict.stderr and out.is_file()
