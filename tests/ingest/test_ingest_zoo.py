"""The program zoo: spec parsing, the registry, the MLP family and the on-disk cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hespas_ml.ingest import IngestError, OpGraph, load_program
from hespas_ml.ingest.zoo import ZOO, ZooEntry, canonical_spec, is_zoo_spec, parse_zoo_spec, zoo_program
from hespas_ml.ingest.zoo.cache import cache_dir, cache_key, export_in_subprocess

ROOT = Path(__file__).resolve().parents[2]
SMALL = "layers=2&width=32&batch=8"


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HESPAS_ML_CACHE", str(tmp_path_factory.mktemp("hespas-cache")))
        yield


def kinds(g: OpGraph, kind: str):
    return [op for op in g.ops if op.kind == kind]


# -- specs --------------------------------------------------------------------------------------

def test_spec_defaults_and_values():
    family, params = parse_zoo_spec("zoo:mlp")
    assert family == "mlp" and params == ZOO["mlp"].defaults()
    family, params = parse_zoo_spec(
        "zoo:mlp?layers=4&width=1024&batch=256&dtype=bf16&step=train&devices=4&parallel=dp")
    assert params["layers"] == 4 and params["width"] == 1024 and params["batch"] == 256
    assert params["dtype"] == "bf16" and params["devices"] == 4 and params["parallel"] == "dp"
    # parameter order and defaults do not change the canonical spelling (or the cache key)
    a = parse_zoo_spec("zoo:mlp?width=64&layers=3")[1]
    b = parse_zoo_spec(" zoo:mlp?layers=3&width=64&dtype=f32 ")[1]
    assert canonical_spec("mlp", a) == canonical_spec("mlp", b)
    assert cache_key("mlp", a) == cache_key("mlp", b) != cache_key("mlp", parse_zoo_spec("zoo:mlp")[1])
    assert is_zoo_spec("zoo:mlp") and not is_zoo_spec("model.mlir") and not is_zoo_spec(Path("zoo:x"))


def test_cache_key_follows_the_exporting_code(monkeypatch):
    """An edit to a generator or to the exporter must never be answered by an older cached export."""
    from hespas_ml.ingest.zoo import cache

    params = parse_zoo_spec("zoo:mlp")[1]
    before = cache.cache_key("mlp", params)
    assert len(cache.exporter_fingerprint()) == 16
    monkeypatch.setattr(cache, "exporter_fingerprint", lambda: "0" * 16)
    assert cache.cache_key("mlp", params) != before


def test_cache_key_follows_the_exporting_processor(monkeypatch):
    """XLA:CPU partitions by the processor's features: a cache copied to another machine must miss."""
    from hespas_ml import host
    from hespas_ml.ingest.zoo import cache

    params = parse_zoo_spec("zoo:mlp")[1]
    before = cache.cache_key("mlp", params)
    assert host.cpu_fingerprint() == host.cpu_fingerprint.__wrapped__()     # stable on one machine
    monkeypatch.setattr(host, "cpu_fingerprint", lambda: "f" * 16)
    assert cache.cache_key("mlp", params) != before


@pytest.mark.parametrize("spec, message", [
    ("mlp", "a zoo spec starts with 'zoo:'"),
    ("zoo:", "names no family (known families: "),
    ("zoo:resnet9000", "unknown zoo family 'resnet9000' (known families: "),
    ("zoo:mlp?depth=3", "mlp has no parameter 'depth' (parameters: layers, width"),
    ("zoo:mlp?layers", "parameter 'layers' has no value"),
    ("zoo:mlp?layers=", "parameter 'layers' has no value"),
    ("zoo:mlp?layers=2&layers=3", "parameter 'layers' is given twice"),
    ("zoo:mlp?layers=two", "layers=two is not an integer"),
    ("zoo:mlp?layers=0", "layers=0 is below the minimum 1"),
    ("zoo:mlp?dtype=f64", "dtype=f64 is not one of f32, bf16"),
    ("zoo:mlp?batch=10&devices=4", "batch=10 is not divisible by devices=4"),
    ("zoo:mlp?&", "empty parameter"),
    ("zoo:mlp?batch=2048&devices=2048&parallel=dp-partitioned", "a compiler-partitioned program runs on at most 1024"),
])
def test_spec_errors_are_clear(spec, message):
    with pytest.raises(IngestError) as info:
        parse_zoo_spec(spec)
    assert message in str(info.value)
    if "known families" in message:                      # the list names every registered family
        assert all(name in str(info.value) for name in ZOO)
    assert "\n" not in str(info.value)
    assert info.value.source == spec.strip()


def test_registry_entries_declare_typed_parameters():
    assert "mlp" in ZOO
    for name, entry in ZOO.items():
        assert isinstance(entry, ZooEntry) and entry.name == name and entry.description
        names = [p.name for p in entry.params]
        assert len(names) == len(set(names))
        for p in entry.params:
            assert isinstance(p.default, p.type), (name, p.name)
            p.validate(p.default)
            assert p.parse(p.format(p.default)) == p.default
        assert entry.devices(entry.defaults()) >= 1


