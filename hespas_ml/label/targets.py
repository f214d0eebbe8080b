"""Hardware targets: what one accelerator can do, for the labelling fidelities.

A :class:`Target` holds the peak rates (matrix units and vector units, per MLIR element type), the memory
system and, for TPU-like chips, the systolic arrays that SCALE-Sim simulates. Presets are data files, one
YAML per target in ``hespas_ml/label/targets/``, each naming its sources. A user file with the same schema
can be loaded by path.

``host-cpu`` is special: :func:`load_target` returns figures *measured on this machine through XLA*
(:func:`measure_host_cpu`), cached as YAML so the micro-benchmark runs once per machine and jax version.
jax is imported only when that measurement runs.

YAML schema (numbers may be written as ``1555e9``; PyYAML reads that as a string, which is accepted)::

    name: H100                       # canonical name
    aliases: [h100, H100-SXM]        # optional; matched case-insensitively, ignoring - _ . and spaces
    description: ...
    matrix_flops: {bf16: 989.5e12}   # FLOP/s of the matrix units per element type (may be empty)
    vector_flops: {f32: 67e12}       # FLOP/s of the vector units per element type (must include f32)
    mem_bw: 3.35e12                  # bytes/s
    mem_capacity: 85899345920        # bytes
    onchip_mem: 52428800             # bytes
    onchip_mem_kind: L2              # optional: which on-chip memory onchip_mem counts
    clock_hz: 1.98e9
    systolic: null                   # or {rows, cols, count, dataflow, ifmap_sram_kb, filter_sram_kb,
                                     #     ofmap_sram_kb}
    sources: [...]                   # non-empty list
    notes: ...
    f32_matmul: tf32                 # optional: the matrix rate f32 dots and convolutions run at under
                                     #   XLA's default precision (TF32 on NVIDIA Ampere and later)
    calibration: {...}               # optional: efficiencies measured on the device, for the calibrated
                                     #   roofline (hespas_ml.label.calibration)
    hespas_node: H100_80GB           # optional: the Hespas node folder this preset corresponds to
    hespas_differences: {f64: why}   # optional: Hespas roofline entries we knowingly disagree with
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import yaml

from ..host import cache_dir, cpu_model, package_version, schedulable_cores
from ..ingest.errors import HespasError
from .calibration import Calibration, CalibrationError, calibration_from_mapping

PRESET_DIR = Path(__file__).with_name("targets")
HOST_CPU = "host-cpu"
DATAFLOWS = ("ws", "os", "is")
UNITS = ("matrix", "vector")

# Element types a YAML may give rates for (MLIR spellings; si*/ui* are folded onto i*).
F8_TYPES = ("f8E4M3FN", "f8E5M2", "f8E4M3", "f8E3M4", "f8E4M3FNUZ", "f8E5M2FNUZ", "f8E4M3B11FNUZ",
            "f8E8M0FNU")
F6_TYPES = ("f6E3M2FN", "f6E2M3FN")
F4_TYPES = ("f4E2M1FN",)
KNOWN_DTYPES = ("f64", "f32", "tf32", "bf16", "f16", *F8_TYPES, *F6_TYPES, *F4_TYPES,
                "i64", "i32", "i16", "i8", "i4", "i2", "i1")

# The dtypes whose peaks make up Target.to_vector(), in this order.
VECTOR_DTYPES = ("f64", "f32", "tf32", "bf16", "f16", "f8E4M3FN", "i8")

_SPELLINGS = {
    "float64": "f64", "fp64": "f64", "double": "f64", "float32": "f32", "fp32": "f32", "float": "f32",
    "float16": "f16", "fp16": "f16", "half": "f16", "bfloat16": "bf16", "fp8": "f8E4M3FN",
    "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "i8", "int4": "i4",
    "pred": "i1", "bool": "i1", "tensorfloat32": "tf32",
}
_CANONICAL_BY_LOWER = {d.lower(): d for d in KNOWN_DTYPES}

_REQUIRED_KEYS = ("name", "matrix_flops", "vector_flops", "mem_bw", "mem_capacity", "onchip_mem",
                  "clock_hz", "sources")
_OPTIONAL_KEYS = ("description", "notes", "aliases", "systolic", "onchip_mem_kind", "hespas_node",
                  "hespas_differences", "measured", "f32_matmul", "calibration")
_SYSTOLIC_KEYS = ("rows", "cols", "count", "dataflow", "ifmap_sram_kb", "filter_sram_kb", "ofmap_sram_kb")


class TargetError(HespasError, ValueError):
    """A hardware target could not be found or its description is invalid (one-line message)."""


@dataclass(frozen=True)
class Systolic:
    """The systolic arrays of a TPU-like chip, as SCALE-Sim describes one array (``count`` per chip)."""

    rows: int
    cols: int
    count: int                 # arrays (MXUs) per target
    dataflow: str              # "ws" | "os" | "is"
    ifmap_sram_kb: int         # SCALE-Sim's per-array input, filter and output buffers
    filter_sram_kb: int
    ofmap_sram_kb: int

    @property
    def macs_per_cycle(self) -> int:
        """Multiply-accumulates per clock over all arrays."""
        return self.rows * self.cols * self.count


@dataclass(frozen=True)
class Target:
    """One accelerator (or the host CPU) as the analytical, SCALE-Sim and learned fidelities see it."""

    name: str
    description: str
    matrix_flops: dict[str, float]
    vector_flops: dict[str, float]
    mem_bw: float
    mem_capacity: float
    onchip_mem: float
    clock_hz: float
    systolic: Systolic | None
    sources: tuple[str, ...]
    notes: str
    onchip_mem_kind: str = ""
    aliases: tuple[str, ...] = ()
    hespas_node: str | None = None
    hespas_differences: dict[str, str] = field(default_factory=dict)
    measured: dict[str, Any] = field(default_factory=dict)
    f32_matmul: str | None = None      # matrix rate of f32 dots/convolutions at XLA's default precision
    calibration: Calibration | None = None   # efficiencies measured on the device (calibrated roofline)

    def __hash__(self) -> int:  # the dict fields are not hashable; equal targets share these fields
        return hash((self.name, self.description, self.mem_bw, self.mem_capacity, self.clock_hz))

    def peak_flops(self, dtype: str, unit: str = "matrix") -> float:
        """Peak FLOP/s an op of element type ``dtype`` gets on ``unit`` ("matrix" or "vector").

        Spellings are normalised (``si32``/``ui32`` -> ``i32``, ``bfloat16`` -> ``bf16``). When the
        unit has no rate for the type, types that the hardware would run it as are tried in turn
        (fp8 -> other fp8 -> f16 -> bf16, i1/i4 -> i8 -> i32, f64 -> f32, ...), ending with ``f32``; for
        each candidate the matrix rate is used when asked for and present, else the vector rate.
        """
        if unit not in UNITS:
            raise TargetError(f"target {self.name}: unit must be one of {', '.join(UNITS)}, got {unit!r}")
        for candidate in fallback_dtypes(dtype):
            if unit == "matrix" and candidate in self.matrix_flops:
                return self.matrix_flops[candidate]
            if candidate in self.vector_flops:
                return self.vector_flops[candidate]
        return self.vector_flops["f32"]  # unreachable for validated targets: f32 is required

    def matrix_type(self, dtype: str) -> str:
        """The element type matrix work on ``dtype`` runs as under XLA's default precision: ``f32_matmul``
        for f32 where the target names one (NVIDIA GPUs since Ampere use TF32 for f32 dots and
        convolutions), else ``dtype`` itself. A program that asks for the highest precision is not told
        apart."""
        dtype = normalize_dtype(dtype)
        return self.f32_matmul if dtype == "f32" and self.f32_matmul else dtype

    def op_rate(self, dtype: str, unit: str = "matrix") -> float:
        """FLOP/s an op of element type ``dtype`` runs at on ``unit`` as XLA compiles it by default: the
        unit's :meth:`peak_flops` for the type it runs as (:meth:`matrix_type` on the matrix unit)."""
        return self.peak_flops(self.matrix_type(dtype) if unit == "matrix" else dtype, unit)

    def to_vector(self) -> dict[str, float]:
        """A flat numeric description for conditioning a learned model on the hardware.

        log10 of the matrix and vector peaks for :data:`VECTOR_DTYPES` (after fallback), of memory
        bandwidth, capacity and on-chip memory; clock in GHz; log2 of the systolic rows/cols/count and a
        one-hot dataflow (all zero without systolic arrays). Keys always come in the same order.
        """
        out: dict[str, float] = {}
        for unit in UNITS:
            for dtype in VECTOR_DTYPES:
                out[f"log10_{unit}_flops_{dtype}"] = math.log10(self.peak_flops(dtype, unit))
        out["log10_mem_bw"] = math.log10(self.mem_bw)
        out["log10_mem_capacity"] = math.log10(self.mem_capacity)
        out["log10_onchip_mem"] = math.log10(self.onchip_mem) if self.onchip_mem > 0 else 0.0
        out["clock_ghz"] = self.clock_hz / 1e9
        sa = self.systolic
        out["log2_systolic_rows"] = math.log2(sa.rows) if sa else 0.0
        out["log2_systolic_cols"] = math.log2(sa.cols) if sa else 0.0
        out["log2_systolic_count"] = math.log2(sa.count) if sa else 0.0
        for flow in DATAFLOWS:
            out[f"dataflow_{flow}"] = 1.0 if sa is not None and sa.dataflow == flow else 0.0
        return out


