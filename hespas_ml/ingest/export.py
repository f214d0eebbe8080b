"""Export JAX functions as StableHLO programs hespas-ml can ingest.

Two routes (see the reference notes on the stack, §2):

* :func:`export_jax` — ``jax.jit(fn).lower(...)`` as StableHLO text: the program as written, global
  shapes, with explicit collectives only where the function has them (``shard_map``, ``psum`` …).
* :func:`export_partitioned` — the compiler-partitioned form: XLA's SPMD partitioner runs at compile
  time, so the optimised HLO module is taken from the compiled executable and converted back to
  StableHLO bytecode with ``jax.extend.mlir.hlo_to_stablehlo``. Per-device shapes, the collectives
  XLA chose, ``mhlo.fusion`` / ``mhlo.copy`` ops.

Multi-device exports on a CPU-only machine need fake host devices, which XLA creates only if
``--xla_force_host_platform_device_count=N`` is set before jax initialises its backends:
:func:`ensure_host_devices` arranges that, or says clearly why it cannot.
"""
from __future__ import annotations

import io
import os
import re
import sys
from typing import Any, Callable

from .errors import HespasError
from .graph import ROLES_ATTR

_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


class ExportError(HespasError):
    """A JAX function could not be exported (or the process cannot provide the devices it needs)."""


def _requested_host_devices() -> int:
    """The host device count XLA_FLAGS asks for (1 when it asks nothing)."""
    m = _COUNT_FLAG.search(os.environ.get("XLA_FLAGS", ""))
    return int(m.group(1)) if m else 1


def with_host_device_flag(flags: str, n: int) -> str:
    """``flags`` (an XLA_FLAGS value) with the fake host device count set to ``n``."""
    if _COUNT_FLAG.search(flags):
        return _COUNT_FLAG.sub(f"--xla_force_host_platform_device_count={n}", flags)
    return f"{flags} --xla_force_host_platform_device_count={n}".strip()


def ensure_host_devices(n: int) -> None:
    """Make at least ``n`` CPU devices available to jax in this process.

    Before jax has initialised its backends this sets the device count (in ``XLA_FLAGS`` when jax is
    not imported yet, else through ``jax_num_cpu_devices``). Afterwards it can only check: with fewer
    devices it raises :class:`ExportError` naming the fix.
    """
    if not isinstance(n, int) or n < 1:
        raise ExportError(f"ensure_host_devices: need a positive device count, got {n!r}")
    if "jax" not in sys.modules:
        if _requested_host_devices() < n:
            os.environ["XLA_FLAGS"] = with_host_device_flag(os.environ.get("XLA_FLAGS", ""), n)
        return
    import jax

    try:
        from jax._src import xla_bridge  # no public way to ask without initialising the backends

        initialised = xla_bridge.backends_are_initialized()
    except Exception:
        initialised = True
    if not initialised:
        configured = getattr(jax.config, "jax_num_cpu_devices", -1)
        current = configured if configured >= 0 else _requested_host_devices()
        if current < n:
            try:
                jax.config.update("jax_num_cpu_devices", n)
            except (AttributeError, KeyError):   # older jax: the flag is still read at backend start
                os.environ["XLA_FLAGS"] = with_host_device_flag(os.environ.get("XLA_FLAGS", ""), n)
        return
    try:
        have = len(jax.devices("cpu"))
    except RuntimeError:
        have = 0
    if have < n:
        raise ExportError(
            f"jax is already initialised with {have} CPU device(s) but {n} are needed: set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before jax is imported, "
            "or export in a fresh process")


def _label(fn: Callable, name: str | None) -> str:
    return name or getattr(fn, "__name__", None) or type(fn).__name__


def _symbol_name(name: str) -> str:
    """A module symbol name MLIR accepts unquoted."""
    clean = re.sub(r"[^\w.$-]", "_", name)
    return clean if re.match(r"[A-Za-z_]", clean) else f"m_{clean}"


