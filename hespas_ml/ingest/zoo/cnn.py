"""Zoo family ``resnet``: ImageNet-style ResNets (depth 18/34/50/101/152) as an inference or training step.

The network is described in :mod:`.cnn_layers` (NHWC, v1.5 bottlenecks, symmetric padding).

* ``step=infer``: the forward pass; batch norm uses its running statistics.
* ``step=train``: forward, backward (``jax.grad``: backward-data and backward-filter convolutions),
  softmax cross-entropy loss against integer labels, and an SGD, momentum-SGD or Adam update. Batch
  norm normalises with the batch's statistics and returns updated running statistics.
* ``norm=none`` replaces every batch norm by a per-channel bias.
* ``devices=N`` (N > 1) and ``parallel``:

  - ``dp``: explicit ``shard_map``; each device takes ``batch/N`` images, gradients are summed with
    ``psum`` (one all-reduce per parameter tensor), the loss too, and the running statistics are
    averaged with ``pmean`` (one all-reduce per statistic; batch statistics themselves stay local, as
    in data parallelism without synchronised batch norm).
  - ``dp-partitioned``: ``jax.jit`` with the batch sharded, exported after XLA's SPMD partitioner
    (global batch-norm statistics, collectives chosen and combined by XLA).
  - ``fsdp``: explicit ``shard_map``; every parameter (and its optimiser state) whose last dimension
    divides by N is stored sharded along it, all-gathered before the forward pass; autodiff turns the
    gathers into reduce-scatters of the gradients. Parameters that do not divide stay replicated and
    are ``psum``-ed.
  - ``fsdp-partitioned``: the same parameter sharding given to ``jax.jit``, compiler-partitioned.

Weights are never allocated: the step is exported from ``jax.ShapeDtypeStruct`` s. The step itself
(:func:`export_cnn_step`) also serves the ``mobilenet``, ``efficientnet``, ``convnext`` and ``swin`` families.
"""
from __future__ import annotations

from typing import Any, Callable

from . import cnn_layers as L
from .base import MAX_DEVICES, ZooEntry, ZooParam

LEARNING_RATE = 0.1
MOMENTUM = 0.9
ADAM_B1, ADAM_B2, ADAM_EPS = 0.9, 0.999, 1e-8
MAX_ACTIVATION_ELEMENTS = 1 << 32      # the largest activation tensor (global batch) may hold this many

PARAMS = (
    ZooParam("depth", int, 18, "ResNet depth: 18, 34 (basic blocks), 50, 101, 152 (bottleneck blocks)",
             minimum=18, maximum=152),
    ZooParam("width", float, 1.0, "channel multiplier (1.0: 64-128-256-512 base channels)", minimum=1 / 64,
             maximum=8.0),
    ZooParam("image", int, 64, "input resolution (square images, 3 channels)", minimum=16, maximum=2048),
    ZooParam("classes", int, 1000, "classifier outputs", minimum=1, maximum=1 << 20),
    ZooParam("batch", int, 8, "global batch size (images)", minimum=1, maximum=1 << 16),
    ZooParam("dtype", str, "f32", "element type of weights and activations (batch-norm statistics: f32)",
             choices=("f32", "bf16")),
    ZooParam("norm", str, "batch", "batch: batch norm after every convolution; none: a bias instead",
             choices=("batch", "none")),
    ZooParam("step", str, "train", "infer: forward only; train: forward, backward and update",
             choices=("infer", "train")),
    ZooParam("optimizer", str, "sgd", "update rule of a training step", choices=("sgd", "momentum", "adam")),
    ZooParam("devices", int, 1, "devices the step runs on", minimum=1, maximum=MAX_DEVICES),
    ZooParam("parallel", str, "dp", "dp | dp-partitioned | fsdp | fsdp-partitioned (see the module docs)",
             choices=("dp", "dp-partitioned", "fsdp", "fsdp-partitioned")),
)


