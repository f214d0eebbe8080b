"""Inverted-residual (MBConv) networks for the ``mobilenet`` and ``efficientnet`` zoo families: the layer
plan, parameter shapes, the forward pass and its analytical FLOPs.

NHWC activations, HWIO kernels, symmetric padding ``(k-1)/2`` (as the PyTorch reference models). A
network is a stem convolution, a sequence of inverted-residual blocks, a 1×1 head convolution, global
average pooling, an optional hidden dense layer (MobileNet-V3) and the classifier. A block is

* a 1×1 expansion convolution (absent when the expanded width equals the input width),
* a k×k depthwise convolution (``feature_group_count`` = its channels) carrying the block's stride,
* optionally squeeze-excitation: global average pool, dense to ``squeeze`` units with an activation,
  dense back with a gate (sigmoid or hard-sigmoid), the feature map scaled by the gate,
* a 1×1 linear projection,
* the identity shortcut when the stride is 1 and the widths match.

Every convolution has batch norm (running statistics, as in ``resnet``) and, except the projection, an
activation: ReLU, ReLU6, hard-swish or SiLU. Everything here builds shapes only; functions that use jax
import it lazily.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .vision_common import conv_output, real_taps

ACTIVATIONS = ("none", "relu", "relu6", "hswish", "silu")
GATES = ("sigmoid", "hsigmoid")


@dataclass(frozen=True)
class Conv:
    """One convolution + batch norm + activation; ``groups`` feature groups (``cin`` for depthwise)."""

    k: int
    stride: int
    cin: int
    cout: int
    act: str
    groups: int = 1


@dataclass(frozen=True)
class SqueezeExcite:
    """Squeeze-excitation on ``channels``: dense to ``squeeze`` units (``act``), dense back, ``gate``."""

    channels: int
    squeeze: int
    act: str
    gate: str


@dataclass(frozen=True)
class Block:
    """One inverted-residual block."""

    expand: Conv | None
    depthwise: Conv
    se: SqueezeExcite | None
    project: Conv

    @property
    def cin(self) -> int:
        return self.expand.cin if self.expand is not None else self.depthwise.cin

    @property
    def residual(self) -> bool:
        return self.depthwise.stride == 1 and self.cin == self.project.cout

    def convs(self) -> list[Conv]:
        return [c for c in (self.expand, self.depthwise, self.project) if c is not None]


@dataclass(frozen=True)
class Plan:
    """The whole network as shapes. ``hidden`` is the width of a dense layer (with ``hidden_act``) between
    the pooled features and the classifier, 0 for none."""

    stem: Conv
    blocks: tuple[Block, ...]
    head: Conv
    hidden: int
    hidden_act: str
    classes: int

    def convs(self) -> list[Conv]:
        """Every convolution in program order."""
        return [self.stem, *(c for b in self.blocks for c in b.convs()), self.head]


def block(cin: int, expanded: int, cout: int, k: int, stride: int, act: str,
          se: tuple[int, str, str] | None) -> Block:
    """A block from its widths; ``se`` is ``(squeeze units, activation, gate)`` or None."""
    expand = Conv(1, 1, cin, expanded, act) if expanded != cin else None
    return Block(expand=expand, depthwise=Conv(k, stride, expanded, expanded, act, groups=expanded),
                 se=SqueezeExcite(expanded, *se) if se else None, project=Conv(1, 1, expanded, cout, "none"))


# -- shapes -----------------------------------------------------------------------------------------

def spatial_sizes(plan: Plan, image: int) -> list[int]:
    """Output size of every convolution, in :meth:`Plan.convs` order, for a square ``image``."""
    sizes, size = [], image
    for c in plan.convs():
        size = conv_output(size, c.k, c.stride, (c.k - 1) // 2)
        sizes.append(size)
    return sizes


def largest_activation(plan: Plan, image: int, batch: int) -> int:
    """Elements of the largest activation tensor (global batch)."""
    per_image = max(s * s * c.cout for s, c in zip(spatial_sizes(plan, image), plan.convs()))
    return batch * max(per_image, image * image * 3)


def _conv_shapes(c: Conv) -> dict[str, tuple[int, ...]]:
    return {"w": (c.k, c.k, c.cin // c.groups, c.cout), "scale": (c.cout,), "bias": (c.cout,)}


def param_shapes(plan: Plan) -> list[Any]:
    """Trainable shapes in layer order: ``[stem, block, …, block, head, (hidden,) fc]``; a block is a dict
    of ``expand``, ``dw``, ``se`` (``w1``, ``b1``, ``w2``, ``b2``), ``project`` (those it has)."""
    layers: list[Any] = [_conv_shapes(plan.stem)]
    for b in plan.blocks:
        d: dict[str, Any] = {"dw": _conv_shapes(b.depthwise), "project": _conv_shapes(b.project)}
        if b.expand is not None:
            d["expand"] = _conv_shapes(b.expand)
        if b.se is not None:
            c, s = b.se.channels, b.se.squeeze
            d["se"] = {"w1": (c, s), "b1": (s,), "w2": (s, c), "b2": (c,)}
        layers.append(d)
    layers.append(_conv_shapes(plan.head))
    features = plan.head.cout
    if plan.hidden:
        layers.append({"w": (features, plan.hidden), "b": (plan.hidden,)})
        features = plan.hidden
    layers.append({"w": (features, plan.classes), "b": (plan.classes,)})
    return layers


def state_shapes(plan: Plan) -> list[Any]:
    """Batch-norm running statistics in the structure of :func:`param_shapes` (convolutions only)."""
    def stat(c: Conv) -> dict[str, tuple[int, ...]]:
        return {"mean": (c.cout,), "var": (c.cout,)}

    out: list[Any] = [stat(plan.stem)]
    for b in plan.blocks:
        d = {"dw": stat(b.depthwise), "project": stat(b.project)}
        if b.expand is not None:
            d["expand"] = stat(b.expand)
        out.append(d)
    out.append(stat(plan.head))
    return out


def forward_flops(plan: Plan, image: int, batch: int) -> dict[str, int]:
    """Analytical matmul/convolution FLOPs of one forward pass (multiply-add = 2; kernel taps on padding
    not counted, as XLA counts them): ``first`` (the stem, whose input gradient a training step skips) and
    ``total`` (convolutions, squeeze-excitation, hidden and classifier layers). A training step does
    ``3 · total − first``."""
    total, size = 0, image
    first = 0
    for c in plan.convs():
        pad = (c.k - 1) // 2
        taps = real_taps(size, c.k, c.stride, pad)
        flops = 2 * batch * taps * taps * (c.cin // c.groups) * c.cout
        first = first or flops
        total += flops
        size = conv_output(size, c.k, c.stride, pad)
    for b in plan.blocks:
        if b.se is not None:
            total += 2 * 2 * batch * b.se.channels * b.se.squeeze
    features = plan.head.cout
    if plan.hidden:
        total += 2 * batch * features * plan.hidden
        features = plan.hidden
    total += 2 * batch * features * plan.classes
    return {"first": first, "total": total}


# -- the forward pass -------------------------------------------------------------------------------

def activation(name: str, x):
    import jax

    if name == "none":
        return x
    return {"relu": jax.nn.relu, "relu6": jax.nn.relu6, "hswish": jax.nn.hard_swish, "silu": jax.nn.silu,
            "sigmoid": jax.nn.sigmoid, "hsigmoid": jax.nn.hard_sigmoid}[name](x)


def apply(plan: Plan, params: list, state: list, images, train: bool):
    """Logits of ``images`` (NHWC) and the new batch-norm statistics (the old ones in inference)."""
    import jax.numpy as jnp

    from .cnn_layers import batch_norm, conv2d

    def conv_bn(x, c: Conv, p: dict, s: dict):
        y, new = batch_norm(conv2d(x, p["w"], c.stride, groups=c.groups), p, s, train)
        return activation(c.act, y), new

    new_state: list[Any] = []
    x, s = conv_bn(images, plan.stem, params[0], state[0])
    new_state.append(s)
    for b, p, st in zip(plan.blocks, params[1:], state[1:]):
        h, ns = x, {}
        if b.expand is not None:
            h, ns["expand"] = conv_bn(h, b.expand, p["expand"], st["expand"])
        h, ns["dw"] = conv_bn(h, b.depthwise, p["dw"], st["dw"])
        if b.se is not None:
            se = p["se"]
            pooled = jnp.mean(h, axis=(1, 2))
            g = activation(b.se.act, pooled @ se["w1"] + se["b1"])
            g = activation(b.se.gate, g @ se["w2"] + se["b2"])
            h = h * g[:, None, None, :]
        h, ns["project"] = conv_bn(h, b.project, p["project"], st["project"])
        x = x + h if b.residual else h
        new_state.append(ns)
    n = len(plan.blocks) + 1
    x, s = conv_bn(x, plan.head, params[n], state[n])
    new_state.append(s)
    x = jnp.mean(x, axis=(1, 2))
    if plan.hidden:
        x = activation(plan.hidden_act, x @ params[n + 1]["w"] + params[n + 1]["b"])
    fc = params[-1]
    logits = x @ fc["w"] + fc["b"]
    return logits, (new_state if train else state)
