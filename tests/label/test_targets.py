"""Hardware targets: presets, aliases, user files, errors, agreement with Hespas, host-cpu measurement."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
import warnings
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from hespas_ml.label.targets import (
    HOST_CPU,
    VECTOR_DTYPES,
    Target,
    TargetError,
    list_targets,
    load_target,
    measure_host_cpu,
    normalize_dtype,
    preset_path,
    read_target_file,
)

REQUIRED = {"A100-40GB", "A100-80GB", "H100", "H200", "B200", "MI300X", "TPUv3", "TPUv4", "host-cpu"}
ACCELERATORS = [name for name in list_targets() if name != HOST_CPU]
GiB = 2**30


def preset(name: str) -> Target:
    """A preset as its file states it (host-cpu: the fallback values, no measurement)."""
    path = preset_path(name)
    assert path is not None, name
    return read_target_file(path)


def test_required_presets_exist_and_names_are_unique() -> None:
    names = list_targets()
    assert REQUIRED <= set(names)
    assert len(names) == len(set(names))


@pytest.mark.parametrize("name", ACCELERATORS)
def test_accelerator_preset_is_sane(name: str) -> None:
    t = load_target(name)
    assert t.name == name and t.description
    assert any("http" in s for s in t.sources), "every preset cites at least one document by URL"
    assert 100e9 <= t.mem_bw <= 20e12
    assert 8 * GiB <= t.mem_capacity <= 256 * GiB
    assert 0 < t.onchip_mem < t.mem_capacity and t.onchip_mem_kind
    assert 0.5e9 <= t.clock_hz <= 3e9
    dtypes = set(t.matrix_flops) | set(t.vector_flops) | set(VECTOR_DTYPES)
    for dtype in dtypes:
        assert t.peak_flops(dtype, "matrix") >= t.peak_flops(dtype, "vector"), dtype
    for dtype, rate in t.matrix_flops.items():
        if dtype in t.vector_flops:
            assert rate >= t.vector_flops[dtype], dtype
    # Narrower types are never slower on GPUs/TPUs; f64 never faster than f32.
    assert t.peak_flops("bf16") >= t.peak_flops("f32") >= t.peak_flops("f64", "vector")
    assert t.peak_flops("f16") >= t.peak_flops("f32")
    assert t.peak_flops("f8E4M3FN") >= t.peak_flops("bf16") or t.peak_flops("f8E4M3FN") >= t.peak_flops("f16")
    # Machine balance at 16-bit: 50..1000 FLOP per byte of memory traffic with matrix units; a GPU without
    # them (Pascal: P4, P100) runs 16-bit work on its vector lanes, 20..100 FLOP per byte.
    balance = max(t.peak_flops("bf16"), t.peak_flops("f16")) / t.mem_bw
    assert (50 <= balance <= 1000) if t.matrix_flops else (20 <= balance <= 100), balance
    if t.systolic is not None:
        sa = t.systolic
        assert sa.rows == sa.cols == 128 and sa.dataflow == "ws"
        assert 2 * sa.macs_per_cycle * t.clock_hz == pytest.approx(t.peak_flops("bf16"), rel=0.01)
        assert min(sa.ifmap_sram_kb, sa.filter_sram_kb, sa.ofmap_sram_kb) > 0
        assert sa.count * (sa.ifmap_sram_kb + sa.filter_sram_kb + sa.ofmap_sram_kb) * 1024 <= t.onchip_mem


def test_published_headline_figures() -> None:
    """Spot checks of dense datasheet figures (sparse ones would be twice these)."""
    assert load_target("A100-40GB").peak_flops("bf16") == pytest.approx(312e12)
    assert load_target("A100-80GB").mem_bw == pytest.approx(2039e9)
    assert load_target("H100").peak_flops("f8E4M3FN") == pytest.approx(1979e12)
    assert load_target("H200").mem_capacity > load_target("H100").mem_capacity
    b200 = load_target("B200")
    assert b200.peak_flops("f4E2M1FN") == pytest.approx(2 * b200.peak_flops("f8E5M2"))
    assert load_target("MI300X").mem_capacity == 192 * GiB
    v3, core, v4 = load_target("TPUv3"), load_target("TPUv3-core"), load_target("TPUv4")
    assert (v3.systolic.count, v4.systolic.count, core.systolic.count) == (4, 8, 2)
    assert core.peak_flops("bf16") == pytest.approx(v3.peak_flops("bf16") / 2)
    assert core.mem_bw == pytest.approx(v3.mem_bw / 2)


def test_to_vector_has_stable_keys_and_distinguishes_targets() -> None:
    vectors = {name: load_target(name).to_vector() for name in ACCELERATORS}
    vectors[HOST_CPU] = preset(HOST_CPU).to_vector()
    keys = [list(v) for v in vectors.values()]
    assert all(k == keys[0] for k in keys)
    assert all(math.isfinite(x) for v in vectors.values() for x in v.values())
    assert vectors["H100"]["log10_matrix_flops_bf16"] == pytest.approx(math.log10(989.5e12))
    assert vectors["TPUv4"]["dataflow_ws"] == 1.0 and vectors["TPUv4"]["log2_systolic_count"] == 3.0
    assert vectors["H100"]["dataflow_ws"] == vectors["H100"]["log2_systolic_rows"] == 0.0
    assert len({tuple(v.values()) for v in vectors.values()}) == len(vectors)


@pytest.mark.parametrize(("alias", "canonical"), [
    ("h100", "H100"), ("H100-SXM", "H100"), ("h100_sxm5", "H100"), ("a100", "A100-40GB"),
    ("A100-40GB", "A100-40GB"), ("a100 80gb", "A100-80GB"), ("tpuv4", "TPUv4"), ("TPUv4", "TPUv4"),
    ("TPU-v3", "TPUv3"), ("mi300x", "MI300X"), ("b200", "B200"), ("H200_141GB", "H200"),
    ("tpuv3-core", "TPUv3-core"), ("V100", "V100-32GB"),
])
def test_aliases(alias: str, canonical: str) -> None:
    target = load_target(alias)
    assert target.name == canonical
    assert target == load_target(canonical) and hash(target) == hash(load_target(canonical))


def test_dtype_spellings_and_fallbacks() -> None:
    h100, a100, v100, v4 = (load_target(n) for n in ("H100", "A100-40GB", "V100-32GB", "TPUv4"))
    assert normalize_dtype("ui32") == normalize_dtype("si32") == "i32"
    assert normalize_dtype("BFloat16") == "bf16"
    assert h100.peak_flops("si32") == h100.peak_flops("ui32") == h100.vector_flops["f32"]
    assert a100.peak_flops("f32", "matrix") == a100.vector_flops["f32"]      # no FP32 Tensor Core mode
    assert a100.peak_flops("complex<f64>", "matrix") == a100.matrix_flops["f64"]
    assert a100.peak_flops("f8E4M3FN") == a100.matrix_flops["f16"]            # no fp8 on Ampere
    assert a100.peak_flops("f8E4M3FN", "vector") == a100.vector_flops["f16"]
    assert h100.peak_flops("f8E4M3FNUZ") == h100.matrix_flops["f8E4M3FN"]
    assert h100.peak_flops("i1") == h100.matrix_flops["i8"]
    assert v100.peak_flops("bf16") == v100.vector_flops["f32"]                # no bf16 on Volta
    tpu = load_target("TPUv3")
    assert tpu.peak_flops("f16") == tpu.matrix_flops["bf16"]                  # f16 matmuls run on the bf16 MXU
    assert v4.peak_flops("f64") == v4.peak_flops("f32")
    assert v4.peak_flops("no-such-type") == v4.peak_flops("f32")
    with pytest.raises(TargetError, match="unit"):
        h100.peak_flops("bf16", "tensor")


def _write(tmp_path: Path, data: object, name: str = "mine.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False) if not isinstance(data, str) else data)
    return path


def _h100_mapping() -> dict:
    return yaml.safe_load(preset_path("H100").read_text())


def test_user_yaml_file(tmp_path: Path) -> None:
    data = _h100_mapping()
    data.update(name="my-gpu", aliases=[], mem_bw="2e12", matrix_flops={"bf16": "5e14", "si8": 1e15})
    data.pop("hespas_node")
    data.pop("hespas_differences")
    data.pop("f32_matmul")                 # its tf32 rate is gone with the H100's matrix table
    data["systolic"] = {"rows": 64, "cols": 32, "count": 2, "dataflow": "os",
                        "ifmap_sram_kb": 512, "filter_sram_kb": 512, "ofmap_sram_kb": 256}
    t = load_target(_write(tmp_path, data))
    assert t.name == "my-gpu" and t.mem_bw == 2e12
    assert t.peak_flops("bf16") == 5e14 and t.peak_flops("ui8") == 1e15
    assert t.systolic.macs_per_cycle == 64 * 32 * 2 and t.to_vector()["dataflow_os"] == 1.0
    assert load_target(str(tmp_path / "mine.yaml")).name == "my-gpu"


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda d: d.pop("mem_bw"), "key 'mem_bw' is missing"),
    (lambda d: d.update(mem_bw=-3e12), "key 'mem_bw' must be a positive number"),
    (lambda d: d.update(clock_hz="fast"), "key 'clock_hz' must be a number"),
    (lambda d: d.update(mem_capacity=True), "key 'mem_capacity' must be a number"),
    (lambda d: d["matrix_flops"].update(bf16=-1), r"key 'matrix_flops\.bf16' must be a positive"),
    (lambda d: d["matrix_flops"].update(fp99=1e12), r"'matrix_flops\.fp99' is not a known element type"),
    (lambda d: d["vector_flops"].pop("f32"), r"'vector_flops\.f32' is missing"),
    (lambda d: d.update(sources=[]), "'sources' must list at least one source"),
    (lambda d: d.update(mem_bandwith=1e12), "unknown key 'mem_bandwith'"),
    (lambda d: d.update(systolic={"rows": 8}), r"'systolic\.cols' is missing"),
    (lambda d: d.update(f32_matmul="fp19"), "'f32_matmul' names 'fp19', which matrix_flops has no rate for"),
    (lambda d: d["calibration"].update(memory_efficiency=1.5), r"'calibration\.memory_efficiency' must lie in"),
    (lambda d: d["calibration"].pop("kernel_overhead_s"), r"'calibration\.kernel_overhead_s' is missing"),
    (lambda d: d["calibration"]["kernel_floor_s"].update(softmax=1e-5), r"'calibration\.kernel_floor_s' must map op"),
    (lambda d: d["calibration"]["kernel_floor_s"].update(convolution=-1e-5), "must hold no negative time"),
])
def test_invalid_user_file_names_file_and_key(tmp_path: Path, edit, expected: str) -> None:
    data = _h100_mapping()
    edit(data)
    path = _write(tmp_path, data)
    with pytest.raises(TargetError, match=expected) as err:
        load_target(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_malformed_and_missing_files(tmp_path: Path) -> None:
    bad = _write(tmp_path, "name: [unclosed\nmem_bw: 1\n", "bad.yaml")
    with pytest.raises(TargetError, match=r"bad\.yaml: malformed YAML") as err:
        load_target(bad)
    assert "\n" not in str(err.value)
    with pytest.raises(TargetError, match="must hold a mapping"):
        load_target(_write(tmp_path, "- 1\n- 2\n", "list.yaml"))
    with pytest.raises(TargetError, match="no such target file"):
        load_target(tmp_path / "absent.yaml")


def test_unknown_name_lists_presets() -> None:
    with pytest.raises(TargetError) as err:
        load_target("Z9000")
    message = str(err.value)
    assert "'Z9000'" in message and "\n" not in message
    assert all(name in message for name in REQUIRED)


# ------------------------------------------------------------------------------ agreement with Hespas

def read_hespas_roofline(path: Path) -> dict:
    """A Hespas roofline.json. V100_32GB's file lacks a comma after one entry: such gaps are repaired."""
    text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(re.sub(r'([0-9"\]}])(\s*\n\s*")', r"\1,\2", text))


