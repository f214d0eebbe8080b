"""What the image-classifier zoo families ``mobilenet``, ``efficientnet``, ``convnext`` and ``swin`` share:
the step parameters (as ``resnet`` declares them), lists of per-stage integers, channel rounding, the
largest-activation limit and the count of kernel taps that read real input.

The steps themselves are exported by :func:`.cnn.export_cnn_step` (inference, or training with SGD,
momentum or Adam; ``devices``/``parallel`` as ``resnet``). No jax here: specs are checked when they are
parsed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import MAX_DEVICES, ParamValue, ZooParam
from .checks import check_parallel

PARALLEL = ("dp", "dp-partitioned", "fsdp", "fsdp-partitioned")
MAX_ACTIVATION_ELEMENTS = 1 << 32      # the largest activation tensor (global batch) may hold this many
MAX_STAGES = 8
VARIANT = "variant"


def step_params(batch: int = 8, classes: int = 1000) -> tuple[ZooParam, ...]:
    """``classes``, ``batch``, ``dtype``, ``step``, ``optimizer``, ``devices``, ``parallel`` (as ``resnet``)."""
    return (
        ZooParam("classes", int, classes, "classifier outputs", minimum=1, maximum=1 << 20),
        ZooParam("batch", int, batch, "global batch size (images)", minimum=1, maximum=1 << 16),
        ZooParam("dtype", str, "f32", "element type of weights and activations (norm statistics: f32)",
                 choices=("f32", "bf16")),
        ZooParam("step", str, "train", "infer: forward only; train: forward, backward and update",
                 choices=("infer", "train")),
        ZooParam("optimizer", str, "sgd", "update rule of a training step", choices=("sgd", "momentum", "adam")),
        ZooParam("devices", int, 1, "devices the step runs on", minimum=1, maximum=MAX_DEVICES),
        ZooParam("parallel", str, "dp", "dp | dp-partitioned | fsdp | fsdp-partitioned (as resnet: explicit "
                 "shard_map or XLA's SPMD partitioner)", choices=PARALLEL),
    )


def parse_ints(text: str) -> tuple[int, ...]:
    """``"3,3,9,3"`` → ``(3, 3, 9, 3)``; ValueError with a message for the user otherwise."""
    parts = text.replace(" ", "").split(",")
    if not all(part.isdigit() for part in parts):
        raise ValueError(f"{text} is not a list of integers (write them joined by commas, e.g. 3,3,9,3) "
                         f"or '{VARIANT}'")
    values = tuple(int(part) for part in parts)
    if any(v < 1 or v > 1 << 16 for v in values):
        raise ValueError(f"{text} has a value outside 1..{1 << 16}")
    if len(values) > MAX_STAGES:
        raise ValueError(f"{text} has {len(values)} stages (at most {MAX_STAGES})")
    return values


@dataclass(frozen=True)
class IntsParam(ZooParam):
    """One positive integer per stage (``3,3,9,3``, stored without spaces or leading zeros), or
    ``variant`` (the variant's own values)."""

    def parse(self, text: str) -> ParamValue:
        if text.strip().lower() == VARIANT:
            return VARIANT
        try:
            value = ",".join(map(str, parse_ints(text)))
        except ValueError as exc:
            raise ValueError(f"{self.name}={exc}") from None
        self.validate(value)
        return value

    def validate(self, value: ParamValue) -> None:
        if value == VARIANT:
            return
        try:
            parse_ints(str(value))
        except ValueError as exc:
            raise ValueError(f"{self.name}={exc}") from None
        super().validate(value)


def ints_or(value: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """The integers of an :class:`IntsParam` value, ``default`` for ``variant``."""
    return default if value == VARIANT else parse_ints(value)


def make_divisible(value: float, divisor: int = 8) -> int:
    """Channels rounded to a multiple of ``divisor`` as the MobileNet/EfficientNet references do: to the
    nearest multiple, at least ``divisor``, and never more than 10 % below ``value``."""
    out = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if out < 0.9 * value:
        out += divisor
    return out


def conv_output(size: int, k: int, stride: int, pad: int) -> int:
    """Spatial output size of a convolution padded by ``pad`` on each side."""
    return (size + 2 * pad - k) // stride + 1


def real_taps(size: int, k: int, stride: int, pad: int) -> int:
    """(output, kernel tap) pairs along one axis that read a real input element (taps on padding are not
    work, as XLA and the cost model count them)."""
    out = conv_output(size, k, stride, pad)
    return sum(1 for o in range(out) for t in range(k) if 0 <= o * stride - pad + t < size)


def check_step(p: dict[str, Any], largest: int, lower: str) -> str | None:
    """A message when the batch does not split over the devices or the largest activation (elements,
    global batch) is above the limit (``lower`` names what to make smaller), else None."""
    problem = check_parallel(p, tp_dims={})
    if problem:
        return problem
    if largest > MAX_ACTIVATION_ELEMENTS:
        return (f"the largest activation would hold {largest} elements (limit {MAX_ACTIVATION_ELEMENTS}); "
                f"lower {lower}")
    return None
