"""Design sweeps: the smoke sweep end to end, the fast replay against the embedded replay, resuming after
SIGKILL, a Dask cluster giving the local engine's rows, the report, and one-line spec errors.

The smoke sweep's programs are exported once into the zoo cache; later runs take a few seconds.
"""
from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from hespas_ml import simulate
from hespas_ml.cli.main import main as cli_main
from hespas_ml.use.sweep import RESULTS, run_sweep
from hespas_ml.use.sweep_report import load_results, make_report, pareto_front, print_report, write_plots
from hespas_ml.use.sweep_spec import load_sweep_spec
from tests.conftest import in_project, readme_command

pytestmark = pytest.mark.slow   # exports programs, starts workers, builds datasets or trains

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "eval" / "sweeps" / "smoke.yaml"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "smoke"
    with in_project():                     # the README's command line
        assert cli_main([*readme_command("hespas-ml sweep eval/sweeps/smoke.yaml", {"out/sweep-smoke": str(out)}),
                         "--no-progress"]) == 0
    return out, json.loads((out / "manifest.json").read_text()), pd.read_parquet(out / RESULTS)


# ------------------------------------------------------------------------------------------ end to end

def test_smoke_sweep_rows_columns_and_sharing(smoke):
    out, manifest, df = smoke
    spec = load_sweep_spec(SMOKE)
    n = spec.n_configs()
    assert manifest["status"] == "done" and manifest["configs"] == n == len(df) > 300
    assert sorted(df["config_id"]) == list(range(n))                       # one row per configuration
    for col in ("workload", "family", "program", "devices", "parallel", "param_layers", "target", "fidelity",
                "replay", "system", "topology", "npus_per_dim", "bandwidth_gbps", "latency_ns",
                "cost_per_device_hour", "status", "error", "step_time_s", "compute_time_s", "exposed_comm_s",
                "step_time_lo_s", "step_time_hi_s", "utilisation", "cost_per_step", "replay_engine"):
        assert col in df.columns, col
    ok = df[df["status"] == "ok"]
    assert (ok["step_time_s"] > 0).all()
    assert ((ok["compute_time_s"] - (ok["step_time_s"] - ok["exposed_comm_s"])).abs() < 1e-15).all()
    assert ok["utilisation"].between(0, 1, inclusive="neither").all()
    assert (ok["replay_engine"] == "fast").all()
    assert set(ok["fidelity"]) == {manifest["fidelities"][0]}
    # the tp-over-8-devices program is rejected by the zoo: recorded as failed rows, the sweep went on
    failed = df[df["status"] == "failed"]
    assert len(failed) == 2 * 24 and (failed["devices"] == 8).all()
    assert failed["error"].str.contains("not divisible by devices=8").all()
    # work shared, not repeated
    st = manifest["stats"]
    programs_ok = sum(1 for p in spec.programs if p.error is None)
    assert st["programs_prepared"] == programs_ok and st["programs_failed"] == 1
    assert st["labels_computed"] == st["regions_unique"] * len(spec.targets) < st["regions_seen"]
    # one trace set per program and variant, three (point, lower, upper) when the fidelity gives intervals
    sets_per_variant = [3 if v.fidelity.startswith("surrogate:") else 1 for v in spec.variants]
    assert st["trace_sets_built"] == programs_ok * sum(sets_per_variant)
    working_systems = len(spec.systems[2]) + len(spec.systems[4])
    assert st["systems_built"] == working_systems * len(spec.targets)      # one per (system, memory bandwidth)
    assert st["replays_fast"] == len(ok) * (3 if manifest["fidelities"][0].startswith("surrogate:") else 1)
    assert sorted(p.name for p in (out / "chunks").iterdir()) == [f"chunk-{c.id:06d}.parquet" for c in spec.chunks()]