def hespas_disagreements(target: Target, hardware: dict) -> dict[str, tuple[float, float]]:
    """Hespas roofline entries that differ from our target by more than 1 %: key -> (ours, Hespas's).

    ``per_datatype_flops`` is the rate an op of that dtype gets, so it is compared with our matrix rate
    (which falls back to the vector rate where there is no matrix path). ``peak_flops`` is the rate of every
    op when there is no table (compared with our bf16 matrix rate), and otherwise the rate of dtypes the
    table omits, which on every Hespas table is the non-Tensor FP64 rate (compared with our f64 vector rate).
    """
    table = hardware.get("per_datatype_flops") or {}
    pairs = {"memory_bandwidth": (target.mem_bw, hardware["memory_bandwidth"])}
    reference = target.peak_flops("f64", "vector") if table else target.peak_flops("bf16", "matrix")
    pairs["peak_flops"] = (reference, hardware["peak_flops"])
    for dtype, rate in table.items():
        pairs[dtype] = (target.peak_flops(dtype, "matrix"), rate)
    return {key: (ours, theirs) for key, (ours, theirs) in pairs.items()
            if abs(ours - theirs) > 0.01 * theirs}


def test_hespas_rooflines_agree_or_are_explained(shared_dir: Path) -> None:
    nodes_dir = shared_dir / "hespas-configs" / "nodes"
    if not nodes_dir.is_dir():
        pytest.skip(f"{nodes_dir} is absent")
    files = sorted(nodes_dir.glob("*/roofline.json"))
    assert files, f"no Hespas roofline files under {nodes_dir}"
    by_node = {preset(n).hespas_node: n for n in list_targets() if preset(n).hespas_node}
    problems = []
    for path in files:
        node = path.parent.name
        if node not in by_node:
            problems.append(f"{node}: no preset names it as hespas_node")
            continue
        target = preset(by_node[node])
        hardware = read_hespas_roofline(path)["perf_estimator"]["hardware"]
        found = hespas_disagreements(target, hardware)
        for key in sorted(set(found) - set(target.hespas_differences)):
            ours, theirs = found[key]
            problems.append(f"{node}/{key}: ours {ours:.4g} vs Hespas {theirs:.4g}, not explained")
        for key in sorted(set(target.hespas_differences) - set(found)):
            problems.append(f"{node}/{key}: listed in hespas_differences of {target.name} but agrees")
    missing = {node for node in by_node if not (nodes_dir / node / "roofline.json").exists()}
    problems += [f"{node}: named by {by_node[node]} but absent from Hespas" for node in sorted(missing)]
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------------------- host cpu

