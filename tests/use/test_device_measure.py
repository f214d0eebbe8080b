"""The device measurement path, end to end on the CPU backend: a plan built here, timed by the device
script (killed part-way and continued), imported as a measured dataset with its provenance."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hespas_ml.label.dataset_tables import load_dataset
from hespas_ml.label.device_run import read_jsonl_gz
from hespas_ml.use.device_plan import PlanError, build_plan, load_plan_spec, sample_strata
from hespas_ml.label.device_run import RunError, read_lines, read_runs, run_plan
from hespas_ml.label.fidelity import FidelityError
from hespas_ml.label.measured import MeasuredError, import_run
from hespas_ml.label.profiling import ProfilingFidelity
from hespas_ml.label.profiling_worker import measure
from hespas_ml.label.targets import load_target
from tests.conftest import PROJECT_ROOT

pytestmark = pytest.mark.slow   # exports programs, starts workers, builds datasets or trains

CORPUS = """
name: tiny-corpus
programs:
  - zoo: gemm
    grid: {m: [64, 128], n: [64], k: [64], dtype: [f32, bf16]}
  - zoo: eltwise
    grid: {shape: [256x1024], ops: ["add,mul,exp"], dtype: [f32]}
  - zoo: mlp
    params: {layers: 2, width: 64, batch: 8}
    grid: {step: [infer, train]}
fidelities:
  roofline: {targets: [host-cpu]}
"""

PLAN = """
name: tiny
target: {target}
corpus: corpus.yaml
corpus_regions: 16
steps:
  - zoo: mlp
    params: {{layers: 2, width: 64, batch: 8}}
    grid: {{step: [infer, train]}}
held_out:
  - zoo: conv
    params: {{h: 8, cin: 8, cout: 8, kernel: 3, stride: 1, dtype: f32}}
    grid: {{pass: [fwd, bwd_filter]}}
