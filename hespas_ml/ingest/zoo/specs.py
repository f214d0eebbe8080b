"""The zoo's families by name, and the spec strings that name their programs (see the package docstring)."""
from __future__ import annotations

from typing import Any

from ..errors import IngestError
from . import gpt, llama, mlp, moe, vit
from . import cnn, micro_conv, micro_matmul, micro_vector
from . import dlrm, unet
from . import convnext, efficientnet, mobilenet, swin
from .base import MAX_PARTITIONED_DEVICES, ParamValue, ZooEntry

ZOO: dict[str, ZooEntry] = {entry.name: entry for entry in (
    mlp.ENTRY,
    llama.ENTRY,
    gpt.ENTRY,
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
    if entry.host_devices(params) > MAX_PARTITIONED_DEVICES:
        raise IngestError(text, f"a compiler-partitioned program runs on at most {MAX_PARTITIONED_DEVICES} devices "
                                f"(XLA partitions for devices that exist); use an explicit strategy")
    return family, params


def named_params(spec: str) -> set[str]:
    """The parameters ``spec`` names itself (the others take their defaults)."""
    query = spec.strip()[len(PREFIX):].partition("?")[2]
    return {name for item in query.split("&") if (name := item.partition("=")[0].strip())}


def with_default_devices(spec: str, devices: int) -> str:
    """``spec`` with ``devices=N`` added when the family takes a device count and the spec names none."""
    family, _, query = spec.strip()[len(PREFIX):].partition("?")
    entry = ZOO.get(family.strip())
    if entry is None or entry.param("devices") is None or "devices" in named_params(spec):
        return spec
    return spec.strip() + ("&" if query.strip() else "?") + f"devices={devices}"


def canonical_spec(family: str, params: dict[str, ParamValue]) -> str:
    """The one spelling of a program: every parameter (an optional one only off its default), in
    declaration order."""
    entry = ZOO[family]
    return PREFIX + family + "?" + "&".join(f"{p.name}={p.format(params[p.name])}" for p in entry.params
                                            if not (p.optional and params[p.name] == p.default))
