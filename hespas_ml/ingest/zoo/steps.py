"""Inference and training steps of a layered model, exported single-device or sharded.

A family describes its model as a :class:`LayeredModel` — parameter shapes (a ``top`` group and one
``layer`` group repeated ``layers`` times), the batch, and four functions (embed, block, head, loss) —
and :func:`export_step` turns it into StableHLO for any strategy of :mod:`.parallel`: the forward pass
(``step=infer``) or forward, backward and an SGD/Adam update (``step=train``), with the layers unrolled
(a Python loop) or as one ``lax.scan`` over stacked layer parameters (``scan=True``: a while loop).

This module imports jax; import it only inside a generator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..export import ExportError, export_jax, export_partitioned
from .checks import MESH_AXES, mesh_of, microbatch_count, schedule_chunks
from .parallel import (AXIS, BATCH_SHARDED, Axes, Collectives, base_strategy, fsdp_axis, is_partitioned,
                       make_mesh, psum_replicated, spec)

LEARNING_RATE = 0.01
ADAM_B1, ADAM_B2, ADAM_EPS = 0.9, 0.999, 1e-8

Shapes = dict[str, jax.ShapeDtypeStruct]


@dataclass(frozen=True)
class LayeredModel:
    """A model in the form :func:`export_step` runs.

    ``embed(top, inputs, col) -> (x, ctx)``; ``block(layer, x, ctx, col) -> x`` (once per layer, ``ctx``
    is loop-invariant); ``head(top, x, ctx, col) -> output``; ``loss(output, targets, col) -> scalar``
    (mean over the local batch). ``top`` and ``layer`` are dicts of parameters; ``col`` is the
    :class:`~.parallel.Collectives` the functions call at communication points. Inputs and targets
    have the batch on axis 0. ``tp_*`` / ``ep_*`` name the axis each parameter is split along under
    tensor / expert parallelism (missing or None: replicated). ``pp_shared`` names the ``top`` parameters
    that both the first and the last pipeline stage use (a tied embedding and LM head): their gradients are
    summed over the pipeline's stages.
    """

    top: Shapes
    layer: Shapes
    layers: int
    inputs: tuple[jax.ShapeDtypeStruct, ...]
    targets: jax.ShapeDtypeStruct
    embed: Callable[..., Any]
    block: Callable[..., Any]
    head: Callable[..., Any]
    loss: Callable[..., Any]
    tp_top: Axes | None = None
    tp_layer: Axes | None = None
    ep_top: Axes | None = None
    ep_layer: Axes | None = None
    pp_shared: tuple[str, ...] = ()


def layouts(model: LayeredModel, strategy: str, n: int) -> dict[str, Axes]:
    """The split axis of every parameter of each group (``top``, ``layer``) under ``strategy``."""
    out: dict[str, Axes] = {}
    for group, shapes in (("top", model.top), ("layer", model.layer)):
        if strategy == "fsdp":
            out[group] = {k: fsdp_axis(tuple(s.shape), n) for k, s in shapes.items()}
        elif strategy in ("tp", "ep"):
            named = getattr(model, f"{strategy}_{group}") or {}
            out[group] = {k: named.get(k) for k in shapes}
        else:
            out[group] = {k: None for k in shapes}
    return out


def param_shapes(model: LayeredModel, scan: bool) -> dict[str, Any]:
    """Global parameter shapes: ``{"top": {…}, "layers": [{…}, …]}``, or with ``scan`` the layer
    parameters stacked along a new leading axis (``{"layers": {name: [layers, …]}}``)."""
    if scan:
        layers: Any = {k: jax.ShapeDtypeStruct((model.layers, *s.shape), s.dtype) for k, s in model.layer.items()}
    else:
        layers = [dict(model.layer) for _ in range(model.layers)]
    return {"top": dict(model.top), "layers": layers}


def param_axes(model: LayeredModel, layout: dict[str, Axes], scan: bool) -> dict[str, Any]:
    """The split axes in the structure of :func:`param_shapes` (stacked layers: one axis further)."""
    if scan:
        layers: Any = {k: None if a is None else a + 1 for k, a in layout["layer"].items()}
    else:
        layers = [dict(layout["layer"]) for _ in range(model.layers)]
    return {"top": dict(layout["top"]), "layers": layers}


def _specs(axes: Any, shapes: Any) -> Any:
    """PartitionSpecs for a tree of axes (dicts/lists whose leaves are int or None) and its shapes."""
    if isinstance(axes, dict):
        return {k: _specs(axes[k], shapes[k]) for k in axes}
    if isinstance(axes, list):
        return [_specs(a, s) for a, s in zip(axes, shapes)]
    return spec(axes, len(shapes.shape))


REMAT = ("none", "selective", "full")
"""Activation recomputation: ``none`` keeps every block's intermediates for backward; ``selective`` keeps the
outputs of the projections (matrix products without batch dimensions) and recomputes the rest, attention's
scores and softmax among them (Megatron-LM's selective recomputation); ``full`` keeps only each block's input."""


def block_fn(model: LayeredModel, col: Collectives, remat: str = "none") -> Callable[..., Any]:
    """``block(lp, x, ctx)``: one of ``model``'s blocks on its layer's parameters ``lp`` as the device holds
    them (under FSDP gathered first), under the activation recomputation ``remat``. The gather is part of
    what is recomputed: with ``selective`` or ``full`` the backward gathers the layer's parameters again, as
    FSDP does once it has freed them (without recomputation the gathered parameters are kept for the
    backward)."""

    def block(lp, x, ctx):
        return model.block(col.gather(lp, "layer"), x, ctx, col)

    if remat == "none":
        return block
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable if remat == "selective" else None
    return jax.checkpoint(block, policy=policy)


def run_layers(model: LayeredModel, layers: Any, x, ctx, col: Collectives, *, scan: bool, remat: str = "none",
               window: tuple[Any, int] | None = None):
    """``x`` through every layer of ``layers``: a list of parameter groups, or one group stacked along a
    leading axis (run as one ``lax.scan`` with ``scan``, else unrolled). Under FSDP each layer's parameters
    are gathered right before it runs (inside the loop) and again in the backward. ``window=(start, count)``:
    only the stacked layers ``start .. start + count - 1`` (``start`` may be traced), each read where it lies."""
    block = block_fn(model, col, remat)
    if window is not None:
        start, count = window

        def layer(i):
            return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, start + i, keepdims=False), layers)

        if scan:
            return jax.lax.scan(lambda h, i: (block(layer(i), h, ctx), None), x, jnp.arange(count))[0]
        for i in range(count):
            x = block(layer(i), x, ctx)
        return x
    if isinstance(layers, list):
        for lp in layers:
            x = block(lp, x, ctx)
        return x
    if scan:
        return jax.lax.scan(lambda h, lp: (block(lp, h, ctx), None), x, layers)[0]
    for i in range(jax.tree.leaves(layers)[0].shape[0]):
        x = block(jax.tree.map(lambda a, i=i: a[i], layers), x, ctx)
    return x


def forward_fn(model: LayeredModel, scan: bool, remat: str = "none") -> Callable[..., Any]:
    """``forward(params, inputs, col)``: embed, every block, head. Under FSDP each group is gathered
    right before it is used (the layer group inside the loop)."""

    def forward(params, inputs, col: Collectives):
        top = col.gather(params["top"], "top")
        x, ctx = model.embed(top, inputs, col)
        x = run_layers(model, params["layers"], x, ctx, col, scan=scan, remat=remat)
        return model.head(top, x, ctx, col)

    return forward


def _microbatches(a, count: int):
    """``a`` cut along its leading (batch) axis into ``count`` microbatches: ``[count, batch / count, …]``."""
    return a.reshape(count, a.shape[0] // count, *a.shape[1:])


def _pick(a, i):
    """Item ``i`` (traced) of ``a``'s leading axis."""
    return jax.lax.dynamic_index_in_dim(a, i, keepdims=False)


def pipeline_forward_fn(model: LayeredModel, *, stages: int, microbatches: int, scan: bool,
                        remat: str = "none", chunks: int = 1) -> Callable[..., Any]:
    """``forward(params, inputs, col, targets=None)`` of a pipeline over the mesh axis ``pp`` (inside
    ``shard_map``): each device holds ``layers / stages`` layers (its stage). The batch is cut into
    ``microbatches``; tick by tick each stage runs its layers on what it holds (the first stage: the next
    microbatch, embedded) and sends the result to the next stage (``ppermute``: collective_permute,
    send/recv), so the stages' idle ticks (the bubble) are run, not assumed. The permute is a ring, as in
    MaxText's pipeline: every device sends once and receives once per tick, alike.

    ``chunks`` = 1 is GPipe: ``microbatches + stages - 1`` ticks of the whole stage, the last stage's ring
    message dropped by the first. ``chunks`` = V > 1 interleaves (Megatron's virtual stages): a stage's
    layers are V chunks, a microbatch goes round the ring V times, through chunk v on its v-th lap, and the
    first stage keeps what comes back from the last until its next lap (``microbatches`` ≥ ``stages``, so
    it is back in time); ``V · microbatches + stages - 1`` ticks of one chunk each, so the bubble is V times
    shorter and there are V times as many messages. (Which layers a chunk holds does not change the time:
    the stage's stacked layers are read as V chunks in order, each layer where it lies.)

    The last stage's outputs of the last lap are kept; with ``targets`` they go through the head and the
    loss one microbatch at a time (a microbatch's logits live for one step of that loop; under ``remat``
    they are made again backward) and the mean loss over the microbatches is returned, which counts on the
    last stage only (the caller masks the others); without, through the head together. Backward, the same
    ticks run in reverse with the gradients sent to the previous stage. Every stage runs the embedding and
    the head (SPMD: one program for all stages), in the time the last stage alone would."""
    last = stages - 1
    to_next = [(i, (i + 1) % stages) for i in range(stages)]
    laps = chunks * microbatches

    def ticks(params, col, stage, first_input, make_fresh=None, embedded=None, ctx=None):
        """The pipeline's ticks on ``stage``; the last stage's outputs of the last lap, one per microbatch.
        GPipe embeds microbatch ``i`` on the tick it enters (``make_fresh(i)``: it and its context);
        interleaved, the first stage keeps every microbatch's input until its next lap anyway, so that
        buffer starts as the microbatches embedded once (``embedded``, with their context ``ctx``)."""
        stack = params["layers"]
        per_chunk = jax.tree.leaves(stack)[0].shape[0] // chunks

        def tick(carry, t):
            if chunks == 1:
                held, outs = carry
                fresh, fresh_ctx = make_fresh(jnp.minimum(t, microbatches - 1))
                h = run_layers(model, stack, jnp.where(stage == 0, fresh, held), fresh_ctx, col, scan=scan,
                               remat=remat)
                outs = jax.lax.dynamic_update_index_in_dim(outs, h, jnp.maximum(t - last, 0), 0)
                return (jax.lax.ppermute(h, "pp", to_next), outs), None
            held, back, outs = carry
            # what the first stage receives now left the last stage a tick ago, at its position t - stages:
            # kept (first stage) for its next lap
            came = t - stages
            keep = (stage == 0) & (came >= 0) & (came < laps - microbatches)
            slot = jnp.clip(came, 0, laps - 1) % microbatches
            back = jax.lax.dynamic_update_index_in_dim(back, jnp.where(keep, held, _pick(back, slot)), slot, 0)
            position = jnp.clip(t - stage, 0, laps - 1)       # this stage's place in its stream
            lap, mb = position // microbatches, position % microbatches
            x = jnp.where(stage == 0, _pick(back, mb), held)
            h = run_layers(model, stack, x, ctx, col, scan=scan, remat=remat, window=(lap * per_chunk, per_chunk))
            done = jnp.clip(t - last - (chunks - 1) * microbatches, 0, microbatches - 1)
            outs = jax.lax.dynamic_update_index_in_dim(outs, h, done, 0)
            return (jax.lax.ppermute(h, "pp", to_next), back, outs), None

        zeros = jnp.zeros_like(first_input)
        buffer = jnp.zeros((microbatches, *first_input.shape), first_input.dtype)
        init = (zeros, buffer) if chunks == 1 else (zeros, embedded, buffer)
        final, _ = jax.lax.scan(tick, init, jnp.arange(laps + last))
        return final[-1]

    def forward(params, inputs, col: Collectives, targets=None):
        top = col.gather(params["top"], "top")
        stage = jax.lax.axis_index("pp")

        if targets is not None:
            parts, goals = tuple(_microbatches(a, microbatches) for a in inputs), _microbatches(targets, microbatches)

            def head_loss(h, ctx, goal):
                return model.loss(model.head(top, h, ctx, col), goal, col).astype(jnp.float32)

            if remat != "none":                # the logits are made again backward, not kept
                head_loss = jax.checkpoint(head_loss)

            def fresh(i):
                return model.embed(top, tuple(_pick(a, i) for a in parts), col)

            if chunks == 1:
                first, ctx = model.embed(top, tuple(_pick(a, 0) for a in parts), col)
                outs = ticks(params, col, stage, first, fresh)
            else:
                x, ctx = model.embed(top, inputs, col)
                xs = _microbatches(x, microbatches)
                outs = ticks(params, col, stage, xs[0], embedded=xs, ctx=ctx)

            def through_head(total, i):
                return total + head_loss(_pick(outs, i), ctx, _pick(goals, i)), None

            total, _ = jax.lax.scan(through_head, jnp.zeros((), jnp.float32), jnp.arange(microbatches))
            return total / microbatches

        x, ctx = model.embed(top, inputs, col)
        batch = x.shape[0]
        xs = _microbatches(x, microbatches)
        outs = (ticks(params, col, stage, xs[0], lambda i: (_pick(xs, i), ctx)) if chunks == 1
                else ticks(params, col, stage, xs[0], embedded=xs, ctx=ctx))
        return model.head(top, outs.reshape(batch, *outs.shape[2:]), ctx, col)

    return forward


def pipeline_1f1b_fn(model: LayeredModel, *, stages: int, microbatches: int, col: Collectives,
                     loss_scale: float) -> Callable[..., Any]:
    """``step(params, inputs, targets) -> (loss, grads)``: a training step's loss and gradients through a
    one-forward-one-backward (1F1B) pipeline over the mesh axis ``pp`` (inside ``shard_map``), each stage
    holding ``layers / stages`` layers and recomputing each layer's activations in its backward (as under
    ``remat=full``: a stage keeps only its layers' inputs for each microbatch in flight).

    In lock-step, as SPMD runs: on tick t stage s runs the forward of microbatch ``t - s`` and the
    backward of microbatch ``t - (2·stages - 2 - s)``, each sent on to the next (previous) stage by
    ``ppermute``; the last stage takes its loss's gradient in the tick of the forward. The first
    ``stages - 1`` ticks only run forwards and the last ``stages - 1`` only backwards, so the step takes
    (microbatches + stages - 1) forwards and backwards on every stage, GPipe's and 1F1B's time, while
    every stage holds the layer inputs of ``min(microbatches, 2·stages - 1)`` microbatches, not of every
    tick (stage s has ``2·(stages - 1 - s) + 1`` of them in flight at most, the first stage the most; a real
    1F1B interleaves forwards and backwards out of step across stages and has ``stages - s``: in lock-step a
    message takes a whole tick each way). ``loss_scale`` scales each microbatch's loss (the
    mean over the replicas that share the batch); the loss and the gradients of the embedding and head
    count on the first and last stage only, as the caller's reduction expects."""
    last = stages - 1
    slots = min(microbatches, 2 * stages - 1)           # microbatches the first stage keeps at most
    to_next = [(i, (i + 1) % stages) for i in range(stages)]
    to_prev = [(i, (i - 1) % stages) for i in range(stages)]

    def masked_add(total, part, on):
        return jax.tree.map(lambda a, g: a + jnp.where(on, g, jnp.zeros_like(g)).astype(a.dtype), total, part)

    def step(params, inputs, targets):
        stage = jax.lax.axis_index("pp")
        top, top_back = jax.vjp(lambda t: col.gather(t, "top"), params["top"])
        layers = params["layers"]
        parts, goals = tuple(_microbatches(a, microbatches) for a in inputs), _microbatches(targets, microbatches)
        first, ctx = model.embed(top, tuple(_pick(a, 0) for a in parts), col)

        def embed(t, i):
            return model.embed(t, tuple(_pick(a, i) for a in parts), col)[0]

        block = block_fn(model, col)

        def layer(lp, h):
            return block(lp, h, ctx)

        def stage_forward(x):                      # the output, and each layer's input
            return jax.lax.scan(lambda h, lp: (layer(lp, h), h), x, layers)

        def stage_backward(kept, g):               # each layer made again from its input, last first
            def back(g, item):
                lp, h = item
                dlp, dh = jax.vjp(layer, lp, h)[1](g)
                return dh, dlp
            return jax.lax.scan(back, g, (layers, kept), reverse=True)

        def head_loss(t, h, i):
            return model.loss(model.head(t, h, ctx, col), _pick(goals, i), col).astype(jnp.float32)

        def tick(carry, t, forward: bool, backward: bool):
            held, grad, kept, dlayers, dtop, loss = carry
            f, b = t - stage, t - (2 * stages - 2 - stage)
            f_ok, b_ok = (f >= 0) & (f < microbatches), (b >= 0) & (b < microbatches)
            f, b = jnp.clip(f, 0, microbatches - 1), jnp.clip(b, 0, microbatches - 1)
            sent, returned, dh = held, grad, None
            if forward:
                y, inputs_of = stage_forward(jnp.where(stage == 0, embed(top, f), held))
                slot = f % slots
                kept = jax.lax.dynamic_update_index_in_dim(kept, jnp.where(f_ok, inputs_of, _pick(kept, slot)), slot, 0)
                sent = jax.lax.ppermute(y, "pp", to_next)
                if backward:                       # the last stage: its loss and the loss's gradient, now
                    value, back = jax.vjp(lambda tt, h: head_loss(tt, h, f), top, y)
                    dtop_head, dh = back(jnp.asarray(loss_scale / microbatches, jnp.float32))
                    on = (stage == last) & f_ok
                    loss = loss + jnp.where(on, value, 0.0)
                    dtop = masked_add(dtop, dtop_head, on)
            if backward:
                g = grad if dh is None else jnp.where(stage == last, dh.astype(grad.dtype), grad)
                dx, dl = stage_backward(_pick(kept, b % slots), g)
                dlayers = masked_add(dlayers, dl, b_ok)
                dtop = masked_add(dtop, jax.vjp(lambda tt: embed(tt, b), top)[1](dx)[0], (stage == 0) & b_ok)
                returned = jax.lax.ppermute(dx, "pp", to_prev)
            return (sent, returned, kept, dlayers, dtop, loss), None

        zeros = jnp.zeros_like(first)
        kept = jnp.zeros((slots, jax.tree.leaves(layers)[0].shape[0], *first.shape), first.dtype)
        carry = (zeros, zeros, kept, jax.tree.map(jnp.zeros_like, layers), jax.tree.map(jnp.zeros_like, top),
                 jnp.zeros((), jnp.float32))
        m = microbatches
        for lo, hi, forward, backward in ((0, last, True, False), (last, m + last, True, True),
                                          (m + last, m + 2 * last, False, True)):
            if hi > lo:
                carry, _ = jax.lax.scan(lambda c, t, f=forward, b=backward: tick(c, t, f, b), carry,
                                        jnp.arange(lo, hi))
        _, _, _, dlayers, dtop, loss = carry
        return loss * (loss_scale / microbatches), {"top": top_back(dtop)[0], "layers": dlayers}

    return step


# -- optimisers -----------------------------------------------------------------------------------

def opt_shapes(params: Any, optimizer: str) -> Any:
    """Optimiser state for ``params``: ``()`` for SGD; ``(m, v, t)`` for Adam (moments shaped like
    the parameters, step counter an int32 scalar)."""
    if optimizer == "sgd":
        return ()
    return (params, params, jax.ShapeDtypeStruct((), jnp.int32))


def opt_specs(param_specs: Any, optimizer: str) -> Any:
    return () if optimizer == "sgd" else (param_specs, param_specs, P())


def apply_update(params: Any, grads: Any, opt: Any, optimizer: str) -> tuple[Any, Any]:
    """One SGD or Adam (bias-corrected) update; returns ``(params, opt)``."""
    if optimizer == "sgd":
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


# -- the step and its export ----------------------------------------------------------------------

def _step_fn(model: LayeredModel, forward, col: Collectives, loss_scale: float, optimizer: str,
             reduce: Callable[[Any, Any], tuple[Any, Any]], train: bool, *, microbatches: int = 1,
             last_stage: int | None = None, compute_dtype: Any = None,
             grads_fn: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """The inference step ``(params, inputs)``, or the training step ``(params, opt_state, inputs, targets)``
    whose loss and gradients ``reduce`` sums over the devices that share them before the update.

    ``microbatches`` > 1 without a pipeline: the batch is cut into that many microbatches, run one after the
    other (``lax.scan``; training accumulates their gradients). ``last_stage``: the forward is a pipeline over
    the mesh axis ``pp`` (:func:`pipeline_forward_fn`, which takes the targets and returns the loss) whose
    stage ``last_stage`` holds the loss (the other stages' loss is zero). ``compute_dtype``: the parameters
    are master weights in another type, cast to this one once per step before the forward (their gradients
    come back in the master type). ``grads_fn(params, inputs, targets) -> (loss, grads)``: how a training step
    gets its loss and gradients when it is not by differentiating the forward (a 1F1B pipeline's own)."""

    accumulate = microbatches > 1 and last_stage is None

    def computed(prm):                         # master weights: the copy the step computes with
        return prm if compute_dtype is None else jax.tree.map(lambda w: w.astype(compute_dtype), prm)

    def infer_step(params, inputs):
        if not accumulate:
            return forward(params, inputs, col)
        out = jax.lax.map(lambda mb: forward(params, mb, col), tuple(_microbatches(a, microbatches) for a in inputs))
        return out.reshape(-1, *out.shape[2:])

    def loss_fn(prm, inputs, targets):
        prm = computed(prm)
        if last_stage is None:
            return model.loss(forward(prm, inputs, col), targets, col) * loss_scale
        loss = forward(prm, inputs, col, targets) * loss_scale        # the pipeline's own loss per tick
        return jnp.where(jax.lax.axis_index("pp") == last_stage, loss, jnp.zeros_like(loss))

    def train_step(params, opt_state, inputs, targets):
        if grads_fn is not None:
            loss, grads = grads_fn(computed(params), inputs, targets)
            grads = jax.tree.map(lambda g, w: g.astype(w.dtype), grads, params)
        elif accumulate:
            def add(total, batch):
                loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
                return jax.tree.map(jnp.add, total, (loss.astype(jnp.float32), grads)), None

            zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            batches = (tuple(_microbatches(a, microbatches) for a in inputs), _microbatches(targets, microbatches))
            (loss, grads), _ = jax.lax.scan(add, zero, batches)
        else:
            loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
        loss, grads = reduce(loss, grads)
        params, opt_state = apply_update(params, grads, opt_state, optimizer)
        return params, opt_state, loss

    return train_step if train else infer_step


def _mesh_layouts(model: LayeredModel, mesh: dict[str, int]) -> tuple[dict[str, Axes], dict[str, Axes],
                                                                      dict[str, Axes]]:
    """(tp, fsdp, ep) split dimension of every parameter of each group on ``mesh``: tp and ep as the model
    names them, fsdp the largest other dimension the fsdp size divides (see :func:`~.parallel.fsdp_axis`)."""
    tp_layout = layouts(model, "tp", 1) if "tp" in mesh else layouts(model, "dp", 1)
    ep_layout = layouts(model, "ep", 1) if "ep" in mesh else layouts(model, "dp", 1)
    fsdp_layout: dict[str, Axes] = {}
    for group, shapes in (("top", model.top), ("layer", model.layer)):
        fsdp_layout[group] = {}
        for k, sh in shapes.items():
            dim = None
            if "fsdp" in mesh:
                avoid = (tp_layout[group][k], ep_layout[group][k])
                free = [d if i not in avoid else 0 for i, d in enumerate(sh.shape)]
                dim = fsdp_axis(tuple(free), mesh["fsdp"])
            fsdp_layout[group][k] = dim
    return tp_layout, fsdp_layout, ep_layout


def _mesh_specs(shapes: Any, **axes: Any) -> Any:
    """PartitionSpecs naming each mesh axis of ``axes`` (``tp=tree, fsdp=tree, …``: trees of split
    dimensions in the structure of ``shapes``) at the dimension its tree gives."""
    if isinstance(shapes, dict):
        return {k: _mesh_specs(shapes[k], **{a: t[k] for a, t in axes.items()}) for k in shapes}
    if isinstance(shapes, list):
        return [_mesh_specs(c, **{a: t[i] for a, t in axes.items()}) for i, c in enumerate(shapes)]
    dims: list[str | None] = [None] * len(shapes.shape)
    for name, dim in axes.items():
        if dim is not None:
            dims[dim] = name
    return P(*dims)


def argument_roles(model: LayeredModel, shapes: Any, opt: Any, train: bool) -> list[tuple[str, int]]:
    """What a step's arguments hold, in order: the parameters, the optimizer state, the batch (inputs and,
    when training, the targets)."""
    return [("parameters", len(jax.tree.leaves(shapes))), ("optimizer_state", len(jax.tree.leaves(opt))),
            ("batch", len(model.inputs) + (1 if train else 0))]


def export_mesh_step(model: LayeredModel, *, step: str, optimizer: str, mesh: dict[str, int], scan: bool,
                     name: str, microbatches: int = 1, remat: str = "none", chunks: int = 1,
                     sequence_parallel: bool = False, master: str = "none", one_f_one_b: bool = False) -> str:
    """Export ``model``'s step on a mesh of several axes at once (``{"pp": S, "dp": D, "fsdp": F, "tp": T}``,
    any subset), with ``shard_map`` over an abstract mesh laid out as :data:`MESH_AXES`: the batch split over
    dp × fsdp × ep, parameters split over tp (Megatron), ep (the experts) and fsdp (gathered before use),
    gradients summed over dp (and over ep, those it does not split).
    With ``pp`` the layers are split into that many consecutive stages, run as a pipeline of
    ``microbatches`` (:func:`pipeline_forward_fn`: GPipe, or interleaved with ``chunks`` per stage); without
    it, ``microbatches`` > 1 accumulates gradients.
    ``remat``: activation recomputation (:data:`REMAT`); ``sequence_parallel``: Megatron's sequence
    parallelism inside tp (:class:`~.parallel.Collectives`); ``master="f32"``: the parameters, their
    gradients and the optimizer state are f32 master weights of a step computed in the model's own type;
    ``one_f_one_b``: a training step's pipeline runs 1F1B (:func:`pipeline_1f1b_fn`) instead of GPipe."""
    sizes = {a: mesh[a] for a in MESH_AXES if mesh.get(a, 1) > 1}
    train = step == "train"
    stages = sizes.get("pp", 1)
    stacked = scan or stages > 1
    tp_layout, fsdp_layout, ep_layout = _mesh_layouts(model, sizes)
    shapes = param_shapes(model, stacked)
    compute_dtype = None
    if master == "f32":
        compute_dtype = jax.tree.leaves(shapes)[0].dtype
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), shapes)
    ep_axes = param_axes(model, ep_layout, stacked)
    p_specs = _mesh_specs(shapes, tp=param_axes(model, tp_layout, stacked),
                          fsdp=param_axes(model, fsdp_layout, stacked), ep=ep_axes)
    if stages > 1:                             # each stage holds its consecutive layers
        p_specs["layers"] = jax.tree.map(lambda sp: P("pp", *tuple(sp)[1:]), p_specs["layers"],
                                         is_leaf=lambda sp: isinstance(sp, P))
        forward = pipeline_forward_fn(model, stages=stages, microbatches=microbatches, scan=scan, remat=remat,
                                      chunks=chunks)
    else:
        forward = forward_fn(model, scan, remat)
    batch_axes = tuple(a for a in ("dp", "fsdp", "ep") if a in sizes)
    batch_spec = P(batch_axes or None, "cp") if "cp" in sizes else (P(batch_axes) if batch_axes else P())
    in_batch = tuple(batch_spec for _ in model.inputs)
    opt = opt_shapes(shapes, optimizer) if train else ()
    col = Collectives("mesh", int(np.prod(list(sizes.values()) or [1])), fsdp_layout,
                      mesh_axes={a: a for a in ("fsdp", "ep", "cp", "tp") if a in sizes},
                      sequence_parallel=sequence_parallel)
    shared = batch_axes + (("cp",) if "cp" in sizes else ())     # devices whose losses make one mean
    loss_scale = 1.0 / float(np.prod([sizes[a] for a in shared] or [1]))
    if stages == 1:
        loss_scale /= microbatches

    tp_axes = param_axes(model, tp_layout, stacked)

    def reduce(loss, grads):
        replicas = tuple(a for a in ("dp", "cp") if a in sizes)
        if replicas:                           # fsdp's gradients come back reduce-scattered from the gathers
            grads = jax.tree.map(lambda g: jax.lax.psum(g, replicas), grads)
        if "ep" in sizes:                      # ep splits the batch too: what it does not split, it sums
            grads = jax.tree.map(lambda a, g: jax.lax.psum(g, "ep") if a is None else g, ep_axes, grads,
                                 is_leaf=lambda a: a is None)
        if col.sequence_parallel:              # a norm's weights saw only this device's part of the sequence
            grads = jax.tree.map(lambda a, g: jax.lax.psum(g, "tp") if a is None else g, tp_axes, grads,
                                 is_leaf=lambda a: a is None)
        if stages > 1 and model.pp_shared:     # a tied embedding: first and last stage's gradients summed
            top = dict(grads["top"])
            top.update({k: jax.lax.psum(top[k], "pp") for k in model.pp_shared})
            grads = {**grads, "top": top}
        loss_axes = shared + (("pp",) if stages > 1 else ())
        if loss_axes:
            loss = jax.lax.psum(loss, loss_axes)
        return loss, grads

    grads_fn = None
    if train and stages > 1 and one_f_one_b:
        grads_fn = pipeline_1f1b_fn(model, stages=stages, microbatches=microbatches, col=col, loss_scale=loss_scale)
    fn = _step_fn(model, forward, col, loss_scale, optimizer, reduce, train, microbatches=microbatches,
                  last_stage=stages - 1 if stages > 1 else None, compute_dtype=compute_dtype, grads_fn=grads_fn)
    args = (shapes, opt, model.inputs, model.targets) if train else (shapes, model.inputs)
    in_specs = ((p_specs, opt_specs(p_specs, optimizer), in_batch, batch_spec) if train else (p_specs, in_batch))
    out_specs = (p_specs, opt_specs(p_specs, optimizer), P()) if train else batch_spec
    roles = argument_roles(model, shapes, opt, train)
    if not sizes:
        return export_jax(fn, *args, name=name, argument_roles=roles)
    abstract = AbstractMesh(tuple(sizes.values()), tuple(sizes))
    sharded = jax.shard_map(fn, mesh=abstract, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return export_jax(sharded, *args, name=name, argument_roles=roles)


def export_step(model: LayeredModel, *, step: str, optimizer: str, devices: int, parallel: str,
                scan: bool, name: str) -> str | bytes:
    """Export ``model``'s inference or training step. One device: plain StableHLO text. Several:
    ``parallel`` is an explicit strategy (shard_map; text) or ``<strategy>-partitioned`` (XLA's SPMD
    output; bytecode)."""
    train = step == "train"
    strategy = base_strategy(parallel) if devices > 1 else "none"
    partitioned = devices > 1 and is_partitioned(parallel)
    layout = layouts(model, strategy, devices)
    shapes = param_shapes(model, scan)
    axes = param_axes(model, layout, scan)
    p_specs = _specs(axes, shapes)
    batch_sharded = strategy in BATCH_SHARDED
    batch_spec = P(AXIS) if batch_sharded else P()
    in_batch = tuple(batch_spec for _ in model.inputs)
    forward = forward_fn(model, scan)
    opt = opt_shapes(shapes, optimizer) if train else ()

    explicit = strategy != "none" and not partitioned
    col = Collectives(strategy if explicit else "none", devices, layout)
    loss_scale = 1.0 / devices if explicit and batch_sharded else 1.0

    def reduce(loss, grads):
        if explicit and strategy in ("dp", "ep"):
            grads = psum_replicated(grads, axes)
        if explicit and batch_sharded:
            loss = jax.lax.psum(loss, AXIS)
        return loss, grads

    fn = _step_fn(model, forward, col, loss_scale, optimizer, reduce, train)
    args = (shapes, opt, model.inputs, model.targets) if train else (shapes, model.inputs)
    roles = argument_roles(model, shapes, opt, train)
    if strategy == "none":
        return export_jax(fn, *args, name=name, argument_roles=roles)
    mesh = make_mesh(devices, partitioned=partitioned)
    in_specs = ((p_specs, opt_specs(p_specs, optimizer), in_batch, batch_spec) if train
                else (p_specs, in_batch))
    out_specs = (p_specs, opt_specs(p_specs, optimizer), P()) if train else batch_spec
    if partitioned:
        def named(tree):
            return jax.tree.map(lambda s: NamedSharding(mesh, s), tree, is_leaf=lambda s: isinstance(s, P))
        return export_partitioned(fn, *args, in_shardings=named(in_specs),
                                  out_shardings=named(out_specs) if train else None, name=name)
    # check_vma=False: every collective is written out (gradients of replicated parameters stay
    # per-device until the explicit psum; the Collectives' custom gradients are the backward ones).
    sharded = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return export_jax(sharded, *args, name=name, argument_roles=roles)


def _top_read_by(fn: Callable[[Any], Any], top: Shapes) -> list[str]:
    """The names of the ``top`` parameters ``fn(top)`` reads (traced, not run)."""
    closed = jax.make_jaxpr(fn)(top)
    read = {id(v) for eqn in closed.jaxpr.eqns for v in eqn.invars} | {id(v) for v in closed.jaxpr.outvars}
    names = [k for k, _ in sorted(top.items())]              # the order a dict's leaves are flattened in
    return [k for k, v in zip(names, closed.jaxpr.invars) if id(v) in read]


def _traced_shapes(fn, args, in_specs, out_specs, tp: int):
    """The shapes ``fn`` returns for ``args`` (inside shard_map over tp when ``tp`` > 1), traced, not run."""
    if tp > 1:
        fn = jax.shard_map(fn, mesh=AbstractMesh((tp,), ("tp",)), in_specs=in_specs, out_specs=out_specs,
                           check_vma=False)
    return jax.eval_shape(fn, *args)


def export_role(model: LayeredModel, p: dict[str, Any], name: str) -> str:
    """One pipeline stage's program (``p["role"]``, :data:`~.checks.ROLES`) on one device, or with
    ``mesh=tp:T`` on the stage's tensor-parallel group (shard_map: the weights split as Megatron splits them,
    the activations whole on every device), with ``model``'s ``layers`` the stage's (or chunk's) layers and
    its batch one microbatch:

    * ``forward:first`` (top, layers, tokens) -> activation; ``forward:middle`` (layers, activation, ctx) ->
      activation; ``forward:last`` (top, layers, activation, ctx[, targets]) -> the loss (training) or the
      output. ``ctx`` is what the embedding hands every block besides the activation (a transformer's
      rotary tables), which a stage without the embedding takes as an argument. In training a forward also
      returns what the stage keeps for the microbatch's backward: what jax's gradient of the stage needs
      besides the parameters, under ``remat`` (none: every intermediate the gradients read; full: each
      layer's input, the layer made again in the backward; selective: that and the projections).
    * ``backward:PLACE`` (top, layers, what the forward kept, the gradient of the activation it handed on
      (not the last stage: its loss's own)) -> the gradients of its parameters and of the activation it took
      (not the first stage's: tokens have none).
    * ``update:PLACE`` (parameters, gradients, optimizer state) -> (parameters, optimizer state): the
      optimizer step over the stage's parameters. Under ``dist_opt`` with ``mesh=dp:D[,tp:T]``, over this
      device's shard of them: 1/D of each tensor-parallel part, flattened (Megatron-LM's distributed
      optimizer, which updates a flat slice of the gradient buffer).

    ``top`` is the part of the model's top parameters the place reads (the first stage the embedding's, the
    last the head's and the loss's)."""
    kind, place = p["role"].split(":")
    train = p["step"] == "train"
    one = Collectives()                        # shapes and what is read are the same on a tp group
    first, last = place == "first", place == "last"
    inputs = model.inputs
    embedded = jax.eval_shape(lambda t, i: model.embed(t, i, one), model.top, inputs)
    activation, ctx = embedded
    shapes = param_shapes(model, True)         # a stage's layers run as one scan
    used = set()
    if first:
        used |= set(_top_read_by(lambda t: model.embed(t, inputs, one)[0], model.top))
    if last:
        def head_loss(t):
            out = model.head(t, jnp.zeros(activation.shape, activation.dtype), ctx_zeros(), one)
            return model.loss(out, jnp.zeros(model.targets.shape, model.targets.dtype), one) if train else out

        def ctx_zeros():
            return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), ctx)

        used |= set(_top_read_by(head_loss, model.top))
    top = {k: v for k, v in shapes["top"].items() if k in used}
    layers = shapes["layers"]
    tp = mesh_of(p).get("tp", 1)
    sp = bool(p.get("sp")) and tp > 1
    col = Collectives("mesh", tp, {}, mesh_axes={"tp": "tp"}, sequence_parallel=sp) if tp > 1 else one
    if tp > 1:                                 # Megatron's split of the weights
        tp_layout = _mesh_layouts(model, {"tp": tp})[0]
        axes = param_axes(model, tp_layout, True)
        specs = _mesh_specs(shapes, tp=axes)
        top_spec = {k: v for k, v in specs["top"].items() if k in used}
        layer_spec = specs["layers"]
        axes = {"top": {k: v for k, v in axes["top"].items() if k in used}, "layers": axes["layers"]}
    else:
        top_spec = layer_spec = axes = None
    # between the tp regions an activation is whole on every device, or under sp this device's part of the
    # sequence (so is what a stage sends on, and what it keeps)
    act_spec = P(None, "tp") if sp else P()

    def export(fn, args, arg_specs, out_specs, roles):
        """``fn`` exported on one device, or inside shard_map over the stage's tp group; every argument kept
        (a backward reads its embedding table's shape only, yet the table is in memory)."""
        if tp > 1:
            fn = jax.shard_map(fn, mesh=AbstractMesh((tp,), ("tp",)), in_specs=arg_specs, out_specs=out_specs,
                               check_vma=False)
        return export_jax(jax.jit(fn, keep_unused=True), *args, name=name, argument_roles=roles)

    def whole(tree):
        return jax.tree.map(lambda _: P(), tree)

    remat = p.get("remat", "none")

    def full(top_p):
        return {**{k: None for k in model.top}, **top_p}

    def stage(top_p, layer_p, x, c, targets=None):
        """The stage's work on one microbatch: (embed,) its layers under ``remat`` (, head and loss)."""
        if first:
            x, c = model.embed(full(top_p), x, col)
        h = run_layers(model, layer_p, x, c, col, scan=True, remat=remat)
        if not last:
            return h
        out = model.head(full(top_p), h, c, col)
        return model.loss(out, targets, col).astype(jnp.float32) if train else out

    taken = inputs if first else activation
    ctx_arg = () if first else (ctx,)
    target_arg = (model.targets,) if last and train else ()
    n_params = len(jax.tree.leaves(top)) + len(jax.tree.leaves(layers))
    args = (top, layers, taken, *ctx_arg, *target_arg)
    in_specs = (top_spec, layer_spec, whole(taken) if first else act_spec, *whole((*ctx_arg, *target_arg)))
    pullback: dict[str, Any] = {}

    def forward(top_p, layer_p, x, *rest):
        c = None if first else rest[0]
        goal = rest[len(ctx_arg):]
        if not train:
            return stage(top_p, layer_p, x, c, *goal)
        if first:                              # tokens have no gradient
            out, pull = jax.vjp(lambda t, lp: stage(t, lp, x, c, *goal), top_p, layer_p)
        else:
            out, pull = jax.vjp(lambda t, lp, a: stage(t, lp, a, c, *goal), top_p, layer_p, x)
        # what the backward needs (jax's residuals) but the parameters, which the stage holds anyway
        leaves, treedef = jax.tree.flatten(pull)
        params = jax.tree.leaves((top_p, layer_p))
        which = [next((i for i, q in enumerate(params) if q is leaf), None) for leaf in leaves]
        pullback.update(treedef=treedef, which=which)
        kept = [leaf[None] if tp > 1 else leaf for leaf, w in zip(leaves, which) if w is None]
        return out, kept

    if train:
        out_spec = (P() if last else act_spec, P("tp"))
    else:
        out_spec = P(None, None, "tp") if last else act_spec        # an output: vocab-split logits
    if kind == "forward":
        return export(forward, args, in_specs, out_spec,
                      [("parameters", n_params), ("activations", len(jax.tree.leaves(args[2:])))])
    if kind == "backward":
        kept_shapes = _traced_shapes(forward, args, in_specs, out_spec, tp)[1]
        grad_in = () if last else (activation,)

        def backward(top_p, layer_p, kept, *g):
            params = jax.tree.leaves((top_p, layer_p))
            left = iter(kept)
            leaves = [params[w] if w is not None else (next(left)[0] if tp > 1 else next(left))
                      for w in pullback["which"]]
            pull = jax.tree.unflatten(pullback["treedef"], leaves)
            return pull(jnp.ones((), jnp.float32) if last else g[0])

        out_specs = (top_spec, layer_spec) if first else (top_spec, layer_spec, act_spec)
        return export(backward, (top, layers, kept_shapes, *grad_in),
                      (top_spec, layer_spec, [P("tp")] * len(kept_shapes), *(act_spec for _ in grad_in)), out_specs,
                      [("parameters", n_params), ("kept", len(kept_shapes)), ("incoming", len(grad_in))])
    params = {"top": top, "layers": layers}
    master = p.get("master", "none") == "f32"
    if master:                                 # f32 master weights, gradients and state; a copy to compute with
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), params)
    shards = mesh_of(p).get("dp", 1) if p.get("dist_opt") else 1
    param_specs = {"top": top_spec, "layers": layer_spec} if tp > 1 else None
    if shards > 1:                             # this device's 1/shards of each (tp-local) parameter, flat
        leaves, treedef = jax.tree.flatten(params)
        split = jax.tree.leaves(axes, is_leaf=lambda a: a is None) if tp > 1 else [None] * len(leaves)

        def flat_shard(a, axis):
            local = math.prod(a.shape) // (tp if axis is not None else 1)
            return jax.ShapeDtypeStruct((-(-local // shards) * tp,), a.dtype)

        params = jax.tree.unflatten(treedef, [flat_shard(a, axis) for a, axis in zip(leaves, split)])
        if tp > 1:
            param_specs = jax.tree.map(lambda _: P("tp"), params)
    opt = opt_shapes(params, p["optimizer"])
    compute = jax.tree.leaves(shapes)[0].dtype

    def update(prm, grads, opt_state):
        if sp:                                 # a norm's weights saw this device's part of the sequence only
            grads = jax.tree.map(lambda a, g: jax.lax.psum(g, "tp") if a is None else g, axes, grads,
                                 is_leaf=lambda a: a is None)
        prm, opt_state = apply_update(prm, grads, opt_state, p["optimizer"])
        return (prm, opt_state, jax.tree.map(lambda w: w.astype(compute), prm)) if master else (prm, opt_state)

    o_specs = opt_specs(param_specs, p["optimizer"]) if tp > 1 else None
    outs = (param_specs, o_specs, param_specs) if master else (param_specs, o_specs)
    return export(update, (params, params, opt), (param_specs, param_specs, o_specs), outs,
                  [("parameters", n_params), ("gradients", n_params), ("optimizer_state", len(jax.tree.leaves(opt)))])


def export_family_step(model: LayeredModel, p: dict[str, Any], family: str) -> str | bytes:
    """The step a zoo family's parameters ``p`` ask for (``step``, ``optimizer``, ``scan``; ``microbatch`` and
    ``remat`` where the family has them): on the mesh ``p`` names, else on ``devices`` shared as ``parallel``
    says; the module is called ``zoo_<family>_<step>``. With a ``role``, one pipeline stage's program
    instead (:func:`export_role`), called ``zoo_<family>_<kind>_<place>``."""
    if p.get("role"):
        return export_role(model, p, f"zoo_{family}_{p['role'].replace(':', '_')}")
    if p.get("dist_opt"):
        raise ExportError("dist_opt=true is laid out from each pipeline stage's own programs (simulate --pipeline "
                         "stages); the one-program step keeps the whole optimizer state (fsdp shards it)")
    name = f"zoo_{family}_{p['step']}"
    if p.get("mesh") or p.get("microbatch") or p.get("remat", "none") != "none" or p.get("sp") \
            or p.get("master", "none") != "none":
        mesh = mesh_of(p)
        return export_mesh_step(model, step=p["step"], optimizer=p["optimizer"], mesh=mesh,
                                scan=p.get("scan", False), name=name, microbatches=microbatch_count(p, mesh),
                                remat=p.get("remat", "none"), chunks=schedule_chunks(p.get("schedule", "gpipe")),
                                sequence_parallel=bool(p.get("sp")), master=p.get("master", "none"),
                                one_f_one_b=p.get("schedule") == "1f1b")
    return export_step(model, step=p["step"], optimizer=p["optimizer"], devices=p["devices"],
                       parallel=p["parallel"], scan=p.get("scan", False), name=name)


__all__ = ["REMAT", "LayeredModel", "apply_update", "argument_roles", "block_fn", "export_family_step",
           "export_mesh_step", "export_role", "export_step", "forward_fn", "layouts", "opt_shapes", "param_axes", "param_shapes",
           "pipeline_1f1b_fn", "pipeline_forward_fn", "run_layers"]
