"""The program zoo: StableHLO programs named by a spec string, usable anywhere a ``.mlir`` path is.

A spec is ``zoo:<family>[?name=value&name=value…]``, e.g. ``zoo:mlp`` or
``zoo:mlp?layers=4&width=1024&batch=256&dtype=bf16&step=train&devices=4&parallel=dp``.
Unnamed parameters take the family's defaults.

Programs are exported by JAX in a fresh process (it needs its own fake host devices, and the
calling process may already have initialised jax) and cached under ``$HESPAS_ML_CACHE/zoo``
(default ``~/.cache/hespas-ml/zoo``), keyed by the canonical spec, the generator code, the jax version
and the exporting processor. Same spec → same bytes on one machine; the compiler-partitioned forms
(``parallel=*-partitioned``) are XLA:CPU's optimised programs and may differ between processors.

Adding a family: write a module with a :class:`ZooEntry` (parameters + generator) and add it to
:data:`ZOO` below.
"""
from __future__ import annotations

from typing import Any

from ..errors import IngestError
from . import llama, mlp, moe, vit
from . import cnn, micro_conv, micro_matmul, micro_vector
from . import dlrm, unet
from . import convnext, efficientnet, mobilenet, swin
from .base import ParamValue, ZooEntry, ZooParam

ZOO: dict[str, ZooEntry] = {entry.name: entry for entry in (
    mlp.ENTRY,
    llama.ENTRY,
    vit.ENTRY,
    moe.ENTRY,
    cnn.ENTRY,
    unet.ENTRY,
    dlrm.ENTRY,
    mobilenet.ENTRY,
    efficientnet.ENTRY,
    convnext.ENTRY,
    swin.ENTRY,
    *micro_matmul.ENTRIES,
    *micro_conv.ENTRIES,
    *micro_vector.ENTRIES,
)}

PREFIX = "zoo:"


def is_zoo_spec(source: Any) -> bool:
    """Whether ``source`` is a zoo spec string (as opposed to a path)."""
    return isinstance(source, str) and source.strip().startswith(PREFIX)


def parse_zoo_spec(spec: str) -> tuple[str, dict[str, ParamValue]]:
    """``(family, params)`` of a spec, every parameter present (defaults filled in) and typed.

    Raises :class:`IngestError` naming the spec for an unknown family or parameter, a repeated
    parameter, or a bad value.
    """
    text = spec.strip() if isinstance(spec, str) else ""
    if not text.startswith(PREFIX):
        raise IngestError(str(spec), f"a zoo spec starts with '{PREFIX}' (e.g. zoo:mlp)")
    family, _, query = text[len(PREFIX):].partition("?")
    family = family.strip()
    known = ", ".join(sorted(ZOO))
    if not family:
        raise IngestError(text, f"names no family (known families: {known})")
    entry = ZOO.get(family)
    if entry is None:
        raise IngestError(text, f"unknown zoo family '{family}' (known families: {known})")
    params = entry.defaults()
    seen: set[str] = set()
    for item in query.split("&") if query.strip() else []:
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not key:
            raise IngestError(text, f"empty parameter in '{query}'")
        param = entry.param(key)
        if param is None:
            names = ", ".join(p.name for p in entry.params)
            raise IngestError(text, f"{family} has no parameter '{key}' (parameters: {names})")
        if not eq or not value:
            raise IngestError(text, f"parameter '{key}' has no value (write {key}=VALUE)")
        if key in seen:
            raise IngestError(text, f"parameter '{key}' is given twice")
        seen.add(key)
        try:
            params[key] = param.parse(value)
        except ValueError as exc:
            raise IngestError(text, str(exc)) from None
    if entry.check is not None:
        problem = entry.check(params)
        if problem:
            raise IngestError(text, problem)
    return family, params


def with_default_devices(spec: str, devices: int) -> str:
    """``spec`` with ``devices=N`` added when the family takes a device count and the spec names none."""
    family, _, query = spec.strip()[len(PREFIX):].partition("?")
    entry = ZOO.get(family.strip())
    if entry is None or entry.param("devices") is None:
        return spec
    if any(item.partition("=")[0].strip() == "devices" for item in query.split("&")):
        return spec
    return spec.strip() + ("&" if query.strip() else "?") + f"devices={devices}"


def canonical_spec(family: str, params: dict[str, ParamValue]) -> str:
    """The one spelling of a program: every parameter, in declaration order."""
    entry = ZOO[family]
    return PREFIX + family + "?" + "&".join(f"{p.name}={p.format(params[p.name])}" for p in entry.params)


def zoo_program(spec: str) -> str | bytes:
    """The StableHLO of a zoo program (text or bytecode), exported on first use and cached."""
    from .cache import cached_program

    family, params = parse_zoo_spec(spec)
    return cached_program(family, params, spec.strip())


def load_zoo(spec: str):
    """Ingest a zoo program into an :class:`~hespas_ml.ingest.graph.OpGraph`."""
    from ..stablehlo import parse_module

    family, params = parse_zoo_spec(spec)
    data = zoo_program(spec)
    entry = ZOO[family]
    changed = [f"{p.name}{p.format(params[p.name])}" for p in entry.params if params[p.name] != p.default]
    name = "_".join([family, *changed])
    # The cache verified the bytes against the checksum written when this machine exported them.
    return parse_module(data, source=spec.strip(), name=name, trusted=True)


__all__ = ["ZOO", "ZooEntry", "ZooParam", "canonical_spec", "is_zoo_spec", "load_zoo", "parse_zoo_spec",
           "with_default_devices", "zoo_program"]
