"""Micro-benchmark zoo family ``conv``: one 2-D convolution, forward or one of its two backward passes.

* ``pass=fwd``: ``y = conv(x, w)``.
* ``pass=bwd_data``: the input gradient ``dx`` from ``w`` and ``dy`` — the transposed convolution
  (an lhs-dilated convolution with the kernel flipped when ``stride > 1``).
* ``pass=bwd_filter``: the kernel gradient ``dw`` from ``x`` and ``dy`` (batch and feature dimensions
  swapped; grouped convolutions become ``batch_group_count`` convolutions).

The backward programs are made with ``jax.linear_transpose`` of the forward convolution, so they are
exactly what ``jax.grad`` emits inside a training step, without the forward pass. All three passes do
the same number of multiply-adds that touch real (non-padding) input elements.

``layout=NHWC`` uses HWIO kernels, ``layout=NCHW`` OIHW kernels. ``padding=SAME`` pads so that the
output has ``ceil(h/stride)`` rows; ``VALID`` does not pad. ``groups`` splits channels into groups
(``groups=cin=cout`` is a depthwise convolution); ``dilation`` spaces the kernel taps.
"""
from __future__ import annotations

from typing import Any

from .base import ZooEntry, ZooParam
from .micro_common import dtype_param, format_shape, jnp_dtype, too_big

PARAMS = (
    ZooParam("batch", int, 8, "images", minimum=1, maximum=1 << 16),
    ZooParam("h", int, 32, "input rows", minimum=1, maximum=1 << 14),
    ZooParam("w", int, 32, "input columns", minimum=1, maximum=1 << 14),
    ZooParam("cin", int, 64, "input channels", minimum=1, maximum=1 << 16),
    ZooParam("cout", int, 64, "output channels", minimum=1, maximum=1 << 16),
    ZooParam("kernel", int, 3, "kernel size (square)", minimum=1, maximum=31),
    ZooParam("stride", int, 1, "stride in both spatial dims", minimum=1, maximum=16),
    ZooParam("padding", str, "SAME", "SAME: output ceil(h/stride) rows; VALID: no padding",
             choices=("SAME", "VALID")),
    ZooParam("groups", int, 1, "feature groups (divides cin and cout)", minimum=1, maximum=1 << 16),
    ZooParam("dilation", int, 1, "kernel dilation", minimum=1, maximum=16),
    ZooParam("layout", str, "NHWC", "NHWC (HWIO kernel) or NCHW (OIHW kernel)", choices=("NHWC", "NCHW")),
    ZooParam("pass", str, "fwd", "fwd: y from x, w; bwd_data: dx from w, dy; bwd_filter: dw from x, dy",
             choices=("fwd", "bwd_data", "bwd_filter")),
    dtype_param(),
)


def output_size(size: int, kernel: int, stride: int, dilation: int, padding: str) -> int:
    """Rows (or columns) of the output; 0 when the kernel does not fit."""
    if padding == "SAME":
        return -(-size // stride)
    extent = dilation * (kernel - 1) + 1
    return 0 if extent > size else (size - extent) // stride + 1


def shapes(p: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Shapes of the input, kernel and output of the forward convolution, in the spec's layout."""
    k, g = p["kernel"], p["groups"]
    oh = output_size(p["h"], k, p["stride"], p["dilation"], p["padding"])
    ow = output_size(p["w"], k, p["stride"], p["dilation"], p["padding"])
    if p["layout"] == "NHWC":
        return {"input": (p["batch"], p["h"], p["w"], p["cin"]), "kernel": (k, k, p["cin"] // g, p["cout"]),
                "output": (p["batch"], oh, ow, p["cout"])}
    return {"input": (p["batch"], p["cin"], p["h"], p["w"]), "kernel": (p["cout"], p["cin"] // g, k, k),
            "output": (p["batch"], p["cout"], oh, ow)}


def check(p: dict[str, Any]) -> str | None:
    g = p["groups"]
    if p["cin"] % g or p["cout"] % g:
        return f"groups={g} must divide cin={p['cin']} and cout={p['cout']}"
    if p["padding"] == "VALID":
        extent = p["dilation"] * (p["kernel"] - 1) + 1
        for dim in ("h", "w"):
            if extent > p[dim]:
                return (f"kernel={p['kernel']} (extent {extent} with dilation={p['dilation']}) is larger than "
                        f"the input {dim}={p[dim]} with padding=VALID")
    s = shapes(p)
    return too_big(**s)


def generate(p: dict[str, Any]) -> str:
    """The convolution pass as StableHLO text."""
    import jax
    from jax import lax

    from ..export import export_jax

    dtype = jnp_dtype(p["dtype"])
    s = shapes(p)
    x, w, y = (jax.ShapeDtypeStruct(s[n], dtype) for n in ("input", "kernel", "output"))
    dn = ("NHWC", "HWIO", "NHWC") if p["layout"] == "NHWC" else ("NCHW", "OIHW", "NCHW")
    stride, dil = (p["stride"],) * 2, (p["dilation"],) * 2

    def conv(lhs, rhs):
        return lax.conv_general_dilated(lhs, rhs, stride, p["padding"], rhs_dilation=dil, dimension_numbers=dn,
                                        feature_group_count=p["groups"])

    def bwd_data(rhs, dy):
        return jax.linear_transpose(lambda lhs: conv(lhs, rhs), x)(dy)[0]

    def bwd_filter(lhs, dy):
        return jax.linear_transpose(lambda rhs: conv(lhs, rhs), w)(dy)[0]

    name = f"zoo_conv_{p['pass']}_{format_shape(s['input'])}"
    if p["pass"] == "fwd":
        return export_jax(conv, x, w, name=name)
    if p["pass"] == "bwd_data":
        return export_jax(bwd_data, w, y, name=name)
    return export_jax(bwd_filter, x, y, name=name)


ENTRY = ZooEntry("conv", "one 2-D convolution: forward, backward-data or backward-filter pass", PARAMS, generate,
                 check=check)
ENTRIES = (ENTRY,)
