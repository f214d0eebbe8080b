"""The dataset builder (hespas_ml.use.dataset*, hespas_ml.label.dataset_*) and the structural region hash (hespas_ml.split.signature).

Real programs, real fidelities: the smoke spec (datasets/smoke.yaml) is built once end to end; resuming
is tested by SIGKILLing the CLI while it labels and comparing the finished folder with an uninterrupted
build. Tiny specs written into tmp_path keep the other tests fast.
"""
from __future__ import annotations

import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from conftest import PROJECT_ROOT, shared_path
from hespas_ml.cli.main import main
from hespas_ml.ingest.stablehlo import parse_module
from hespas_ml.use.dataset import build_dataset, load_dataset, snapshot_dataset
from hespas_ml.label.dataset_cache import DatasetError
from hespas_ml.label.dataset_spec import DatasetSpecError, load_spec
from hespas_ml.label.dataset_tables import GRAPH_COLUMNS, LABEL_COLUMNS, REGION_COLUMNS
from hespas_ml.label.region_records import program_records, region_from_record, region_record
from hespas_ml.label.roofline import RooflineFidelity
from hespas_ml.label.scalesim import LayerCache, ScaleSimFidelity
from hespas_ml.label.targets import load_target
from hespas_ml.ingest import load_program
from hespas_ml.split.regions import split_program
from hespas_ml.split.signature import region_signature, signatures
from tests.conftest import readme_command

pytestmark = pytest.mark.slow   # exports programs, starts workers, builds datasets or trains

SMOKE = PROJECT_ROOT / "datasets" / "smoke.yaml"
SA32 = PROJECT_ROOT / "datasets" / "targets" / "sa32x32.yaml"


# -- programs for the signature ---------------------------------------------------------------------------

def layer(i: int, inp: str, dim: int = 16, dtype: str = "f32", rhs_contract: int = 0, direction: str = "GT") -> str:
    """One dense layer: a dot (its own kernel) and a compare/select ReLU epilogue (a loop fusion)."""
    t = f"tensor<{dim}x{dim}x{dtype}>"
    zero = "0.0" if dtype.startswith(("f", "b")) else "0"
    return (f"  %d{i} = stablehlo.dot_general {inp}, %w{i}, contracting_dims = [1] x [{rhs_contract}] : "
            f"({t}, {t}) -> {t}\n"
            f"  %z{i} = stablehlo.constant dense<{zero}> : {t}\n"
            f"  %c{i} = stablehlo.compare {direction}, %d{i}, %z{i} : ({t}, {t}) -> tensor<{dim}x{dim}xi1>\n"
            f"  %h{i} = stablehlo.select %c{i}, %d{i}, %z{i} : tensor<{dim}x{dim}xi1>, {t}\n")


def mlp_program(n: int, dim: int = 16, dtype: str = "f32", prologue: bool = False, **kw) -> str:
    t = f"tensor<{dim}x{dim}x{dtype}>"
    args = ", ".join([f"%x: {t}"] + [f"%w{i}: {t}" for i in range(n)])
    body = f"  %p = stablehlo.multiply %x, %x : {t}\n" if prologue else ""
    inp = "%p" if prologue else "%x"
    for i in range(n):
        body += layer(i, inp, dim, dtype, **kw)
        inp = f"%h{i}"
    return f"func.func @main({args}) -> {t} {{\n{body}  return {inp} : {t}\n}}\n"


def region_hashes(text: str) -> list[str]:
    rg = split_program(parse_module(text))
    return signatures(rg.compute_regions())


def dot_hash(text: str) -> str:
    rg = split_program(parse_module(text))
    dots = [r for r in rg.compute_regions() if any(rg.graph.ops[i].kind == "dot_general" for i in r.op_ids)]
    return region_signature(dots[0])


# -- signature ----------------------------------------------------------------------------------------------

def test_repeated_layers_collapse_to_one_hash_per_kernel():
    one, four = region_hashes(mlp_program(1)), region_hashes(mlp_program(4))
    assert len(one) == 2 and len(set(one)) == 2          # the dot and its epilogue differ
    assert len(four) == 8 and set(four) == set(one)     # four layers: the same two kernels
    assert all(len(h) == 64 and int(h, 16) >= 0 for h in four)


def test_the_same_region_in_two_programs_has_one_hash():
    # different op ids and positions (a prologue op shifts everything), same dot kernel and epilogue
    plain, shifted = region_hashes(mlp_program(2)), region_hashes(mlp_program(2, prologue=True))
    assert set(plain) <= set(shifted)
    assert dot_hash(mlp_program(1)) == dot_hash(mlp_program(3, prologue=True))


@pytest.mark.parametrize("change", [
    {"dim": 32},                         # a shape
    {"dtype": "bf16"},                   # an element type
    {"rhs_contract": 1},                 # a contracting dim (same operand and result types)
])
def test_changing_the_computation_changes_the_dot_hash(change):
    assert dot_hash(mlp_program(1)) != dot_hash(mlp_program(1, **change))