# --------------------------------------------------------------------------------------------- dtypes

def normalize_dtype(dtype: str) -> str:
    """The canonical MLIR spelling of an element type (``si32``/``ui32`` -> ``i32``, ``BF16`` -> ``bf16``)."""
    text = str(dtype).strip()
    lower = text.lower()
    if lower in _SPELLINGS:
        return _SPELLINGS[lower]
    match = re.fullmatch(r"[su]i(\d+)", lower)
    if match:
        return f"i{match.group(1)}"
    return _CANONICAL_BY_LOWER.get(lower, text)


def fallback_dtypes(dtype: str) -> tuple[str, ...]:
    """``dtype`` (normalised) followed by the types to try when a target has no rate for it, ending in f32."""
    d = normalize_dtype(dtype)
    if d in F8_TYPES:
        chain = [d, *F8_TYPES, "f16", "bf16"]
    elif d in F6_TYPES:  # narrow floats run as a wider narrow float, never a narrower one
        chain = [d, *F6_TYPES, *F8_TYPES, "f16", "bf16"]
    elif d in F4_TYPES:
        chain = [d, *F4_TYPES, *F6_TYPES, *F8_TYPES, "f16", "bf16"]
    elif d in ("i1", "i2", "i4"):
        chain = [d, "i8", "i32"]
    elif d in ("i8", "i16", "i64"):
        chain = [d, "i32"]
    elif d == "f16":  # TPUs have no f16 units: XLA runs f16 matmuls on the bf16 MXU (bf16 stays bf16:
        chain = [d, "bf16"]  # Volta has no bf16 at all and upcasts it to f32)
    elif d.startswith("complex<") and d.endswith(">"):
        chain = [d, normalize_dtype(d[len("complex<"):-1])]
    else:
        chain = [d]
    if chain[-1] != "f32":
        chain.append("f32")
    return tuple(dict.fromkeys(chain))