def test_smoke_rows_equal_simulate(smoke):
    from hespas_ml import simulate
    _out, _m, df = smoke
    ok = df[df["status"] == "ok"]
    for _, row in ok.sample(3, random_state=3).iterrows():
        res = simulate(row["program"], target=row["target"], system=row["system"], fidelity=row["fidelity"],
                       replay="embedded")
        assert (res.step_time_s, res.exposed_comm_s, res.compute_time_s) == \
               (row["step_time_s"], row["exposed_comm_s"], row["compute_time_s"])
        assert (res.n_comp_nodes, res.n_comm_nodes) == (row["n_comp_nodes"], row["n_comm_nodes"])


def test_rerun_of_a_finished_sweep_adds_nothing(smoke):
    out, _m, df = smoke
    manifest = run_sweep(SMOKE, out, workers=1, progress=False)
    assert manifest["stats"]["chunks_written"] == 0
    pd.testing.assert_frame_equal(pd.read_parquet(out / RESULTS), df)


def test_dask_cluster_gives_the_local_engines_rows(smoke, tmp_path):
    from dask.distributed import LocalCluster
    _out, _m, df = smoke
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        manifest = run_sweep(SMOKE, tmp_path / "dask", engine="dask", address=cluster.scheduler_address,
                             progress=False)
    assert manifest["engine"] == "dask"
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "dask" / RESULTS), df)


def test_failed_programs_are_recorded_not_fatal(tmp_path):
    bad = tmp_path / "broken.mlir"
    bad.write_text("module { this is not stablehlo }\n")
    spec = tmp_path / "fail.yaml"
    spec.write_text(yaml.safe_dump({
        "workloads": [{"mlir": str(bad), "devices": 4},
                      {"zoo": "mlp", "params": {"layers": 2, "width": 64, "batch": 16},
                       "parallelism": [{"devices": 4, "parallel": "dp"}]}],
        "targets": ["H100"], "systems": {"specs": ["ring:4x100", "fc:4x50@100"]}}))
    m = run_sweep(spec, tmp_path / "out", workers=1, progress=False)
    df = pd.read_parquet(tmp_path / "out" / RESULTS)
    assert len(df) == 4 and m["stats"]["programs_failed"] == 1
    broken = df[df["family"] == "mlir"]
    assert (broken["status"] == "failed").all() and broken["error"].str.contains("broken.mlir").all()
    assert (df[df["family"] == "mlp"]["status"] == "ok").all()


# ------------------------------------------------------------------------------------------ fast replay

def _traces(spec: str, target: str = "H100"):
    from hespas_ml.ingest import load_program
    from hespas_ml.fidelities import get_fidelity
    from hespas_ml.label.targets import load_target
    from hespas_ml.replay.traces import build_traces
    from hespas_ml.split.regions import split_program

    graph = load_program(spec)
    rg = split_program(graph)
    tgt = load_target(target)
    labels = get_fidelity("roofline").label_regions(rg.compute_regions(), tgt)
    seconds = [0.0] * len(rg.regions)
    for r, lab in zip(rg.compute_regions(), labels):
        seconds[r.id] = lab.seconds
    return build_traces(rg, seconds, graph.n_devices), tgt


def _random_system(rng: random.Random, n: int) -> str:
    shapes = {4: ["ring:4", "fc:4", "switch:4", "ring:2,switch:2", "fc:2,ring:2"],
              8: ["ring:8", "fc:8", "switch:8", "switch:2,ring:4", "fc:4,switch:2", "ring:2,fc:2,switch:2"]}[n]
    dims = []
    for part in rng.choice(shapes).split(","):
        name, k = part.split(":")
        dims.append(f"{name}:{k}x{rng.choice([12.5, 50, 150, 400, 900])}@{rng.choice([0, 1, 100, 500, 2000])}")
    return ",".join(dims)