def test_changing_an_attribute_changes_the_epilogue_hash():
    gt, lt = region_hashes(mlp_program(1)), region_hashes(mlp_program(1, direction="LT"))
    assert gt[0] == lt[0]                 # the dot is unchanged
    assert gt[1] != lt[1]                 # compare GT vs LT


def test_reading_one_tensor_twice_differs_from_reading_two():
    t = "tensor<8x8xf32>"
    dot = lambda name, a, b: f"  %{name} = stablehlo.dot_general %{a}, %{b}, contracting_dims = [1] x [0] : ({t}, {t}) -> {t}\n"  # noqa: E731
    head = f"func.func @main(%a: {t}, %b: {t}) -> {t} {{\n" + dot("s", "a", "b") + dot("u", "b", "a")
    same = head + f"  %m = stablehlo.multiply %s, %s : {t}\n  %r = stablehlo.add %m, %u : {t}\n  return %r : {t}\n}}\n"
    two = head + f"  %m = stablehlo.multiply %s, %u : {t}\n  %r = stablehlo.add %m, %u : {t}\n  return %r : {t}\n}}\n"
    assert region_hashes(same)[-1] != region_hashes(two)[-1]


def test_signature_is_stable_across_processes():
    text = mlp_program(2)
    code = ("import sys, json; from hespas_ml.ingest.stablehlo import parse_module; "
            "from hespas_ml.split.regions import split_program; from hespas_ml.split.signature import signatures; "
            "print(json.dumps(signatures(split_program(parse_module(sys.stdin.read())).compute_regions())))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], input=text, capture_output=True, text=True, env=env,
                         cwd=PROJECT_ROOT, check=True).stdout
    assert json.loads(out) == region_hashes(text)


def test_records_rebuild_regions_that_label_identically():
    rg = split_program(parse_module(mlp_program(2)))
    users = rg.graph.users()
    roofline, sa = RooflineFidelity(), load_target(SA32)
    scalesim = ScaleSimFidelity(workers=1, cache=LayerCache(disk=False))
    target = load_target("H100")
    for region in rg.compute_regions():
        record = region_record(region, region_signature(region), users)
        rebuilt = region_from_record(json.loads(json.dumps(record)))
        assert roofline.label(rebuilt, target).seconds == roofline.label(region, target).seconds
        assert scalesim.label(rebuilt, sa).seconds == scalesim.label(region, sa).seconds
        assert record["n_nodes"] == len(region.op_ids) and len(record["kernels"]) == 1


def test_program_records_count_occurrences():
    path = shared_path("mlir", "resnet_50_inference_step_4_devices_1024_batch.mlir")
    res = program_records(split_program(load_program(str(path)), "fusion"))
    assert res["n_regions"] == sum(e["occurrences"] for e in res["regions"].values()) + res["n_skipped"]
    assert len(res["regions"]) < res["n_regions"]       # ResNet's repeated blocks collapse
    assert max(e["occurrences"] for e in res["regions"].values()) > 1


# -- spec validation ------------------------------------------------------------------------------------------

