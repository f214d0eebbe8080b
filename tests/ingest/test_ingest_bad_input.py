"""Bad input gives an IngestError with one line naming the file and the problem — never a traceback."""
from __future__ import annotations

import gzip
import io
import random
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import shared_path
from hespas_ml.ingest import IngestError, load_program, parse_file, parse_module

GOOD = """
module @ok {
  func.func @main(%a: tensor<4x4xf32>) -> tensor<4x4xf32> {
    %0 = stablehlo.tanh %a : tensor<4x4xf32>
    return %0 : tensor<4x4xf32>
  }
}
"""


def ingest_error(path: Path, *patterns: str) -> str:
    """Parse ``path``; it must fail with a one-line IngestError naming it and matching ``patterns``."""
    with pytest.raises(IngestError) as info:
        parse_file(path)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(f"{path}: "), text
    assert info.value.source == str(path)
    for pattern in patterns:
        assert pattern.lower() in text.lower(), text
    return text


def write(tmp_path: Path, name: str, data: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    return path


def test_a_good_module_parses(tmp_path):
    assert parse_file(write(tmp_path, "ok.mlir", GOOD)).op_counts() == {"tanh": 1}


def random_bytes(n: int, seed: int = 3) -> bytes:
    rng = random.Random(seed)
    return bytes(rng.randrange(256) for _ in range(n))


@pytest.mark.parametrize("name, data, expected", [
    ("random.mlir", random_bytes(4096), "neither MLIR text nor"),
    ("photo.mlir", b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01" + bytes(200), "neither MLIR text nor"),
    ("script.mlir", "import os\nprint(os.getcwd())\n", "not valid MLIR (line 1"),
    ("prose.mlir", "hello world, this is not a program\n", "not valid MLIR"),
    ("empty.mlir", b"", "is empty"),
    ("blank.mlir", "  \n\t\n", "is empty"),
    ("nul.mlir", "module {}\x00\x00", "NUL"),
    ("zipped.mlir", b"PK\x03\x04" + bytes(60), "zip"),
])
def test_not_mlir(tmp_path, name, data, expected):
    ingest_error(write(tmp_path, name, data), expected)


def test_truncated_file(tmp_path):
    text = shared_path("mlir", "resnet_50_inference_step_4_devices_1024_batch.mlir").read_text()
    ingest_error(write(tmp_path, "half.mlir", text[:len(text) // 2]), "not valid MLIR")


def test_gzip(tmp_path):
    ingest_error(write(tmp_path, "m.mlir.gz", gzip.compress(GOOD.encode())), "gzip")


def test_directory_and_missing_file(tmp_path):
    ingest_error(tmp_path, "directory")
    ingest_error(tmp_path / "nothere.mlir", "no such file")


def test_dynamic_and_unranked_shapes(tmp_path):
    dynamic = GOOD.replace("tensor<4x4xf32>", "tensor<?x4xf32>")
    text = ingest_error(write(tmp_path, "dyn.mlir", dynamic), "dynamic shape", "?x4xf32", "static shapes")
    assert "line 3" in text
    unranked = GOOD.replace("tensor<4x4xf32>", "tensor<*xf32>")
    ingest_error(write(tmp_path, "unranked.mlir", unranked), "unranked")


def test_missing_main(tmp_path):
    ingest_error(write(tmp_path, "nomain.mlir", GOOD.replace("@main", "@forward")), "no 'main'", "@forward")


def test_call_to_an_undefined_function(tmp_path):
    text = GOOD.replace("%0 = stablehlo.tanh %a : tensor<4x4xf32>",
                        "%0 = func.call @ghost(%a) : (tensor<4x4xf32>) -> tensor<4x4xf32>")
    ingest_error(write(tmp_path, "ghost.mlir", text), "ghost")


RECURSIVE = """
module @rec {
  func.func private @f(%a: tensor<4xf32>) -> tensor<4xf32> {
    %0 = func.call @g(%a) : (tensor<4xf32>) -> tensor<4xf32>
    return %0 : tensor<4xf32>
  }
  func.func private @g(%a: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.negate %a : tensor<4xf32>
    %1 = func.call @f(%0) : (tensor<4xf32>) -> tensor<4xf32>
    return %1 : tensor<4xf32>
  }
  func.func @main(%a: tensor<4xf32>) -> tensor<4xf32> {
    %0 = func.call @f(%a) : (tensor<4xf32>) -> tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}
"""


def test_recursion(tmp_path):
    ingest_error(write(tmp_path, "rec.mlir", RECURSIVE), "recursive call @f -> @g -> @f")
    self_call = RECURSIVE.replace("func.call @f(%0)", "func.call @g(%0)")
    ingest_error(write(tmp_path, "self.mlir", self_call), "recursive call @g -> @g")


def test_call_tree_that_explodes_is_refused(tmp_path):
    # 40 levels of functions each calling the next twice: 2**40 inlined call sites.
    funcs = ["func.func private @f40(%a: tensor<f32>) -> tensor<f32> {\n return %a : tensor<f32>\n}"]
    for i in range(39, -1, -1):
        funcs.append(f"""func.func private @f{i}(%a: tensor<f32>) -> tensor<f32> {{
  %0 = func.call @f{i + 1}(%a) : (tensor<f32>) -> tensor<f32>
  %1 = func.call @f{i + 1}(%0) : (tensor<f32>) -> tensor<f32>
  return %1 : tensor<f32>
}}""")
    funcs.append("""func.func @main(%a: tensor<f32>) -> tensor<f32> {
  %0 = func.call @f0(%a) : (tensor<f32>) -> tensor<f32>
  return %0 : tensor<f32>
}""")
    import hespas_ml.ingest.stablehlo as shlo
    old = shlo.MAX_VISITED_OPS
    shlo.MAX_VISITED_OPS = 100_000       # the real limit (20M) takes a while to reach in pure Python
    try:
        ingest_error(write(tmp_path, "boom.mlir", "module {\n" + "\n".join(funcs) + "\n}"), "call tree")
    finally:
        shlo.MAX_VISITED_OPS = old


def test_nesting_deep_enough_to_crash_mlir_is_refused_before_parsing(tmp_path):
    # 5,000 nested modules overflow the stack of MLIR's recursive-descent parser (segfault).
    ingest_error(write(tmp_path, "deep.mlir", "module {" * 5000 + "}" * 5000), "nest 5000 deep")
    deep_type = "tuple<" * 3000 + "tensor<f32>" + ">" * 3000
    ingest_error(write(tmp_path, "tuple.mlir", f"func.func @main(%a: {deep_type}) {{ return }}"), "nest")


def test_convolution_dim_numbers_that_make_mlir_allocate_gigabytes(tmp_path):
    conv = shared_path("mlir", "convolution.mlir").read_text()
    bad = conv.replace("x[0, 1, i, o]", "x[2147483647, 1, i, o]")
    assert bad != conv
    ingest_error(write(tmp_path, "conv.mlir", bad), "line 4", "dimension 2147483647")


def test_device_counts_and_groups_are_checked(tmp_path):
    split = shared_path("mlir", "test_split_replica_groups.mlir").read_text()
    ingest_error(write(tmp_path, "zero.mlir", split.replace("mhlo.num_replicas = 4", "mhlo.num_replicas = 0")),
                 "mhlo.num_replicas", "positive")
    # (MLIR's verifier already rejects gaps and repeats; ids past the device count are ours to catch)
    six = split.replace("[[0, 1], [2, 3]]> : tensor<2x2xi64>", "[[0, 1], [2, 3], [4, 5]]> : tensor<3x2xi64>")
    assert six != split
    ingest_error(write(tmp_path, "range.mlir", six), "all_reduce at line 7", "replica id 4", "4 replicas")
    ingest_error(write(tmp_path, "twice.mlir", split.replace("[[0, 1], [2, 3]]", "[[0, 0], [2, 3]]")),
                 "line 7", "seen more than once")


def _bytecode(text: str) -> bytes:
    from jax.extend.mlir import ir
    from jax.interpreters import mlir as jmlir

    with jmlir.make_ir_context():
        buf = io.BytesIO()
        ir.Module.parse(text).operation.write_bytecode(buf)
        return buf.getvalue()


def test_bytecode_parses_and_truncated_bytecode_is_refused(tmp_path):
    data = _bytecode(GOOD)
    assert parse_file(write(tmp_path, "ok.mlirbc", data)).op_counts() == {"tanh": 1}
    ingest_error(write(tmp_path, "short.mlirbc", data[:10]), "truncated")
    ingest_error(write(tmp_path, "cut.mlirbc", data[:len(data) // 2]), "not valid MLIR")


CRASH_PROBE = """
import sys
from jax.interpreters import mlir as jmlir
from jax.extend.mlir import ir
with jmlir.make_ir_context():
    try:
        ir.Module.parse(open(sys.argv[1], "rb").read())
    except Exception:
        pass
print("survived")
"""


# Byte flips (offset, new value) of test_no_comm_graph.mlir's bytecode found by the fuzzer: MLIR's
# bytecode reader corrupts its heap on the result ("malloc(): invalid size") and aborts the process.
HEAP_CORRUPTING_FLIPS = [(48, 106), (117, 106), (155, 112), (271, 223), (446, 47), (502, 243), (588, 187),
                         (634, 184)]


def test_bytecode_that_crashes_mlir_is_refused_cleanly(tmp_path):
    data = bytearray(_bytecode(shared_path("mlir", "test_no_comm_graph.mlir").read_text()))
    for offset, value in HEAP_CORRUPTING_FLIPS:
        data[offset] = value
    path = write(tmp_path, "damaged.mlirbc", bytes(data))
    probe = subprocess.run([sys.executable, "-c", CRASH_PROBE, str(path)], capture_output=True, text=True,
                           timeout=120)
    if probe.returncode == 0:
        pytest.skip("this jaxlib writes or reads bytecode differently: the damaged file no longer crashes it")
    assert probe.returncode < 0                      # killed by a signal (abort / segfault)
    ingest_error(path, "bytecode is damaged", "crashed")
    # and this process is still fine
    assert parse_module(GOOD).op_counts() == {"tanh": 1}


@pytest.mark.parametrize("text", [
    'func.func @main() {\n  "stablehlo.\\E3"() : () -> ()\n  return\n}',
    'func.func @main() {\n  func.call @"g\\E3"() : () -> ()\n  return\n}',
])
def test_escaped_names_that_are_not_utf8(tmp_path, text):
    # MLIR would quote these names in its error message, which the bindings cannot convert: abort.
    ingest_error(write(tmp_path, "escape.mlir", text), "line 2", "not UTF-8")


def test_escaped_names_that_are_utf8_are_fine(tmp_path):
    text = GOOD.replace("module @ok", 'module @"\\C3\\A9t\\C3\\A9"')
    assert parse_file(write(tmp_path, "utf8.mlir", text)).op_counts() == {"tanh": 1}


def test_other_sources(tmp_path):
    with pytest.raises(IngestError, match="expected MLIR text or bytes"):
        parse_module(12345, source="number")
    with pytest.raises(IngestError, match="no program given"):
        load_program("  ")
    with pytest.raises(IngestError, match=r"^zoo:nope: unknown zoo family 'nope' \(known families: .*mlp"):
        load_program("zoo:nope")


def test_bom_is_accepted(tmp_path):
    assert parse_file(write(tmp_path, "bom.mlir", b"\xef\xbb\xbf" + GOOD.encode())).op_counts() == {"tanh": 1}
