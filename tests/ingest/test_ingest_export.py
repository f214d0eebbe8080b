"""JAX export: shard_map programs and the compiler-partitioned form ingest with their collectives.

Fake host devices must be configured before jax initialises, and other tests in this pytest process
import jax, so multi-device exports run in a fresh Python that prints a JSON summary.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from hespas_ml.ingest import parse_module
from hespas_ml.ingest.export import ExportError, export_jax, with_host_device_flag

ROOT = Path(__file__).resolve().parents[2]


def run_fresh(code: str) -> dict:
    """Run ``code`` in a new interpreter without XLA_FLAGS; it prints one JSON line last."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


SUMMARY = """
def summary(g):
    out = []
    for op in g.ops:
        if op.is_collective:
            out.append({"kind": op.kind, "groups": op.attrs.get("replica_groups"),
                        "pairs": op.attrs.get("source_target_pairs"),
                        "channel": op.attrs.get("channel_handle"),
                        "in": [str(t) for t in op.operand_types], "out": [str(t) for t in op.result_types]})
    return {"devices": g.n_devices, "collectives": out, "inputs": [str(t) for t in g.inputs],
            "loops": [[lp.trip_count, lp.derived] for lp in g.loops], "counts": g.op_counts(),
            "warnings": g.warnings}
"""

EXPORTS = SUMMARY + """
import json, os
from hespas_ml.ingest.export import ensure_host_devices, export_jax, export_partitioned
ensure_host_devices(4)                      # jax not imported yet: sets XLA_FLAGS
flags = os.environ["XLA_FLAGS"]
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from hespas_ml.ingest import parse_module

mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))

def collectives(x):
    s = jax.lax.psum(x, "b")
    g = jax.lax.all_gather(x, "a", tiled=True)
    r = jax.lax.psum_scatter(x, ("a", "b"), scatter_dimension=0, tiled=True)
    p = jax.lax.ppermute(x, "b", perm=[(0, 1), (1, 0)])
    t = jax.lax.all_to_all(x, "a", 0, 0, tiled=True)
    return s, g, r, p, t

explicit = jax.shard_map(collectives, mesh=mesh, in_specs=P(("a", "b")),
                         out_specs=(P(("a", "b")),) * 5, check_vma=False)
text = export_jax(explicit, jax.ShapeDtypeStruct((16, 8), jnp.float32), name="explicit")

flat = Mesh(np.array(jax.devices()), ("d",))
def step(w, x):
    return jnp.sum(jax.lax.fori_loop(0, 5, lambda i, h: jnp.tanh(h @ w), x))
bc = export_partitioned(step, jax.ShapeDtypeStruct((64, 64), jnp.float32),
                        jax.ShapeDtypeStruct((32, 64), jnp.float32),
                        in_shardings=(NamedSharding(flat, P(None, "d")), NamedSharding(flat, P("d", None))))
bc2 = export_partitioned(step, jax.ShapeDtypeStruct((64, 64), jnp.float32),
                         jax.ShapeDtypeStruct((32, 64), jnp.float32),
                         in_shardings=(NamedSharding(flat, P(None, "d")), NamedSharding(flat, P("d", None))))
print(json.dumps({"flags": flags, "n": len(jax.devices()), "text_head": text.splitlines()[0],
                  "manual": "sdy.manual_computation" in text, "bytecode": bc[:4].hex(),
                  "deterministic": bc == bc2,
                  "explicit": summary(parse_module(text, source="explicit")),
                  "partitioned": summary(parse_module(bc, source="partitioned"))}))
"""


@pytest.fixture(scope="module")
def exported() -> dict:
    return run_fresh(EXPORTS)


def test_ensure_host_devices_sets_the_flag_before_jax_is_imported(exported):
    assert "--xla_force_host_platform_device_count=4" in exported["flags"]
    assert exported["n"] == 4


