"""Import NeuSight's measured GPU operator latencies as a measured dataset folder, with provenance.

    python eval/import_neusight.py --mirror NEUSIGHT_GIT_DIR \
        --out datasets/measured/neusight-db1fdc9 [--max-regions N] [--work out/neusight-db1fdc9]

``NEUSIGHT_GIT_DIR``: the git directory of a clone of https://github.com/trsharm25/NeuSight (bare is fine).

Reads the per-GPU operator files (``scripts/asplos/data/dataset/train/collect/<op>/p2.1.0/<Device>.csv``)
and the bmm / linear test files of the NeuSight repository at the pinned commit straight from a git
directory (a bare mirror is enough), chooses a stratified sample of shapes per operator, writes their
single-operation modules and builds them under ``--work`` (git ignores out/; a second run reuses the
build), and writes ``--out`` (replaced as a whole): a dataset folder with the measured times as
``profiling`` labels, plus steps.csv, provenance.json and README.md.

NeuSight's measured GPU operator latencies as profiling labels.

The NeuSight artifact (https://github.com/trsharm25/NeuSight, MIT licence, Georgia Institute of Technology
and Microsoft Corporation) ships one CSV per operator and GPU of single PyTorch calls timed with CUDA
events: ``scripts/asplos/data/dataset/train/collect/<op>/p2.1.0/<Device>.csv`` and, with more GPUs,
``scripts/asplos/data/dataset/test/{bmm,linear}.csv``. This module reads those rows and writes each one's
operator as a single-operation StableHLO module (f32, the same shapes), so that the dataset builder splits
it into one region whose structural hash keys the measured time.

Row formats (the columns after ``CUDA Version``, and ``Kernels`` where present, hold the shape):

* ``bmm`` — ``B, M, N, K``: ``(B, M, N) @ (B, N, K) -> (B, M, K)`` (N is contracted);
* ``linear`` — ``B, M, N, K``: input ``(B, M, N)``, weight ``(K, N)``, bias ``(K)``; written as a
  ``(B*M, N) x (K, N)`` dot contracting N, plus the broadcast bias (PyTorch flattens the leading dims);
* ``conv`` — ``B, Input_Channel, Output_Channel, Kernel_Szie, Input_Size, Stride, Padding`` (NeuSight's
  spelling): NCHW input ``(B, Cin, S, S)``, OIHW weight, no bias, dilation 1, one group;
* ``softmax``, ``ln`` and the elementwise ops — ``B, H``: softmax over dim 1; layer norm over H with
  affine weight and bias (eps 1e-5); ``add, mul, div, pow`` of two ``(B, H)`` tensors; ``addu, mulu, divu,
  powu`` of a tensor and a scalar constant; ``relu``; ``gelu`` (exact, with erf); ``tanh``.

Every problem with a row is a :class:`NeuSightError` of one line naming the file and the row (data rows
counted from 1 after the header).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hespas_ml.ingest.errors import HespasError  # noqa: E402

REPOSITORY = "https://github.com/trsharm25/NeuSight"
COMMIT = "db1fdc966633fe96c0717e0706e7621ad0921ed2"
LICENCE = "MIT, Copyright (c) 2025 Georgia Institute of Technology and Microsoft Corporation"
TRAIN_DIR = "scripts/asplos/data/dataset/train/collect"
TEST_DIR = "scripts/asplos/data/dataset/test"
TORCH_DIR = "p2.1.0"

MATRIX_DIMS = ("B", "M", "N", "K")
CONV_DIMS = ("B", "Input_Channel", "Output_Channel", "Kernel_Szie", "Input_Size", "Stride", "Padding")
VECTOR_DIMS = ("B", "H")
BINARY_OPS = {"add": "add", "mul": "multiply", "div": "divide", "pow": "power"}
SCALAR_OPS = {"addu": "add", "mulu": "multiply", "divu": "divide", "powu": "power"}
UNARY_OPS = ("relu", "gelu", "tanh")
OPS: dict[str, tuple[str, ...]] = {
    "bmm": MATRIX_DIMS, "linear": MATRIX_DIMS, "conv": CONV_DIMS, "softmax": VECTOR_DIMS, "ln": VECTOR_DIMS,
    **{op: VECTOR_DIMS for op in (*BINARY_OPS, *SCALAR_OPS, *UNARY_OPS)},
}
TRAIN_OPS = tuple(OPS)
TEST_OPS = ("bmm", "linear")

# Device names as NeuSight (torch.cuda.get_device_name) wrote them -> hespas-ml target presets.
DEVICES = {
    "NVIDIA A100-PCIE-40GB": "A100-40GB",           # the SXM4 preset's datasheet figures are the PCIe card's
    "NVIDIA A100-SXM4-40GB": "A100-40GB",
    "NVIDIA A100 80GB PCIe": "A100-80GB-PCIe",
    "NVIDIA H100 80GB HBM3": "H100",
    "NVIDIA L4": "L4",
    "Tesla P100-PCIE-16GB": "P100-16GB-PCIe",
    "Tesla P4": "P4",
    "Tesla T4": "T4",
    "Tesla V100-PCIE-32GB": "V100-32GB-PCIe",
}

COMMON_COLUMNS = ("OPName", "Latency", "Device", "Torch Version", "CUDNN Version", "Kernel Name", "CUDA Version")
LAUNCH_COLUMNS = ("Grid x", "Grid y", "Grid z", "Block x", "Block y", "Block z")
MEASUREMENT = ("CUDA events (torch.cuda.Event) around one forward call under torch.no_grad(); the mean of the 5 "
               "fastest of 25 calls, with no separate warm-up; FP32 inputs with TF32 off (cuDNN TF32 disabled, "
               "cuBLAS TF32 off by default); cudnn.benchmark on")
LAUNCH_NOTE = ("the latency covers one call of the PyTorch operator: every kernel it launched (see kernels) "
               "and the launch gaps between them; small ops sit on a launch floor of about 25 us")
SCALAR = 0.5            # the tensor-scalar ops' constant (NeuSight drew one in (0, 1] per call)
LN_EPS = 1e-5


class NeuSightError(HespasError):
    """A NeuSight row that cannot be imported: ``<file>: row <n>: <problem>``."""


@dataclass(frozen=True)
class Measurement:
    """One NeuSight row: an operator of one shape timed once on one GPU."""

    op: str
    dims: tuple[int, ...]          # in the order of OPS[op]
    seconds: float
    device: str                    # as NeuSight wrote it
    path: str                      # file inside the NeuSight repository
    row: int                       # data row, 1 = the first row after the header
    torch: str = ""
    cuda: str = ""
    cudnn: str = ""
    kernel: str = ""               # the kernel NeuSight matched as the op's main one
    kernels: tuple[str, ...] = ()  # every kernel the call launched, where the file lists them
    launch: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def target(self) -> str:
        return DEVICES[self.device]

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(OPS[self.op], self.dims))

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        """What the module depends on: the operator and its shape."""
        return self.op, self.dims


# ------------------------------------------------------------------------------------------- reading

def _number(value: str, path: str, row: int, column: str) -> tuple[float, str]:
    """A cell as a number, and its text; NeuSightError for an empty or non-numeric cell."""
    text = (value or "").strip()
    if not text:
        raise NeuSightError(f"{path}: row {row}: column '{column}' is empty")
    try:
        return float(text), text
    except ValueError:
        raise NeuSightError(f"{path}: row {row}: column '{column}' is not a number: {text!r}") from None


def _whole(value: str, path: str, row: int, column: str) -> int:
    number, text = _number(value, path, row, column)
    if not math.isfinite(number) or number != int(number) or number < 0:
        raise NeuSightError(f"{path}: row {row}: column '{column}' is not a whole number >= 0: {text!r}")
    return int(number)


def _latency_ms(value: str, path: str, row: int) -> float:
    number, text = _number(value, path, row, "Latency")
    if not math.isfinite(number) or number <= 0:
        raise NeuSightError(f"{path}: row {row}: column 'Latency' must be a positive number of ms, got {text!r}")
    return number


def _check_dims(op: str, dims: tuple[int, ...], path: str, row: int) -> None:
    shape = dict(zip(OPS[op], dims))
    zero = [c for c in OPS[op] if shape[c] < 1 and c != "Padding"]
    if zero:
        raise NeuSightError(f"{path}: row {row}: column '{zero[0]}' must be at least 1, got {shape[zero[0]]}")
    if op == "conv":
        if shape["Input_Size"] + 2 * shape["Padding"] < shape["Kernel_Szie"]:
            raise NeuSightError(f"{path}: row {row}: a {shape['Kernel_Szie']}x{shape['Kernel_Szie']} kernel does "
                                f"not fit the padded {shape['Input_Size']}x{shape['Input_Size']} input")


def read_rows(text: str, path: str, op: str | None = None) -> list[Measurement]:
    """The rows of one NeuSight CSV (``text``; ``path`` names it in errors and in each row's source).
    ``op``: the operator the file must hold (its folder), None for any. Raises :class:`NeuSightError` on the
    first row that cannot be imported (unknown op or device, missing column, empty or non-numeric value)."""
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader)
    except StopIteration:
        raise NeuSightError(f"{path}: empty file (no header)") from None
    except csv.Error as exc:
        raise NeuSightError(f"{path}: header: malformed CSV ({exc})") from None
    header = [h.strip() for h in header]
    index = {name: i for i, name in enumerate(header)}
    missing = [c for c in COMMON_COLUMNS[:3] if c not in index]
    if missing:
        raise NeuSightError(f"{path}: header: no column '{missing[0]}' (a NeuSight operator CSV starts "
                            f"{', '.join(COMMON_COLUMNS[:3])}, …)")
    out: list[Measurement] = []
    n = 0
    try:
        for n, fields in enumerate(reader, start=1):
            if not fields or all(not f.strip() for f in fields):
                continue
            if len(fields) != len(header):
                raise NeuSightError(f"{path}: row {n}: {len(fields)} fields, the header has {len(header)}")
            get = dict(zip(header, fields))
            name = get["OPName"].strip()
            if name not in OPS:
                raise NeuSightError(f"{path}: row {n}: unknown op {name!r} (known: {', '.join(OPS)})")
            if op is not None and name != op:
                raise NeuSightError(f"{path}: row {n}: op {name!r} in a file of {op!r} rows")
            need = OPS[name]
            absent = [c for c in need if c not in index]
            if absent:
                raise NeuSightError(f"{path}: row {n}: no column '{absent[0]}' ({name} rows need "
                                    f"{', '.join(need)})")
            device = get["Device"].strip()
            if device not in DEVICES:
                raise NeuSightError(f"{path}: row {n}: unknown device {device!r} (known: {', '.join(DEVICES)})")
            dims = tuple(_whole(get[c], path, n, c) for c in need)
            _check_dims(name, dims, path, n)
            seconds = _latency_ms(get["Latency"], path, n) / 1000.0
            kernels = tuple(k.strip() for k in get.get("Kernels", "").split(";") if k.strip())
            launch = {}
            for c in LAUNCH_COLUMNS + ("Warps per SM", "Blocks per SM"):
                if get.get(c, "").strip():
                    try:
                        launch[c] = float(get[c])
                    except ValueError:
                        raise NeuSightError(f"{path}: row {n}: column '{c}' is not a number: {get[c]!r}") from None
            out.append(Measurement(op=name, dims=dims, seconds=seconds, device=device, path=path, row=n,
                                   torch=get.get("Torch Version", "").strip(), cuda=get.get("CUDA Version", "").strip(),
                                   cudnn=get.get("CUDNN Version", "").strip(),
                                   kernel=get.get("Kernel Name", "").strip(), kernels=kernels, launch=launch))
    except csv.Error as exc:
        raise NeuSightError(f"{path}: row {n + 1}: malformed CSV ({exc})") from None
    return out


def train_path(op: str, device: str) -> str:
    """The per-GPU file of ``op`` measured on ``device`` inside the NeuSight repository."""
    return f"{TRAIN_DIR}/{op}/{TORCH_DIR}/{device}.csv"


def test_path(op: str) -> str:
    return f"{TEST_DIR}/{op}.csv"


# ------------------------------------------------------------------------------------------- modules

def _t(*dims: int) -> str:
    return "tensor<" + "x".join(str(d) for d in dims) + ("x" if dims else "") + "f32>"


def conv_output(size: int, kernel: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - kernel) // stride + 1


def module_name(op: str, dims: tuple[int, ...]) -> str:
    """A file-name-safe name of the module of ``op`` at ``dims``, e.g. ``bmm_B6_M27_N21_K390``."""
    short = {"Input_Channel": "Cin", "Output_Channel": "Cout", "Kernel_Szie": "k", "Input_Size": "S",
             "Stride": "s", "Padding": "p"}
    return op + "".join(f"_{short.get(c, c)}{d}" for c, d in zip(OPS[op], dims))


def module_text(op: str, dims: tuple[int, ...]) -> str:
    """StableHLO text of one call of ``op`` at ``dims`` (f32), as jax's MLIR parser reads it."""
    if op not in OPS:
        raise NeuSightError(f"unknown op {op!r} (known: {', '.join(OPS)})")
    if len(dims) != len(OPS[op]):
        raise NeuSightError(f"{op}: expected {len(OPS[op])} dims ({', '.join(OPS[op])}), got {len(dims)}")
    body, args, result = _BUILDERS[op](op, *dims)
    name = module_name(op, dims)
    lines = [f"module @{name} attributes {{mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32}} {{",
             f"  func.func public @main({', '.join(f'%{n}: {t}' for n, t in args)}) -> {result} {{"]
    lines += [f"    {line}" for line in body]
    lines += ["  }", "}", ""]
    return "\n".join(lines)


def _bmm(_: str, b: int, m: int, n: int, k: int):
    x, y, out = _t(b, m, n), _t(b, n, k), _t(b, m, k)
    body = [f"%0 = stablehlo.dot_general %x, %y, batching_dims = [0] x [0], contracting_dims = [2] x [1] : "
            f"({x}, {y}) -> {out}",
            f"return %0 : {out}"]
    return body, [("x", x), ("y", y)], out


def _linear(_: str, b: int, m: int, n: int, k: int):
    rows = b * m
    x, w, bias, out = _t(rows, n), _t(k, n), _t(k), _t(rows, k)
    body = [f"%0 = stablehlo.dot_general %x, %w, contracting_dims = [1] x [1] : ({x}, {w}) -> {out}",
            f"%1 = stablehlo.broadcast_in_dim %bias, dims = [1] : ({bias}) -> {out}",
            f"%2 = stablehlo.add %0, %1 : {out}",
            f"return %2 : {out}"]
    return body, [("x", x), ("w", w), ("bias", bias)], out


def _conv(_: str, b: int, cin: int, cout: int, k: int, s: int, stride: int, pad: int):
    o = conv_output(s, k, stride, pad)
    x, w, out = _t(b, cin, s, s), _t(cout, cin, k, k), _t(b, cout, o, o)
    body = [f"%0 = stablehlo.convolution(%x, %w) dim_numbers = [b, f, 0, 1]x[o, i, 0, 1]->[b, f, 0, 1], "
            f"window = {{stride = [{stride}, {stride}], pad = [[{pad}, {pad}], [{pad}, {pad}]]}} "
            f"{{batch_group_count = 1 : i64, feature_group_count = 1 : i64}} : ({x}, {w}) -> {out}",
            f"return %0 : {out}"]
    return body, [("x", x), ("w", w)], out


def _softmax(_: str, b: int, h: int):
    x, row = _t(b, h), _t(b)
    body = [f"%ninf = stablehlo.constant dense<0xFF800000> : {_t()}",
            f"%zero = stablehlo.constant dense<0.000000e+00> : {_t()}",
            f"%0 = stablehlo.reduce(%x init: %ninf) applies stablehlo.maximum across dimensions = [1] : "
            f"({x}, {_t()}) -> {row}",
            f"%1 = stablehlo.broadcast_in_dim %0, dims = [0] : ({row}) -> {x}",
            f"%2 = stablehlo.subtract %x, %1 : {x}",
            f"%3 = stablehlo.exponential %2 : {x}",
            f"%4 = stablehlo.reduce(%3 init: %zero) applies stablehlo.add across dimensions = [1] : "
            f"({x}, {_t()}) -> {row}",
            f"%5 = stablehlo.broadcast_in_dim %4, dims = [0] : ({row}) -> {x}",
            f"%6 = stablehlo.divide %3, %5 : {x}",
            f"return %6 : {x}"]
    return body, [("x", x)], x


def _ln(_: str, b: int, h: int):
    x, row, vec = _t(b, h), _t(b), _t(h)
    body = [f"%zero = stablehlo.constant dense<0.000000e+00> : {_t()}",
            f"%inv_h = stablehlo.constant dense<{1.0 / h:.9e}> : {row}",
            f"%eps = stablehlo.constant dense<{LN_EPS:.9e}> : {row}",
            f"%0 = stablehlo.reduce(%x init: %zero) applies stablehlo.add across dimensions = [1] : "
            f"({x}, {_t()}) -> {row}",
            f"%1 = stablehlo.multiply %0, %inv_h : {row}",
            f"%2 = stablehlo.broadcast_in_dim %1, dims = [0] : ({row}) -> {x}",
            f"%3 = stablehlo.subtract %x, %2 : {x}",
            f"%4 = stablehlo.multiply %3, %3 : {x}",
            f"%5 = stablehlo.reduce(%4 init: %zero) applies stablehlo.add across dimensions = [1] : "
            f"({x}, {_t()}) -> {row}",
            f"%6 = stablehlo.multiply %5, %inv_h : {row}",
            f"%7 = stablehlo.add %6, %eps : {row}",
            f"%8 = stablehlo.rsqrt %7 : {row}",
            f"%9 = stablehlo.broadcast_in_dim %8, dims = [0] : ({row}) -> {x}",
            f"%10 = stablehlo.multiply %3, %9 : {x}",
            f"%11 = stablehlo.broadcast_in_dim %gamma, dims = [1] : ({vec}) -> {x}",
            f"%12 = stablehlo.multiply %10, %11 : {x}",
            f"%13 = stablehlo.broadcast_in_dim %beta, dims = [1] : ({vec}) -> {x}",
            f"%14 = stablehlo.add %12, %13 : {x}",
            f"return %14 : {x}"]
    return body, [("x", x), ("gamma", vec), ("beta", vec)], x


def _binary(op: str, b: int, h: int):
    x = _t(b, h)
    body = [f"%0 = stablehlo.{BINARY_OPS[op]} %x, %y : {x}", f"return %0 : {x}"]
    return body, [("x", x), ("y", x)], x


def _scalar(op: str, b: int, h: int):
    x = _t(b, h)
    body = [f"%c = stablehlo.constant dense<{SCALAR:.6e}> : {_t()}",
            f"%0 = stablehlo.broadcast_in_dim %c, dims = [] : ({_t()}) -> {x}",
            f"%1 = stablehlo.{SCALAR_OPS[op]} %x, %0 : {x}",
            f"return %1 : {x}"]
    return body, [("x", x)], x


def _unary(op: str, b: int, h: int):
    x = _t(b, h)
    if op == "tanh":
        body = [f"%0 = stablehlo.tanh %x : {x}", f"return %0 : {x}"]
    elif op == "relu":
        body = [f"%c = stablehlo.constant dense<0.000000e+00> : {_t()}",
                f"%0 = stablehlo.broadcast_in_dim %c, dims = [] : ({_t()}) -> {x}",
                f"%1 = stablehlo.maximum %x, %0 : {x}",
                f"return %1 : {x}"]
    else:                              # gelu, exact: x * (1 + erf(x / sqrt 2)) / 2
        body = [f"%half = stablehlo.constant dense<5.000000e-01> : {_t()}",
                f"%one = stablehlo.constant dense<1.000000e+00> : {_t()}",
                f"%rsqrt2 = stablehlo.constant dense<{1 / math.sqrt(2):.9e}> : {_t()}",
                f"%0 = stablehlo.broadcast_in_dim %rsqrt2, dims = [] : ({_t()}) -> {x}",
                f"%1 = stablehlo.multiply %x, %0 : {x}",
                f"%2 = chlo.erf %1 : {x} -> {x}",
                f"%3 = stablehlo.broadcast_in_dim %one, dims = [] : ({_t()}) -> {x}",
                f"%4 = stablehlo.add %2, %3 : {x}",
                f"%5 = stablehlo.multiply %x, %4 : {x}",
                f"%6 = stablehlo.broadcast_in_dim %half, dims = [] : ({_t()}) -> {x}",
                f"%7 = stablehlo.multiply %5, %6 : {x}",
                f"return %7 : {x}"]
    return body, [("x", x)], x


_BUILDERS = {"bmm": _bmm, "linear": _linear, "conv": _conv, "softmax": _softmax, "ln": _ln,
             **{op: _binary for op in BINARY_OPS}, **{op: _scalar for op in SCALAR_OPS},
             **{op: _unary for op in UNARY_OPS}}


# --------------------------------------------------------------------------------------------- costs

def _conv_taps(size: int, kernel: int, stride: int, pad: int) -> int:
    """Kernel taps over all output positions of one spatial dim that read a real (unpadded) input element."""
    return sum(1 for o in range(conv_output(size, kernel, stride, pad)) for j in range(kernel)
               if 0 <= o * stride - pad + j < size)


def op_cost(op: str, dims: tuple[int, ...]) -> tuple[float, float]:
    """``(flops, transcendentals)`` of one call of ``op`` at ``dims`` as the module writes it, counted the way
    the project's cost model (XLA's HloCostAnalysis conventions) counts them."""
    if op in ("bmm", "linear"):
        b, m, n, k = dims
        flops = 2.0 * b * m * n * k
        return (flops + b * m * k if op == "linear" else flops), 0.0
    if op == "conv":
        b, cin, cout, k, s, stride, pad = dims
        return 2.0 * b * cin * cout * _conv_taps(s, k, stride, pad) ** 2, 0.0
    b, h = dims
    n = float(b * h)
    if op == "softmax":                # max-reduce, subtract, exp, add-reduce, divide
        return 2 * (n - b) + 2 * n, n
    if op == "ln":                     # sum, scale, centre, square, sum, scale, +eps, rsqrt, normalise, affine
        return 2 * (n - b) + 3 * b + 5 * n, float(b)
    if op in ("pow", "powu", "tanh"):
        return 0.0, n
    if op == "gelu":                   # scale, erf, +1, times x, halve
        return 4 * n, n
    return n, 0.0


# ---------------------------------------------------------------------------------------------- labels

def label_meta(m: Measurement, others: Iterable[Measurement] = ()) -> dict[str, Any]:
    """A label's ``meta``: where its number comes from, the device and software it was measured with, the
    kernels, and any other row of the same shape on the same GPU (``also_measured``)."""
    meta: dict[str, Any] = {
        "source": {"repository": REPOSITORY, "path": m.path, "commit": COMMIT, "row": m.row},
        "device": m.device, "op": m.op, "shape": m.shape, "latency_ms": m.seconds * 1e3,
        "torch": m.torch, "cuda": m.cuda, "cudnn": m.cudnn,
        "kernel": m.kernel, "launch": m.launch, "note": LAUNCH_NOTE,
    }
    if m.kernels:                      # only the bmm, linear, conv and ln files list every kernel launched
        meta["kernels"] = list(m.kernels)
    extra = [{"path": o.path, "row": o.row, "seconds": o.seconds} for o in others]
    if extra:
        meta["also_measured"] = extra
    return meta


# -------------------------------------------------------------------------------------------- sampling

# Shapes per pool (an operator's training files, or "<op>-test": shapes only the test files hold) that the
# importer keeps by default; every GPU's measurement of a kept shape is kept.
DEFAULT_QUOTAS = {"bmm": 3000, "bmm-test": 1200, "linear": 1500, "linear-test": 600, "conv": 1500,
                  "softmax": 150, "ln": 150, **{op: 250 for op in (*BINARY_OPS, *SCALAR_OPS, *UNARY_OPS)}}
# Compute regions the fusion split cuts one module of the op into (1 unless listed): what a kept shape adds
# to the dataset's unique regions.
REGIONS_PER_MODULE = {"softmax": 4, "ln": 4}


def op_of_path(path: str) -> str | None:
    """The operator a NeuSight file holds, from its path (None when the path is neither layout)."""
    parts = path.split("/")
    if path.startswith(TRAIN_DIR + "/") and len(parts) >= 3 and parts[-3] in OPS:
        return parts[-3]
    if path.startswith(TEST_DIR + "/") and parts[-1].endswith(".csv") and parts[-1][:-4] in OPS:
        return parts[-1][:-4]
    return None


def is_test(m: Measurement) -> bool:
    return m.path.startswith(TEST_DIR + "/")


def group(measurements: Iterable[Measurement]) -> dict[tuple[str, tuple[int, ...]], list[Measurement]]:
    """Measurements by (op, shape): training files before test files, then file and row order."""
    out: dict[tuple[str, tuple[int, ...]], list[Measurement]] = {}
    for m in sorted(measurements, key=lambda m: (is_test(m), m.path, m.row)):
        out.setdefault(m.key, []).append(m)
    return out


def pool_of(key: tuple[str, tuple[int, ...]], rows: list[Measurement]) -> str:
    return key[0] if any(not is_test(m) for m in rows) else f"{key[0]}-test"


def io_bytes(op: str, dims: tuple[int, ...]) -> float:
    """f32 bytes of the module's inputs and output."""
    if op == "bmm":
        b, m, n, k = dims
        return 4.0 * b * (m * n + n * k + m * k)
    if op == "linear":
        b, m, n, k = dims
        return 4.0 * (b * m * n + k * n + k + b * m * k)
    if op == "conv":
        b, cin, cout, k, s, stride, pad = dims
        o = conv_output(s, k, stride, pad)
        return 4.0 * (b * cin * s * s + cout * cin * k * k + b * cout * o * o)
    b, h = dims
    inputs = 2 if op in BINARY_OPS else 1
    return 4.0 * (b * h * (inputs + 1) + (2 * h if op == "ln" else 0))


def stratum(op: str, dims: tuple[int, ...]) -> tuple[int, int]:
    """A shape's sampling stratum: half-decades of its larger of work and traffic, and factors of 4 of its
    arithmetic intensity (FLOPs and transcendentals per byte)."""
    flops = sum(op_cost(op, dims))
    traffic = io_bytes(op, dims)
    size = max(flops, traffic, 1.0)
    return int(math.floor(2 * math.log10(size))), int(math.floor(math.log2(max(flops, 1.0) / traffic) / 2))


def _order(key: tuple[str, tuple[int, ...]]) -> str:
    import hashlib
    return hashlib.sha256(repr(key).encode()).hexdigest()


def choose_shapes(groups: dict[tuple[str, tuple[int, ...]], list[Measurement]],
                  quotas: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    """Up to ``quotas[pool]`` shapes of each pool, taken round-robin over its strata (:func:`stratum`), each
    stratum in a fixed pseudo-random order (SHA-256 of the shape): the same files give the same choice."""
    pools: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for key, rows in groups.items():
        pools.setdefault(pool_of(key, rows), []).append(key)
    chosen: list[tuple[str, tuple[int, ...]]] = []
    for pool in sorted(pools):
        want = quotas.get(pool, 0)
        strata: dict[tuple[int, int], list[tuple[str, tuple[int, ...]]]] = {}
        for key in pools[pool]:
            strata.setdefault(stratum(*key), []).append(key)
        queues = [sorted(strata[s], key=_order) for s in sorted(strata)]
        taken = 0
        depth = 0
        while taken < want and any(depth < len(q) for q in queues):
            for q in queues:
                if depth < len(q) and taken < want:
                    chosen.append(q[depth])
                    taken += 1
            depth += 1
    return chosen


def scaled_quotas(max_regions: int | None) -> dict[str, int]:
    """:data:`DEFAULT_QUOTAS`, scaled down (never up) so that the kept shapes make at most ``max_regions``
    unique regions."""
    if max_regions is None:
        return dict(DEFAULT_QUOTAS)
    if max_regions < 1:
        raise NeuSightError(f"max_regions must be at least 1, got {max_regions}")
    cost = {pool: REGIONS_PER_MODULE.get(pool.removesuffix("-test"), 1) for pool in DEFAULT_QUOTAS}
    total = sum(DEFAULT_QUOTAS[p] * cost[p] for p in DEFAULT_QUOTAS)
    scale = min(1.0, max_regions / total)
    return {p: int(q * scale) for p, q in DEFAULT_QUOTAS.items()}


# ---------------------------------------------------------------------------------------------- import

STEP_EXTRA = ("meta",)


def _shown(path: Path) -> str:
    """``path`` relative to the working folder when inside it (no machine's absolute paths in tables)."""
    p = path.resolve()
    try:
        return str(p.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def read_files(files: dict[str, str]) -> list[Measurement]:
    """Every row of NeuSight files given as ``path -> text`` (paths inside the repository)."""
    out: list[Measurement] = []
    for path, text in files.items():
        op = op_of_path(path)
        if op is None:
            raise NeuSightError(f"{path}: not a NeuSight operator file ({TRAIN_DIR}/<op>/{TORCH_DIR}/<Device>.csv "
                                f"or {TEST_DIR}/<op>.csv)")
        out.extend(read_rows(text, path, op))
    return out


def import_neusight(files: dict[str, str], out_dir: str | os.PathLike[str], work_dir: str | os.PathLike[str],
                    *, quotas: dict[str, int] | None = None, workers: int = 1, progress: bool = False,
                    command: str = "", blobs: dict[str, str] | None = None) -> dict[str, Any]:
    """Write the measured dataset folder ``out_dir`` (replaced) from NeuSight files (``path -> text``).

    Chooses shapes (:func:`choose_shapes` with ``quotas``, default :data:`DEFAULT_QUOTAS`), writes their
    modules under ``work_dir/mlir``, builds them (fusion split, roofline on every target a kept row was
    measured on) in ``work_dir/build`` and adds one profiling label per (region, target) for every module
    that is one region; a module the split cuts into several regions (softmax, layer norm) is a whole
    program timed, so its rows go to ``steps.csv`` beside the roofline's sum over its regions. ``blobs``:
    the git blob id of each file, for the provenance. Returns the summary written into the manifest."""
    import shutil

    from hespas_ml.use.dataset import build_dataset
    from hespas_ml.label.dataset_cache import BuildCache
    from hespas_ml.label.dataset_spec import CAP_DEFAULTS, DatasetSpec, FidelitySpec, ProgramSpec, TargetRef
    from hespas_ml.label.dataset_tables import load_dataset
    from hespas_ml.label.measured import STEP_COLUMNS, csv_text, write_measured
    from hespas_ml.label.targets import load_target

    measurements = read_files(files)
    groups = group(measurements)
    quotas = dict(DEFAULT_QUOTAS if quotas is None else quotas)
    chosen = choose_shapes(groups, quotas)
    if not chosen:
        raise NeuSightError("no shape to import (no rows, or every quota is 0)")
    work = Path(work_dir)
    build = work / "build"
    changed = False
    programs: list[ProgramSpec] = []
    source_of: dict[tuple[str, tuple[int, ...]], str] = {}
    for op, dims in chosen:
        path = work / "mlir" / op / f"{module_name(op, dims)}.mlir"
        text = module_text(op, dims)
        if not path.is_file() or path.read_text() != text:
            changed = changed or path.is_file()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        source = _shown(path)
        source_of[(op, dims)] = source
        programs.append(ProgramSpec(source, f"neusight-{op}", f"neusight:{op}"))
    if changed:                        # a module's text changed: what the build cached for it is stale
        shutil.rmtree(build, ignore_errors=True)
    targets = sorted({m.target for key in chosen for m in groups[key]})
    for name in targets:
        load_target(name)              # every target is a preset that loads
    spec = DatasetSpec(path=Path(_shown(work)), name=Path(out_dir).name, split="fusion", programs=programs,
                       fidelities=[FidelitySpec("roofline", [TargetRef(t) for t in targets], {}, None, 512)],
                       caps=dict(CAP_DEFAULTS),
                       raw={"name": Path(out_dir).name, "split": "fusion",
                            "programs": f"{len(programs)} single-operation modules written by "
                                        f"eval/import_neusight.py from {REPOSITORY} at {COMMIT}",
                            "fidelities": {"roofline": {"targets": targets}}})
    build_dataset(spec, build, workers=workers, progress=progress)
    ds = load_dataset(build)
    with BuildCache(build) as cache:
        status = {s: st for (s, sp), st in cache.program_status().items() if sp == "fusion"}
        regions: dict[str, list[tuple[str, int]]] = {}
        for source, split, digest, occ, _ in cache.occurrences():
            if split == "fusion":
                regions.setdefault(source, []).append((digest, int(occ)))
    roofline = {(h, t): s for h, t, f, st, s in zip(ds.labels["hash"], ds.labels["target"], ds.labels["fidelity"],
                                                    ds.labels["status"], ds.labels["seconds"])
                if f == "roofline" and st == "ok"}
    reasons = dict(zip(ds.programs["source"], ds.programs["reason"]))
    label_rows: list[dict[str, Any]] = []
    step_rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    taken: dict[tuple[str, str], tuple[str, tuple[int, ...]]] = {}
    for key in chosen:
        source = source_of[key]
        parts = sorted(regions.get(source, []))
        if status.get(source) != "ok" or not parts:
            skipped.append({"module": source, "reason": reasons.get(source) or "no compute region"})
            continue
        by_target: dict[str, list[Measurement]] = {}
        for m in groups[key]:
            by_target.setdefault(m.target, []).append(m)
        single = len(parts) == 1 and parts[0][1] == 1
        for target, rows in sorted(by_target.items()):
            first, others = rows[0], rows[1:]
            meta = label_meta(first, others)
            if single:
                digest = parts[0][0]
                if (digest, target) in taken:       # two shapes, one module (linear with the same B*M)
                    skipped.append({"module": source, "reason": f"region also made by {taken[(digest, target)]}"})
                    continue
                taken[(digest, target)] = key
                label_rows.append({"hash": digest, "target": target, "fidelity": "profiling",
                                   "seconds": first.seconds, "noise": None, "status": "ok", "reason": "",
                                   "meta": json.dumps(meta, separators=(",", ":")), "label_s": None,
                                   "finished_at": None})
            else:
                roof = sum(n * roofline.get((h, target), math.nan) for h, n in parts)
                step_rows.append({"id": f"{module_name(*key)}@{target}", "source": source,
                                  "family": f"neusight-{key[0]}", "phase": "neusight", "target": target,
                                  "status": "ok", "reason": "", "step_s": first.seconds, "min_s": None,
                                  "iqr_s": None, "repeats": 25, "compile_s": None, "region_sum_s": 0.0,
                                  "region_sum_less_overhead_s": 0.0, "regions_covered": 0.0, "roofline_s": roof,
                                  "device": first.device, "measured_at": "",
                                  "meta": json.dumps(meta, separators=(",", ":"))})
    counts = _counts(label_rows, step_rows)
    summary = {"source": REPOSITORY, "commit": COMMIT, "licence": LICENCE, "rows_read": len(measurements),
               "shapes_available": len(groups), "shapes_chosen": len(chosen), "labels": len(label_rows),
               "steps": len(step_rows), "skipped": len(skipped), "targets": targets,
               "regions_unique": len(ds.regions), "quotas": quotas, "counts": counts}
    rows_in: dict[str, int] = {}
    for m in measurements:
        rows_in[m.path] = rows_in.get(m.path, 0) + 1
    provenance = {"repository": REPOSITORY, "commit": COMMIT, "licence": LICENCE,
                  "files": [{"path": p, "blob": (blobs or {}).get(p), "rows": rows_in.get(p, 0)}
                            for p in sorted(files)],
                  "devices": {d: DEVICES[d] for d in sorted({m.device for key in chosen for m in groups[key]})},
                  "software": sorted({f"torch {m.torch}, CUDA {m.cuda}, cuDNN {m.cudnn}"
                                      for key in chosen for m in groups[key]}),
                  "measurement": MEASUREMENT, "note": LAUNCH_NOTE, "quotas": quotas,
                  "sampling": "per pool, round-robin over strata (half-decades of max(FLOPs, bytes) x factors of 4 "
                              "of FLOPs per byte), each stratum in SHA-256 order of repr((op, dims))",
                  "skipped": skipped, "command": command}
    extra = {"README.md": readme(summary, provenance, counts, command),
             "provenance.json": json.dumps(provenance, indent=1),
             "steps.csv": csv_text(step_rows, STEP_COLUMNS + STEP_EXTRA)}
    write_measured(out_dir, build, label_rows, summary, extra)
    return summary


def _counts(label_rows: list[dict[str, Any]], step_rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """``{target: {op: rows}}`` over labels and whole-program rows together."""
    out: dict[str, dict[str, int]] = {}
    for row in label_rows + step_rows:
        op = json.loads(row["meta"])["op"]
        per = out.setdefault(row["target"], {})
        per[op] = per.get(op, 0) + 1
    return {t: dict(sorted(v.items())) for t, v in sorted(out.items())}


def readme(summary: dict[str, Any], provenance: dict[str, Any], counts: dict[str, dict[str, int]],
           command: str) -> str:
    """The measured folder's README: provenance, how the numbers were measured, what was kept, the command."""
    ops = [op for op in OPS if any(op in per for per in counts.values())]
    devices = provenance["devices"]
    lines = [f"# NeuSight GPU operator latencies (commit {COMMIT[:7]})", "",
             "Measured latencies of single PyTorch operators on NVIDIA GPUs, from the artifact of NeuSight, imported "
             "as `profiling` labels of single-operation StableHLO modules (f32, the measured shapes) by "
             "`eval/import_neusight.py`.", "",
             "## Provenance", "",
             f"- Repository: {REPOSITORY}, commit `{COMMIT}`.",
             f"- Licence: {LICENCE} (the repository's `LICENSE`). The measured numbers are theirs; no code or text "
             "of the repository is copied here. Cite NeuSight when you use these labels.",
             f"- Files: `{TRAIN_DIR}/<op>/{TORCH_DIR}/<Device>.csv` (one per operator and GPU) and "
             f"`{TEST_DIR}/{{bmm,linear}}.csv`; `provenance.json` lists every file read with its git blob id "
             "and row count.",
             "- Every label's `meta` names its source: `source` = {repository, path, commit, row} (row 1 is the first "
             "row after the header), the device as NeuSight wrote it, the torch / CUDA / cuDNN versions, the main "
             "kernel (`kernel`), every kernel launched (`kernels`, where the file lists them), the launch shape, "
             "and `also_measured` where the same shape was measured again on the same GPU (the first row is the "
             "label).",
             "", "## How NeuSight measured", "",
             f"- {MEASUREMENT}.",
             f"- Software as the files name it: {'; '.join(provenance['software'])} (every GPU).",
             "- Latency is per operator call, not per kernel: it covers every kernel the call launched and the gaps "
             "between them, so small operators sit on a launch floor of about 25 us. No floor is subtracted here; "
             "`seconds` = NeuSight's `Latency` (ms) / 1000.",
             "- Forward only. Inputs are `randn` (bmm, linear) or `zeros` (the others); the tensor-scalar ops "
             "(addu, mulu, divu, powu) used a scalar drawn in (0, 1] per call; the modules here use 0.5.", "",
             "## Devices and targets", "", "| NeuSight device | target preset |", "|---|---|"]
    lines += [f"| {d} | `{t}` |" for d, t in devices.items()]
    if "NVIDIA A100-PCIE-40GB" in devices:
        lines += ["", "`NVIDIA A100-PCIE-40GB` is labelled `A100-40GB`: that preset's datasheet figures (FP32 19.5 TF, "
                  "1,555 GB/s, 1410 MHz boost) are the PCIe card's too; the cards differ in power limit (250 W "
                  "vs 400 W)."]
    lines += ["", "## What was kept", "",
              f"{summary['rows_read']} rows read ({summary['shapes_available']} distinct operator shapes). To keep "
              f"the folder small, {summary['shapes_chosen']} shapes were chosen in all, a quota per pool (an "
              "operator's training files, or `<op>-test`: shapes only the test files hold), round-robin over strata "
              "of size (half-decades of max(FLOPs, bytes)) and arithmetic intensity (factors of 4), each stratum in "
              "SHA-256 order of the shape; every GPU's measurement of a chosen shape is kept. Quotas (shapes): "
              + ", ".join(f"{p} {q}" for p, q in summary["quotas"].items()) + ".", "",
              f"- {summary['labels']} profiling labels in `labels.parquet` (beside the roofline's labels of the same "
              f"regions on {', '.join(summary['targets'])}); {summary['regions_unique']} unique regions.",
              f"- {summary['steps']} whole-operator times in `steps.csv`: softmax and layer norm, which the fusion "
              "split cuts into several regions (reductions and their elementwise consumers) while PyTorch runs one "
              "kernel, are whole programs timed, set beside the roofline's sum over their regions (`roofline_s`).",
              f"- {summary['skipped']} chosen shapes skipped (see `provenance.json`).", "",
              "Rows per GPU and operator (labels and `steps.csv` together). H100 and L4 come from the test files "
              "only; the other GPUs from the training files and, for the test shapes chosen, the test files too:",
              "", "| target (NeuSight device) | " + " | ".join(ops) + " | all |", "|---|" + "---|" * (len(ops) + 1)]
    names = {t: ", ".join(d for d, dt in devices.items() if dt == t) for t in counts}
    for target, per in counts.items():
        lines.append(f"| `{target}` ({names[target]}) | " + " | ".join(str(per.get(op, 0)) for op in ops)
                     + f" | {sum(per.values())} |")
    lines += ["", "Not imported: the merged copies beside the per-GPU files, the elementwise, layer norm and "
              "softmax test files, the AMD data (`data/dataset_amd/`), and the whole-model times "
              "(`scripts/asplos/label/`), which are evaluation data."]
    if command:
        lines += ["", "## Command", "", "```", command.strip(), "```"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ command line

def git(mirror: str, *args: str) -> str:
    out = subprocess.run(["git", f"--git-dir={mirror}", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise NeuSightError(f"{mirror}: git {' '.join(args)}: {' '.join(out.stderr.split())[:300]}")
    return out.stdout


def neusight_files(mirror: str, commit: str) -> tuple[dict[str, str], dict[str, str]]:
    """``path -> text`` and ``path -> blob id`` of every operator file the importer reads."""
    listing = git(mirror, "ls-tree", "-r", commit, "--", TRAIN_DIR, TEST_DIR)
    blobs: dict[str, str] = {}
    for line in listing.splitlines():
        meta, path = line.split("\t", 1)
        _, kind, blob = meta.split()
        op = op_of_path(path)
        if kind != "blob" or op is None:
            continue
        if path.startswith(TRAIN_DIR + "/"):
            if f"/{TORCH_DIR}/" not in path:
                continue                 # merged copies beside the per-GPU files
        elif op not in TEST_OPS:
            continue
        blobs[path] = blob
    if not blobs:
        raise NeuSightError(f"{mirror}: no NeuSight operator files at {commit}")
    texts = {path: git(mirror, "cat-file", "blob", blob) for path, blob in sorted(blobs.items())}
    return texts, blobs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mirror", required=True, help="git directory of the NeuSight repository (bare is fine)")
    ap.add_argument("--out", required=True, help="measured dataset folder to write (replaced)")
    ap.add_argument("--work", default=None, help="modules and build (default: out/<name of --out>)")
    ap.add_argument("--max-regions", type=int, default=None,
                    help="scale the per-operator quotas down to at most this many unique regions")
    ap.add_argument("--workers", type=int, default=1, help="processes that split the modules (default 1)")
    args = ap.parse_args(argv)
    work = Path(args.work) if args.work else Path("out") / Path(args.out).name
    given = list(argv if argv is not None else sys.argv[1:])
    shown = ["NEUSIGHT_GIT_DIR" if a == args.mirror and i and given[i - 1] == "--mirror" else a
             for i, a in enumerate(given)]                       # the clone's place is this machine's
    command = "python eval/import_neusight.py " + " ".join(shlex.quote(a) for a in shown)
    started = time.perf_counter()
    try:
        texts, blobs = neusight_files(args.mirror, COMMIT)
        summary = import_neusight(texts, args.out, work, quotas=scaled_quotas(args.max_regions),
                                           workers=args.workers, progress=sys.stderr.isatty(), command=command,
                                           blobs=blobs)
    except HespasError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = {k: v for k, v in summary.items() if k not in ("quotas", "counts")}
    print(json.dumps({**summary, "seconds": round(time.perf_counter() - started, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