def test_importing_ingest_and_parsing_specs_does_not_import_jax():
    code = ("import sys, hespas_ml.ingest, hespas_ml.ingest.zoo as z; z.parse_zoo_spec('zoo:mlp?devices=2');"
            "print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# -- MLP programs -------------------------------------------------------------------------------

@pytest.mark.slow      # exports zoo programs
def test_mlp_inference_step():
    g = load_program("zoo:mlp?layers=3&width=32&batch=8&step=infer")
    assert g.source.startswith("zoo:mlp?")
    dots = kinds(g, "dot_general")
    assert len(dots) == 3
    assert [str(t) for t in dots[0].operand_types] == ["8x32xf32", "32x32xf32"]
    assert [str(t) for t in g.inputs] == ["32x32xf32", "32xf32"] * 3 + ["8x32xf32"]
    assert not any(op.is_collective for op in g.ops)
    assert g.n_devices == 1


@pytest.mark.slow      # exports zoo programs
def test_mlp_training_step_with_adam_in_bf16():
    g = load_program(f"zoo:mlp?{SMALL}&optimizer=adam&dtype=bf16")
    dots = kinds(g, "dot_general")
    assert len(dots) == 3 * 2 - 1           # forward 2, weight gradients 2, input gradient 1
    assert {op.dtype for op in dots} == {"bf16"}
    assert len(kinds(g, "sqrt")) >= 4       # Adam: one per parameter (+ bias correction)
    # params, first and second moments (each 2 weights + 2 biases), step counter, x, y
    assert len(g.inputs) == 4 * 3 + 1 + 2


@pytest.mark.slow      # exports zoo programs
def test_mlp_data_parallel_shard_map_sums_gradients_with_psum():
    g = load_program(f"zoo:mlp?{SMALL}&devices=4&parallel=dp")
    assert g.n_devices == 4
    reduces = kinds(g, "all_reduce")
    assert len(reduces) == 2 * 2 + 1         # one per weight and bias gradient, plus the loss
    assert all(op.attrs["replica_groups"] == [[0, 1, 2, 3]] for op in reduces)
    assert sorted(str(op.operand_types[0]) for op in reduces) == ["32x32xf32", "32x32xf32", "32xf32", "32xf32", "f32"]
    # each device works on batch/4 = 2 rows
    assert str(kinds(g, "dot_general")[0].operand_types[0]) == "2x32xf32"


@pytest.mark.slow      # exports zoo programs
def test_explicit_strategies_export_over_an_abstract_mesh_without_devices():
    """shard_map programs are written over an abstract mesh: no fake host device is made for them, and a
    device count far above what a machine could fake exports in seconds with every device in its groups."""
    params = parse_zoo_spec("zoo:mlp?devices=4&parallel=dp")[1]
    assert ZOO["mlp"].host_devices(params) == 1 and ZOO["mlp"].devices(params) == 4
    partitioned = parse_zoo_spec("zoo:mlp?devices=4&parallel=dp-partitioned")[1]
    assert ZOO["mlp"].host_devices(partitioned) == 4
    g = load_program("zoo:mlp?layers=1&width=32&batch=16384&devices=16384&parallel=dp")
    assert g.n_devices == 16384
    reduces = kinds(g, "all_reduce")
    assert reduces and all(op.attrs["replica_groups"] == [list(range(16384))] for op in reduces)


@pytest.mark.slow      # exports zoo programs
def test_mlp_data_parallel_compiler_partitioned():
    g = load_program(f"zoo:mlp?{SMALL}&devices=4&parallel=dp-partitioned")
    assert g.n_devices == 4
    assert any(op.is_collective for op in g.ops)
    for op in g.ops:
        if op.is_collective:
            assert op.attrs["replica_groups"] == [[0, 1, 2, 3]]
    assert "2x32xf32" in [str(t) for t in g.inputs]          # the per-device batch shard
    files = list(cache_dir().glob("*.mlirbc"))
    assert files, "the partitioned program is cached as bytecode"


@pytest.mark.slow      # exports zoo programs
def test_cache_makes_the_second_use_instant_and_repairs_damage():
    spec = f"zoo:mlp?{SMALL}&step=infer"
    first = load_program(spec)
    key = cache_key(*parse_zoo_spec(spec))
    program, meta = cache_dir() / f"{key}.mlir", cache_dir() / f"{key}.json"
    original = program.read_bytes()
    assert json.loads(meta.read_text())["spec"] == canonical_spec(*parse_zoo_spec(spec))
    written = (program.stat().st_mtime_ns, meta.stat().st_mtime_ns)
    again = load_program(spec)
    assert (program.stat().st_mtime_ns, meta.stat().st_mtime_ns) == written     # read, not exported again
    assert again.op_counts() == first.op_counts()
    # a damaged entry is exported again — to the very same text (the export is deterministic)
    program.write_bytes(original[: len(original) // 2] + b"garbage")
    assert load_program(spec).op_counts() == first.op_counts()
    assert program.read_bytes() == original
    meta.write_text("{not json")
    assert zoo_program(spec) == original.decode()


def test_export_failures_are_one_clean_line():
    ZOO["broken"] = ZooEntry("broken", "never registered in the child", (), generate=lambda p: "")
    try:
        with pytest.raises(IngestError) as info:
            export_in_subprocess("broken", {}, "zoo:broken")
    finally:
        del ZOO["broken"]
    assert str(info.value).startswith("zoo:broken: export failed: KeyError")
    assert "\n" not in str(info.value)


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HESPAS_ML_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path / "zoo"
    monkeypatch.delenv("HESPAS_ML_CACHE")
    assert cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "hespas-ml" / "zoo"
