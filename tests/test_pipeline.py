"""The pipeline's stages one by one, the question resolved once at the door, and simulate as their sum."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from hespas_ml.fidelities import get_fidelity
from hespas_ml.ingest.errors import HespasError
from hespas_ml.ingest.stablehlo import parse_module
from hespas_ml.label.targets import load_target
from hespas_ml.pipeline import (Question, RegionTimes, SimulationError, ingest, label, replay, run, simulate, split,
                                trace)
from hespas_ml.replay import ReplayError, find_binary, load_system
from hespas_ml.replay.chakra import read_traces

from conftest import shared_path

pytestmark = pytest.mark.slow   # exports zoo programs

MLP_DP = "zoo:mlp?layers=3&width=128&batch=64&step=train&parallel=dp"
ONE_DEVICE = str(shared_path("mlir", "jax_example.mlir"))


class CountingFidelity:
    """A real fidelity, counting the regions it is asked to label."""

    def __init__(self, fid):
        self.fid, self.name, self.asked = fid, fid.name, 0

    def check_target(self, target):
        self.fid.check_target(target)

    def label_regions(self, regions, target):
        self.asked += len(regions)
        return self.fid.label_regions(regions, target)


def test_the_stages_one_by_one_give_simulates_answer():
    q = Question.resolve(MLP_DP, target="A100-40GB", system="ring:4x150")
    graph = ingest(q.program, q.system)
    assert graph.n_devices == 4
    regions = split(graph, q.split)
    times = label(regions, q.fidelity, q.target)
    step = replay(trace(regions, times), q.system, q.replay)
    whole = simulate(MLP_DP, target="A100-40GB", system="ring:4x150")
    assert (step.step_time_s, step.exposed_comm_s, step.compute_time_s) == \
           (whole.step_time_s, whole.exposed_comm_s, whole.compute_time_s)
    assert step.exposed_comm_s > 0 and step.traces.point.node_counts(0) == (whole.n_comp_nodes, whole.n_comm_nodes)
    assert run(q).step_time_s == whole.step_time_s


def test_a_question_is_resolved_once_and_passes_objects_through():
    target = load_target("H100")
    fid = get_fidelity("roofline")
    system = load_system("ring:4x150", local_mem_bw_gbps=target.mem_bw / 1e9)
    q = Question.resolve(MLP_DP, target, system, fidelity=fid)
    assert q.target is target and q.fidelity is fid and q.system is system
    named = Question.resolve(MLP_DP, "H100", "ring:4x150")
    assert named.target == target and named.fidelity.name == "roofline"
    assert named.system.n_npus == 4 and named.system.system["local-mem-bw"] == pytest.approx(target.mem_bw / 1e9)


@pytest.mark.parametrize("kwargs, expected", [
    ({"split": "blocks"}, "unknown split 'blocks'"),
    ({"replay": "ns3"}, "unknown replay backend 'ns3'"),
    ({"target": "Z80"}, "Z80"),
    ({"fidelity": "roofline-plus"}, "roofline-plus"),
    ({"fidelity": "scalesim", "target": "H100"}, "systolic"),
    ({"system": "torus:4x1"}, "torus"),
])
def test_a_bad_choice_is_refused_before_the_program_is_read(kwargs, expected):
    with pytest.raises(HespasError, match=expected) as info:
        Question.resolve("no/such/program.mlir", **kwargs)
    assert "no/such/program.mlir" not in str(info.value) and "\n" not in str(info.value)


def test_ingest_refuses_a_program_its_system_cannot_run():
    with pytest.raises(SimulationError, match="runs on 4 devices; give a system of 4"):
        ingest(f"{MLP_DP}&devices=4", 1)
    with pytest.raises(SimulationError, match="runs on 4 devices; give a system of 4"):
        simulate(f"{MLP_DP}&devices=4")
    assert ingest(f"{MLP_DP}&devices=4").n_devices == 4                  # without a system: as it says
    with pytest.raises(SimulationError, match="but system ring:2x100 has 2 NPUs"):
        ingest(shared_path("mlir", "maxtext", "llama3-100m-4dev.mlir"), load_system("ring:2x100"))
    assert ingest(MLP_DP, load_system("ring:2x100")).n_devices == 2       # a zoo spec follows its system
    assert ingest(MLP_DP, 8).n_devices == 8                                # or the device count it is given
    with pytest.raises(SimulationError, match="runs on 4 device.s. but 2 expected"):
        ingest(shared_path("mlir", "maxtext", "llama3-100m-4dev.mlir"), 2)


def test_label_times_each_distinct_region_once_and_shares_it_with_its_repeats():
    graph = ingest("zoo:llama?layers=3&d_model=64&heads=2&vocab=128&seq=32&batch=2&step=infer")
    regions = split(graph)
    target = load_target("H100")
    counting = CountingFidelity(get_fidelity("roofline"))
    times = label(regions, counting, target)
    compute = regions.compute_regions()
    assert counting.asked == len(times.distinct) < len(compute)
    one_by_one = get_fidelity("roofline").label_regions(compute, target)
    assert [lab.seconds for lab in times.labels] == [lab.seconds for lab in one_by_one]
    assert [times.seconds[r.id] for r in compute] == [lab.seconds for lab in one_by_one]
    assert all(times.seconds[r.id] == 0.0 for r in regions.collectives())
    assert times.lower is None and times.failed == 0


def test_one_device_step_is_the_exact_sum_of_its_regions():
    res = simulate(ONE_DEVICE, target="H100")
    exact = sum(r.total_seconds for r in res.regions if r.kind == "compute")
    assert res.step_time_s == pytest.approx(exact, rel=1e-12) and res.exposed_comm_s == 0.0
    assert res.step_time_s * 1e6 != round(res.step_time_s * 1e6)       # not rounded to whole microseconds
    assert res.replay == "none (single device)"


def test_intervals_are_replayed_when_the_labels_carry_them():
    q = Question.resolve(ONE_DEVICE, "H100", fidelity="surrogate:roofline", fidelity_options={"fallback": "off"})
    regions = split(ingest(q.program, q.system))
    times = label(regions, q.fidelity, q.target)
    assert isinstance(times, RegionTimes) and times.lower is not None
    step = replay(trace(regions, times), q.system, q.replay)
    lo, hi = step.interval_s
    assert lo < step.step_time_s < hi
    assert (lo, hi) == pytest.approx((sum(times.lower[r.id] * r.count for r in regions.compute_regions()),
                                      sum(times.upper[r.id] * r.count for r in regions.compute_regions())))
    assert replay(trace(regions, times, interval=False), q.system, q.replay).interval_s is None
    many = simulate("zoo:mlp?layers=4&width=2048&batch=512&step=train&parallel=dp", "H100", "ring:4x150",
                    fidelity="surrogate:roofline", fidelity_options={"fallback": "off"})
    lo, hi = many.step_time_interval_s             # whole microseconds per trace node: may be one point
    assert lo <= many.step_time_s <= hi


@pytest.mark.skipif(find_binary(None) is not None, reason="an ASTRA-sim binary is installed here")
def test_simulate_out_keeps_its_traces_when_the_replay_fails(tmp_path):
    with pytest.raises(ReplayError, match="no AstraSim"):
        simulate(MLP_DP, target="H100", system="ring:2x100", replay="astra-sim", out=tmp_path)
    prefix = Path(tmp_path) / "et" / next((tmp_path / "et").iterdir()).name.split(".")[0]
    assert len(read_traces(prefix, 2)) == 2 and (tmp_path / "regions.csv").is_file()


def test_simulate_out_draws_the_step_timeline(tmp_path):
    res = simulate(MLP_DP, target="H100", system="ring:2x100", out=tmp_path)
    png = tmp_path / "timeline.png"
    assert res.out_dir == str(tmp_path) and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("program, expected", [
    ("no/such/program.mlir", "no/such/program.mlir: no such file"),
    ("zoo:mlp?layers=two", "zoo:mlp?layers=two"),
    ("zoo:llama?heads=4&parallel=tp&devices=8", "zoo:llama"),
])
def test_a_program_that_cannot_be_read_is_refused_at_the_door(program, expected):
    with pytest.raises(HespasError, match=re.escape(expected)) as info:
        Question.resolve(program, "H100")
    assert "\n" not in str(info.value)


def test_simulate_reports_the_peak_memory_and_whether_it_fits():
    small = simulate(MLP_DP, target="H100", system="ring:2x100")
    assert small.fits and small.peak_memory_bytes == small.memory["peak"] > small.memory["arguments"] > 0
    data = small.to_dict()
    assert data["fits"] is True and data["peak_memory_bytes"] == small.peak_memory_bytes
    assert data["memory_capacity_bytes"] == load_target("H100").mem_capacity
    big = simulate("zoo:mlp?layers=4&width=8192&batch=65536&step=train", target="T4")   # 16 GiB card
    assert not big.fits and big.peak_memory_bytes > 16 * 2**30
    assert any(w.startswith("does not fit:") and "T4" in w for w in big.warnings)


def test_at_scale_simulate_says_whether_the_replay_used_the_ranks_symmetry(capsys):
    from hespas_ml.cli.main import main as cli_main

    spec = "zoo:mlp?layers=2&width=64&batch=64&step=train&parallel=dp&devices=64"
    assert cli_main(["simulate", spec, "--target", "H100", "--system", "switch:8x100,switch:8x50"]) == 0
    assert "replay embedded   (ranks alike: one rank simulated for all)" in capsys.readouterr().out
    assert simulate(spec, "H100", "switch:8x100,switch:8x50").replay_engine == "fast"
    two_of_64 = parse_module(SOME_RANKS_SIT_OUT, "two_of_64")          # an all-reduce of ranks 0 and 1 only
    assert simulate(two_of_64, "H100", "switch:8x100,switch:8x50").replay_engine == "full"


SOME_RANKS_SIT_OUT = """
module @two attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 64 : i32} {
  func.func @main(%x: tensor<256x256xf32>) -> tensor<256x256xf32> {
    %0 = stablehlo.tanh %x : tensor<256x256xf32>
    %1 = "stablehlo.all_reduce"(%0) ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %s = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }) {replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>} : (tensor<256x256xf32>) -> tensor<256x256xf32>
    return %1 : tensor<256x256xf32>
  }
}
"""


def test_out_writes_every_ranks_trace_only_up_to_a_thousand_ranks(tmp_path):
    from hespas_ml.pipeline import MAX_TRACE_FILES

    spec = "zoo:llama?layers=1&d_model=64&heads=8&vocab=256&seq=16&batch=2048&devices=2048&mesh=dp:256,tp:8"
    res = simulate(spec, target="H100", system="switch:8x450,switch:256x50", out=tmp_path)
    assert res.n_devices > MAX_TRACE_FILES
    (only,) = (tmp_path / "et").iterdir()
    assert only.name.endswith(".0.et") and len(read_traces(str(only)[:-len(".0.et")])) == 1
    assert any("rank 0's trace written, not all 2048" in w for w in res.warnings)