def test_shard_map_program_has_each_collective_with_its_groups(exported):
    assert exported["manual"] and exported["text_head"].startswith("module @explicit ")
    s = exported["explicit"]
    assert s["devices"] == 4
    by_kind = {c["kind"]: c for c in s["collectives"]}
    assert sorted(by_kind) == ["all_gather", "all_reduce", "all_to_all", "collective_permute", "reduce_scatter"]
    # mesh (a=2, b=2) over devices 0..3: "b" pairs neighbours, "a" pairs devices two apart
    assert by_kind["all_reduce"]["groups"] == [[0, 1], [2, 3]]
    assert by_kind["all_gather"]["groups"] == [[0, 2], [1, 3]]
    assert by_kind["reduce_scatter"]["groups"] == [[0, 1, 2, 3]]
    assert by_kind["all_to_all"]["groups"] == [[0, 2], [1, 3]]
    assert sorted(by_kind["collective_permute"]["pairs"]) == [[0, 1], [1, 0], [2, 3], [3, 2]]
    assert all(c["channel"]["handle"] > 0 for c in s["collectives"])
    # per-device shapes inside the shard_map body: 16 rows over 4 devices
    assert by_kind["all_reduce"]["in"] == ["4x8xf32"]
    assert by_kind["all_gather"]["out"] == ["8x8xf32"]
    assert by_kind["reduce_scatter"]["out"] == ["1x8xf32"]
    assert s["inputs"] == ["4x8xf32"]                 # what one device holds of the 16x8 argument


def test_partitioned_form_has_xla_chosen_collectives_and_per_device_shapes(exported):
    assert exported["bytecode"] == b"ML\xefR".hex() and exported["deterministic"]
    s = exported["partitioned"]
    assert s["devices"] == 4
    assert s["inputs"] == ["64x16xf32", "8x64xf32"]          # per-device parameter shapes
    kinds = [c["kind"] for c in s["collectives"]]
    assert "all_gather" in kinds and "all_reduce" in kinds
    gather = next(c for c in s["collectives"] if c["kind"] == "all_gather")
    assert gather["in"] == ["64x16xf32"] and gather["out"] == ["64x64xf32"]
    assert all(c["groups"] == [[0, 1, 2, 3]] for c in s["collectives"])
    # the fori_loop survives compilation as a while whose condition sits in a fusion
    assert s["loops"] == [[5, True]]
    assert not s["warnings"]


def test_ensure_host_devices_after_jax_started_checks_and_explains():
    out = run_fresh("""
        import json
        import jax
        from hespas_ml.ingest.export import ExportError, ensure_host_devices
        ensure_host_devices(3)               # imported but not initialised: still settable
        n = len(jax.devices())
        ensure_host_devices(2)               # enough: fine
        try:
            ensure_host_devices(8)
            message = None
        except ExportError as exc:
            message = str(exc)
        print(json.dumps({"n": n, "message": message}))
    """)
    assert out["n"] == 3
    assert "already initialised with 3 CPU device(s) but 8 are needed" in out["message"]
    assert "--xla_force_host_platform_device_count=8" in out["message"]


def test_export_jax_in_process_renames_and_reports_errors():
    text = export_jax(lambda a: jnp.tanh(a) * 2.0, jax.ShapeDtypeStruct((4, 4), jnp.float32), name="my program")
    assert text.startswith("module @my_program ")
    assert parse_module(text).op_counts()["tanh"] == 1
    with pytest.raises(ExportError, match="cannot export bad"):
        export_jax(lambda a: a @ a, jax.ShapeDtypeStruct((4, 3), jnp.float32), name="bad")


def test_with_host_device_flag():
    assert with_host_device_flag("", 4) == "--xla_force_host_platform_device_count=4"
    assert with_host_device_flag("--xla_dump_to=/x --xla_force_host_platform_device_count=2", 8) == \
        "--xla_dump_to=/x --xla_force_host_platform_device_count=8"
    assert with_host_device_flag("--xla_dump_to=/x", 2) == "--xla_dump_to=/x --xla_force_host_platform_device_count=2"
