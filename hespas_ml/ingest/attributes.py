"""Decoding MLIR attributes into plain Python values (the forms are listed in :mod:`.stablehlo`'s docstring).

Device groups (``replica_groups``) are decoded by :mod:`.device_groups`, which needs the program's mesh
and device counts; everything else is decoded here, op by op, without context.
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

from .bindings import mlir, text_of

# Attributes no stage reads (layouts, shardings, opaque backend configs): not decoded.
SKIPPED_ATTRS = frozenset({"mhlo.sharding", "mhlo.frontend_attributes", "sdy.sharding", "backend_config",
                           "output_operand_aliases", "result_layout", "operand_layouts", "mhlo.backend_config",
                           "sdy.sharding_rule", "xla_shape", "precision_config", "sdy.sharding_per_value"})


def decode(key: str, attr, opname: str) -> Any:
    """The plain form of attribute ``key`` of an op named ``opname`` (may raise on malformed input)."""
    _, ir, sh = mlir()
    if key == "value" and isinstance(attr, ir.DenseElementsAttr):
        if attr.is_splat:
            return scalar_of(attr.get_splat_value())
        return None
    if key == "dot_dimension_numbers":
        d = sh.DotDimensionNumbers(attr)
        return {"lhs_batch": list(d.lhs_batching_dimensions), "rhs_batch": list(d.rhs_batching_dimensions),
                "lhs_contract": list(d.lhs_contracting_dimensions),
                "rhs_contract": list(d.rhs_contracting_dimensions)}
    if key == "dimension_numbers" and "convolution" in opname:
        d = sh.ConvDimensionNumbers(attr)
        return {"input_batch": d.input_batch_dimension, "input_feature": d.input_feature_dimension,
                "input_spatial": list(d.input_spatial_dimensions),
                "kernel_input_feature": d.kernel_input_feature_dimension,
                "kernel_output_feature": d.kernel_output_feature_dimension,
                "kernel_spatial": list(d.kernel_spatial_dimensions),
                "output_batch": d.output_batch_dimension, "output_feature": d.output_feature_dimension,
                "output_spatial": list(d.output_spatial_dimensions)}
    if key == "dimension_numbers" and "gather" in opname:
        d = sh.GatherDimensionNumbers(attr)
        return {"offset_dims": list(d.offset_dims), "collapsed_slice_dims": list(d.collapsed_slice_dims),
                "operand_batching_dims": list(d.operand_batching_dims),
                "start_indices_batching_dims": list(d.start_indices_batching_dims),
                "start_index_map": list(d.start_index_map), "index_vector_dim": d.index_vector_dim}
    if key == "scatter_dimension_numbers":
        d = sh.ScatterDimensionNumbers(attr)
        return {"update_window_dims": list(d.update_window_dims),
                "inserted_window_dims": list(d.inserted_window_dims),
                "input_batching_dims": list(d.input_batching_dims),
                "scatter_indices_batching_dims": list(d.scatter_indices_batching_dims),
                "scatter_dims_to_operand_dims": list(d.scatter_dims_to_operand_dims),
                "index_vector_dim": d.index_vector_dim}
    if key == "channel_handle":
        try:
            d = sh.ChannelHandle(attr)
            return {"handle": int(d.handle), "type": int(d.channel_type)}
        except Exception:  # mhlo's spelling of the same attribute
            m = re.search(r'handle\s*=\s*(-?\d+)\s*,\s*type\s*=\s*(-?\d+)', str(attr))
            if not m:
                raise
            return {"handle": int(m.group(1)), "type": int(m.group(2))}
    if key == "comparison_direction":
        try:
            return str(sh.ComparisonDirectionAttr(attr).value)
        except Exception:  # mhlo's #mhlo<comparison_direction LT>
            m = re.search(r'\b(EQ|NE|LT|LE|GT|GE)\b', str(attr))
            if not m:
                raise
            return m.group(1)
    return generic(attr)


def generic(attr, depth: int = 0) -> Any:
    """Builtin attributes as Python values; anything else as its printed text."""
    _, ir, _ = mlir()
    if isinstance(attr, ir.BoolAttr):
        return bool(attr.value)
    if isinstance(attr, ir.IntegerAttr):
        return int(attr.value)
    if isinstance(attr, ir.FloatAttr):
        return float(attr.value)
    if isinstance(attr, (ir.StringAttr, ir.FlatSymbolRefAttr)):
        return text_of(attr)
    if isinstance(attr, (ir.DenseI64ArrayAttr, ir.DenseI32ArrayAttr, ir.DenseI16ArrayAttr,
                         ir.DenseI8ArrayAttr, ir.DenseBoolArrayAttr, ir.DenseF32ArrayAttr,
                         ir.DenseF64ArrayAttr)):
        return list(attr)
    if isinstance(attr, ir.DenseIntElementsAttr):
        arr = np.array(attr)
        return arr.tolist() if arr.size <= 65536 else None
    if isinstance(attr, ir.DenseElementsAttr):
        return None
    if isinstance(attr, ir.ArrayAttr):
        if depth > 32:
            return str(attr)
        return [generic(a, depth + 1) for a in attr]
    if isinstance(attr, ir.UnitAttr):
        return True
    if isinstance(attr, ir.TypeAttr):
        return str(attr.value)
    return str(attr)


def scalar_of(value) -> Any:
    """A splat constant's element as a Python bool / int / float (None when it is none of these)."""
    v = getattr(value, "value", None)
    if isinstance(v, (bool, int, float)):
        return v
    text = str(value)
    m = re.match(r'^\s*(true|false|-?\d+)\s*(?::|$)', text)
    if m:
        t = m.group(1)
        return True if t == "true" else False if t == "false" else int(t)
    try:
        return float(text.split(":")[0])
    except ValueError:
        return None


def int_attr(attr, default: int | None) -> int | None:
    """An integer attribute's value, ``default`` when absent or not an integer."""
    if attr is None:
        return default
    try:
        return int(attr.value)
    except Exception:
        return default