profiling: {{measure_s: 0.05, min_repeats: 3}}
step_measure_s: 0.1
"""

SCRIPTS = PROJECT_ROOT / "eval" / "device"


def write_spec(folder: Path, target: str = "host-cpu", **replace: str) -> Path:
    (folder / "corpus.yaml").write_text(CORPUS)
    text = PLAN.format(target=target)
    for old, new in replace.items():
        text = text.replace(old, new)
    (folder / "plan.yaml").write_text(text)
    return folder / "plan.yaml"


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    folder = tmp_path_factory.mktemp("device-plan")
    spec = write_spec(folder)
    counts = build_plan(spec, folder / "plan", folder / "work", workers=1, progress=False)
    return folder, counts


def script(name: str, *args: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True, env=env,
                          timeout=600, **kw)


def test_a_plan_holds_the_step_programs_regions_a_corpus_sample_and_the_held_out_programs(plan):
    folder, counts = plan
    regions = read_jsonl_gz(folder / "plan" / "regions.jsonl.gz")
    steps = read_jsonl_gz(folder / "plan" / "steps.jsonl.gz")
    assert counts["programs_steps"] == 2 and counts["programs_held_out"] == 2
    assert [s["phase"] for s in steps] == ["steps", "steps", "held_out", "held_out"]
    phase_of = {r["hash"]: r["phase"] for r in regions}
    # every region of a step program is planned, in the first phase
    for s in steps[:2]:
        assert s["regions"] and all(phase_of[h] == "regions" for h, _ in s["regions"])
        assert s["text"].lstrip().startswith("module") and "func.func" in s["text"]
        assert s["roofline_s"] > 0
    # the corpus sample fills the first phase up to corpus_regions (the corpus has more than that)
    assert len({h for s in steps[:2] for h, _ in s["regions"]}) < 16
    assert sum(1 for r in regions if r["phase"] == "regions") == 16
    # the held-out programs' own regions are planned in the held-out phase
    assert all(r["family"] == "conv" for r in regions if r["phase"] == "held_out")
    assert any(r["phase"] == "held_out" for r in regions)
    assert len({r["hash"] for r in regions}) == len(regions)
    for r in regions:
        assert r["text"].count("func.func public @main") == 1 and len(r["module_sha256"]) == 64
    # the planned regions' tables form a dataset folder
    ds = load_dataset(folder / "plan")
    assert set(ds.regions["hash"]) >= {r["hash"] for r in regions}
    assert set(ds.labels["fidelity"]) == {"roofline"} and set(ds.labels["target"]) == {"host-cpu"}


def test_sampling_goes_round_robin_over_strata():
    rows = [{"hash": f"{k}{i}", "stratum": k} for k in "abc" for i in range(5)]
    rows += [{"hash": "d0", "stratum": "d"}]
    picked = [r["stratum"] for r in sample_strata(rows, 6)]
    assert picked == ["a", "b", "c", "d", "a", "b"]
    assert len(sample_strata(rows, 100)) == len(rows)


def test_the_device_script_continues_after_a_kill_and_imports_with_provenance(plan, tmp_path):
    folder, _ = plan
    out = tmp_path / "results"
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "measure.py"), "--plan", str(folder / "plan"),
                             "--out", str(out), "--budget-s", "300"],
                            env={**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    labels = out / "labels.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if labels.is_file() and len(labels.read_text().splitlines()) >= 4:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait()
    first = read_lines(labels)
    planned = len(read_jsonl_gz(folder / "plan" / "regions.jsonl.gz"))
    assert 4 <= len(first) < planned, "the kill came before the run could finish"
    again = script("measure.py", "--plan", str(folder / "plan"), "--out", str(out), "--budget-s", "300")
    assert again.returncode == 0, again.stderr
    rows = read_lines(labels)
    hashes = [r["hash"] for r in rows]
    assert len(hashes) == len(set(hashes)) == planned     # nothing timed twice, everything timed
    assert [r["hash"] for r in rows[: len(first)]] == [r["hash"] for r in first]
    steps = read_lines(out / "steps.jsonl")
    assert [s["status"] for s in steps] == ["ok"] * 4
    assert json.loads(again.stdout.splitlines()[-1])["left"] == {"regions": 0, "steps": 0, "held_out": 0}
    for row in rows:
        assert row["status"] == "ok" and row["fidelity"] == "profiling" and row["target"] == "host-cpu"
        meta = json.loads(row["meta"])
        assert meta["backend"] == "cpu" and meta["device"].startswith("cpu: ")
        assert meta["jax_version"] and meta["jaxlib_version"] and meta["timing"] == "blocking"
        assert meta["machine"]["cpu_fingerprint"] and meta["machine"]["hostname"]
        assert meta["module_sha256"] == row["module_sha256"]
    # a third call finds nothing to do and says so
    third = script("measure.py", "--plan", str(folder / "plan"), "--out", str(out), "--budget-s", "60")
    assert third.returncode == 0 and len(read_lines(labels)) == planned
    runs = read_runs(out / "runs.jsonl")      # the killed call kept the record it wrote when it started
    assert len(runs) == 3 and [r["finished"] is None for r in runs] == [True, False, False]
    assert runs[0]["device"]["machine"]["cpu_fingerprint"] and runs[0]["done"] == {}

    measured = tmp_path / "measured"
    done = script("collect.py", "--plan", str(folder / "plan"), str(out), "--out", str(measured))
    assert done.returncode == 0, done.stderr
    ds = load_dataset(measured)
    prof = ds.labels[ds.labels["fidelity"] == "profiling"]
    assert len(prof) == planned and set(prof["target"]) == {"host-cpu"} and prof["seconds"].gt(0).all()
    assert set(prof["hash"]) <= set(ds.regions["hash"])
    import pandas as pd
    table = pd.read_csv(measured / "steps.csv")
    assert list(table["phase"]) == ["steps", "steps", "held_out", "held_out"]
    assert table["step_s"].gt(0).all() and table["regions_covered"].eq(1.0).all()
    assert table["region_sum_s"].gt(table["region_sum_less_overhead_s"]).all()
    assert len(read_lines(measured / "raw" / "labels.jsonl")) == planned      # what a later session continues
    readme = (measured / "README.md").read_text()
    assert "cpu: " in readme and "eval/device/collect.py" in readme
    runs = json.loads((measured / "provenance.json").read_text())["runs"]
    assert len(runs) == 3 and runs[1]["device"]["machine"]["cpu_fingerprint"] and runs[1]["done"]
    assert "killed before it ended" in readme

    # the measured fidelity answers a step program from these labels: its compute is their sum, each less
    # the dispatch overhead of its own measurement
    from hespas_ml import simulate
    step = table.iloc[0]
    res = simulate(step["source"], target="host-cpu", fidelity="measured", fidelity_options={"folders": [measured]})
    assert res.fidelity == "measured"
    assert res.step_time_s == pytest.approx(step["region_sum_less_overhead_s"], rel=1e-6, abs=2e-6)  # whole µs
    assert {r.bound for r in res.regions} == {"measured"}
    # a program with regions nobody measured is refused, saying how many
    with pytest.raises(FidelityError, match=r"measured: \d+ of \d+ compute regions have no label measured on "
                                            r"host-cpu"):
        simulate("zoo:mlp?layers=3&width=96&batch=8&step=train", target="host-cpu", fidelity="measured",
                 fidelity_options={"folders": [measured]})
    with pytest.raises(FidelityError, match="no labels measured on H100"):
        simulate(step["source"], target="H100", fidelity="measured", fidelity_options={"folders": [measured]})


def test_results_of_another_plan_are_refused(plan, tmp_path):
    folder, _ = plan
    out = tmp_path / "results"
    out.mkdir()
    (out / "labels.jsonl").write_text(json.dumps({"hash": "f" * 64, "module_sha256": "0" * 64, "status": "ok",
                                                  "target": "host-cpu", "seconds": 1.0, "meta": "{}"}) + "\n")
    with pytest.raises(MeasuredError, match="another plan"):
        import_run(folder / "plan", [out], tmp_path / "measured")
    with pytest.raises(MeasuredError, match="not a results folder"):
        import_run(folder / "plan", [tmp_path / "empty"], tmp_path / "measured")


def test_a_device_that_is_not_the_plans_target_is_refused_in_one_line(tmp_path):
    spec = write_spec(tmp_path, target="H100", **{"grid: {pass: [fwd, bwd_filter]}": "grid: {pass: [fwd]}",
                                                   "corpus_regions: 16": "corpus_regions: 2"})
    build_plan(spec, tmp_path / "plan", tmp_path / "work", workers=1, progress=False)
    done = script("measure.py", "--plan", str(tmp_path / "plan"), "--out", str(tmp_path / "results"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "not target H100" in lines[0] and str(tmp_path / "plan") in lines[0]
    assert read_lines(tmp_path / "results" / "labels.jsonl") == []
    # a rehearsal on this machine says what it measured, and is never collected as the plan's target
    rehearsal = script("measure.py", "--plan", str(tmp_path / "plan"), "--out", str(tmp_path / "results"),
                       "--target", "host-cpu", "--phases", "regions")
    assert rehearsal.returncode == 0, rehearsal.stderr
    rows = read_lines(tmp_path / "results" / "labels.jsonl")
    assert rows and {r["target"] for r in rows} == {"host-cpu"}
    with pytest.raises(MeasuredError, match="measured on host-cpu, the plan is for H100"):
        import_run(tmp_path / "plan", [tmp_path / "results"], tmp_path / "measured")


@pytest.mark.parametrize("change, message", [
    ({"corpus_regions: 16": "corpus_regions: -1"}, "corpus_regions"),
    ({"zoo: conv\n": "zoo: conv\n    family: gemm\n"}, "held_out: family gemm is in the corpus"),
    ({"measure_s: 0.05": "measure_s: -1"}, "profiling"),
    ({"name: tiny": "name: tiny\nbudget: 3"}, "budget: unknown key"),
])
def test_bad_plan_specs_are_one_line_naming_the_file_and_key(tmp_path, change, message):
    spec = write_spec(tmp_path, **change)
    with pytest.raises(PlanError, match=message) as info:
        load_plan_spec(spec)
    assert str(spec) in str(info.value) and "\n" not in str(info.value)


def test_a_run_refuses_a_folder_that_is_not_a_plan(tmp_path):
    with pytest.raises(RunError, match="not a readable measurement plan"):
        run_plan(tmp_path, tmp_path / "out", budget_s=1)


def test_queued_samples_time_the_work_not_the_queueing():
    """The GPU path of the sampler: calls queue work and a sample waits only for the last one; a sample
    then lasts as long as the queued work, not as long as queueing it."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:           # one stream: work runs in order
        queued = measure(lambda: pool.submit(time.sleep, 0.002), 0.3, 5, 50, 0.02, 0.01,
                         finish=lambda future: future.result())
    assert 0.0018 <= queued["median_s"] <= 0.01
    unwaited = measure(lambda: None, 0.1, 5, 20, 0.02, 0.01)
    assert unwaited["median_s"] < 0.0005


