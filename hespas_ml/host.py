"""The machine this process runs on: the cache folder, the processor, the cores and installed versions.

Everything measured or compiled here (host-cpu figures, profiling labels, compiler-partitioned zoo
programs) is cached under :func:`cache_dir` and keyed by what this module reports, so that a cache
copied to another machine never answers for it.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

CACHE_ENV = "HESPAS_ML_CACHE"


def cache_dir() -> Path:
    """Root of every hespas-ml cache: ``$HESPAS_ML_CACHE`` or ``~/.cache/hespas-ml``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "hespas-ml"


def _cpuinfo() -> dict[str, str]:
    """The first value of each field of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, sep, value = line.partition(":")
            if sep:
                fields.setdefault(name.strip().lower(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The processor's model name, e.g. ``AMD EPYC 7B13``."""
    info = _cpuinfo()
    return (info.get("model name") or info.get("cpu model") or platform.processor() or platform.machine()
            or "unknown cpu")


@functools.lru_cache(maxsize=1)
def cpu_fingerprint() -> str:
    """Hash of the architecture, model name and instruction-set flags of the processor.

    XLA:CPU's passes choose by the processor's features, so what it compiles here may differ on a
    processor of another kind.
    """
    info = _cpuinfo()
    flags = " ".join(sorted((info.get("flags") or info.get("features") or "").split()))
    ident = "|".join([platform.system(), platform.machine(), cpu_model(), flags])
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def schedulable_cores() -> int:
    """Cores this process may run on (what XLA's CPU thread pool sizes itself by)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def package_version(package: str) -> str:
    """An installed package's version without importing it (importing jax is slow); ``absent`` if none."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


@functools.lru_cache(maxsize=1)
def machine_identity() -> dict[str, str | int]:
    """Who measured: host name, processor (model and :func:`cpu_fingerprint`), cores, memory, kernel and a
    hash of the machine id (``/etc/machine-id``), so that measurements say which machine took them."""
    try:
        machine_id = Path("/etc/machine-id").read_text().strip()
    except OSError:
        machine_id = ""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        memory = 0
    return {"hostname": platform.node(), "cpu": cpu_model(), "cpu_fingerprint": cpu_fingerprint(),
            "cores": os.cpu_count() or 1, "memory_gb": round(memory / 2**30, 1), "kernel": platform.release(),
            "machine_id": hashlib.sha256(machine_id.encode()).hexdigest()[:16] if machine_id else "unknown"}


GPU_QUERY = ("name", "uuid", "driver_version", "vbios_version", "pci.bus_id", "memory.total", "clocks.sm",
             "clocks.mem", "clocks.max.sm", "clocks.max.mem", "power.limit", "temperature.gpu", "pstate")


@functools.lru_cache(maxsize=1)
def gpu_facts() -> dict[str, str] | None:
    """The first NVIDIA GPU as ``nvidia-smi`` reports it (name, driver, clocks in MHz, power limit …, and
    the CUDA version the driver supports); None where there is no ``nvidia-smi`` or it fails."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(GPU_QUERY)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode != 0 or not out.stdout.strip():
            return None
        values = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
        facts = {k.replace(".", "_"): v for k, v in zip(GPU_QUERY, values)}
        banner = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in banner.splitlines():
        if "CUDA Version" in line:
            facts["cuda_version"] = line.split("CUDA Version:")[1].split()[0].strip("|")
            break
    return facts


def machine_name() -> str:
    """This machine in a few words, as measured step times record it: ``AMD EPYC (2 cores)``."""
    return f"{cpu_model()} ({schedulable_cores()} cores)"