def largest_activation(p: dict[str, Any]) -> int:
    """Elements of the largest activation tensor of the step (global batch)."""
    plan = L.resnet_plan(p["depth"], p["width"], p["classes"])
    sizes = L.spatial_sizes(plan, p["image"])
    per_image = max(s * s * c.cout for s, c in zip(sizes, plan.convs()))
    return p["batch"] * max(per_image, p["image"] * p["image"] * 3)


def check(p: dict[str, Any]) -> str | None:
    if p["depth"] not in L.STAGES:
        return f"depth={p['depth']} is not one of {', '.join(map(str, L.STAGES))}"
    if p["devices"] > 1 and p["batch"] % p["devices"]:
        return f"batch={p['batch']} is not divisible by devices={p['devices']}"
    n = largest_activation(p)
    if n > MAX_ACTIVATION_ELEMENTS:
        return (f"the largest activation would hold {n} elements (limit {MAX_ACTIVATION_ELEMENTS}); "
                "lower batch, image or width")
    return None


def _optimizer(kind: str):
    """``(state_of(params), update(params, grads, state))`` for ``sgd``, ``momentum`` or ``adam``."""
    import jax
    import jax.numpy as jnp

    tmap = jax.tree.map

    if kind == "sgd":
        return (lambda params: ()), (lambda w, g, s: (tmap(lambda a, b: a - LEARNING_RATE * b, w, g), s))
    if kind == "momentum":
        def momentum(w, g, v):
            v = tmap(lambda a, b: MOMENTUM * a + b, v, g)
            return tmap(lambda a, b: a - LEARNING_RATE * b, w, v), v
        return (lambda params: params), momentum

    def adam(w, g, s):
        m, v, t = s
        t = t + 1
        m = tmap(lambda a, b: ADAM_B1 * a + (1 - ADAM_B1) * b, m, g)
        v = tmap(lambda a, b: ADAM_B2 * a + (1 - ADAM_B2) * b * b, v, g)
        tf = t.astype(jnp.float32)
        scale = LEARNING_RATE * jnp.sqrt(1 - ADAM_B2 ** tf) / (1 - ADAM_B1 ** tf)
        w = tmap(lambda a, b, c: a - (scale * b / (jnp.sqrt(c) + ADAM_EPS)).astype(a.dtype), w, m, v)
        return w, (m, v, t)

    return (lambda params: (params, params, jax.ShapeDtypeStruct((), jnp.int32))), adam


def generate(p: dict[str, Any]) -> str | bytes:
    """The ResNet step's StableHLO (text; bytecode for the compiler-partitioned forms)."""
    plan = L.resnet_plan(p["depth"], p["width"], p["classes"])
    norm = p["norm"] == "batch"

    def apply(w, s, x, train):
        return L.apply(plan, norm, w, s, x, train=train)

    return export_cnn_step(p, L.param_shapes(plan, norm), L.state_shapes(plan, norm), apply, plan.classes,
                           name=f"zoo_resnet{p['depth']}_{p['step']}")