@pytest.mark.parametrize("program", [
    "zoo:llama?layers=2&d_model=64&heads=4&kv_heads=4&ffn=128&vocab=256&seq=16&batch=8&devices=4&parallel=fsdp",
    "zoo:llama?layers=2&d_model=64&heads=4&kv_heads=4&ffn=128&vocab=256&seq=16&batch=8&devices=4&parallel=tp",
    "zoo:mlp?layers=2&width=64&batch=16&devices=4&parallel=dp",
])
def test_fast_replay_equals_embedded_replay(program):
    from hespas_ml.replay import replay
    from hespas_ml.replay.system import load_system
    from hespas_ml.replay.fast import SystemContext, compile_plan, evaluate, replay_fast

    rng = random.Random(program)
    for target in ("H100", "V100-32GB"):
        traces, tgt = _traces(program, target)
        plan = compile_plan(traces.traces, traces.comm_groups)
        assert not isinstance(plan, str), plan
        for _ in range(10):
            cfg = load_system(_random_system(rng, 4), local_mem_bw_gbps=tgt.mem_bw / 1e9)
            ref = replay(traces.traces, cfg, traces.comm_groups or None, backend="embedded")
            res = evaluate(plan, SystemContext(cfg))
            assert res is not None
            assert res.finish_ns / 1e9 == ref.step_time_s, cfg.source
            assert res.exposed_ns / 1e9 == ref.exposed_comm_s, cfg.source
            fast = replay_fast(traces.traces, cfg, traces.comm_groups or None, plan=plan)
            assert fast.details["engine"] == "fast" and fast.ranks == ref.ranks, cfg.source


def test_fast_replay_hands_over_where_it_does_not_apply(tmp_path):
    """Systems whose collectives the shape path does not time (halvingDoubling, doubleBinaryTree,
    several active chunks) still give the embedded replay's step times through replay_fast."""
    from hespas_ml.replay import replay
    from hespas_ml.replay.system import load_system, write_system
    from hespas_ml.replay.fast import replay_fast

    traces, _tgt = _traces("zoo:llama?layers=2&d_model=64&heads=4&kv_heads=4&ffn=128&vocab=256&seq=16&batch=8"
                           "&devices=4&parallel=fsdp")
    base = load_system("ring:2x100@200,switch:2x50@700")
    for name, change in (("hd", {"all-reduce-implementation": ["halvingDoubling", "halvingDoubling"],
                                 "all-gather-implementation": ["halvingDoubling", "ring"]}),
                         ("dbt", {"all-reduce-implementation": ["doubleBinaryTree", "ring"]}),
                         ("chunks", {"active-chunks-per-dimension": 2, "collective-optimization": "baseline"})):
        base.system.update(change)
        folder = tmp_path / name
        write_system(base, folder)
        cfg = load_system(str(folder))
        ref = replay(traces.traces, cfg, traces.comm_groups or None, backend="embedded")
        res = replay_fast(traces.traces, cfg, traces.comm_groups or None)
        assert (res.step_time_s, res.exposed_comm_s) == (ref.step_time_s, ref.exposed_comm_s), name