def test_import_does_not_import_jax() -> None:
    code = "import sys, hespas_ml.label.targets; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_host_cpu_fallback_file_is_valid() -> None:
    fallback = preset(HOST_CPU)
    assert fallback.name == HOST_CPU and fallback.systolic is None and not fallback.measured


@pytest.fixture(scope="module")
def host_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory holding one host-cpu measurement made for this module."""
    directory = tmp_path_factory.mktemp("hespas-ml-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HESPAS_ML_CACHE", str(directory))
        measure_host_cpu()
    return directory


def test_host_cpu_measures_and_reuses_cache(host_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HESPAS_ML_CACHE", str(host_cache))
    (cache_file,) = host_cache.glob("host-cpu-*.yaml")
    mtime = cache_file.stat().st_mtime_ns
    first, second = load_target("host-cpu"), load_target("cpu")
    assert cache_file.stat().st_mtime_ns == mtime, "a cached measurement is not re-measured"
    assert first.measured["measured_at"] == second.measured["measured_at"]
    m = first.measured
    assert m["jax_version"] == metadata.version("jax") and m["cores"] >= 1 and m["cpu_model"]
    assert m["cpu_model"] in m["key"] and m["jax_version"] in m["key"]
    assert first.matrix_flops["f32"] > 1e9 and first.vector_flops["f32"] > 1e8 and first.mem_bw > 1e9
    assert first.mem_capacity > 1 * GiB and first.onchip_mem > 0
    assert m["benchmark_seconds"] < 30


def test_host_cpu_cache_is_parsed_once_while_unchanged(host_cache: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (cached,) = host_cache.glob("host-cpu-*.yaml")
    copy = tmp_path / cached.name
    copy.write_text(cached.read_text())
    monkeypatch.setenv("HESPAS_ML_CACHE", str(tmp_path))
    first = load_target("host-cpu")
    assert load_target("host-cpu") is first                     # the same parsed target, file unchanged
    text = copy.read_text()
    edited = text.replace(f"mem_bw: {first.mem_bw!r}", f"mem_bw: {first.mem_bw * 2!r}  # edited")
    assert edited != text
    copy.write_text(edited)                                      # changed on disk: read again
    again = load_target("host-cpu")
    assert again is not first and again.mem_bw == 2 * first.mem_bw


def test_host_cpu_gemm_rate_predicts_an_xla_gemm(host_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The measured f32 matrix rate predicts an independent XLA GEMM within a factor of 3 (shared cores)."""
    import jax
    import jax.numpy as jnp

    monkeypatch.setenv("HESPAS_ML_CACHE", str(host_cache))
    rate = load_target("host-cpu").peak_flops("f32", "matrix")
    n = 1024
    a = jax.device_put(jnp.full((n, n), 0.5, jnp.float32), jax.devices("cpu")[0])
    f = jax.jit(lambda x: x @ x.T)
    f(a).block_until_ready()
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    predicted = 2 * n**3 / rate
    assert predicted / 3 <= best <= predicted * 3