def export_cnn_step(p: dict[str, Any], param_shapes: Any, state_shapes: Any,
                    apply: Callable[..., Any], classes: int, name: str) -> str | bytes:
    """Export the inference or training step of an image classifier, as the module docs describe.

    ``param_shapes`` and ``state_shapes`` are trees (dicts/lists) whose leaves are shape tuples: the
    trainable parameters (in ``p["dtype"]``) and the running statistics (f32; an empty list for none).
    ``apply(w, s, images, train) -> (logits, new_state)``; ``p`` names ``dtype``, ``batch``, ``image``,
    ``step``, ``optimizer``, ``devices`` and ``parallel``. The images are ``[batch, image, image, 3]``.
    Text; bytecode for the compiler-partitioned forms.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AbstractMesh, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..export import export_jax, export_partitioned

    dtype = jnp.bfloat16 if p["dtype"] == "bf16" else jnp.float32
    train, n_dev = p["step"] == "train", p["devices"]
    is_shape = lambda t: isinstance(t, tuple)          # noqa: E731  (shape tuples are leaves)

    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), param_shapes, is_leaf=is_shape)
    state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), state_shapes, is_leaf=is_shape)
    images = jax.ShapeDtypeStruct((p["batch"], p["image"], p["image"], 3), dtype)
    labels = jax.ShapeDtypeStruct((p["batch"],), jnp.int32)
    opt_init, update = _optimizer(p["optimizer"])
    opt = opt_init(params)

    def infer(w, s, x):
        return apply(w, s, x, False)[0]

    def loss_fn(w, s, x, y):
        logits, new_state = apply(w, s, x, True)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        loss = -jnp.mean(jnp.sum(jax.nn.one_hot(y, classes, dtype=jnp.float32) * logp, axis=-1))
        return loss, new_state

    def make_train(reduce, prepare=lambda w: w):
        """A train step; ``reduce(loss, grads, state)`` combines across devices, ``prepare`` gathers."""
        def train_step(w, o, s, x, y):
            (loss, new_state), grads = jax.value_and_grad(lambda v: loss_fn(prepare(v), s, x, y), has_aux=True)(w)
            loss, grads, new_state = reduce(loss, grads, new_state)
            w, o = update(w, grads, o)
            return w, o, new_state, loss
        return train_step

    local = lambda loss, grads, s: (loss, grads, s)     # noqa: E731
    args = (params, opt, state, images, labels) if train else (params, state, images)
    if n_dev == 1:
        return export_jax(make_train(local) if train else infer, *args, name=name)

    partitioned = p["parallel"].endswith("-partitioned")
    # XLA's partitioner needs the devices; shard_map writes the per-device program over an abstract mesh
    mesh = Mesh(np.array(jax.devices()[:n_dev]), ("data",)) if partitioned else AbstractMesh((n_dev,), ("data",))
    fsdp = p["parallel"].startswith("fsdp")
    # FSDP: a parameter is sharded along its last dimension when that divides by the device count.
    sharded = jax.tree.map(lambda a: fsdp and a.ndim >= 1 and a.shape[-1] % n_dev == 0, params)
    pspec = jax.tree.map(lambda a, s: P(*([None] * (a.ndim - 1)), "data") if s else P(), params, sharded)
    opt_spec = {"sgd": (), "momentum": pspec, "adam": (pspec, pspec, P())}[p["optimizer"]]

    if partitioned:
        shard = lambda spec: NamedSharding(mesh, spec)   # noqa: E731
        is_p = lambda x: isinstance(x, P)                # noqa: E731
        w_sh = jax.tree.map(shard, pspec, is_leaf=is_p)
        o_sh = jax.tree.map(shard, opt_spec, is_leaf=is_p)
        rep, rows = shard(P()), shard(P("data"))
        in_sh = (w_sh, o_sh, rep, rows, rows) if train else (w_sh, rep, rows)
        return export_partitioned(make_train(local) if train else infer, *args, in_shardings=in_sh, name=name)

    def gather(w):
        return jax.tree.map(lambda a, s: jax.lax.all_gather(a, "data", axis=a.ndim - 1, tiled=True) if s else a,
                            w, sharded)

    def reduce(loss, grads, s):
        # Sharded parameters' gradients arrive reduce-scattered (the transpose of their all-gather).
        grads = jax.tree.map(lambda g, sh: (g if sh else jax.lax.psum(g, "data")) / n_dev, grads, sharded)
        return jax.lax.psum(loss, "data") / n_dev, grads, jax.tree.map(lambda v: jax.lax.pmean(v, "data"), s)

    if train:
        body = make_train(reduce, gather)
        in_specs = (pspec, opt_spec, P(), P("data"), P("data"))
        out_specs = (pspec, opt_spec, P(), P())
    else:
        body = lambda w, s, x: infer(gather(w), s, x)   # noqa: E731
        in_specs, out_specs = (pspec, P(), P("data")), P("data")
    # check_vma=False: gradients stay per-device until the explicit psum / the gathers' reduce-scatter.
    step = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return export_jax(step, *args, name=name)


ENTRY = ZooEntry(
    name="resnet",
    description="ResNet-18/34/50/101/152 (NHWC, batch norm); inference or training step (SGD/momentum/Adam); "
                "data parallel or FSDP",
    params=PARAMS,
    generate=generate,
    check=check,
    version=2,  # partitioned exports declare their device count
)
