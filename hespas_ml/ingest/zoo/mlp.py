"""Zoo family ``mlp``: a stack of dense layers (ReLU between them), as an inference or training step.

* ``step=infer``: the forward pass. ``step=train``: forward, backward (mean-squared-error loss against
  a target batch) and an SGD or Adam update; returns the new parameters, optimiser state and loss.
* ``devices=N`` (N > 1) with ``parallel=dp``: data parallel written explicitly with ``shard_map`` —
  each device takes ``batch/N`` rows and gradients are summed with ``psum`` (one all-reduce per
  parameter). ``parallel=dp-partitioned``: the same step under ``jax.jit`` with the batch sharded by
  ``in_shardings``, exported in the compiler-partitioned form (XLA picks the collectives).
"""
from __future__ import annotations

from typing import Any

from .base import MAX_DEVICES, ZooEntry, ZooParam

LEARNING_RATE = 0.01
ADAM_B1, ADAM_B2, ADAM_EPS = 0.9, 0.999, 1e-8

PARAMS = (
    ZooParam("layers", int, 2, "number of dense layers", minimum=1, maximum=256),
    ZooParam("width", int, 256, "features of the input, every hidden layer and the output", minimum=1,
             maximum=65536),
    ZooParam("batch", int, 64, "global batch size (rows)", minimum=1, maximum=1 << 24),
    ZooParam("dtype", str, "f32", "element type of parameters and activations", choices=("f32", "bf16")),
    ZooParam("step", str, "train", "infer: forward only; train: forward, backward and update",
             choices=("infer", "train")),
    ZooParam("optimizer", str, "sgd", "update rule of a training step", choices=("sgd", "adam")),
    ZooParam("devices", int, 1, "devices the step runs on", minimum=1, maximum=MAX_DEVICES),
    ZooParam("parallel", str, "dp", "dp: shard_map with psum of gradients; dp-partitioned: jit with "
             "in_shardings, compiler-partitioned form", choices=("dp", "dp-partitioned")),
)


def check(p: dict[str, Any]) -> str | None:
    if p["devices"] > 1 and p["batch"] % p["devices"]:
        return f"batch={p['batch']} is not divisible by devices={p['devices']}"
    return None


def generate(p: dict[str, Any]) -> str | bytes:
    """The MLP step's StableHLO (text; bytecode for ``parallel=dp-partitioned`` on several devices)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AbstractMesh, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..export import export_jax, export_partitioned

    dtype = jnp.bfloat16 if p["dtype"] == "bf16" else jnp.float32
    n_layers, width, batch, n_dev = p["layers"], p["width"], p["batch"], p["devices"]
    train, adam = p["step"] == "train", p["optimizer"] == "adam"
    name = f"zoo_mlp_{p['step']}"

    def spec(*shape):
        return jax.ShapeDtypeStruct(shape, dtype)

    weights = [(spec(width, width), spec(width)) for _ in range(n_layers)]
    x, y = spec(batch, width), spec(batch, width)

    def forward(params, h):
        for i, (w, b) in enumerate(params):
            h = h @ w + b
            if i < len(params) - 1:
                h = jax.nn.relu(h)
        return h

    def loss_fn(params, xb, yb):
        return jnp.mean(jnp.square(forward(params, xb) - yb))

    def update(params, grads, opt):
        if not adam:
            return jax.tree.map(lambda w, g: w - LEARNING_RATE * g, params, grads), opt
        m, v, t = opt
        t = t + 1
        m = jax.tree.map(lambda a, g: ADAM_B1 * a + (1 - ADAM_B1) * g, m, grads)
        v = jax.tree.map(lambda a, g: ADAM_B2 * a + (1 - ADAM_B2) * g * g, v, grads)
        tf = t.astype(jnp.float32)
        scale = LEARNING_RATE * jnp.sqrt(1 - ADAM_B2 ** tf) / (1 - ADAM_B1 ** tf)
        params = jax.tree.map(lambda w, a, b: w - (scale * a / (jnp.sqrt(b) + ADAM_EPS)).astype(w.dtype),
                              params, m, v)
        return params, (m, v, t)

    def make_train(reduce_grads):
        def train_step(params, opt, xb, yb):
            loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
            loss, grads = reduce_grads(loss, grads)
            params, opt = update(params, grads, opt)
            return params, opt, loss
        return train_step

    opt = (weights, weights, jax.ShapeDtypeStruct((), jnp.int32)) if adam else ()
    args = (weights, opt, x, y) if train else (weights, x)
    if n_dev == 1:
        step = make_train(lambda loss, grads: (loss, grads)) if train else forward
        return export_jax(step, *args, name=name)

    partitioned = p["parallel"] == "dp-partitioned"
    # XLA's partitioner needs the devices; shard_map writes the per-device program over an abstract mesh
    mesh = Mesh(np.array(jax.devices()[:n_dev]), ("data",)) if partitioned else AbstractMesh((n_dev,), ("data",))
    batch_specs = (P("data"), P("data")) if train else (P("data"),)
    if partitioned:
        step = make_train(lambda loss, grads: (loss, grads)) if train else forward
        replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        in_shardings = ((replicated, replicated, rows, rows) if train else (replicated, rows))
        return export_partitioned(step, *args, in_shardings=in_shardings, name=name)

    def psum_mean(loss, grads):
        return (jax.lax.psum(loss, "data") / n_dev,
                jax.tree.map(lambda g: jax.lax.psum(g, "data") / n_dev, grads))

    if train:
        local = make_train(psum_mean)
        in_specs, out_specs = (P(), P()) + batch_specs, (P(), P(), P())
    else:
        local = forward
        in_specs, out_specs = (P(),) + batch_specs, P("data")
    # check_vma=False: gradients stay per-device until the explicit psum (with it, autodiff would
    # already sum the gradients of the replicated parameters).
    step = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return export_jax(step, *args, name=name)


ENTRY = ZooEntry(
    name="mlp",
    description="dense layers with ReLU; inference or training step (SGD/Adam); data parallel",
    params=PARAMS,
    generate=generate,
    check=check,
    version=2,  # partitioned exports declare their device count
)
