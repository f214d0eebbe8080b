"""The command line end to end: simulate, analyze, replay, and clean errors (exit code 2, one line)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import PROJECT_ROOT, shared_path
from hespas_ml.cli.main import main
from hespas_ml.replay import chakra

RESNET = "resnet_50_inference_step_4_devices_1024_batch.mlir"


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_json_on_a_hespas_system_folder(capsys):
    code, out, _ = run_cli(capsys, "simulate", str(shared_path("mlir", RESNET)), "--target", "H100",
                           "--system", str(shared_path("hespas-configs", "systems", "H100_80GB_4GPU")), "--json")
    assert code == 0
    res = json.loads(out)
    for key in ("step_time_s", "compute_time_s", "exposed_comm_s", "n_devices", "n_comp_nodes", "n_comm_nodes",
                "fidelity", "target", "replay"):
        assert key in res
    assert res["n_devices"] == 4 and res["fidelity"] == "roofline" and res["target"] == "H100"
    assert res["replay"] == "embedded"
    assert res["n_comm_nodes"] == 0                     # inference: no collectives
    # with no communication the step is the (rounded) compute time of the device
    assert res["step_time_s"] == pytest.approx(res["compute_time_s"], rel=1e-6)
    assert 1e-3 < res["step_time_s"] < 1.0


def test_simulate_with_collectives_reports_exposed_communication(capsys):
    code, out, _ = run_cli(capsys, "simulate", str(shared_path("mlir", "maxtext", "llama3-100m-4dev.mlir")),
                           "--target", "A100-40GB", "--system", "ring:4x150", "--json")
    assert code == 0
    res = json.loads(out)
    assert res["n_comm_nodes"] == 372                   # 100 all_gather + 272 all_reduce
    assert res["exposed_comm_s"] > 0
    assert res["step_time_s"] >= res["compute_time_s"]
    assert res["step_time_s"] == pytest.approx(res["compute_time_s"] + res["exposed_comm_s"], rel=1e-6)
    # bytes on the basis of the times (the fusion split's kernels) beside XLA's op-by-op count
    assert 0 < res["kernel_bytes"] < res["bytes"]


def test_simulate_out_dir_keeps_traces_configs_and_region_table(capsys, tmp_path):
    out_dir = tmp_path / "run"
    code, out, _ = run_cli(capsys, "simulate", str(shared_path("mlir", "test_split_replica_groups.mlir")),
                           "--target", "H100", "--system", "switch:4x400", "--out", str(out_dir))
    assert code == 0 and "step time" in out
    traces = chakra.read_traces(out_dir / "et" / "test_split_replica_groups")
    assert len(traces) == 4
    assert json.loads((out_dir / "comm_group.json").read_text()) == {"1": [0, 1], "2": [2, 3]}
    for name in ("network.yml", "system.json", "remote_memory.json"):
        assert (out_dir / "system" / name).is_file()
    assert "moved by the fusion split's kernels" in out and "op by op; per device" in out
    lines = (out_dir / "regions.csv").read_text().splitlines()
    assert lines[0].startswith("region,kind,name")
    assert len(lines) == 1 + 5                          # 3 compute regions + 2 collectives
    # the kept traces replay to the same step time through `hespas-ml replay`
    first = json.loads((out_dir / "result.json").read_text())["step_time_s"]
    code, out, _ = run_cli(capsys, "replay", str(out_dir / "et" / "test_split_replica_groups"),
                           "--system", str(out_dir / "system"), "--comm-group", str(out_dir / "comm_group.json"),
                           "--json")
    assert code == 0
    assert json.loads(out)["step_time_s"] == pytest.approx(first)


def test_single_device_program_needs_no_system(capsys):
    code, out, _ = run_cli(capsys, "simulate", str(shared_path("mlir", "test_no_comm_graph.mlir")), "--json")
    assert code == 0
    res = json.loads(out)
    assert res["n_devices"] == 1 and res["n_comm_nodes"] == 0 and res["step_time_s"] > 0


def test_replay_of_existing_traces_matches_the_real_astra_sim(capsys):
    folder = shared_path("astra-vectors", "pg_pairs_strided_ring4")
    expected = json.loads((folder / "expected.json").read_text())["runs"]["congestion_unaware"]["ranks"]
    code, out, _ = run_cli(capsys, "replay", str(folder / "et" / "dev"), "--system", str(folder),
                           "--comm-group", str(folder / "comm_group.json"), "--replay", "embedded", "--json")
    assert code == 0
    res = json.loads(out)
    assert res["step_time_s"] * 1e9 == pytest.approx(max(r["finished_cycles"] for r in expected.values()))
    assert len(res["ranks"]) == 4


def test_analyze_json_keys_and_counts(capsys):
    code, out, _ = run_cli(capsys, "analyze", str(shared_path("mlir", "custom_call_topk.mlir")), "--json")
    assert code == 0
    res = json.loads(out)
    for key in ("flops", "bytes", "ops", "unmodelled", "n_devices"):
        assert key in res
    assert res["unmodelled"] == {"custom_call": 1}
    assert res["ops"]["custom_call"] == 1


def test_analyze_human_output_names_collectives(capsys):
    code, out, _ = run_cli(capsys, "analyze", str(shared_path("mlir", "jax_example.mlir")))
    assert code == 0
    assert "all_reduce" in out and "FLOPs" in out


@pytest.mark.parametrize("argv, needle", [
    (["simulate", "no/such/file.mlir"], "no such file"),
    (["simulate", "{mlir}", "--target", "Z80"], "unknown"),
    (["simulate", "{mlir}", "--system", "ring:4x150"], "4 NPUs"),
    (["simulate", "{mlir}", "--system", "torus:4x1"], "torus"),
    (["replay", "no/such/prefix", "--system", "ring:4x150"], "prefix"),
    (["simulate", "{mlir}", "--out", "/dev/null/run"], "--out /dev/null/run: /dev/null is not a folder"),
    (["generate", "lookalike", "{mlir}", "--out", "."], "--out .: is a folder"),
    (["layouts", "zoo:llama", "--devices", "8", "--system", "ring:8x100", "--target", "Z80"], "'Z80'"),
    (["layouts", "zoo:llama", "--devices", "8", "--system", "ring:4x100"], "8 devices"),
    (["layouts", "zoo:llama?layers=x", "--devices", "8", "--system", "ring:8x100"], "layers=x"),
    (["sweep", "no/such.yaml", "--out", "out/never"], "no/such.yaml"),
    (["study", "no/such.yaml", "--out", "out/never"], "no/such.yaml"),
    (["dataset", "info", "no/such"], "no such dataset"),
    (["train", "--dataset", "no/such", "--fidelity", "roofline"], "no such dataset"),
    (["predict", "{mlir}", "--model", "nope"], "unknown model"),
    (["generate", "programs", "--n", "-1", "--like", "zoo:mlp", "--out", "out/never"], "--n"),
    (["generate", "traces", "--like", "no/such", "--ranks", "4", "--out", "out/never"], "no/such"),
])
def test_bad_input_is_one_line_and_exit_code_2(capsys, argv, needle):
    mlir = str(shared_path("mlir", "test_no_comm_graph.mlir"))
    argv = [a.replace("{mlir}", mlir) for a in argv]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hespas-ml: error:")
    assert needle.lower() in lines[0].lower()


def test_malformed_mlir_file_named_in_error(capsys, tmp_path):
    bad = tmp_path / "broken.mlir"
    text = shared_path("mlir", "jax_example.mlir").read_text()
    bad.write_text(text[: len(text) // 2])
    code, _, err = run_cli(capsys, "analyze", str(bad))
    assert code == 2 and "broken.mlir" in err and "Traceback" not in err


def test_console_script_runs_as_a_process():
    proc = subprocess.run([sys.executable, "-m", "hespas_ml.cli.main", "simulate",
                           str(shared_path("mlir", "test_dependency_graph.mlir")), "--json"],
                          capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["n_comm_nodes"] == 1


def test_zoo_program_takes_its_device_count_from_the_system(capsys):
    code, out, _ = run_cli(capsys, "simulate", "zoo:mlp?layers=3&width=128&batch=64", "--target", "A100-40GB",
                           "--system", "ring:4x150", "--json")
    assert code == 0
    res = json.loads(out)
    assert res["n_devices"] == 4 and res["program"].endswith("devices=4")
    # data parallel training: one all-reduce per weight and bias, plus one for the loss
    assert res["n_comm_nodes"] == 3 * 2 + 1
    assert res["exposed_comm_s"] > 0