def test_a_slow_first_call_does_not_use_up_the_sampling_window():
    """A program's first call may hold one-off work longer than the whole window (a GPU library choosing
    its plans): the samples after the warm-up still get their window, not a single sample."""
    calls = []

    def call():
        time.sleep(0.3 if not calls else 0.002)
        calls.append(1)

    got = measure(call, 0.2, 5, 50, 1e-9, 0.004)
    assert got["warmup_s"] >= 0.3 and got["repeats"] >= 5 and got["median_s"] < 0.1


def test_a_batch_compiled_ahead_labels_like_one_at_a_time(tmp_path):
    """compile_threads > 1 compiles a batch ahead of its timings; a module XLA refuses fails alone."""
    def gemm(n: int) -> str:
        return textwrap.dedent(f"""\
            func.func @main(%a: tensor<{n}x{n}xf32>, %b: tensor<{n}x{n}xf32>) -> tensor<{n}x{n}xf32> {{
              %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<{n}x{n}xf32>, tensor<{n}x{n}xf32>) -> tensor<{n}x{n}xf32>
              return %0 : tensor<{n}x{n}xf32>
            }}""")
    bad = ("func.func @main(%a: tensor<4xf32>) -> tensor<4xf32> {\n  %0 = stablehlo.custom_call @no_such_target(%a)"
           " : (tensor<4xf32>) -> tensor<4xf32>\n  return %0 : tensor<4xf32>\n}")
    texts = [gemm(64), gemm(128), bad, gemm(96), gemm(64)]
    host = load_target("host-cpu")
    with ProfilingFidelity(cache=False, measure_s=0.05, compile_threads=2) as fid:
        assert fid.batch_size(host) == 8
        labels = fid.label_modules(texts, host)
        assert fid.stats["worker_starts"] == 1 and fid.stats["timed"] == 3
    assert [lab.status for lab in labels] == ["ok", "ok", "failed", "ok", "ok"]
    assert labels[2].meta["kind"] == "compile"
    assert labels[0].seconds == labels[4].seconds                   # one module, timed once
    assert all(lab.meta["compile_s"] > 0 and lab.meta["xla_flops"] > 0 for lab in labels if lab.status == "ok")
    assert labels[1].meta["xla_flops"] == 2 * 128**3


