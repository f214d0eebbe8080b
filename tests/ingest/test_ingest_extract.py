"""Region extraction: any op set of a program becomes a standalone module that verifies, re-ingests to the
same ops and costs, compiles with XLA and computes what the program computes."""
from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hespas_ml.ingest import load_program, parse_file, parse_module
from hespas_ml.ingest.errors import HespasError
from hespas_ml.ingest.extract import (ExtractError, extract_modules, extract_region, extract_regions,
                                     program_data)
from hespas_ml.costs import graph_cost, op_cost
from hespas_ml.split.regions import split_program
from tests.conftest import shared_path

ROOT = Path(__file__).resolve().parents[2]


def same_work(region_ops, extracted_text: str) -> None:
    """The extracted module re-ingests to the region's ops: same kinds, same FLOPs and bytes."""
    g2 = parse_module(extracted_text, source="extracted")
    assert collections.Counter(op.kind for op in g2.ops) == collections.Counter(op.kind for op in region_ops)
    cost = graph_cost(g2)
    want = [op_cost(op) for op in region_ops]
    assert cost["flops"] == pytest.approx(sum(c.flops for c in want), rel=1e-9, abs=1e-9)
    assert cost["transcendentals"] == pytest.approx(sum(c.transcendentals for c in want), rel=1e-9, abs=1e-9)
    assert cost["bytes_in"] + cost["bytes_out"] == pytest.approx(sum(c.bytes_in + c.bytes_out for c in want))
    assert all(op.count == 1 and op.loop is None for op in g2.ops)


def check_regions(path: Path, every: int = 1) -> tuple:
    graph = parse_file(path)
    regions = split_program(graph).regions[::every]
    texts = extract_regions(program_data(graph), [r.op_ids for r in regions], source=str(path),
                            names=[r.name for r in regions])
    for region, text in zip(regions, texts):
        assert text.startswith(f"module @{region.name}")
        same_work([graph.ops[i] for i in region.op_ids], text)
    return graph, regions, texts


_BACKEND = None


def compile_text(text: str):
    """Compile on one CPU device through the PJRT client (no x64: these programs need none)."""
    global _BACKEND
    from jax.extend import backend as jeb

    if _BACKEND is None:
        be = jeb.get_backend("cpu")
        _BACKEND = (be, be.local_devices()[:1], jeb.get_compile_options(num_replicas=1, num_partitions=1))
    be, devs, opts = _BACKEND
    return be.compile_and_load(text, devs, opts)


def run(text: str, args: list[np.ndarray]) -> list[np.ndarray]:
    import jax

    exe = compile_text(text)
    dev = _BACKEND[1][0]
    return [np.asarray(r) for r in exe.execute([jax.device_put(a, dev) for a in args])]


# ---------------------------------------------------------------------------------------- shared programs

@pytest.mark.parametrize("name, every", [("jax_example.mlir", 1),
                                         ("resnet_50_inference_step_4_devices_1024_batch.mlir", 1),
                                         ("maxtext/llama3-100m-4dev.mlir", 13)])
def test_every_region_of_shared_programs_extracts_with_its_exact_work(name, every):
    graph, regions, texts = check_regions(shared_path("mlir", name), every)
    assert len(regions) > 10
    # collectives keep their device groups: the module keeps the program's device counts
    for region, text in zip(regions, texts):
        if region.kind == "collective":
            g2 = parse_module(text)
            assert g2.n_devices == graph.n_devices
            assert g2.ops[0].attrs.get("replica_groups") == graph.ops[region.op_ids[0]].attrs.get("replica_groups")
        else:
            assert "mhlo.num_partitions" not in text.splitlines()[0]


@pytest.mark.parametrize("name", ["jax_example.mlir", "resnet_50_inference_step_4_devices_1024_batch.mlir",
                                  "maxtext/llama3-100m-4dev.mlir"])
