"""ResNet building blocks for the ``resnet`` zoo family: layer plan, parameter shapes and the forward pass.

Layout is NHWC activations and HWIO kernels (what XLA's convolution prefers on accelerators). The
network follows the standard ImageNet ResNets: a 7×7/2 stem convolution, a 3×3/2 max-pool, four stages
of basic blocks (two 3×3 convolutions; depth 18/34) or bottleneck blocks (1×1, 3×3, 1×1 with 4×
expansion; depth 50/101/152), the stride of a downsampling bottleneck on its 3×3 convolution (the
"v1.5" variant), a 1×1 projection shortcut where the shape changes, global average pooling and a dense
classifier. Convolutions pad symmetrically by ``(k-1)/2``, so spatial sizes halve exactly as in the
reference implementations.

Everything here builds shapes only; nothing allocates weights. Functions that use jax import it
lazily, so importing this module is cheap.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# depth -> (block kind, blocks per stage)
STAGES: dict[int, tuple[str, tuple[int, int, int, int]]] = {
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
}
STAGE_CHANNELS = (64, 128, 256, 512)
STEM_CHANNELS = 64
EXPANSION = {"basic": 1, "bottleneck": 4}
BN_EPS = 1e-5
BN_MOMENTUM = 0.9


@dataclass(frozen=True)
class ConvSpec:
    """One convolution (+ normalisation): kernel size, stride, input and output channels."""

    name: str
    k: int
    stride: int
    cin: int
    cout: int


@dataclass(frozen=True)
class BlockSpec:
    """One residual block: its convolutions in order, and the projection shortcut if it has one."""

    convs: tuple[ConvSpec, ...]
    shortcut: ConvSpec | None


@dataclass(frozen=True)
class ResNetPlan:
    """The whole network as shapes: stem, blocks, classifier width."""

    stem: ConvSpec
    blocks: tuple[BlockSpec, ...]
    features: int
    classes: int

    def convs(self) -> list[ConvSpec]:
        """Every convolution in program order (shortcut after its block's main path)."""
        out = [self.stem]
        for b in self.blocks:
            out.extend(b.convs)
            if b.shortcut is not None:
                out.append(b.shortcut)
        return out


def scaled(channels: int, width: float) -> int:
    """``channels`` times the width multiplier, at least 1."""
    return max(1, int(round(channels * width)))


def resnet_plan(depth: int, width: float, classes: int) -> ResNetPlan:
    """The layer plan of a ResNet of ``depth`` with channel multiplier ``width``."""
    kind, counts = STAGES[depth]
    expand = EXPANSION[kind]
    stem = ConvSpec("stem", 7, 2, 3, scaled(STEM_CHANNELS, width))
    cin = stem.cout
    blocks = []
    for s, (n_blocks, base) in enumerate(zip(counts, STAGE_CHANNELS)):
        mid = scaled(base, width)
        cout = mid * expand
        for b in range(n_blocks):
            stride = 2 if (b == 0 and s > 0) else 1
            tag = f"s{s + 1}b{b}"
            if kind == "basic":
                convs = (ConvSpec(f"{tag}c1", 3, stride, cin, cout), ConvSpec(f"{tag}c2", 3, 1, cout, cout))
            else:
                convs = (ConvSpec(f"{tag}c1", 1, 1, cin, mid), ConvSpec(f"{tag}c2", 3, stride, mid, mid),
                         ConvSpec(f"{tag}c3", 1, 1, mid, cout))
            shortcut = ConvSpec(f"{tag}sc", 1, stride, cin, cout) if (stride != 1 or cin != cout) else None
            blocks.append(BlockSpec(convs, shortcut))
            cin = cout
    return ResNetPlan(stem, tuple(blocks), cin, classes)


def output_size(size: int, k: int, stride: int) -> int:
    """Spatial output size of a convolution or pool padded by ``(k-1)//2`` on each side."""
    pad = (k - 1) // 2
    return (size + 2 * pad - k) // stride + 1


def spatial_sizes(plan: ResNetPlan, image: int) -> list[int]:
    """Output size of every convolution of ``plan`` for a square ``image``, in :meth:`ResNetPlan.convs` order."""
    sizes = []
    size = output_size(image, plan.stem.k, plan.stem.stride)
    sizes.append(size)
    size = output_size(size, 3, 2)                       # max-pool
    for b in plan.blocks:
        block_in = size
        for c in b.convs:
            size = output_size(size, c.k, c.stride)
            sizes.append(size)
        if b.shortcut is not None:
            sizes.append(output_size(block_in, b.shortcut.k, b.shortcut.stride))
    return sizes


# -- parameters as shapes ---------------------------------------------------------------------------

def conv_param_shapes(c: ConvSpec, norm: bool) -> dict[str, tuple[int, ...]]:
    """Trainable shapes of one convolution: the HWIO kernel and either BN scale/bias or a conv bias."""
    shapes = {"w": (c.k, c.k, c.cin, c.cout)}
    if norm:
        shapes.update(scale=(c.cout,), bias=(c.cout,))
    else:
        shapes["b"] = (c.cout,)
    return shapes


def param_shapes(plan: ResNetPlan, norm: bool) -> list[Any]:
    """Trainable parameter shapes in layer order: ``[stem, block, …, block, fc]``.

    A block is a list of its convolutions' dicts (shortcut last); ``fc`` is ``{"w", "b"}``.
    """
    layers: list[Any] = [conv_param_shapes(plan.stem, norm)]
    for b in plan.blocks:
        convs = [conv_param_shapes(c, norm) for c in b.convs]
        if b.shortcut is not None:
            convs.append(conv_param_shapes(b.shortcut, norm))
        layers.append(convs)
    layers.append({"w": (plan.features, plan.classes), "b": (plan.classes,)})
    return layers


def state_shapes(plan: ResNetPlan, norm: bool) -> list[dict[str, tuple[int, ...]]]:
    """Batch-norm running statistics (mean, var), one dict per convolution in program order."""
    if not norm:
        return []
    return [{"mean": (c.cout,), "var": (c.cout,)} for c in plan.convs()]


# -- the forward pass -------------------------------------------------------------------------------

def conv2d(x, w, stride: int, groups: int = 1):
    """NHWC × HWIO convolution padded by ``(k-1)//2`` on each side; ``groups`` feature groups (the kernel
    is ``[k, k, cin/groups, cout]``; ``groups = cin = cout`` is a depthwise convolution)."""
    from jax import lax

    k = w.shape[0]
    pad = (k - 1) // 2
    return lax.conv_general_dilated(x, w, (stride, stride), ((pad, pad), (pad, pad)),
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=groups)


def max_pool(x):
    """3×3/2 max-pool padded by 1 (padding never wins the max)."""
    import numpy as np
    from jax import lax

    init = np.array(-np.inf, x.dtype)        # a concrete identity, so jax uses its differentiable max-pool
    return lax.reduce_window(x, init, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (1, 1), (1, 1), (0, 0)))


