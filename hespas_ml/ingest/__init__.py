"""Ingest: a StableHLO program (a ``.mlir`` file, text or bytecode, or a ``zoo:`` spec) → :class:`OpGraph`.

Importing this package does not import jax; jax is imported when something is parsed or exported.
"""
from __future__ import annotations

from pathlib import Path

from .errors import IngestError
from .graph import Loop, Op, OpGraph, TensorType
from .stablehlo import parse_file, parse_module


def load_program(source: str | Path, devices: int | None = None) -> OpGraph:
    """Ingest ``source``: a path to a ``.mlir`` file (text or MLIR bytecode) or a ``zoo:`` spec.

    ``devices`` is the device count of the system the program will run on: a zoo spec that does not
    name its ``devices`` is generated for that many (a file keeps the devices it was exported for).
    """
    from .zoo import is_zoo_spec, load_zoo, with_default_devices

    if is_zoo_spec(source):
        spec = str(source)
        if devices is not None:
            spec = with_default_devices(spec, devices)
        return load_zoo(spec)
    if isinstance(source, str) and not source.strip():
        raise IngestError("<empty>", "no program given (a .mlir path or a zoo: spec)")
    return parse_file(source)


def check_program(source: str | Path, devices: int | None = None) -> None:
    """Refuse, in one line and before any slow work, a program that :func:`load_program` cannot read: a
    zoo spec whose family or parameters are wrong (for ``devices`` when it names none), a path that is
    not a readable file."""
    from .zoo import is_zoo_spec, parse_zoo_spec, with_default_devices

    if is_zoo_spec(source):
        parse_zoo_spec(with_default_devices(str(source), devices) if devices is not None else str(source))
        return
    if isinstance(source, str) and not source.strip():
        raise IngestError("<empty>", "no program given (a .mlir path or a zoo: spec)")
    path = Path(source)
    if not path.exists():
        raise IngestError(str(path), "no such file")
    if path.is_dir():
        raise IngestError(str(path), "is a directory, not an MLIR file")


__all__ = ["IngestError", "Loop", "Op", "OpGraph", "TensorType", "check_program", "load_program", "parse_file",
           "parse_module"]