# -------------------------------------------------------------------------------------------- parsing

def _number(value: Any, origin: str, key: str, *, allow_zero: bool = False) -> float:
    """A finite positive number from a YAML value (numeric strings such as ``1555e9`` accepted)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TargetError(f"{origin}: key '{key}' must be a number, got {value!r}")
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except ValueError:
        raise TargetError(f"{origin}: key '{key}' must be a number, got {value!r}") from None
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        bound = "non-negative" if allow_zero else "positive"
        raise TargetError(f"{origin}: key '{key}' must be a {bound} number, got {value!r}")
    return number


def _integer(value: Any, origin: str, key: str) -> int:
    number = _number(value, origin, key)
    if number != int(number):
        raise TargetError(f"{origin}: key '{key}' must be a whole number, got {value!r}")
    return int(number)


def _text(value: Any, origin: str, key: str, *, required: bool = False) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (required and not value.strip()):
        raise TargetError(f"{origin}: key '{key}' must be a non-empty string, got {value!r}")
    return value.strip()


def _string_list(value: Any, origin: str, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise TargetError(f"{origin}: key '{key}' must be a list of non-empty strings")
    return tuple(v.strip() for v in value)


def _rates(value: Any, origin: str, key: str) -> dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TargetError(f"{origin}: key '{key}' must be a mapping of element type to FLOP/s")
    rates: dict[str, float] = {}
    for raw, rate in value.items():
        dtype = normalize_dtype(str(raw))
        if dtype not in KNOWN_DTYPES:
            raise TargetError(f"{origin}: key '{key}.{raw}' is not a known element type "
                              f"(known: {', '.join(KNOWN_DTYPES)})")
        if dtype in rates:
            raise TargetError(f"{origin}: key '{key}.{raw}' repeats element type {dtype}")
        rates[dtype] = _number(rate, origin, f"{key}.{raw}")
    return rates


def _systolic(value: Any, origin: str) -> Systolic | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TargetError(f"{origin}: key 'systolic' must be a mapping or null")
    for key in _SYSTOLIC_KEYS:
        if key not in value:
            raise TargetError(f"{origin}: key 'systolic.{key}' is missing")
    unknown = sorted(set(value) - set(_SYSTOLIC_KEYS))
    if unknown:
        raise TargetError(f"{origin}: unknown key 'systolic.{unknown[0]}'")
    dataflow = value["dataflow"]
    if dataflow not in DATAFLOWS:
        raise TargetError(f"{origin}: key 'systolic.dataflow' must be one of {', '.join(DATAFLOWS)}, "
                          f"got {dataflow!r}")
    ints = {k: _integer(value[k], origin, f"systolic.{k}") for k in _SYSTOLIC_KEYS if k != "dataflow"}
    return Systolic(dataflow=dataflow, **ints)


def target_from_mapping(data: Any, origin: str) -> Target:
    """Validate one parsed target description; ``origin`` (a file name) prefixes every error."""
    if not isinstance(data, dict):
        raise TargetError(f"{origin}: a target file must hold a mapping, got {type(data).__name__}")
    for key in _REQUIRED_KEYS:
        if key not in data:
            raise TargetError(f"{origin}: key '{key}' is missing")
    unknown = sorted(set(data) - set(_REQUIRED_KEYS) - set(_OPTIONAL_KEYS))
    if unknown:
        raise TargetError(f"{origin}: unknown key '{unknown[0]}'")
    vector = _rates(data["vector_flops"], origin, "vector_flops")
    if "f32" not in vector:
        raise TargetError(f"{origin}: key 'vector_flops.f32' is missing (every target needs an f32 rate)")
    sources = _string_list(data["sources"], origin, "sources")
    if not sources:
        raise TargetError(f"{origin}: key 'sources' must list at least one source")
    differences = data.get("hespas_differences") or {}
    if not isinstance(differences, dict) or not all(isinstance(v, str) and v.strip()
                                                    for v in differences.values()):
        raise TargetError(f"{origin}: key 'hespas_differences' must map Hespas keys to reasons (strings)")
    measured = data.get("measured") or {}
    if not isinstance(measured, dict):
        raise TargetError(f"{origin}: key 'measured' must be a mapping")
    hespas_node = data.get("hespas_node")
    try:
        calibration = (calibration_from_mapping(data["calibration"], origin)
                       if data.get("calibration") is not None else None)
    except CalibrationError as exc:
        raise TargetError(str(exc)) from None
    matrix = _rates(data["matrix_flops"], origin, "matrix_flops")
    f32_matmul = data.get("f32_matmul")
    if f32_matmul is not None and f32_matmul not in matrix:
        raise TargetError(f"{origin}: key 'f32_matmul' names {f32_matmul!r}, which matrix_flops has no rate for")
    return Target(
        name=_text(data["name"], origin, "name", required=True),
        description=_text(data.get("description"), origin, "description"),
        matrix_flops=matrix,
        vector_flops=vector,
        mem_bw=_number(data["mem_bw"], origin, "mem_bw"),
        mem_capacity=_number(data["mem_capacity"], origin, "mem_capacity"),
        onchip_mem=_number(data["onchip_mem"], origin, "onchip_mem", allow_zero=True),
        clock_hz=_number(data["clock_hz"], origin, "clock_hz"),
        systolic=_systolic(data.get("systolic"), origin),
        sources=sources,
        notes=_text(data.get("notes"), origin, "notes"),
        onchip_mem_kind=_text(data.get("onchip_mem_kind"), origin, "onchip_mem_kind"),
        aliases=_string_list(data.get("aliases"), origin, "aliases"),
        hespas_node=_text(hespas_node, origin, "hespas_node", required=True) if hespas_node else None,
        hespas_differences={str(k): v.strip() for k, v in differences.items()},
        measured=dict(measured),
        f32_matmul=str(f32_matmul) if f32_matmul is not None else None,
        calibration=calibration,
    )


def _read_yaml(path: Path) -> Any:
    """Parse one YAML file; a missing or malformed file is a one-line TargetError naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TargetError(f"{path}: no such target file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TargetError(f"{path}: cannot read target file ({exc})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise TargetError(f"{path}: malformed YAML{where}: {problem}") from None


def read_target_file(path: str | os.PathLike[str]) -> Target:
    """Load a target YAML file as written (no host measurement)."""
    path = Path(path)
    return target_from_mapping(_read_yaml(path), str(path))


# -------------------------------------------------------------------------------------------- presets

@functools.lru_cache(maxsize=None)
def _read_preset(path: str) -> Target:
    """A shipped preset, parsed once per process (presets are package files; a Target is immutable)."""
    return read_target_file(path)


def _alias_key(name: str) -> str:
    return re.sub(r"[\s_.\-]+", "", name.lower())


@lru_cache(maxsize=1)
def _preset_index() -> tuple[dict[str, Path], tuple[str, ...]]:
    """Alias key -> preset file, and the canonical names, read from the preset folder once."""
    index: dict[str, Path] = {}
    names: list[str] = []
    for path in sorted(PRESET_DIR.glob("*.yaml")):
        data = _read_yaml(path)
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise TargetError(f"{path}: key 'name' is missing")
        names.append(data["name"])
        for alias in [data["name"], *(data.get("aliases") or [])]:
            key = _alias_key(str(alias))
            if index.get(key, path) != path:
                raise TargetError(f"{path}: alias {alias!r} is also used by {index[key].name}")
            index[key] = path
    return index, tuple(sorted(names, key=str.lower))


def list_targets() -> list[str]:
    """Canonical names of the preset targets."""
    return list(_preset_index()[1])


def preset_path(name: str) -> Path | None:
    """The YAML file of the preset called ``name`` (or one of its aliases), or None."""
    return _preset_index()[0].get(_alias_key(name))


def load_target(name_or_path: str | os.PathLike[str]) -> Target:
    """A preset by name or alias (case-insensitive), or a user YAML file by path.

    ``host-cpu`` (and its aliases) returns the figures measured on this machine (see
    :func:`measure_host_cpu`); loading ``host-cpu.yaml`` by path gives its fallback values instead.
    """
    text = os.fspath(name_or_path)
    looks_like_path = text.endswith((".yaml", ".yml")) or os.sep in text or "/" in text
    preset = None if looks_like_path else preset_path(text)
    if preset is not None:
        if preset.stem == HOST_CPU:
            return measure_host_cpu()
        return _read_preset(str(preset))
    if looks_like_path or Path(text).is_file():
        return read_target_file(text)
    raise TargetError(f"unknown hardware target {text!r}; known presets: {', '.join(list_targets())} "
                      f"(or give a path to a target YAML file)")


# ------------------------------------------------------------------------------------------- host cpu

def _host_facts() -> dict[str, float]:
    """Memory size, last-level cache size and clock of this machine, where the OS tells them."""
    facts: dict[str, float] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                facts["mem_capacity"] = float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    caches = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"))
    sizes = []
    for size_file in caches:
        match = re.fullmatch(r"(\d+)([KMG]?)", size_file.read_text().strip())
        if match:
            sizes.append(int(match.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[match.group(2)])
    if sizes:
        facts["onchip_mem"] = float(max(sizes))
    freq = Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
    try:
        facts["clock_hz"] = float(freq.read_text()) * 1e3
    except (OSError, ValueError):
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.lower().startswith("cpu mhz"):
                    facts["clock_hz"] = float(line.split(":", 1)[1]) * 1e6
                    break
        except (OSError, ValueError):
            pass
    return facts


def _best_seconds(fn: Callable[[], Any], reps: int) -> float:
    """Fastest of ``reps`` timed calls of ``fn`` (which must block until its result is ready)."""
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _run_host_benchmarks() -> dict[str, Any]:
    """Time a GEMM, an elementwise FMA chain and a streaming add through XLA on the host CPU."""
    import jax
    import jax.numpy as jnp

    cpu = jax.devices("cpu")[0]
    started = time.perf_counter()
    out: dict[str, Any] = {}

    matmul = jax.jit(lambda a, b: a @ b)

    def gemm_rate(dtype: Any) -> tuple[float, int]:
        def run(n: int, reps: int) -> float:
            a = jax.device_put(jnp.full((n, n), 0.5, dtype), cpu)
            b = jax.device_put(jnp.full((n, n), 0.25, dtype), cpu)
            matmul(a, b).block_until_ready()  # compile and warm
            return _best_seconds(lambda: matmul(a, b).block_until_ready(), reps)

        probe = run(512, 2)
        rate = 2 * 512**3 / probe
        n = int(round((rate * 0.1 / 2) ** (1 / 3) / 256)) * 256  # ~100 ms per call
        n = max(256, min(4096, n))
        return 2 * n**3 / run(n, 3), n

    out["matrix_f32"], out["gemm_n_f32"] = gemm_rate(jnp.float32)
    try:
        out["matrix_bf16"], out["gemm_n_bf16"] = gemm_rate(jnp.bfloat16)
    except Exception as exc:  # noqa: BLE001 - a backend without bf16 dots just lacks the figure
        out["matrix_bf16"], out["bf16_error"] = None, f"{type(exc).__name__}: {exc}".splitlines()[0]

    steps, n_vec = 32, 1 << 18

    def fma_chain(x: Any, a: Any, b: Any, iters: Any) -> Any:
        def body(_: Any, v: Any) -> Any:
            for _ in range(steps):
                v = v * a + b
            return v
        return jax.lax.fori_loop(0, iters, body, x)

    chain = jax.jit(fma_chain)
    x = jax.device_put(jnp.full((n_vec,), 0.5, jnp.float32), cpu)
    a, b = jnp.float32(0.999), jnp.float32(1e-3)
    chain(x, a, b, 1).block_until_ready()
    probe = _best_seconds(lambda: chain(x, a, b, 4).block_until_ready(), 2)
    iters = max(4, int(4 * 0.05 / probe))  # ~50 ms per call
    seconds = _best_seconds(lambda: chain(x, a, b, iters).block_until_ready(), 3)
    out["vector_f32"] = 2 * steps * n_vec * iters / seconds
    out["vector_elements"], out["vector_iterations"] = n_vec, iters

    n_bw = 1 << 25  # 128 MiB per f32 array, well beyond any last-level cache
    y = jax.device_put(jnp.full((n_bw,), 1.0, jnp.float32), cpu)
    bytes_moved = 3 * 4 * n_bw  # read two arrays, write one
    add_fresh = jax.jit(lambda p, q: p + q)
    add_fresh(y, y).block_until_ready()
    out["mem_bw_fresh_output"] = bytes_moved / _best_seconds(lambda: add_fresh(y, y).block_until_ready(), 3)
    add_in_place = jax.jit(lambda p, q: p + q, donate_argnums=0)
    state = {"acc": jax.device_put(jnp.zeros((n_bw,), jnp.float32), cpu)}

    def step() -> None:
        state["acc"] = add_in_place(state["acc"], y)
        state["acc"].block_until_ready()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "donated buffers were not usable" on backends without donation
        step()
        out["mem_bw"] = bytes_moved / _best_seconds(step, 5)
    out["mem_bw_array_bytes"] = 4 * n_bw
    out["jaxlib_version"] = package_version("jaxlib")
    out["benchmark_seconds"] = round(time.perf_counter() - started, 3)
    return out


def _host_cache_path(key: str) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", key.lower()).strip("-")[:60]
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    return cache_dir() / f"{HOST_CPU}-{slug}-{digest}.yaml"


def _host_key() -> tuple[str, int, str, str]:
    model, cores, version = cpu_model(), schedulable_cores(), package_version("jax")
    return model, cores, version, f"{model} | {cores} cores | jax {version}"


def host_cpu_cache_path() -> Path:
    """The file this machine's host-cpu measurement is cached in (it may not exist yet)."""
    return _host_cache_path(_host_key()[3])


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _measured_mapping(fallback: dict[str, Any], bench: dict[str, Any], model: str, cores: int,
                      version: str, key: str) -> dict[str, Any]:
    """The host-cpu target description built from the fallback file and the measurement."""
    facts = _host_facts()
    data = dict(fallback)
    data["description"] = f"{model}, {cores} cores, as XLA runs on it (jax {version})"
    data["matrix_flops"] = {"f32": bench["matrix_f32"]}
    if bench.get("matrix_bf16"):
        data["matrix_flops"]["bf16"] = bench["matrix_bf16"]
    data["vector_flops"] = {"f32": bench["vector_f32"]}
    data["mem_bw"] = bench["mem_bw"]
    for name in ("mem_capacity", "onchip_mem", "clock_hz"):
        if name in facts:
            data[name] = facts[name]
    if "onchip_mem" in facts:
        data["onchip_mem_kind"] = "largest CPU cache (LLC) seen by cpu0"
    data["sources"] = [
        "measured on this machine through XLA by hespas_ml.label.targets.measure_host_cpu "
        "(jax.jit GEMM, fused FMA chain, donated streaming add; best of several runs)",
        "/proc/cpuinfo, /proc/meminfo, /sys/devices/system/cpu/cpu0/{cache,cpufreq}",
    ]
    data["notes"] = (
        "Measured through XLA on this machine; best of several runs, so a busy machine reads low. "
        f"mem_bw is a streaming add into a donated buffer; with a freshly allocated output XLA reached "
        f"{bench['mem_bw_fresh_output'] / 1e9:.1f} GB/s (first-touch page faults of large buffers). "
        "Rates for element types not measured fall back as Target.peak_flops describes.")
    data["measured"] = {"key": key, "cpu_model": model, "cores": cores, "cpu_count": os.cpu_count(),
                        "jax_version": version, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                              time.gmtime()),
                        **{k: v for k, v in bench.items() if v is not None}}
    return data


def _write_atomically(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            yaml.safe_dump(data, handle, sort_keys=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


_HOST_TARGETS: dict[str, tuple[tuple[int, int], Target]] = {}   # cache file -> ((mtime, size), its Target)


def measure_host_cpu(force: bool = False) -> Target:
    """The host-cpu target with figures measured through XLA on this machine, cached per machine.

    The cache file (YAML, under :func:`cache_dir`) is keyed by cpu model, schedulable core count and jax
    version. A cached result is reused unless ``force`` (parsed once per process while the file is
    unchanged); a corrupt cache file is re-measured with a warning. If the measurement itself fails, a
    warning is issued and the fallback values of ``host-cpu.yaml`` are returned (and nothing is cached).
    """
    model, cores, version, key = _host_key()
    path = _host_cache_path(key)
    try:
        stat = path.stat()
        stamp = (stat.st_mtime_ns, stat.st_size)
    except OSError:
        stamp = None
    if not force and stamp is not None:
        hit = _HOST_TARGETS.get(str(path))
        if hit is not None and hit[0] == stamp:          # parsed before in this process, file unchanged
            return hit[1]
        try:
            cached = target_from_mapping(_read_yaml(path), str(path))
            if cached.measured.get("key") != key:
                raise TargetError(f"{path}: key 'measured.key' does not match {key!r}")
            _HOST_TARGETS[str(path)] = (stamp, cached)
            return cached
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with the cache, measure again
            warnings.warn(f"corrupt host-cpu cache, re-measuring: {exc}", RuntimeWarning, stacklevel=2)
    fallback_path = PRESET_DIR / f"{HOST_CPU}.yaml"
    fallback = _read_yaml(fallback_path)
    load = _load_average()                               # 1-minute load before measuring
    try:
        bench = _run_host_benchmarks()
    except Exception as exc:  # noqa: BLE001 - no jax / no cpu backend: fall back, never crash
        warnings.warn(f"host-cpu measurement failed ({type(exc).__name__}: {exc}); using the fallback "
                      f"values of {fallback_path}", RuntimeWarning, stacklevel=2)
        return target_from_mapping(fallback, str(fallback_path))
    bench["load_average"] = load
    data = _measured_mapping(fallback, bench, model, cores, version, key)
    target = target_from_mapping(data, f"measured host-cpu ({key})")
    if load is not None and load > 0.5 * cores:
        warnings.warn(f"{path}: host-cpu measured while this machine was busy (1-minute load {load:.2f} on {cores} "
                      "cores): its rates may read low, and they are cached for this machine; re-measure when it is "
                      "quiet with: hespas-ml host-cpu --measure", RuntimeWarning, stacklevel=2)
    try:
        _write_atomically(path, data)
    except OSError as exc:
        warnings.warn(f"{path}: cannot write the host-cpu cache ({exc})", RuntimeWarning, stacklevel=2)
    return target