@pytest.mark.slow      # compiles regions with XLA (or exports a zoo program)
def test_compute_regions_of_shared_programs_compile_with_xla(name):
    graph = parse_file(shared_path("mlir", name))
    compute = [r for r in split_program(graph).compute_regions()]
    # the heaviest few and a spread of the rest
    heavy = sorted(compute, key=lambda r: -r.flops)[:3]
    picks = {r.id: r for r in heavy + compute[::max(1, len(compute) // 5)]}
    texts = extract_regions(program_data(graph), [r.op_ids for r in picks.values()], source=name)
    for text in texts:
        exe = compile_text(text)
        assert exe.cost_analysis() is not None


def test_called_computations_come_along():
    path = shared_path("mlir", "custom_call_topk.mlir")
    graph = parse_file(path)
    topk = next(op.id for op in graph.ops if op.kind == "custom_call")
    text = extract_region(program_data(graph), [topk], source=str(path), name="topk")
    assert "func.func private @topk_comparator" in text and "called_computations = [@topk_comparator]" in text
    assert parse_module(text).ops[0].attrs["call_target_name"] == "TopK"


def test_attributes_survive_exactly():
    path = shared_path("mlir", "convolution.mlir")
    graph = parse_file(path)
    conv = next(op for op in graph.ops if op.kind == "convolution")
    text = extract_region(path.read_text(), [conv.id], source=str(path), name="conv")
    assert parse_module(text).ops[0].attrs == conv.attrs
    assert "lhs_dilate" in text


# ------------------------------------------------------------------------------- JAX-exported programs

EXPORTS = """
import sys
from hespas_ml.ingest.export import ensure_host_devices, export_jax, export_partitioned
ensure_host_devices(4)
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
out = sys.argv[1]
f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)

def loop(w, x):
    body = lambda i, h: jnp.tanh(h @ w) + jnp.sum(h, axis=0, keepdims=True) * 0.01
    return jax.lax.fori_loop(0, 3, body, x)
open(f"{out}/loop.mlir", "w").write(export_jax(loop, f32(64, 64), f32(32, 64), name="loop"))

mesh = Mesh(np.array(jax.devices()), ("d",))
def shmap(x, w):
    def inner(xb, wb):
        y = jnp.maximum(xb @ wb, 0.0)
        return y * jax.lax.psum(jnp.sum(y, axis=0), "d")
    return jax.shard_map(inner, mesh=mesh, in_specs=(P("d", None), P()), out_specs=P("d", None),
                         check_vma=False)(x, w)
open(f"{out}/shard_map.mlir", "w").write(export_jax(shmap, f32(64, 32), f32(32, 16), name="shard_map"))

def step(w, x):
    return jnp.sum(jax.lax.fori_loop(0, 5, lambda i, h: jnp.tanh(h @ w), x))
bc = export_partitioned(step, f32(64, 64), f32(32, 64),
                        in_shardings=(NamedSharding(mesh, P(None, "d")), NamedSharding(mesh, P("d", None))))
open(f"{out}/partitioned.mlirbc", "wb").write(bc)

def mix(x, idx, w):
    y = jax.nn.softmax(x @ w, axis=-1)
    s = jnp.sort(y, axis=-1)
    g = jnp.take(s, idx, axis=0)
    z = jax.lax.reduce_window(g, -jnp.inf, jax.lax.max, (1, 2), (1, 2), "VALID")
    u = jnp.zeros((16, 8)).at[idx].add(z[:, :8])
    c = jax.lax.conv_general_dilated(x[None, None], w[None, None, :8, :8], (1, 1), "SAME")
    return u, c, jnp.cumsum(y, axis=0)
open(f"{out}/mix.mlir", "w").write(export_jax(mix, f32(16, 24), jax.ShapeDtypeStruct((16,), jnp.int32),
                                              f32(24, 16), name="mix"))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """JAX programs with a loop, shard_map, XLA fusions and reducer-body ops (4 fake devices: a fresh
    interpreter, since this one's jax may already be initialised)."""
    out = tmp_path_factory.mktemp("exported")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(EXPORTS), str(out)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("name, feature", [("loop.mlir", "stablehlo.while"),
                                           ("shard_map.mlir", "sdy.manual_computation"),
                                           ("partitioned.mlirbc", "mhlo.fusion"),
                                           ("mix.mlir", "stablehlo.sort")])
@pytest.mark.slow      # compiles regions with XLA (or exports a zoo program)
def test_exported_programs_every_region_extracts_and_compiles(exported, name, feature):
    path = exported / name
    data = path.read_bytes()
    from hespas_ml.ingest.stablehlo import load_module

    ctx, module = load_module(data, name)
    assert feature in str(module)                         # the program has what this case is about
    graph, regions, texts = check_regions(path)
    for region, text in zip(regions, texts):
        if region.kind == "compute":
            compile_text(text)


def test_loop_body_region_takes_loop_carried_values_as_parameters(exported):
    path = exported / "loop.mlir"
    graph = parse_file(path)
    dot = next(op for op in graph.ops if op.kind == "dot_general")
    assert dot.loop == 0
    (module,) = extract_modules(path.read_text(), [[dot.id]], source=str(path))
    assert sorted(p[0] for p in module.params) == ["loop", "loop"]
    assert module.results == [("op", dot.id, 0)]
    h = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)
    shapes = [t.shape for t in parse_module(module.text).inputs]
    args = [h if shape == h.shape else w for shape in shapes]
    assert sorted(shapes) == [h.shape, w.shape]
    (out,) = run(module.text, args)
    np.testing.assert_allclose(out, h @ w, rtol=1e-4, atol=1e-4)


def test_shard_map_region_has_per_device_shapes(exported):
    path = exported / "shard_map.mlir"
    graph = parse_file(path)
    dot = next(op for op in graph.ops if op.kind == "dot_general")
    text = extract_region(path.read_text(), [dot.id], source=str(path), name="local")
    g2 = parse_module(text)
    # w is replicated: the program's input itself; x is split over the devices: a local block of
    # 64 / 4 rows crosses into the manual computation
    params = extract_modules(path.read_text(), [[dot.id]])[0].params
    assert params[0] == ("input", 1) and params[1][0] == "boundary"
    assert [str(t) for t in g2.inputs] == ["32x16xf32", "16x32xf32"]


def inputs_for(graph, rng) -> list[np.ndarray]:
    out = []
    for t in graph.inputs:
        if t.dtype == "i32":
            out.append(rng.integers(0, 16, t.shape).astype(np.int32))
        else:
            out.append(rng.standard_normal(t.shape).astype(np.float32))
    return out


@pytest.mark.slow      # compiles regions with XLA (or exports a zoo program)
def test_regions_run_one_after_another_compute_the_program(exported):
    """Execute the program whole, and as its regions chained through their parameters and results:
    the outputs agree, so every region computes exactly its part."""
    path = exported / "mix.mlir"
    text = path.read_text()
    graph = parse_file(path)
    args = inputs_for(graph, np.random.default_rng(3))
    expected = run(text, args)
    regions = split_program(graph).regions
    modules = extract_modules(text, [r.op_ids for r in regions], source=str(path))
    values: dict[tuple, np.ndarray] = {("input", i): a for i, a in enumerate(args)}
    for module in modules:                               # regions are in a valid execution order
        outs = run(module.text, [values[p] for p in module.params])
        values.update(zip(module.results, outs))
    assert all(len(graph.ops[i].result_types) == 1 for i in graph.outputs)
    for want, oid in zip(expected, graph.outputs):
        np.testing.assert_allclose(values[("op", oid, 0)], want, rtol=1e-5, atol=1e-6)


def test_whole_program_extracted_computes_the_same(exported):
    path = exported / "mix.mlir"
    text = path.read_text()
    graph = parse_file(path)
    (module,) = extract_modules(text, [range(len(graph.ops))], source=str(path))
    assert module.params == [("input", i) for i in range(len(graph.inputs))]
    args = inputs_for(graph, np.random.default_rng(5))
    got = dict(zip(module.results, run(module.text, args)))
    for want, oid in zip(run(text, args), graph.outputs):
        np.testing.assert_allclose(got[("op", oid, 0)], want, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------ errors

def test_bad_op_ids_and_sourceless_graphs_are_clean_errors(tmp_path):
    text = shared_path("mlir", "test_no_comm_graph.mlir").read_text()
    graph = parse_module(text)
    n = len(graph.ops)
    with pytest.raises(ExtractError, match=rf"prog: op id {n + 3} is out of range \(the program has {n} ops\)"):
        extract_region(text, [0, n + 3], source="prog")
    with pytest.raises(ExtractError, match="prog: no op ids"):
        extract_region(text, [], source="prog")
    with pytest.raises(ExtractError, match="negative"):
        extract_region(text, [-1], source="prog")
    with pytest.raises(ExtractError, match="in-memory"):
        program_data(graph)
    with pytest.raises(HespasError, match="not valid MLIR"):
        extract_region("module { bogus }", [0], source="prog")
    path = tmp_path / "p.mlir"
    path.write_text(text)
    g = parse_file(path)
    assert program_data(g) == text.encode()
    path.unlink()
    with pytest.raises(ExtractError, match="gone"):
        program_data(g)


@pytest.mark.slow      # compiles regions with XLA (or exports a zoo program)
def test_program_data_of_a_zoo_graph(tmp_path, monkeypatch):
    monkeypatch.setenv("HESPAS_ML_CACHE", str(tmp_path))
    spec = "zoo:mlp?layers=1&width=32&batch=8&step=infer"
    graph = load_program(spec)
    data = program_data(graph)
    dot = next(op for op in graph.ops if op.kind == "dot_general")
    text = extract_region(data, [dot.id], source=spec, name="dot")
    same_work([dot], text)