def test_fast_replay_sub_group_collectives():
    """Hand-made traces with sub-group, full-group (pg_name) and global collectives: the fast path
    applies and gives the embedded replay's per-rank results."""
    from hespas_ml.replay import chakra as et
    from hespas_ml.replay import replay
    from hespas_ml.replay.chakra import EtNode
    from hespas_ml.replay.system import load_system
    from hespas_ml.replay.fast import compile_plan, replay_fast

    groups = {1: [0, 1], 2: [2, 3], 3: [0, 1, 2, 3]}
    rng = random.Random(5)
    for _ in range(12):
        sizes = [rng.choice([4096, 1 << 20, 3 << 18]) for _ in range(3)]
        us = [rng.randint(0, 40) for _ in range(4)]
        comp = {"num_ops": 1, "tensor_size": 1}
        traces = [[EtNode(0, "c0", et.COMP_NODE, [], [], us[0], comp),
                   EtNode(1, "ar", et.COMM_COLL_NODE, [0], [], 0, {"comm_type": et.ALL_REDUCE, "comm_size": sizes[0],
                                                                  "pg_name": "1" if rank < 2 else "2"}),
                   EtNode(2, "c1", et.COMP_NODE, [0], [], us[1], comp),
                   EtNode(3, "ag", et.COMM_COLL_NODE, [2], [1], 0, {"comm_type": et.ALL_GATHER, "comm_size": sizes[1],
                                                                   "pg_name": "3"}),
                   EtNode(4, "c2", et.COMP_NODE, [1, 2], [], us[2], comp),
                   EtNode(5, "rs", et.COMM_COLL_NODE, [4], [3], 0, {"comm_type": et.REDUCE_SCATTER,
                                                                   "comm_size": sizes[2]}),
                   EtNode(6, "c3", et.COMP_NODE, [5], [], us[3], comp)] for rank in range(4)]
        spec = rng.choice(["ring:4x{b}@{l}", "fc:4x{b}@{l}", "switch:2x{b}@{l},ring:2x{b}@{l}"])
        cfg = load_system(spec.format(b=rng.choice([25, 100, 400]), l=rng.choice([0, 100, 700])))
        plan = compile_plan(traces, groups)
        assert not isinstance(plan, str), plan
        ref = replay(traces, cfg, groups, backend="embedded")
        res = replay_fast(traces, cfg, groups, plan=plan)
        assert res.details["engine"] == "fast" and res.ranks == ref.ranks, cfg.source


def test_collective_times_match_the_system_layer():
    """Shape + linear phase fits + composition give what running the collective through the embedded
    system layer gives, on many random systems and sizes."""
    from hespas_ml.replay import chakra as et
    from hespas_ml.replay.embedded.network import Network
    from hespas_ml.replay.system import load_system
    from hespas_ml.replay.fast_collectives import link_class
    from hespas_ml.replay.fast import SystemContext

    rng = random.Random(11)
    shaped = 0
    for _ in range(60):
        cfg = load_system(_random_system(rng, rng.choice([4, 8])), local_mem_bw_gbps=rng.choice([900, 3350, 8000]))
        net = Network(cfg)
        npus, kinds = [d.npus for d in cfg.dims], [d.topology for d in cfg.dims]
        a, b = rng.sample(range(cfg.n_npus), 2)
        dim, hops = link_class(npus, kinds, a, b)
        assert net.delay(a, b, 4096) == int(hops * net.latency[dim] + 4096 / net.bytes_per_ns[dim])
        ctx = SystemContext(cfg)
        for _ in range(4):
            key = (rng.choice([et.ALL_REDUCE, et.ALL_GATHER, et.REDUCE_SCATTER, et.ALL_TO_ALL]),
                   rng.choice([64, 4096, 147456, 3145728, rng.randint(64, 20_000_000)]), None, None, None)
            assert ctx.timer.time(key) == ctx.timer._run(key), (cfg.source, key)
        shaped += ctx.timer.by_shape
    assert shaped > 150


# ------------------------------------------------------------------------------------------ resume

def test_resume_after_sigkill(tmp_path, smoke):
    _out, _m, reference = smoke
    data = yaml.safe_load(SMOKE.read_text())
    data["chunk_size"] = 10
    spec = tmp_path / "smoke10.yaml"
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "hespas_ml.cli.main", "sweep", str(spec), "--out", str(out),
                             "--no-progress", "--workers", "2"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    n_chunks = len(load_sweep_spec(spec).chunks())
    deadline = time.time() + 120
    try:
        while time.time() < deadline:
            written = list((out / "chunks").glob("chunk-*.parquet")) if (out / "chunks").is_dir() else []
            if len(written) >= 3:
                break
            assert proc.poll() is None, "the sweep ended before it could be killed"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)          # the driver and its worker processes
    finally:
        proc.wait(timeout=30)
    written = list((out / "chunks").glob("chunk-*.parquet"))
    assert 3 <= len(written) < n_chunks and not (out / RESULTS).exists()
    assert json.loads((out / "manifest.json").read_text())["status"] == "running"
    manifest = run_sweep(spec, out, workers=2, progress=False)
    assert manifest["stats"]["chunks_written"] == n_chunks - len(written)
    df = pd.read_parquet(out / RESULTS)
    assert sorted(df["config_id"]) == list(range(len(reference)))          # exactly one row each
    pd.testing.assert_frame_equal(df, reference)


