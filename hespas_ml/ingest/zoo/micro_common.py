"""What the micro-benchmark zoo families share: parameter kinds, dtypes and size limits.

Convention for sizes: a dimension with a meaning is its own integer parameter (``m``, ``n``, ``k`` of
a GEMM; ``batch``, ``h``, ``w``, ``cin``, ``cout`` of a convolution; ``seq``, ``head_dim`` of
attention). A tensor of arbitrary rank (elementwise, reduce, softmax, norm families) is one ``shape``
parameter written as sizes joined by ``x`` — ``shape=64x128x256`` — with 1 to :data:`MAX_RANK`
dimensions, each at least 1. Axes are written as comma-separated integers (negative counts from the
end): ``axes=0,2`` or ``axes=-1``; ``axes=all`` names every axis.

No tensor of a micro program (input, output or the work of a single op) may hold more than
:data:`MAX_ELEMENTS` elements; :func:`too_big` says so in one line.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

from .base import ParamValue, ZooParam

MAX_RANK = 6
MAX_ELEMENTS = 1 << 32          # 16 GiB of f32: bigger than any one accelerator tensor we care to model
MAX_DIM = 1 << 24
DTYPES = ("f32", "bf16", "f16")


def jnp_dtype(name: str):
    """The jax dtype of a spec's ``dtype`` value."""
    import jax.numpy as jnp

    return {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}[name]


def dtype_param(default: str = "f32") -> ZooParam:
    return ZooParam("dtype", str, default, "element type", choices=DTYPES)


def parse_shape(text: str) -> tuple[int, ...]:
    """``"64x128x256"`` → ``(64, 128, 256)``; ValueError with a message for the user otherwise."""
    parts = text.strip().lower().split("x")
    if not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"shape={text} is not a shape (write sizes joined by x, e.g. 64x128x256)")
    dims = tuple(int(p) for p in parts)
    if len(dims) > MAX_RANK:
        raise ValueError(f"shape={text} has {len(dims)} dimensions (at most {MAX_RANK})")
    if any(d < 1 for d in dims):
        raise ValueError(f"shape={text} has a dimension below 1")
    if any(d > MAX_DIM for d in dims):
        raise ValueError(f"shape={text} has a dimension above the maximum {MAX_DIM}")
    return dims


def format_shape(dims: tuple[int, ...]) -> str:
    return "x".join(map(str, dims))


@dataclass(frozen=True)
class ShapeParam(ZooParam):
    """A ``shape`` parameter (``64x128x256``), stored in its canonical spelling."""

    def parse(self, text: str) -> ParamValue:
        value = format_shape(parse_shape(text))
        self.validate(value)
        return value

    def validate(self, value: ParamValue) -> None:
        parse_shape(str(value))
        super().validate(value)


def parse_axes(text: str, rank: int) -> tuple[int, ...]:
    """Sorted non-negative axes of ``axes=`` for a tensor of ``rank``; ValueError naming the problem."""
    if text.strip().lower() == "all":
        return tuple(range(rank))
    try:
        raw = [int(a, 10) for a in text.split(",")]
    except ValueError:
        raise ValueError(f"axes={text} is not a list of integers (e.g. axes=0,2 or axes=-1 or axes=all)") from None
    axes = []
    for a in raw:
        if not -rank <= a < rank:
            raise ValueError(f"axes={text}: axis {a} is out of range for a tensor of rank {rank}")
        axes.append(a % rank)
    if len(set(axes)) != len(axes):
        raise ValueError(f"axes={text} names an axis twice")
    return tuple(sorted(axes))


@dataclass(frozen=True)
class AxesParam(ZooParam):
    """An ``axes`` parameter (``0,2``, ``-1``, ``all``), stored without spaces; checked against the shape
    by the family's ``check``."""

    def parse(self, text: str) -> ParamValue:
        value = text.replace(" ", "").lower()
        if value != "all":
            parse_axes(value, MAX_RANK * 2)      # syntax only; the range depends on the shape
        self.validate(value)
        return value


@dataclass(frozen=True)
class ListParam(ZooParam):
    """A comma-separated list of names, each one of ``choices`` (stored without spaces)."""

    def parse(self, text: str) -> ParamValue:
        value = text.replace(" ", "").lower()
        self.validate(value)
        return value

    def validate(self, value: ParamValue) -> None:
        items = str(value).split(",")
        bad = [i for i in items if not self.choices or i not in self.choices]
        if bad:
            raise ValueError(f"{self.name}={value}: '{bad[0]}' is not one of {', '.join(self.choices or ())}")


def too_big(**tensors: tuple[int, ...]) -> str | None:
    """A message for the first named tensor that holds more than :data:`MAX_ELEMENTS`, else None."""
    for name, shape in tensors.items():
        n = prod(shape)
        if n > MAX_ELEMENTS:
            return (f"the {name} tensor {format_shape(shape)} would hold {n} elements "
                    f"(limit {MAX_ELEMENTS}); choose smaller sizes")
    return None