def test_host_cpu_command_shows_and_remeasures_the_cached_target(host_cache: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from hespas_ml.cli.main import main

    (cached,) = host_cache.glob("host-cpu-*.yaml")
    copy = tmp_path / cached.name
    copy.write_text(cached.read_text())
    monkeypatch.setenv("HESPAS_ML_CACHE", str(tmp_path))
    before = load_target("host-cpu")
    assert isinstance(before.measured["load_average"], float)     # the load it was measured at is kept
    assert main(["host-cpu"]) == 0
    out = capsys.readouterr().out
    assert str(copy) in out and "host-cpu --measure" in out
    assert f"memory {before.mem_bw / 1e9:.2f} GB/s" in out and f"f32 matrix {before.matrix_flops['f32'] / 1e9:.2f}" in out
    stamp = copy.stat().st_mtime_ns
    assert main(["host-cpu"]) == 0 and copy.stat().st_mtime_ns == stamp   # showing does not measure
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)                     # a busy test machine is told so
        assert main(["host-cpu", "--measure", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert copy.stat().st_mtime_ns != stamp                                 # measured again and cached
    after = load_target("host-cpu")
    assert shown["cache"] == str(copy) and shown["mem_bw"] == after.mem_bw
    assert after.measured["key"] == before.measured["key"] and after.matrix_flops["f32"] > 1e9


@pytest.mark.slow
def test_host_cpu_command_checks_timing_steadiness(host_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from hespas_ml.cli.main import main

    monkeypatch.setenv("HESPAS_ML_CACHE", str(host_cache))
    code = main(["host-cpu", "--steadiness", "--seconds", "1", "--json"])
    check = json.loads(capsys.readouterr().out)["steadiness"]
    assert code == (0 if check["steady"] else 1)                  # scripts can stop before a long build
    assert check["rounds"] >= 3 and set(check["kernels"]) == {"gemm_256", "stream_4m", "reduce_rows"}
    code = main(["host-cpu", "--steadiness", "--seconds", "1"])
    out = capsys.readouterr().out
    assert "timing steadiness: " in out and ("UNSTEADY" in out) == (code == 1)


def test_corrupt_host_cache_is_remeasured(host_cache: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    (cached,) = host_cache.glob("host-cpu-*.yaml")
    broken = tmp_path / cached.name
    broken.write_text(cached.read_text()[: len(cached.read_text()) // 3])  # a half-written file
    monkeypatch.setenv("HESPAS_ML_CACHE", str(tmp_path))
    with pytest.warns(RuntimeWarning, match="corrupt host-cpu cache"):
        target = load_target("host-cpu")
    assert target.matrix_flops["f32"] > 1e9
    assert read_target_file(broken).measured["key"] == target.measured["key"]  # rewritten, valid


def test_f32_matrix_work_runs_at_the_rate_xla_gives_it_by_default() -> None:
    h100, v100 = load_target("H100"), load_target("V100-32GB")
    # f32 dots on the TF32 Tensor Cores where the target says so; the unit's own peak is unchanged
    assert h100.op_rate("f32", "matrix") == h100.matrix_flops["tf32"] > h100.peak_flops("f32", "matrix")
    assert h100.op_rate("f32", "vector") == h100.vector_flops["f32"]
    assert h100.op_rate("bf16", "matrix") == h100.peak_flops("bf16", "matrix")
    # no TF32 on Volta: the rate is the peak
    assert v100.f32_matmul is None and v100.op_rate("f32", "matrix") == v100.peak_flops("f32", "matrix")