def test_gpu_facts_read_the_drivers_report(tmp_path, monkeypatch):
    """``gpu_facts`` reads nvidia-smi's CSV query and banner; here a stand-in prints what an H100 machine's
    nvidia-smi prints (driver 580.159.04, CUDA 13.0), and without one there are no facts."""
    from hespas_ml.host import GPU_QUERY, gpu_facts

    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    values = ["NVIDIA H100 80GB HBM3", "GPU-1234", "580.159.04", "96.00.99.00.01", "00000000:00:07.0", "81559",
              "1980", "2619", "1980", "2619", "700.00", "31", "P0"]
    assert len(values) == len(GPU_QUERY)
    fake.write_text("#!/bin/sh\ncase \"$1\" in\n  --query-gpu=*) echo '" + ", ".join(values) + "';;\n"
                    "  *) echo '| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: 13.0     |';;\n"
                    "esac\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    gpu_facts.cache_clear()
    try:
        facts = gpu_facts()
        assert facts["name"] == "NVIDIA H100 80GB HBM3" and facts["driver_version"] == "580.159.04"
        assert facts["clocks_max_sm"] == "1980" and facts["power_limit"] == "700.00"
        assert facts["cuda_version"] == "13.0"
        fake.write_text("#!/bin/sh\nexit 9\n")
        gpu_facts.cache_clear()
        assert gpu_facts() is None
    finally:
        gpu_facts.cache_clear()


def test_xla_flags_reach_the_worker_and_their_times_are_not_the_plans(plan, tmp_path):
    """A run with XLA flags the plan does not name (an override on the command line) records them with
    every label; collecting it for the plan is refused, since the flags change what XLA compiles."""
    folder, _ = plan
    with pytest.raises(FidelityError, match="xla_flags must be XLA flags"):
        ProfilingFidelity(xla_flags="-O3")
    host = load_target("host-cpu")
    with ProfilingFidelity(cache=False, measure_s=0.05, xla_flags="--xla_no_such_flag=1") as fid:
        with pytest.raises(FidelityError, match="Unknown flag in XLA_FLAGS: --xla_no_such_flag"):
            fid.label_modules([read_jsonl_gz(folder / "plan" / "regions.jsonl.gz")[0]["text"]], host)
    out = tmp_path / "results"
    run_plan(folder / "plan", out, budget_s=3, phases=("regions",), echo=None,
             options={"xla_flags": "--xla_gpu_autotune_level=0"})
    rows = read_lines(out / "labels.jsonl")
    assert rows and all(json.loads(r["meta"])["xla_flags"] == "--xla_gpu_autotune_level=0" for r in rows)
    with pytest.raises(MeasuredError, match="timed with XLA_FLAGS --xla_gpu_autotune_level=0, the plan with"):
        import_run(folder / "plan", [out], tmp_path / "measured")
    # where XLA keeps its autotuning results is not which kernels it picks: such a run is collected
    cached = tmp_path / "cached"
    run_plan(folder / "plan", cached, budget_s=3, phases=("regions",), echo=None,
             options={"xla_flags": f"--xla_gpu_per_fusion_autotune_cache_dir={tmp_path / 'autotune'}"})
    assert import_run(folder / "plan", [cached], tmp_path / "measured")["labels_ok"] > 0
    # the two runs compared region by region, and a plan cut from the first to time its regions again
    compared = script("compare.py", str(out), str(cached))
    assert compared.returncode == 0, compared.stderr
    both = len({r["hash"] for r in rows} & {r["hash"] for r in read_lines(cached / "labels.jsonl")})
    assert f"regions timed in both: {both} (XLA_FLAGS base --xla_gpu_autotune_level=0" in compared.stdout
    cut = script("subplan.py", "--plan", str(folder / "plan"), "--from", str(out), "--regions", "2",
                 "--out", str(tmp_path / "cut"))
    assert cut.returncode == 0, cut.stderr
    assert json.loads(cut.stdout)["regions"] == 2
    assert [r["hash"] for r in read_jsonl_gz(tmp_path / "cut" / "regions.jsonl.gz")] == [r["hash"] for r in rows[:2]]


def test_a_call_starts_no_program_it_may_not_finish_within_its_budget(plan, tmp_path):
    """A whole program may take the profiling budget to compile and time: with less than that left of the
    call it is not started (the call would overrun the device's time limit), and it stays to do."""
    folder, _ = plan
    out = tmp_path / "results"
    record = run_plan(folder / "plan", out, budget_s=5, phases=("steps",), echo=None, options={"budget_s": 30})
    assert record["left"]["steps"] == 2 and not read_lines(out / "steps.jsonl")
    assert "a program may take 30 s: no more programs this call" in (out / "log.txt").read_text()
    record = run_plan(folder / "plan", out, budget_s=60, phases=("steps",), echo=None, options={"budget_s": 30})
    assert record["left"]["steps"] == 0 and len(read_lines(out / "steps.jsonl")) == 2


def test_results_timed_before_indices_were_spread_are_timed_again(plan, tmp_path):
    """A region with a gather or scatter whose row does not say how its indices were drawn was timed
    with every integer in [1, 4): the next call times it again (and only it), its new row saying so."""
    import gzip
    import shutil

    from tests.label.test_profiling import EMBEDDING_GRADIENT

    folder, _ = plan
    mine = tmp_path / "plan"
    shutil.copytree(folder / "plan", mine)
    regions = read_jsonl_gz(mine / "regions.jsonl.gz")
    gather = {**regions[0], "hash": "e" * 64, "text": "module @m {\n" + EMBEDDING_GRADIENT + "}\n"}
    with gzip.open(mine / "regions.jsonl.gz", "wt") as fh:
        for row in [*regions, gather]:
            fh.write(json.dumps(row) + "\n")
    out = tmp_path / "results"
    out.mkdir()
    old = [{"hash": r["hash"], "status": "ok", "seconds": 1.0, "meta": "{}"} for r in (regions[0], gather)]
    (out / "labels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    run_plan(mine, out, budget_s=120, phases=("regions",), echo=None)
    rows = read_lines(out / "labels.jsonl")
    again = [r for r in rows[2:] if r["hash"] in {regions[0]["hash"], gather["hash"]}]
    assert [r["hash"] for r in again] == [gather["hash"]]
    assert again[0]["status"] == "ok", again[0]["reason"]
    assert json.loads(again[0]["meta"])["index_inputs"] == 2
    timed = sum(1 for r in regions if r["phase"] == "regions")
    assert len(rows) == 2 + (timed - 1) + 1 and regions[0]["phase"] == "regions"   # the others timed once


def test_regions_timed_one_execution_at_a_time_are_timed_again_in_a_loop_first(plan, tmp_path):
    """With a loop option and ``retime_unlooped`` N, the first N regions of the regions phase whose labels
    were timed one execution at a time are timed again, looped, before anything new; without the loop
    option nothing is timed again."""
    folder, _ = plan
    regions = [r for r in read_jsonl_gz(folder / "plan" / "regions.jsonl.gz") if r["phase"] == "regions"]
    out = tmp_path / "results"
    out.mkdir()
    old = [{"hash": r["hash"], "status": "ok", "seconds": 1.0, "meta": json.dumps({"index_inputs": 0})}
           for r in regions[:3]]
    (out / "labels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    run_plan(folder / "plan", out, budget_s=120, phases=("regions",), echo=None, retime_unlooped=2)
    first = read_lines(out / "labels.jsonl")[3:]
    assert first and not {r["hash"] for r in first} & {r["hash"] for r in regions[:3]}   # no loop: not again
    (out / "labels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    run_plan(folder / "plan", out, budget_s=120, phases=("regions",), echo=None, retime_unlooped=2,
             options={"loop": 2}, chunk=2)
    rows = read_lines(out / "labels.jsonl")[3:]
    assert [r["hash"] for r in rows[:2]] == [r["hash"] for r in regions[:2]]
    assert all(json.loads(r["meta"]).get("loop") == 2 for r in rows if r["status"] == "ok")
    assert regions[2]["hash"] not in {r["hash"] for r in rows}          # the third keeps its one label
    assert "2 timed one execution at a time are timed again in a loop first" in (out / "log.txt").read_text()
