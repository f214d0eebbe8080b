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
:data:`~hespas_ml.ingest.zoo.specs.ZOO`.
"""
from __future__ import annotations

from .base import ZooEntry, ZooParam
from .cache import cached_program
from .specs import ZOO, canonical_spec, is_zoo_spec, parse_zoo_spec, with_default_devices


def zoo_program(spec: str) -> str | bytes:
    """The StableHLO of a zoo program (text or bytecode), exported on first use and cached."""
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
