"""Micro-benchmark zoo families of vector work: ``eltwise``, ``reduce``, ``softmax`` and ``layernorm``.

Each is one tiny inference program (one device) over a tensor given as ``shape=64x128x256`` (see
:mod:`.micro_common` for the size conventions):

* ``eltwise``: a chain of ``length`` elementwise ops over ``x``; the ops are taken in turn from the
  ``ops`` list (``ops=add,mul,exp``); a binary op combines the running value with a second input ``y``
  of the same shape. XLA fuses the chain into one loop kernel.
* ``reduce``: ``sum``, ``max``, ``min`` or ``mean`` over ``axes`` (``axes=-1``, ``axes=0,2``, ``axes=all``).
* ``softmax``: numerically stable softmax along ``axis`` (max, subtract, exp, sum, divide).
* ``layernorm``: ``norm=layer`` (mean and variance, scale and bias) or ``norm=rms`` (root mean square,
  scale) over the last axis, statistics in f32, the result in ``dtype``.
"""
from __future__ import annotations

from typing import Any

from .base import ZooEntry, ZooParam
from .micro_common import AxesParam, ListParam, ShapeParam, dtype_param, jnp_dtype, parse_axes, parse_shape, too_big

UNARY = ("neg", "abs", "exp", "log", "tanh", "logistic", "sqrt", "rsqrt", "relu", "square", "sin", "cos", "erf")
BINARY = ("add", "sub", "mul", "div", "max", "min", "pow")
LN_EPS = 1e-6

ELTWISE_PARAMS = (
    ShapeParam("shape", str, "1024x1024", "tensor shape, sizes joined by x"),
    ZooParam("length", int, 4, "elementwise ops in the chain", minimum=1, maximum=256),
    ListParam("ops", str, "add,mul,exp", "the ops, used in turn: " + ", ".join(BINARY + UNARY),
              choices=BINARY + UNARY),
    dtype_param(),
)
REDUCE_PARAMS = (
    ShapeParam("shape", str, "1024x1024", "tensor shape, sizes joined by x"),
    AxesParam("axes", str, "-1", "reduced axes: comma-separated (negative from the end) or all"),
    ZooParam("op", str, "sum", "reduction", choices=("sum", "max", "min", "mean")),
    dtype_param(),
)
SOFTMAX_PARAMS = (
    ShapeParam("shape", str, "64x1024", "tensor shape, sizes joined by x"),
    ZooParam("axis", int, -1, "normalised axis (negative from the end)", minimum=-6, maximum=5),
    dtype_param(),
)
LAYERNORM_PARAMS = (
    ShapeParam("shape", str, "64x1024", "tensor shape, sizes joined by x; the last axis is normalised"),
    ZooParam("norm", str, "layer", "layer: LayerNorm (mean, variance, scale, bias); rms: RMSNorm (scale)",
             choices=("layer", "rms")),
    dtype_param(),
)


def _sds(p: dict[str, Any], shape: tuple[int, ...] | None = None):
    import jax

    return jax.ShapeDtypeStruct(parse_shape(p["shape"]) if shape is None else shape, jnp_dtype(p["dtype"]))


def check_shape(p: dict[str, Any]) -> str | None:
    return too_big(input=parse_shape(p["shape"]))


def _apply_op(name: str, h, y):
    import jax
    import jax.numpy as jnp
    from jax import lax

    unary = {"neg": lax.neg, "abs": lax.abs, "exp": lax.exp, "log": lax.log, "tanh": lax.tanh,
             "logistic": lax.logistic, "sqrt": lax.sqrt, "rsqrt": lax.rsqrt, "relu": jax.nn.relu,
             "square": lax.square, "sin": lax.sin, "cos": lax.cos, "erf": lax.erf}
    binary = {"add": lax.add, "sub": lax.sub, "mul": lax.mul, "div": lax.div, "max": lax.max, "min": lax.min,
              "pow": jnp.power}
    return unary[name](h) if name in unary else binary[name](h, y)


def generate_eltwise(p: dict[str, Any]) -> str:
    from ..export import export_jax

    ops = p["ops"].split(",")
    chain = [ops[i % len(ops)] for i in range(p["length"])]
    binary = any(op in BINARY for op in chain)

    def eltwise(x, y=None):
        h = x
        for op in chain:
            h = _apply_op(op, h, y)
        return h

    args = (_sds(p), _sds(p)) if binary else (_sds(p),)
    return export_jax(eltwise, *args, name="zoo_eltwise")


def check_reduce(p: dict[str, Any]) -> str | None:
    try:
        parse_axes(p["axes"], len(parse_shape(p["shape"])))
    except ValueError as exc:
        return str(exc)
    return check_shape(p)


def generate_reduce(p: dict[str, Any]) -> str:
    import jax.numpy as jnp

    from ..export import export_jax

    axes = parse_axes(p["axes"], len(parse_shape(p["shape"])))
    fn = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "mean": jnp.mean}[p["op"]]
    return export_jax(lambda x: fn(x, axis=axes), _sds(p), name=f"zoo_reduce_{p['op']}")


def check_softmax(p: dict[str, Any]) -> str | None:
    rank = len(parse_shape(p["shape"]))
    if not -rank <= p["axis"] < rank:
        return f"axis={p['axis']} is out of range for shape={p['shape']} (rank {rank})"
    return check_shape(p)


def generate_softmax(p: dict[str, Any]) -> str:
    import jax

    from ..export import export_jax

    return export_jax(lambda x: jax.nn.softmax(x, axis=p["axis"]), _sds(p), name="zoo_softmax")


def generate_layernorm(p: dict[str, Any]) -> str:
    import jax.numpy as jnp
    from jax import lax

    from ..export import export_jax

    shape = parse_shape(p["shape"])
    rms = p["norm"] == "rms"

    def norm(x, scale, bias=None):
        xf = x.astype(jnp.float32)
        if rms:
            y = xf * lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + LN_EPS)
        else:
            mean = jnp.mean(xf, axis=-1, keepdims=True)
            centred = xf - mean
            y = centred * lax.rsqrt(jnp.mean(jnp.square(centred), axis=-1, keepdims=True) + LN_EPS)
        y = y * scale.astype(jnp.float32)
        if bias is not None:
            y = y + bias.astype(jnp.float32)
        return y.astype(x.dtype)

    params = (_sds(p, shape[-1:]),) * (1 if rms else 2)
    return export_jax(norm, _sds(p), *params, name=f"zoo_{p['norm']}norm")


ELTWISE = ZooEntry("eltwise", "a chain of elementwise ops over one tensor", ELTWISE_PARAMS, generate_eltwise,
                   check=check_shape)
REDUCE = ZooEntry("reduce", "a sum/max/min/mean reduction over chosen axes", REDUCE_PARAMS, generate_reduce,
                  check=check_reduce)
SOFTMAX = ZooEntry("softmax", "a numerically stable softmax along one axis", SOFTMAX_PARAMS, generate_softmax,
                   check=check_softmax)
LAYERNORM = ZooEntry("layernorm", "LayerNorm or RMSNorm over the last axis", LAYERNORM_PARAMS, generate_layernorm,
                     check=check_shape)
ENTRIES = (ELTWISE, REDUCE, SOFTMAX, LAYERNORM)