# ------------------------------------------------------------------------------------------ report

def _table() -> pd.DataFrame:
    """Two workloads; for A the front over devices is configs 0 (2 dev, 9 s), 2 (4 dev, 5 s), 4 (8 dev, 4 s)."""
    rows = [  # config, workload, devices, step, cost
        (0, "A", 2, 9.0, 1.0), (1, "A", 2, 10.0, 0.5), (2, "A", 4, 5.0, 2.0), (3, "A", 4, 6.0, 0.4),
        (4, "A", 8, 4.0, 3.0), (5, "A", 8, 4.0, 3.5), (6, "A", 16, 4.5, 9.0),
        (7, "B", 4, 2.0, 1.0), (8, "B", 8, 2.0, 2.0),
    ]
    df = pd.DataFrame(rows, columns=["config_id", "workload", "devices", "step_time_s", "cost_per_step"])
    df["compute_time_s"] = df["step_time_s"] * 0.75
    df["exposed_comm_s"] = df["step_time_s"] * 0.25
    df["status"] = "ok"
    df["error"] = ""
    df["target"] = ["H100", "A100-80GB"] * 4 + ["H100"]
    df["parallel"] = "dp"
    df["system"] = "ring:4x100"
    df["bandwidth_gbps"] = [100.0, 200.0] * 4 + [100.0]
    df["utilisation"] = 0.5
    failed = df.iloc[[0]].copy()
    failed[["config_id", "status", "error", "step_time_s"]] = [9, "failed", "boom", float("nan")]
    return pd.concat([df, failed], ignore_index=True)


def test_pareto_front_by_hand():
    assert pareto_front([2, 2, 4, 4, 8, 8, 16], [9, 10, 5, 6, 4, 4, 4.5]) == [0, 2, 4]
    assert pareto_front([1, 1, 1], [3, 3, 3], ids=[7, 5, 6]) == [1]            # duplicates: lowest id stands
    assert pareto_front([3, 2, 1], [1, 2, 3]) == [2, 1, 0]
    assert pareto_front([], []) == []


