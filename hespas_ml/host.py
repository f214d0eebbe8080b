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