def batch_norm(x, p: dict, s: dict, train: bool):
    """Batch norm over N, H, W: batch statistics in training (returns the new running stats), running
    statistics in inference. Statistics are computed in f32 whatever the activation type."""
    import jax.numpy as jnp
    from jax import lax

    xf = x.astype(jnp.float32)
    if train:
        mean = jnp.mean(xf, axis=(0, 1, 2))
        var = jnp.mean(jnp.square(xf - mean), axis=(0, 1, 2))
        new = {"mean": BN_MOMENTUM * s["mean"] + (1 - BN_MOMENTUM) * lax.stop_gradient(mean),
               "var": BN_MOMENTUM * s["var"] + (1 - BN_MOMENTUM) * lax.stop_gradient(var)}
    else:
        mean, var, new = s["mean"], s["var"], s
    y = (xf - mean) * lax.rsqrt(var + BN_EPS)
    y = y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)
    return y.astype(x.dtype), new


class _Apply:
    """One forward pass: walks the plan and collects the new batch-norm statistics in order."""

    def __init__(self, norm: bool, train: bool, state: list):
        self.norm, self.train, self.state = norm, train, state
        self.new_state: list = []

    def conv_norm(self, x, c: ConvSpec, p: dict, relu: bool):
        import jax

        y = conv2d(x, p["w"], c.stride)
        if self.norm:
            y, s = batch_norm(y, p, self.state[len(self.new_state)], self.train)
            self.new_state.append(s)
        else:
            y = y + p["b"].astype(y.dtype)
        return jax.nn.relu(y) if relu else y


def apply(plan: ResNetPlan, norm: bool, params: list, state: list, images, train: bool):
    """Logits of ``images`` (NHWC) and the new batch-norm state (the old one in inference)."""
    import jax
    import jax.numpy as jnp

    run = _Apply(norm, train, state)
    x = run.conv_norm(images, plan.stem, params[0], relu=True)
    x = max_pool(x)
    for block, p in zip(plan.blocks, params[1:-1]):
        h = x
        last = len(block.convs) - 1
        for i, (c, pc) in enumerate(zip(block.convs, p)):
            h = run.conv_norm(h, c, pc, relu=i < last)
        short = run.conv_norm(x, block.shortcut, p[-1], relu=False) if block.shortcut is not None else x
        x = jax.nn.relu(h + short)
    pooled = jnp.mean(x, axis=(1, 2))
    fc = params[-1]
    logits = pooled @ fc["w"] + fc["b"]
    return logits, (run.new_state if train else state)
