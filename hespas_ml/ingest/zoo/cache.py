"""Exporting zoo programs in a fresh process, and the on-disk cache of exported programs.

An entry is ``<key>.mlir`` (text) or ``<key>.mlirbc`` (bytecode) plus ``<key>.json`` recording the
spec, versions and the program's SHA-256. The JSON is written last, so an entry without it (or whose
program no longer matches its checksum) is treated as absent and exported again.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ... import host
from ..errors import IngestError
from ..export import with_host_device_flag
from .specs import ZOO, canonical_spec

FORMAT_VERSION = 1
EXPORT_TIMEOUT_S = 900


def cache_dir() -> Path:
    """Where exported zoo programs live: ``<cache root>/zoo`` (see :func:`hespas_ml.host.cache_dir`)."""
    return host.cache_dir() / "zoo"


@functools.lru_cache(maxsize=1)
def exporter_fingerprint() -> str:
    """Hash of the code that writes zoo programs (the zoo package and the exporter).

    Part of every cache key, so that an edit to a generator or to the export path can never be answered
    by a program exported by the older code (a cache that outlives a checkout, as on a CI machine).
    """
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted([*here.glob("*.py"), here.parent / "export.py"]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def cache_key(family: str, params: dict[str, Any]) -> str:
    """Hash of the canonical spec, the family's generator version, the exporting code, jax/jaxlib and
    the exporting processor."""
    ident = "|".join([canonical_spec(family, params), f"family-v{ZOO[family].version}",
                      f"code={exporter_fingerprint()}", f"cpu={host.cpu_fingerprint()}",
                      f"jax={host.package_version('jax')}", f"jaxlib={host.package_version('jaxlib')}",
                      f"format={FORMAT_VERSION}"])
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def cached_program(family: str, params: dict[str, Any], source: str) -> str | bytes:
    """The cached program, exported (and stored) first when missing or damaged."""
    directory = cache_dir()
    key = cache_key(family, params)
    data = _read_entry(directory, key)
    if data is not None:
        return data
    data = export_in_subprocess(family, params, source)
    _write_entry(directory, key, canonical_spec(family, params), data)
    return data


def _read_entry(directory: Path, key: str) -> str | bytes | None:
    try:
        meta = json.loads((directory / f"{key}.json").read_text())
        suffix = ".mlirbc" if meta["kind"] == "bytecode" else ".mlir"
        raw = (directory / f"{key}{suffix}").read_bytes()
        if hashlib.sha256(raw).hexdigest() != meta["sha256"]:
            return None
        return raw if meta["kind"] == "bytecode" else raw.decode("utf-8")
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


def _write_entry(directory: Path, key: str, spec: str, data: str | bytes) -> None:
    """Store atomically (temp file + rename); a cache that cannot be written is not an error."""
    raw = data if isinstance(data, bytes) else data.encode("utf-8")
    kind = "bytecode" if isinstance(data, bytes) else "text"
    meta = {"spec": spec, "kind": kind, "sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw),
            "jax": host.package_version("jax"), "jaxlib": host.package_version("jaxlib"),
            "format": FORMAT_VERSION}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _atomic_write(directory / f"{key}{'.mlirbc' if kind == 'bytecode' else '.mlir'}", raw)
        _atomic_write(directory / f"{key}.json", json.dumps(meta, indent=1).encode())
    except OSError:
        pass


def _atomic_write(path: Path, raw: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def export_in_subprocess(family: str, params: dict[str, Any], source: str) -> str | bytes:
    """Run the family's generator in a fresh Python with the fake host devices it needs."""
    devices = ZOO[family].host_devices(params)
    env = dict(os.environ)
    env["XLA_FLAGS"] = with_host_device_flag(env.get("XLA_FLAGS", ""), max(1, devices))
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_ENABLE_X64", None)    # the cache key assumes jax's default dtypes
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="hespas-zoo-") as tmp:
        out = Path(tmp) / "program"
        request = json.dumps({"family": family, "params": params, "out": str(out)})
        try:
            proc = subprocess.run([sys.executable, "-m", "hespas_ml.ingest.zoo._export_worker", request],
                                  capture_output=True, text=True, env=env, timeout=EXPORT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise IngestError(source, f"export did not finish within {EXPORT_TIMEOUT_S} s") from None
        if proc.returncode != 0:
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            why = next((ln[len("EXPORT-ERROR "):] for ln in reversed(lines) if ln.startswith("EXPORT-ERROR ")),
                       lines[-1] if lines else f"exit status {proc.returncode}")
            raise IngestError(source, f"export failed: {why[:400]}")
        meta = json.loads(out.with_suffix(".json").read_text())
        raw = out.read_bytes()
        return raw if meta["kind"] == "bytecode" else raw.decode("utf-8")
