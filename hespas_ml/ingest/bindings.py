"""Access to the MLIR Python bindings that ship in jaxlib, and small helpers every ingest module shares.

jax is imported lazily (:func:`mlir`): importing it costs about a second, and most of hespas-ml never
needs it.
"""
from __future__ import annotations

import re
from typing import Any

_MLIR: tuple[Any, Any, Any] | None = None   # (jmlir, ir, stablehlo dialect module)


def mlir() -> tuple[Any, Any, Any]:
    """``(jax.interpreters.mlir, jax.extend.mlir.ir, the stablehlo dialect module)``, imported once."""
    global _MLIR
    if _MLIR is None:
        from jax.extend.mlir import ir
        from jax.extend.mlir.dialects import stablehlo as sh
        from jax.interpreters import mlir as jmlir

        _MLIR = (jmlir, ir, sh)
    return _MLIR


def describe_mlir_error(exc: Exception) -> str:
    """One line for an ``ir.MLIRError``: its first diagnostic with its line and column when known."""
    diags = getattr(exc, "error_diagnostics", None) or []
    if diags:
        d = diags[0]
        loc = re.search(r':(\d+):(\d+)\)', str(d.location))
        where = f"line {loc.group(1)}, column {loc.group(2)}: " if loc and loc.group(1) != "0" else ""
        msg = (d.message.splitlines() or ["parse failed"])[0][:300]
        return f"not valid MLIR ({where}{msg})"
    text = [t for t in str(exc).splitlines() if t.strip()]
    return f"not valid MLIR ({(text[-1] if text else 'parse failed')[:300]})"


def text_of(attr) -> str:
    """The text of a string or symbol attribute. Bytecode can hold bytes that are not UTF-8, which
    the bindings cannot convert: then the printed (escaped) spelling is used, e.g. ``m\\E3in``."""
    try:
        value = attr.value
        if isinstance(value, str):
            return value
    except (RuntimeError, UnicodeDecodeError, AttributeError):
        pass
    text = str(attr).lstrip("@")
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text


def line_of(op) -> str:
    """``line N`` of an operation's source location, or ``an unknown line``."""
    try:
        where = str(op.location)
    except Exception:
        return "an unknown line"
    m = re.search(r':(\d+):(\d+)', where)
    return f"line {m.group(1)}" if m and m.group(1) != "0" else "an unknown line"


# Terminators: not ops of the graph.
TERMINATORS = frozenset({"func.return", "stablehlo.return", "mhlo.return", "sdy.return", "mpmd.return"})