def export_jax(fn: Callable, *example_args: Any, name: str | None = None,
               argument_roles: list[tuple[str, int]] | None = None) -> str:
    """StableHLO text of ``jax.jit(fn)`` lowered for ``example_args`` (arrays or ShapeDtypeStructs).

    An already jitted ``fn`` keeps its own options. ``name`` renames the module (``module @name``).
    ``argument_roles``: what main's arguments hold, as (role, how many arguments) in order; written as the
    module attribute ``hespas.argument_roles``, which ingest reads back.
    """
    import jax

    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    try:
        text = jitted.lower(*example_args).as_text()
    except Exception as exc:
        raise ExportError(f"cannot export {_label(fn, name)}: {type(exc).__name__}: "
                          f"{(str(exc).splitlines() or [''])[0][:300]}") from exc
    if name:
        text = re.sub(r"^(\s*module\s+)@(?:\"[^\"]*\"|[\w.$-]+)", rf"\g<1>@{_symbol_name(name)}", text,
                      count=1, flags=re.M)
    if argument_roles:
        roles = ",".join(f"{role}:{n}" for role, n in argument_roles if n)
        head = re.search(r"^(\s*module\s+@(?:\"[^\"]*\"|[\w.$-]+))(\s+attributes\s*\{)?", text, flags=re.M)
        if head is not None:
            attr = f'{ROLES_ATTR} = "{roles}"'
            text = (text[:head.end()] + f" {attr}," + text[head.end():] if head.group(2)
                    else text[:head.end()] + f" attributes {{{attr}}}" + text[head.end():])
    return text


def export_partitioned(fn: Callable, *example_args: Any, in_shardings: Any, out_shardings: Any = None,
                       name: str | None = None) -> bytes:
    """MLIR bytecode of the per-device program XLA's SPMD partitioner makes of ``fn``.

    ``in_shardings`` / ``out_shardings`` are as for ``jax.jit`` (None: let XLA choose the outputs').
    The devices the shardings name must exist (see :func:`ensure_host_devices`).
    """
    import jax
    import jax.extend.mlir  # noqa: F401  (jax.extend is not imported by ``import jax``)

    options = {"in_shardings": in_shardings}
    if out_shardings is not None:
        options["out_shardings"] = out_shardings
    try:
        lowered = jax.jit(fn, **options).lower(*example_args)
        compiled = lowered.compile(compiler_options=PARTITIONER_OPTIONS)
        hlo_modules = compiled.runtime_executable().hlo_modules()
        proto = hlo_modules[0].as_serialized_hlo_module_proto()
        bytecode = jax.extend.mlir.hlo_to_stablehlo(proto)
        shardings = jax.tree.leaves(compiled.input_shardings)
        n_devices = max((len(sh.device_set) for sh in shardings), default=1)
    except Exception as exc:
        raise ExportError(f"cannot export {_label(fn, name)} partitioned: {type(exc).__name__}: "
                          f"{(str(exc).splitlines() or [''])[0][:300]}") from exc
    return _annotated_bytecode(bytecode, name, n_devices)


# Options for the partitioner's compile. Replica groups as device lists, not mesh axes: with mesh-axes
# groups (XLA's default) hlo_to_stablehlo turns a partitioner-chosen all_to_all into an mhlo.all_to_all
# that no MLIR parser accepts (jaxlib 0.10.2). No LLVM optimisation of machine code nobody runs: the same
# HLO, exported 1.5-2x faster.
PARTITIONER_OPTIONS = {"xla_enable_rgv3_materialization": False, "xla_backend_optimization_level": 0}


def _annotated_bytecode(bytecode: bytes, name: str | None, n_devices: int) -> bytes:
    """The partitioned module renamed to ``name`` and declaring its device count: hlo_to_stablehlo drops
    ``mhlo.num_partitions``, without which a reader cannot place partition-id device groups."""
    from jax.extend.mlir import ir
    from jax.interpreters import mlir as jmlir

    with jmlir.make_ir_context():
        module = ir.Module.parse(bytecode)
        if name:
            module.operation.attributes["sym_name"] = ir.StringAttr.get(_symbol_name(name))
        i32 = ir.IntegerType.get_signless(32)
        module.operation.attributes["mhlo.num_partitions"] = ir.IntegerAttr.get(i32, n_devices)
        module.operation.attributes["mhlo.num_replicas"] = ir.IntegerAttr.get(i32, 1)
        buf = io.BytesIO()
        module.operation.write_bytecode(buf)
        return buf.getvalue()