def test_report_fronts_best_and_plots(tmp_path):
    df = _table()
    rep = make_report(df, top=2)
    assert (rep["configs"], rep["ok"], rep["failed"]) == (10, 9, 1)
    a = next(w for w in rep["workloads"] if w["workload"] == "A")
    assert [r["config_id"] for r in a["front"]] == [0, 2, 4]
    assert [r["config_id"] for r in a["best"]] == [4, 5]
    b = next(w for w in rep["workloads"] if w["workload"] == "B")
    assert [r["config_id"] for r in b["front"]] == [7]
    by_cost = make_report(df, x="cost_per_step")
    a = next(w for w in by_cost["workloads"] if w["workload"] == "A")
    assert [r["config_id"] for r in a["front"]] == [3, 2, 4]
    files = write_plots(df, rep, tmp_path / "report")
    names = {Path(f).name for f in files}
    assert {"pareto.png", "step_vs_bandwidth.png", "step_vs_devices.png", "breakdown.png", "report.json"} <= names
    for f in files:
        if f.endswith(".png"):
            assert Path(f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and Path(f).stat().st_size > 5000


def test_report_cli_on_a_sweep_folder(smoke, tmp_path, capsys):
    out, _m, df = smoke
    command = readme_command("hespas-ml sweep report", {"out/sweep-smoke": str(out),
                                                        "out/sweep-smoke/report": str(tmp_path / "rep")})
    assert cli_main([*command, "--top", "1"]) == 0
    text = capsys.readouterr().out
    assert "Pareto front" in text and f"{len(df)} configurations" in text
    assert (tmp_path / "rep" / "pareto.png").is_file()
    assert cli_main(["sweep", "report", str(out / RESULTS), "--x", "cost_per_step", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["x"] == "cost_per_step" and len(rep["workloads"]) == 3
    assert len(load_results(out)) == len(df)


# ------------------------------------------------------------------------------------------ errors

def _spec(tmp_path: Path, **changes) -> Path:
    data = yaml.safe_load(SMOKE.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_sweep_notes_what_a_learned_fidelity_says_about_its_targets(tmp_path, fast_host):
    spec = load_sweep_spec(_spec(tmp_path, targets=[str(fast_host)], fidelities=["surrogate:profiling", "roofline"],
                                 costs=None))
    caveats = [n for n in spec.notes if n.startswith("surrogate:profiling learned the host-cpu timings of another")]
    assert len(caveats) == 1 and "100,000 GFLOP/s" in caveats[0]
    assert not [n for n in load_sweep_spec(_spec(tmp_path, fidelities=["surrogate:roofline"])).notes
                if "another machine" in n]


def test_a_sweep_over_labels_that_changed_meaning_does_not_resume_results_of_the_older_ones(tmp_path, monkeypatch):
    from hespas_ml.label.profiling import ProfilingFidelity

    def fingerprint(fidelities: list[str]) -> str:
        return load_sweep_spec(_spec(tmp_path, fidelities=fidelities)).fingerprint()

    profiling, roofline = fingerprint(["profiling", "roofline"]), fingerprint(["roofline"])
    monkeypatch.setattr(ProfilingFidelity, "LABEL_VERSION", ProfilingFidelity.LABEL_VERSION + 1)
    assert fingerprint(["profiling", "roofline"]) != profiling
    assert fingerprint(["roofline"]) == roofline


@pytest.mark.parametrize("changes, expected", [
    ({"workloads": [{"zoo": "nope"}]}, "unknown zoo family 'nope'"),
    ({"workloads": [{"zoo": "llama", "params": {"depth": 3}}]}, "llama has no parameter 'depth'"),
    ({"targets": ["H100", "Z80"]}, "target 'Z80'"),
    ({"fidelities": ["guesswork"]}, "fidelity 'guesswork'"),
    ({"systems": {"topologies": ["torus"], "bandwidth_gbps": [100]}}, "unknown 'torus'"),
    ({"systems": {"topologies": ["ring:3,ring"], "bandwidth_gbps": [100]}}, "fits none of the device counts"),
    ({"systems": {"specs": ["ring:16x100"]}}, "has 16 NPUs but no workload runs on 16 devices"),
    ({"systems": {"topologies": ["ring"], "bandwidth_gbps": [[100, 50]]}}, "has 2 entries but topology 'ring'"),
    ({"costs": {"TPUv4": 3.0}}, "costs names target 'TPUv4'"),
    ({"chunk_size": 0}, "chunk_size must be a positive integer"),
    ({"replay": ["ns3"]}, "replay 'ns3'"),
    ({"colour": "red"}, "unknown key 'colour'"),
    ({"targets": None}, "'targets' is missing"),
])
def test_spec_errors_are_one_line(tmp_path, capsys, changes, expected):
    path = _spec(tmp_path, **changes)
    assert cli_main(["sweep", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and expected in err, err


def test_bad_input_files_are_one_line(tmp_path, capsys, smoke):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("workloads: [unclosed\n")
    corrupt = tmp_path / "results.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet")
    other = _spec(tmp_path, chunk_size=7)
    out, _m, _df = smoke
    for argv, where in ((["sweep", str(bad_yaml), "--out", str(tmp_path / "o")], str(bad_yaml)),
                        (["sweep", "report", str(corrupt)], str(corrupt)),
                        (["sweep", "report", str(tmp_path / "missing")], "missing"),
                        (["sweep", str(other), "--out", str(out)], str(out))):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and where in err, err


def test_configurations_that_do_not_fit_are_counted_and_left_out_of_fronts_and_best(capsys):
    df = _table()
    df["fits"] = True
    df.loc[df["config_id"] == 4, "fits"] = False          # A's fastest configuration needs more memory
    rep = make_report(df, top=2)
    assert (rep["ok"], rep["not_fitting"], rep["failed"]) == (8, 1, 1)
    a = next(w for w in rep["workloads"] if w["workload"] == "A")
    assert 4 not in [r["config_id"] for r in a["front"] + a["best"]]
    text = io.StringIO()
    print_report(rep, text)
    assert "1 timed but do not fit the target's memory" in text.getvalue()


def test_smoke_rows_say_their_peak_memory_and_that_it_fits(smoke):
    _out, _m, df = smoke
    ok = df[df["status"] == "ok"]
    assert (ok["peak_memory_bytes"] > 0).all() and ok["fits"].all()
    row = ok.iloc[0]
    res = simulate(row["program"], target=row["target"], system=row["system"], replay="embedded")
    assert res.peak_memory_bytes == row["peak_memory_bytes"]


def test_mesh_auto_sweeps_every_layout_of_the_devices(tmp_path):
    from hespas_ml.ingest.zoo.checks import all_meshes

    spec = tmp_path / "auto.yaml"
    spec.write_text(yaml.safe_dump({
        "workloads": [{"zoo": "llama", "params": {"layers": 2, "d_model": 64, "heads": 4, "kv_heads": 4, "ffn": 128,
                                                  "vocab": 256, "seq": 16, "batch": 8}},
                      {"zoo": "gpt", "params": {"layers": 2, "d_model": 64, "heads": 4, "vocab": 256, "seq": 16,
                                                "batch": 8, "microbatch": 2}}],
        "parallelism": [{"devices": 4, "mesh": "auto"}],
        "targets": ["H100"], "replay": ["embedded"], "systems": {"specs": ["switch:2x450,switch:2x50"]}}))
    programs = load_sweep_spec(spec).programs
    llama = {p.parallel: p for p in programs if p.family == "llama"}
    assert len(llama) == len(all_meshes(4)) == 10
    assert "microbatch=1" in llama["pp:2,dp:2"].source and "microbatch" not in llama["dp:2,tp:2"].source
    assert llama["pp:4"].error and "pp 4 does not divide layers 2" in llama["pp:4"].error
    gpt = {p.parallel: p for p in programs if p.family == "gpt"}
    assert "microbatch=2" in gpt["pp:2,dp:2"].source                  # the workload's own microbatches
    data = yaml.safe_load(spec.read_text())
    data["workloads"] = data["workloads"][:1]                         # the sweep itself over llama's layouts
    spec.write_text(yaml.safe_dump(data))
    run_sweep(spec, tmp_path / "out", workers=1, progress=False)
    df = pd.read_parquet(tmp_path / "out" / RESULTS)
    ok = df[df["status"] == "ok"]
    assert set(df[df["status"] == "failed"]["parallel"]) == {"pp:4"} and len(ok) == 9
    row = ok[ok["parallel"] == "pp:2,dp:2"].iloc[0]
    res = simulate(row["program"], target="H100", system="switch:2x450,switch:2x50", replay="embedded",
                   fidelity=row["fidelity"])
    assert res.step_time_s == row["step_time_s"] and row["replay_engine"] == "fast"


def test_a_sweep_over_several_axis_meshes_times_each_layout_as_simulate_does(tmp_path):
    spec = tmp_path / "mesh.yaml"
    spec.write_text(yaml.safe_dump({
        "workloads": [{"zoo": "llama", "params": {"layers": 1, "d_model": 64, "heads": 4, "kv_heads": 4, "ffn": 128,
                                                  "vocab": 256, "seq": 16, "batch": 8}},
                      {"zoo": "mlp", "params": {"layers": 1, "width": 64, "batch": 16}}],
        "parallelism": [{"devices": 8, "mesh": "dp:2,tp:4"}, {"devices": 8, "mesh": "dp:4,fsdp:2"},
                        {"devices": 8, "parallel": "dp"}],
        "targets": ["H100"], "replay": ["embedded"], "systems": {"specs": ["switch:4x450,switch:2x50"]}}))
    run_sweep(spec, tmp_path / "out", workers=1, progress=False)
    df = pd.read_parquet(tmp_path / "out" / RESULTS)
    llama = df[df["family"] == "llama"].set_index("parallel")
    assert set(llama.index) == {"dp:2,tp:4", "dp:4,fsdp:2", "dp"} and (llama["status"] == "ok").all()
    row = llama.loc["dp:2,tp:4"]
    res = simulate(row["program"], target="H100", system="switch:4x450,switch:2x50", replay="embedded")
    assert (res.step_time_s, res.peak_memory_bytes) == (row["step_time_s"], row["peak_memory_bytes"])
    mlp = df[df["family"] == "mlp"]                      # mlp has one axis: its mesh plans fail in one line
    assert (mlp[mlp["parallel"] != "dp"]["status"] == "failed").all()
    assert mlp[mlp["parallel"] != "dp"]["error"].str.contains("mlp has no parameter 'mesh'").all()


def test_a_stages_sweep_simulates_pipelines_from_their_stages_programs(tmp_path):
    from hespas_ml.pipeline_stages import simulate_stages

    spec = tmp_path / "stages.yaml"
    spec.write_text(yaml.safe_dump({
        "pipeline": "stages",
        # the stage programs of tests/test_pipeline_stages.py's pp:2,dp:2 layout (exported once)
        "workloads": [{"zoo": "llama", "params": {"layers": 8, "d_model": 64, "heads": 2, "vocab": 256, "seq": 32,
                                                  "batch": 8, "step": "train", "remat": "full", "scan": True,
                                                  "schedule": "1f1b", "microbatch": 1}}],
        "parallelism": [{"devices": 4, "mesh": "pp:2,dp:2"}, {"devices": 4, "mesh": "pp:2,cp:2"},
                        {"devices": 4, "mesh": "dp:4"}],
        "targets": ["H100"], "costs": {"H100": 2.0}, "replay": ["embedded"],
        "systems": {"specs": ["switch:2x450,switch:2x50"]}}))
    programs = {p.parallel: p for p in load_sweep_spec(spec).programs}
    assert {k: p.pipeline for k, p in programs.items()} == {"pp:2,dp:2": "stages", "pp:2,cp:2": "stages",
                                                             "dp:4": "lockstep"}
    run_sweep(spec, tmp_path / "out", workers=1, progress=False)
    df = pd.read_parquet(tmp_path / "out" / RESULTS).set_index("parallel")
    row = df.loc["pp:2,dp:2"]
    staged = simulate_stages(programs["pp:2,dp:2"].source, "H100", "switch:2x450,switch:2x50",
                             fidelity=row["fidelity"], replay_backend="embedded")
    assert (row["status"], row["pipeline"]) == ("ok", "stages")
    assert (row["step_time_s"], row["peak_memory_bytes"], row["bubble"]) == (
        staged.step_time_s, staged.peak_memory_bytes, staged.bubble) and 0 < row["bubble"] < 1
    assert row["model_flops"] == staged.model_flops and 0 < row["utilisation"] < 1 and row["cost_per_step"] > 0
    assert row["compute_time_s"] + row["exposed_comm_s"] == pytest.approx(row["step_time_s"])
    assert df.loc["pp:2,cp:2", "status"] == "failed"                   # not laid out from stages: says why
    assert "cp inside a stage is not handled" in df.loc["pp:2,cp:2", "error"]
    assert (df.loc["dp:4", "status"], df.loc["dp:4", "pipeline"], df.loc["dp:4", "bubble"]) == ("ok", "lockstep", 0.0)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["stats"]["programs_staged"] == 2 and manifest["stats"]["programs_prepared"] == 1