def write_spec(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


CONV = str(shared_path("mlir", "convolution.mlir")) if (PROJECT_ROOT / ".." / "shared").is_dir() else "x.mlir"


@pytest.mark.parametrize("body, key, message", [
    ("programs: [{zoo: nosuch}]\nfidelities: {roofline: {targets: [H100]}}", "programs[0].zoo", "unknown zoo family"),
    ("programs: [{zoo: mlp, grid: {layers: [2, x]}}]\nfidelities: {roofline: {targets: [H100]}}",
     "programs[0].grid.layers", "not an integer"),
    ("programs: [{zoo: mlp, grid: {depth: [2]}}]\nfidelities: {roofline: {targets: [H100]}}",
     "programs[0].grid.depth", "has no parameter"),
    ("programs: [{zoo: mlp, params: {batch: 6}, devices: 4}]\nfidelities: {roofline: {targets: [H100]}}",
     "programs[0]", "not divisible"),
    ("programs: [{mlir: missing.mlir}]\nfidelities: {roofline: {targets: [H100]}}", "programs[0].mlir",
     "no such file"),
    ("programs: [{zoo: mlp}]\nfidelities: {roofline: {targets: [H900]}}", "fidelities.roofline.targets[0]",
     "unknown target"),
    ("programs: [{zoo: mlp}]\nfidelities: {scalesim: {targets: [H100]}}", "fidelities.scalesim.targets[0]",
     "no systolic arrays"),
    ("programs: [{zoo: mlp}]\nfidelities: {scalesim: {targets: [TPUv4], budget_s: -1}}",
     "fidelities.scalesim.budget_s", "positive number"),
    ("programs: [{zoo: mlp}]\nfidelities: {roofline: {targets: [H100], speed: 2}}", "fidelities.roofline.speed",
     "unknown key"),
    ("programs: [{zoo: mlp}]\nfidelities: {magic: {targets: [H100]}}", "fidelities.magic", "unknown fidelity"),
    ("programs: [{zoo: mlp}]\nfidelities: {roofline: {}}", "fidelities.roofline.targets", "missing"),
    ("programs: [{zoo: mlp}]\nsplit: blocks\nfidelities: {roofline: {targets: [H100]}}", "split", "expected one of"),
    ("programs: [{zoo: mlp}]\nfidelities: {roofline: {targets: [H100]}}\ncaps: {max_ops: 3}", "caps.max_ops",
     "unknown key"),
    ("programs: []\nfidelities: {roofline: {targets: [H100]}}", "programs", "non-empty list"),
    ("programs: [{zoo: mlp, mlir: a.mlir}]\nfidelities: {roofline: {targets: [H100]}}", "programs[0]",
     "exactly one of"),
    ("programs: [{zoo: mlp}\n", "", "malformed YAML"),
    ("programs: [{zoo: mlp}]\nfidelities: {roofline: {targets: [H100], families: mlp}}",
     "fidelities.roofline.families", "non-empty list of family names"),
    ("programs: [{zoo: mlp}]\nfidelities: {roofline: {targets: [H100], families: [mlp, llama]}}",
     "fidelities.roofline.families", "no program of family llama (the spec's families: mlp)"),
])
def test_spec_errors_name_the_file_and_the_key(tmp_path, body, key, message):
    path = write_spec(tmp_path, body)
    with pytest.raises(DatasetSpecError) as info:
        load_spec(path)
    text = str(info.value)
    assert text.startswith(str(path)) and message in text and "\n" not in text
    assert info.value.key == key


def test_spec_expands_grids_lists_and_shorthands(tmp_path):
    path = write_spec(tmp_path, """
        programs:
          - zoo: mlp
            grid: {layers: [1, 2], width: [8, 16]}
            devices: [1, 2]
            params: {batch: 4}
          - zoo: mlp
            list: [{layers: 1, width: 8, batch: 4, devices: 1}, {layers: 5}]   # the first is a duplicate
          - mlir: %s
        targets: all
        fidelities: {roofline: {}, scalesim: {targets: [TPUv4, %s], budget_s: 2}}
        """ % (CONV, SA32))
    spec = load_spec(path)
    zoo = [p for p in spec.programs if p.is_zoo]
    assert len(zoo) == 2 * 2 * 2 + 1
    assert all(p.source.startswith("zoo:mlp?layers=") and "batch=" in p.source for p in zoo)
    assert sum("devices=2" in p.source for p in zoo) == 4
    assert spec.programs[-1].family == "convolution" and Path(spec.programs[-1].source).is_absolute()
    roofline, scalesim = spec.fidelities
    assert len(roofline.targets) == len(load_spec(path).fidelities[0].targets) >= 10
    assert [t.ref for t in scalesim.targets] == ["TPUv4", str(SA32)] and scalesim.options["budget_s"] == 2.0


def test_spec_crosses_lists_with_grids_and_takes_spec_strings(tmp_path):
    path = write_spec(tmp_path, """
        programs:
          - zoo: "mlp?dtype=bf16&batch=8"
            list: [{width: 16, layers: 1}, {width: 32, layers: 2}]
            grid: {step: [infer, train]}
        fidelities: {roofline: {targets: [H100]}}
        """)
    sources = [p.source for p in load_spec(path).programs]
    assert len(sources) == 4
    assert all("dtype=bf16" in s and "batch=8" in s for s in sources)
    assert sum("width=16&" in s and "layers=1&" in s for s in sources) == 2      # paired, not crossed
    assert not any("width=16&" in s and "layers=2&" in s for s in sources)


def test_cli_reports_a_bad_spec_in_one_line(tmp_path, capsys):
    path = write_spec(tmp_path, "programs: [{zoo: mlp, grid: {layers: [0]}}]\nfidelities: {roofline: {targets: [H100]}}")
    assert main(["dataset", "build", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "programs[0].grid.layers" in err and "below the minimum" in err


# -- building ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke") / "ds"
    return out, build_dataset(SMOKE, out, progress=False)


def test_smoke_build_writes_documented_tables(smoke):
    out, summary = smoke
    ds = load_dataset(out)
    assert list(ds.regions.columns) == list(REGION_COLUMNS)
    assert list(ds.labels.columns) == list(LABEL_COLUMNS)
    assert {"target", "ref", "fidelities", "log10_mem_bw"} <= set(ds.targets.columns)
    assert ds.regions["hash"].is_unique and len(ds.regions) == summary["counts"]["regions_unique"] > 10
    assert set(ds.labels["status"]) <= {"ok", "failed"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"] == summary["counts"] and manifest["versions"]["jax"]
    assert {"programs_s", "labels_s", "tables_s", "total_s"} <= set(manifest["timings"])
    # several families, every program split
    assert (ds.programs["status"] == "ok").all()
    assert ds.regions["families"].map(json.loads).explode().nunique() >= 3
    # the graph of every region is readable without pickle, in the documented form
    import pyarrow.parquet as pq
    assert pq.read_schema(out / "graphs.parquet").names == list(GRAPH_COLUMNS)
    for digest, n_ops in zip(ds.regions["hash"], ds.regions["n_ops"]):
        g = ds.region_graph(digest)
        assert g["hash"] == digest and len(g["nodes"]) == n_ops
        assert all({"kind", "dtype", "result_types", "operand_types", "flops", "bytes", "attrs"} <= set(n)
                   for n in g["nodes"])
        assert all(0 <= s < n_ops and 0 <= d < n_ops for s, d, _, _ in g["edges"])
    dots = [d for d, counts in zip(ds.regions["hash"], ds.regions["op_counts"]) if "dot_general" in counts]
    node = next(n for n in ds.region_graph(dots[0])["nodes"] if n["kind"] == "dot_general")
    assert "lhs_contract" in node["attrs"]["dot_dimension_numbers"]


def test_smoke_build_dedupes_and_labels_each_triple_once(smoke):
    out, summary = smoke
    ds = load_dataset(out)
    counts = summary["counts"]
    assert counts["regions_seen"] > counts["regions_unique"]
    # a training MLP repeats its layers: fewer unique regions than regions in that program
    prog = ds.programs[ds.programs["source"].str.contains("layers=3") & ds.programs["source"].str.contains("train")]
    assert (prog["n_unique"] < prog["n_regions"]).all() and len(prog)
    assert (ds.regions["occurrences"] >= ds.regions["n_programs"]).all() and ds.regions["occurrences"].max() > 1
    keys = ds.labels[["hash", "target", "fidelity"]]
    assert not keys.duplicated().any()
    spec = load_spec(SMOKE)
    expected = set()
    for fs in spec.fidelities:
        for ref in fs.targets:
            name = load_target(ref.loadable).name
            expected |= {(h, name, fs.name) for h in ds.regions["hash"][: fs.max_regions]}
    assert set(map(tuple, keys.to_numpy().tolist())) == expected
    ok = ds.labels[ds.labels["status"] == "ok"]
    assert (ok["seconds"] >= 0).all() and ok["seconds"].notna().all()
    failed = ds.labels[ds.labels["status"] != "ok"]
    assert failed["reason"].notna().all() and failed["seconds"].isna().all()
    assert {"roofline", "scalesim", "profiling"} == set(ok["fidelity"])
    # XLA:CPU cannot compile the bf16 TopK custom call: profiling records why, the other fidelities label it
    topk = ds.regions.loc[ds.regions["family"] == "topk", "hash"].iloc[0]
    prof = ds.labels[(ds.labels["hash"] == topk) & (ds.labels["fidelity"] == "profiling")].iloc[0]
    assert prof["status"] == "failed" and "compile" in prof["reason"]
    assert (ds.labels[(ds.labels["hash"] == topk) & (ds.labels["fidelity"] == "roofline")]["status"] == "ok").all()
    measured = ok[ok["fidelity"] == "profiling"]
    assert (measured["noise"] >= 0).all() and (measured["seconds"] > 0).all()
    assert (ok[ok["fidelity"] != "profiling"]["noise"] == 0).all()


def test_smoke_rebuilds_from_cache_without_recomputing(smoke, capsys):
    out, summary = smoke
    again = build_dataset(SMOKE, out, progress=False)       # everything cached: nothing recomputed
    assert again["this_run"]["programs_new"] == 0
    assert all(v == 0 for k, v in again["this_run"].items() if k.startswith("labels_new"))
    assert again["counts"] == summary["counts"]
    assert main(["dataset", "info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "roofline" in text and "scalesim" in text and "mlp" in text


def test_failures_are_recorded_with_reasons_and_skipped(tmp_path, monkeypatch):
    # SCALE-Sim layers simulated by earlier runs (on disk or in this process) would satisfy any budget
    from hespas_ml.label import scalesim
    monkeypatch.setenv("HESPAS_ML_CACHE", str(tmp_path / "cache"))
    scalesim._SHARED_CACHE.clear_memory()
    bad = tmp_path / "broken.mlir"
    bad.write_text("func.func @main(%a: tensor<4xf32>) -> tensor<4xf32> {\n  %0 = stablehlo.frobnicate %a\n}\n")
    good = tmp_path / "dot.mlir"
    good.write_text(mlp_program(1, dim=64))
    path = write_spec(tmp_path, f"""
        programs: [{{mlir: [{bad.name}, {good.name}]}}]
        fidelities:
          roofline: {{targets: [H100]}}
          scalesim: {{targets: [{SA32}], budget_s: 0.001, mode: full, analytical_tail: false, workers: 1}}
        """)
    out = tmp_path / "out"
    build_dataset(path, out, progress=False)
    ds = load_dataset(out)
    failed_prog = ds.programs[ds.programs["status"] == "failed"]
    assert list(failed_prog["source"]) == [str(bad)] and "broken.mlir" in failed_prog["reason"].iloc[0]
    sims = ds.labels[ds.labels["fidelity"] == "scalesim"]
    dot = [h for h, c in zip(ds.regions["hash"], ds.regions["op_counts"]) if "dot_general" in c]
    failed = sims[sims["hash"].isin(dot)]
    assert (failed["status"] == "failed").all() and failed["reason"].str.contains("budget").all()
    assert (ds.labels[ds.labels["fidelity"] == "roofline"]["status"] == "ok").all()
    first = {(h, t, f): at for h, t, f, at in ds.labels[["hash", "target", "fidelity", "finished_at"]].itertuples(False)}
    build_dataset(path, out, progress=False)              # failures are not retried …
    assert {(h, t, f): at for h, t, f, at in
            load_dataset(out).labels[["hash", "target", "fidelity", "finished_at"]].itertuples(False)} == first
    summary = build_dataset(path, out, progress=False, retry_failed=True)   # … unless asked to
    assert summary["this_run"]["programs_failed_new"] == 1
    assert summary["this_run"]["labels_new_scalesim"] == len(failed)


def test_corrupt_dataset_folder_is_one_clean_error(smoke, tmp_path, capsys):
    out, _ = smoke
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("manifest.json", "regions.parquet", "graphs.parquet", "programs.parquet", "targets.parquet"):
        (broken / name).write_bytes((out / name).read_bytes())
    (broken / "labels.parquet").write_bytes((out / "labels.parquet").read_bytes()[:100])
    with pytest.raises(DatasetError, match="labels.parquet: unreadable"):
        load_dataset(broken)
    assert main(["dataset", "info", str(broken)]) == 2
    err = capsys.readouterr().err.strip()
    assert "labels.parquet" in err and "\n" not in err
    with pytest.raises(DatasetError, match="manifest.json: missing"):
        load_dataset(tmp_path)


def test_a_folder_recorded_with_older_kernel_costs_is_refused(smoke, tmp_path):
    out, _ = smoke
    old = tmp_path / "old"
    old.mkdir()
    (old / "cache.sqlite").write_bytes((out / "cache.sqlite").read_bytes())
    db = sqlite3.connect(old / "cache.sqlite")
    db.execute("DELETE FROM meta WHERE key = 'records'")      # as written before records had a version
    db.commit()
    db.close()
    for _ in range(2):     # the refusal unlocks the folder: the second try is refused for the same reason
        with pytest.raises(DatasetError, match=r"cache.sqlite: its regions are records version 1 .* new folder"):
            build_dataset(SMOKE, old, progress=False)
    # a folder this version recorded resumes as before
    assert build_dataset(SMOKE, out, progress=False)["this_run"]["programs_new"] == 0


# -- resume after SIGKILL ---------------------------------------------------------------------------------------

RESUME_SPEC = """
    programs:
      - zoo: mlp
        grid: {{layers: [2], width: [32, 64], batch: [16], step: [train]}}
      - mlir: [{conv}, {dot}]
    fidelities:
      roofline: {{targets: [H100, TPUv4]}}
      scalesim: {{targets: [TPUv4, {sa}], mode: full, budget_s: 20, workers: 1, chunk: 1}}
    """


def _labels(out: Path) -> list[tuple]:
    """The labels in a (possibly still building) folder's cache, read without writing to it."""
    if not (out / "cache.sqlite").exists():
        return []
    try:
        db = sqlite3.connect(f"file:{out / 'cache.sqlite'}?mode=ro", uri=True, timeout=10)
        try:
            return list(db.execute("SELECT hash, target, fidelity, status, seconds, finished_at FROM labels"))
        finally:
            db.close()
    except sqlite3.OperationalError:       # created but not initialised yet
        return []


def test_resume_after_sigkill_equals_an_uninterrupted_build(tmp_path):
    from hespas_ml.ingest.zoo.cache import cache_dir as zoo_cache_dir

    # a fresh SCALE-Sim layer cache (so labelling takes a while), the real zoo export cache (exports are slow)
    cache = tmp_path / "cache"
    cache.mkdir()
    zoo = zoo_cache_dir()
    zoo.mkdir(parents=True, exist_ok=True)
    (cache / "zoo").symlink_to(zoo)
    dot = tmp_path / "dots.mlir"
    dot.write_text(mlp_program(3, dim=96, dtype="bf16"))
    path = write_spec(tmp_path, RESUME_SPEC.format(conv=CONV, dot=dot, sa=SA32))
    env = {**os.environ, "HESPAS_ML_CACHE": str(cache), "PYTHONPATH": str(PROJECT_ROOT)}
    cmd = [sys.executable, "-m", "hespas_ml.cli.main", "dataset", "build", str(path), "--no-progress",
           "--workers", "1"]

    killed = tmp_path / "killed"
    proc = subprocess.Popen([*cmd, "--out", str(killed)], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    try:
        while time.time() < deadline and proc.poll() is None:
            if sum(1 for row in _labels(killed) if row[2] == "scalesim") >= 2:
                break
            time.sleep(0.02)
    finally:
        proc.kill()                                 # SIGKILL the CLI alone; its workers see their pipes close
        proc.wait()
    try:
        _resume_and_compare(proc, killed, tmp_path, cmd, env)
    finally:
        try:                                        # whatever the killed CLI left running
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _resume_and_compare(proc, killed: Path, tmp_path: Path, cmd: list[str], env: dict[str, str]) -> None:
    before = _labels(killed)
    n_sim = sum(1 for row in before if row[2] == "scalesim")
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    assert n_sim >= 2 and not (killed / "labels.parquet").exists()

    resumed = subprocess.run([*cmd, "--out", str(killed)], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    whole = tmp_path / "whole"
    build = subprocess.run([*cmd, "--out", str(whole)], env=env, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]

    a, b = load_dataset(killed), load_dataset(whole)
    key = ["hash", "target", "fidelity"]
    for ds in (a, b):
        assert not ds.labels[key].duplicated().any()
    la = a.labels.sort_values(key).reset_index(drop=True)
    lb = b.labels.sort_values(key).reset_index(drop=True)
    assert la[key + ["status"]].equals(lb[key + ["status"]])
    assert len(la) == len(a.regions) * 4 and n_sim < (la["fidelity"] == "scalesim").sum()
    assert all(math.isclose(x, y, rel_tol=1e-12) for x, y in zip(la["seconds"].fillna(-1), lb["seconds"].fillna(-1)))
    assert a.regions.equals(b.regions)
    # labels finished before the kill were kept, not recomputed
    after = {(h, t, f): at for h, t, f, _, _, at in _labels(killed)}
    assert all(after[(h, t, f)] == at for h, t, f, _, _, at in before)


def test_snapshot_of_a_build_matches_its_tables_and_leaves_it_alone(smoke, tmp_path, capsys):
    from hespas_ml.use.dataset import snapshot_dataset

    out, _ = smoke
    spec = SMOKE
    command = readme_command("hespas-ml dataset snapshot", {"datasets/main.yaml": str(spec), "out/datasets/main": str(out),
                                                            "out/datasets/main-now": str(tmp_path / "snap")})
    assert main([*command, "--no-progress"]) == 0         # the README's line, on the smoke build
    snap, built = load_dataset(tmp_path / "snap"), load_dataset(out)
    key = ["hash", "target", "fidelity"]
    assert snap.labels[key + ["seconds", "status"]].sort_values(key).reset_index(drop=True).equals(
        built.labels[key + ["seconds", "status"]].sort_values(key).reset_index(drop=True))
    assert sorted(snap.regions["hash"]) == sorted(built.regions["hash"])
    with pytest.raises(DatasetError, match="another folder"):
        snapshot_dataset(spec, out, out)
    with pytest.raises(DatasetError, match="no dataset build"):
        snapshot_dataset(spec, tmp_path / "nothing", tmp_path / "snap2")


def test_a_long_profiling_stage_starts_with_a_steadiness_check(tmp_path, monkeypatch, capsys):
    from hespas_ml.use import dataset_labels
    monkeypatch.setenv("HESPAS_ML_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(dataset_labels, "STEADINESS_MIN_LABELS", 1)     # this tiny stage counts as long
    monkeypatch.setattr(dataset_labels, "STEADINESS_S", 0.5)
    good = tmp_path / "dot.mlir"
    good.write_text(mlp_program(1, dim=64))
    path = write_spec(tmp_path, f"""
        programs: [{{mlir: [{good.name}]}}]
        fidelities:
          profiling: {{targets: [host-cpu], measure_s: 0.05}}
        """)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)                  # a busy test machine is told so
        summary = build_dataset(path, tmp_path / "out", progress=False)
    check = summary["this_run"]["profiling_steadiness"]
    assert check["rounds"] >= 3 and check["p90_dev"] >= check["median_dev"] >= 0 and "steady" in check
    assert "timing steadiness:" in capsys.readouterr().err
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["this_run"]["profiling_steadiness"]["rounds"] == check["rounds"]
    again = build_dataset(path, tmp_path / "out", progress=False)        # nothing left to label: no check …
    assert "profiling_steadiness" not in again["this_run"]
    (logged,) = load_dataset(tmp_path / "out").steadiness()              # … and the first stays on record
    assert logged["times"] == check["times"] and logged["pending"] >= 1
    assert main(["dataset", "info", str(tmp_path / "out")]) == 0
    assert "profiling machine's timing steadiness: 1 check(s), p90 " in capsys.readouterr().out
    snapshot_dataset(path, tmp_path / "out", tmp_path / "snap", progress=False)   # a snapshot keeps the record
    assert load_dataset(tmp_path / "snap").steadiness() == [logged]
    with open(tmp_path / "out" / "steadiness.jsonl", "a") as log:
        log.write("{oops\n")
    with pytest.raises(DatasetError, match=r"steadiness.jsonl:2: not a steadiness check"):
        load_dataset(tmp_path / "out").steadiness()


def test_labels_that_overran_their_budget_are_taken_again_with_a_larger_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HESPAS_ML_CACHE", str(tmp_path / "cache"))
    (tmp_path / "dot.mlir").write_text(mlp_program(1, dim=64))

    def spec(budget_s: float) -> Path:
        return write_spec(tmp_path, f"""
            programs: [{{mlir: [dot.mlir]}}]
            fidelities:
              profiling: {{targets: [host-cpu], measure_s: 0.05, budget_s: {budget_s}}}
            """, f"b{budget_s}.yaml")

    out = tmp_path / "out"
    build_dataset(spec(0.001), out, progress=False)
    tables = load_dataset(out).labels
    assert len(tables) >= 1 and set(tables["status"]) == {"failed"}
    assert all("budget" in r for r in tables["reason"])
    summary = build_dataset(spec(60), out, retry_failed=True, progress=False)
    assert summary["this_run"]["labels_new_profiling"] == len(tables)
    assert set(load_dataset(out).labels["status"]) == {"ok"}


def test_a_fidelity_can_label_only_the_regions_of_some_families_and_the_rest_later(tmp_path, capsys):
    (tmp_path / "small.mlir").write_text(mlp_program(1, dim=64))
    (tmp_path / "big.mlir").write_text(mlp_program(2, dim=64, prologue=True))   # its dot and epilogue too
    (tmp_path / "other.mlir").write_text(mlp_program(1, dim=32))
    spec = """
        programs:
          - {mlir: [small.mlir, big.mlir], family: ours}
          - {mlir: [other.mlir], family: theirs}
        fidelities:
          roofline: {targets: [H100]}
          scalesim: {targets: [%s], budget_s: 30, workers: 1%s}
        """
    path = write_spec(tmp_path, spec % (SA32, ", families: [ours]"))
    assert main(["dataset", "build", str(path), "--dry-run"]) == 0
    assert "scalesim    1 target(s): %s, only regions of ours\n" % SA32 in capsys.readouterr().out
    out = tmp_path / "out"
    build_dataset(path, out, progress=False)
    ds = load_dataset(out)
    ours = {h for h, f in zip(ds.regions["hash"], ds.regions["families"]) if "ours" in json.loads(f)}
    assert 0 < len(ours) < len(ds.regions)
    def labelled(fidelity):
        return set(ds.labels[ds.labels["fidelity"] == fidelity]["hash"])
    assert labelled("scalesim") == ours and labelled("roofline") == set(ds.regions["hash"])
    write_spec(tmp_path, spec % (SA32, ""))                      # the same labels: the folder resumes
    summary = build_dataset(path, out, progress=False)
    ds = load_dataset(out)
    assert summary["this_run"]["labels_new_scalesim"] == len(ds.regions) - len(ours)
    assert labelled("scalesim") == set(ds.regions["hash"])


def test_a_folder_refuses_labels_of_a_target_whose_figures_changed_and_says_so(tmp_path):
    (tmp_path / "dot.mlir").write_text(mlp_program(1, dim=64))
    (tmp_path / "sa.yaml").write_text(SA32.read_text())
    path = write_spec(tmp_path, """
        programs: [{mlir: [dot.mlir]}]
        fidelities:
          roofline: {targets: [sa.yaml]}
        """)
    out = tmp_path / "out"
    assert build_dataset(path, out, progress=False)["this_run"]["labels_new_roofline"] >= 1
    (tmp_path / "sa.yaml").write_text(SA32.read_text().replace("mem_bw: 64e9", "mem_bw: 128e9"))
    with pytest.raises(DatasetError, match=r"out: its roofline labels on SA-32x32 were made with another definition "
                                           r"of the target \(its figures changed\); build into a new folder$"):
        build_dataset(path, out, progress=False)


def test_scalesim_worker_count_is_not_part_of_a_folder_fingerprint_but_its_budget_is(tmp_path):
    (tmp_path / "dot.mlir").write_text(mlp_program(1, dim=64))

    def fingerprint(options: str) -> str:
        path = write_spec(tmp_path, f"""
            programs: [{{mlir: [dot.mlir]}}]
            fidelities:
              scalesim: {{targets: [TPUv3], {options}}}
            """, "s.yaml")
        return load_spec(path).fidelities[0].fingerprint()

    one = fingerprint("workers: 1, budget_s: 10")
    assert fingerprint("workers: 2, budget_s: 10") == one
    assert fingerprint("workers: 1, budget_s: 20") != one              # overruns fall back: other labels


def test_writing_a_default_down_or_a_run_option_keeps_a_folder_resumable_and_another_value_is_refused(
        tmp_path, monkeypatch):
    monkeypatch.setenv("HESPAS_ML_CACHE", str(tmp_path / "cache"))
    (tmp_path / "dot.mlir").write_text(mlp_program(1, dim=64))

    def spec(name: str, options: str) -> Path:
        return write_spec(tmp_path, f"""
            programs: [{{mlir: [dot.mlir]}}]
            fidelities:
              profiling: {{targets: [host-cpu], {options}}}
            """, name)

    out = tmp_path / "out"
    plain, explicit = spec("plain.yaml", "measure_s: 0.05"), spec(
        "explicit.yaml", "measure_s: 0.05, sample_s: 0.01, cores: 1, statistic: median, budget_s: 60")
    assert build_dataset(plain, out, progress=False)["this_run"]["labels_new_profiling"] >= 1
    labels = _labels(out)
    assert build_dataset(explicit, out, progress=False)["this_run"]["labels_new_profiling"] == 0
    assert _labels(out) == labels                                       # the defaults written down change nothing
    # a longer time limit or another cache changes how labels are taken, not what they are
    run = spec("run.yaml", "measure_s: 0.05, budget_s: 120, lock_timeout_s: 30, cache: false")
    assert build_dataset(run, out, progress=False)["this_run"]["labels_new_profiling"] == 0
    # another value is refused, and the error says which option differs
    with pytest.raises(DatasetError, match=r"out: its profiling labels on host-cpu were made with measure_s 0.05 "
                                           r"\(this spec: 0.1\); build into a new folder$"):
        build_dataset(spec("other.yaml", "measure_s: 0.1"), out, progress=False)
    with pytest.raises(DatasetError, match=r"were made with statistic the default \"median\" \(this spec: \"min\"\);"):
        build_dataset(spec("min.yaml", "measure_s: 0.05, statistic: min"), out, progress=False)
    assert _labels(out) == labels
    # a folder of the first profiling labels (recorded in any of the older forms, with no record of what it
    # holds) is refused for what it is: labels of an older labeller
    for older in load_spec(run).fidelities[0].older_fingerprints():
        _store_fingerprint(out, "profiling", older)
        with pytest.raises(DatasetError, match=r"out: its profiling labels on host-cpu were made with an older "
                                               r"profiling labeller \(labels version 1; since version 2 regions are "
                                               r"timed without page faults on buffers over 32 MiB\); build into"):
            build_dataset(run, out, progress=False)


def _store_fingerprint(out: Path, fidelity: str, older: str) -> None:
    """Make a folder look as an older version left it: ``older`` as its fidelity's fingerprint (the
    target's part kept), nothing recorded of what the labels were made with."""
    db = sqlite3.connect(out / "cache.sqlite")
    (stored,) = db.execute("SELECT fingerprint FROM label_configs WHERE fidelity=?", (fidelity,)).fetchone()
    db.execute("UPDATE label_configs SET fingerprint=? WHERE fidelity=?", (older + stored[len(older):], fidelity))
    db.execute("DELETE FROM meta WHERE key LIKE 'label_config/%'")
    db.commit()
    db.close()


def test_a_folder_that_recorded_unchanged_labels_in_an_older_form_resumes_and_is_brought_up_to_date(tmp_path):
    (tmp_path / "dot.mlir").write_text(mlp_program(1, dim=64))

    def spec(name: str, options: str) -> Path:
        return write_spec(tmp_path, f"""
            programs: [{{mlir: [dot.mlir]}}]
            fidelities:
              roofline: {{targets: [H100]}}
              scalesim: {{targets: [TPUv3], {options}}}
            """, name)

    out = tmp_path / "out"
    written, plain = spec("written.yaml", "mode: auto, workers: 1"), spec("plain.yaml", "workers: 2")
    build_dataset(written, out, progress=False)
    labels = _labels(out)
    forms = load_spec(written).fidelities[1].older_fingerprints()
    assert len(set(forms)) == 3                      # every option; off their default; counted (no workers)
    for older in forms[:2]:
        _store_fingerprint(out, "scalesim", older)
        with pytest.raises(DatasetError, match=r"scalesim labels on TPUv3 were made with other options or another "
                                               r"definition of the target; build into a new folder$"):
            build_dataset(plain, out, progress=False)   # an old form is a digest of the options as written
        assert build_dataset(written, out, progress=False)["this_run"]["labels_new_scalesim"] == 0
        assert build_dataset(plain, out, progress=False)["this_run"]["labels_new_scalesim"] == 0
    assert _labels(out) == labels
