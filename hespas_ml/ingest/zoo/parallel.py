"""Parallelism building blocks for zoo families: meshes, sharding layouts, and explicit collectives
whose gradients are the collectives a hand-written distributed step would use.

Strategies (the ``parallel`` parameter of a family; one mesh axis of ``devices`` devices):

* ``dp`` — data parallel: parameters replicated, the batch split; gradients summed with ``psum``.
* ``fsdp`` — fully sharded data parallel: every parameter split along one axis (see
  :func:`fsdp_axis`), gathered with ``all_gather`` right before use; the gradient of that gather is a
  ``psum_scatter`` (reduce-scatter), so gradients come back sharded. The batch is split.
* ``tp`` — Megatron tensor parallel: weights split along the axis a layout names (heads, hidden units);
  the model marks where a parallel region starts (:meth:`Collectives.enter_tp`: identity forward,
  all-reduce backward) and ends (:meth:`Collectives.exit_tp`: all-reduce forward, identity backward).
  The batch is replicated.
* ``ep`` — expert parallel: expert weights split along the expert axis, tokens split with the batch;
  tokens reach their experts and come back with ``all_to_all``. Other parameters as in ``dp``.
* ``<strategy>-partitioned`` — the same layouts given to ``jax.jit`` as ``in_shardings``; XLA's SPMD
  partitioner chooses the collectives (the model's collective calls are then identities).

This module imports jax; import it only inside a generator.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

AXIS = "devices"
"""Name of the one mesh axis every strategy uses."""

EXPLICIT = ("dp", "fsdp", "tp", "ep")
BATCH_SHARDED = ("dp", "fsdp", "ep")

Axes = dict[str, "int | None"]
"""For each parameter of a group (by name), the axis a strategy splits, or None (replicated)."""


def base_strategy(parallel: str) -> str:
    """``fsdp`` for ``fsdp`` and ``fsdp-partitioned``."""
    return parallel.removesuffix("-partitioned")


def is_partitioned(parallel: str) -> bool:
    return parallel.endswith("-partitioned")


def make_mesh(n: int, *, partitioned: bool) -> Mesh | AbstractMesh:
    """A one-axis mesh of ``n`` devices with an Auto axis. For XLA's partitioner (``partitioned``) the
    first ``n`` devices, which must exist; for ``shard_map`` an abstract mesh: the per-device program and
    its device groups are written without any device (``jax.make_mesh`` would default to Explicit axes)."""
    if partitioned:
        return Mesh(np.array(jax.devices()[:n]), (AXIS,))
    return AbstractMesh((n,), (AXIS,))


def fsdp_axis(shape: tuple[int, ...], n: int) -> int | None:
    """The axis FSDP splits a parameter of ``shape`` along over ``n`` devices: the largest axis that
    ``n`` divides (the first of equals), or None when none does (the parameter stays replicated)."""
    best = None
    for i, d in enumerate(shape):
        if d % n == 0 and d >= n and (best is None or d > shape[best]):
            best = i
    return best


def spec(axis: int | None, ndim: int) -> P:
    """PartitionSpec splitting ``axis`` of an ``ndim``-dimensional array over the mesh axis."""
    if axis is None:
        return P()
    return P(*([None] * axis + [AXIS] + [None] * (ndim - axis - 1)))


# -- collectives with chosen gradients ---------------------------------------------------------------

@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _all_gather(x, name: str, axis: int):
    return jax.lax.all_gather(x, name, axis=axis, tiled=True)


def _all_gather_fwd(x, name, axis):
    return _all_gather(x, name, axis), None


def _all_gather_bwd(name, axis, _, g):
    return (jax.lax.psum_scatter(g, name, scatter_dimension=axis, tiled=True),)


_all_gather.defvjp(_all_gather_fwd, _all_gather_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _identity_psum_grad(x, name: str):
    """Identity; its gradient is summed over the axis (Megatron's "f")."""
    return x


def _ipg_fwd(x, name):
    return x, None


def _ipg_bwd(name, _, g):
    return (jax.lax.psum(g, name),)


_identity_psum_grad.defvjp(_ipg_fwd, _ipg_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _psum_identity_grad(x, name: str):
    """Sum over the axis; its gradient passes through unchanged (Megatron's "g")."""
    return jax.lax.psum(x, name)


def _pig_fwd(x, name):
    return jax.lax.psum(x, name), None


def _pig_bwd(name, _, g):
    return (g,)


_psum_identity_grad.defvjp(_pig_fwd, _pig_bwd)


SEQ_AXIS = 1
"""The sequence axis of the transformer families' activations (``[batch, seq, d_model]``)."""


class Collectives:
    """What a model calls where a parallel strategy communicates. ``strategy`` is ``"none"`` (single
    device or compiler-partitioned: every call is the identity) or one of :data:`EXPLICIT`, inside
    ``shard_map`` over :data:`AXIS` with ``size`` devices; or ``"mesh"``, inside ``shard_map`` over a mesh of
    several axes, ``mesh_axes`` naming the mesh axis of each role (``fsdp``, ``tp``, ``ep``) it has. ``axes``
    maps a parameter group name to its FSDP layout (used by :meth:`gather`)."""

    def __init__(self, strategy: str = "none", size: int = 1, axes: dict[str, Axes] | None = None,
                 mesh_axes: dict[str, str] | None = None, sequence_parallel: bool = False):
        self.strategy = strategy
        self.size = size
        self.axes = axes or {}
        self.mesh_axes = mesh_axes if mesh_axes is not None else ({strategy: AXIS} if strategy in EXPLICIT else {})
        # Megatron's sequence parallelism: between tensor-parallel regions the activations ([batch, seq,
        # …]) are split over tp along the sequence, so the region's entry all-gathers and its exit
        # reduce-scatters instead of all-reducing
        self.sequence_parallel = sequence_parallel and "tp" in self.mesh_axes

    def gather(self, params: dict[str, Any], group: str) -> dict[str, Any]:
        """FSDP: the full parameters of ``group`` (those named in ``params``), all-gathered; their
        gradients reduce-scatter (replicated ones: all-reduce). Identity without an FSDP axis."""
        axis = self.mesh_axes.get("fsdp")
        if axis is None:
            return params
        layout = self.axes[group]
        return {k: (_identity_psum_grad(v, axis) if layout[k] is None else _all_gather(v, axis, layout[k]))
                for k, v in params.items()}

    def enter_tp(self, x):
        """Start of a tensor-parallel region (input of column-parallel matmuls): its gradient all-reduced;
        under sequence parallelism the sequence all-gathered (its gradient reduce-scattered)."""
        axis = self.mesh_axes.get("tp")
        if axis is None:
            return x
        if self.sequence_parallel:
            return jax.lax.all_gather(x, axis, axis=SEQ_AXIS, tiled=True)
        return _identity_psum_grad(x, axis)

    def exit_tp(self, x):
        """End of a tensor-parallel region (output of a row-parallel matmul): all-reduce; under sequence
        parallelism reduce-scatter along the sequence (its gradient all-gathered)."""
        axis = self.mesh_axes.get("tp")
        if axis is None:
            return x
        if self.sequence_parallel:
            return jax.lax.psum_scatter(x, axis, scatter_dimension=SEQ_AXIS, tiled=True)
        return _psum_identity_grad(x, axis)

    def seq_shard(self, x):
        """This device's part of ``x`` along the sequence (a table indexed by position, broadcast over the
        batch) between the tensor-parallel regions: its context-parallel part, and of that its sequence-
        parallel part; ``x`` without either."""
        return self._part(self.cp_shard(x), "tp", SEQ_AXIS) if self.sequence_parallel else self.cp_shard(x)

    def cp_shard(self, x, axis: int = SEQ_AXIS):
        """Context parallelism: this device's part of ``x`` along the sequence ``axis`` (identity without cp)."""
        return self._part(x, "cp", axis) if "cp" in self.mesh_axes else x

    def cp_offset(self, local: int):
        """The position of this device's first token in the whole sequence, ``local`` tokens a device (0
        without cp)."""
        return self.cp_rank() * local if "cp" in self.mesh_axes else 0

    def cp_rank(self):
        return jax.lax.axis_index(self.mesh_axes["cp"]) if "cp" in self.mesh_axes else 0

    def cp_gather(self, x):
        """Context parallelism: ``x`` (keys or values, ``[batch, seq part, …]``) over the whole sequence,
        all-gathered (its gradient reduce-scattered); identity without cp."""
        axis = self.mesh_axes.get("cp")
        return x if axis is None else jax.lax.all_gather(x, axis, axis=SEQ_AXIS, tiled=True)

    def _part(self, x, role: str, axis: int):
        name = self.mesh_axes[role]
        size = x.shape[axis] // jax.lax.psum(1, name)
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(name) * size, size, axis=axis)

    def tp_rank(self):
        """This device's index along the tensor-parallel axis (0 without one)."""
        axis = self.mesh_axes.get("tp")
        return 0 if axis is None else jax.lax.axis_index(axis)

    def tp_sum(self, x):
        """Sum over the tensor-parallel axis whose gradient passes through unchanged (identity without one)."""
        axis = self.mesh_axes.get("tp")
        return x if axis is None else _psum_identity_grad(x, axis)

    def tp_max(self, x):
        """Maximum over the tensor-parallel axis, without a gradient (identity without one)."""
        axis = self.mesh_axes.get("tp")
        return x if axis is None else jax.lax.pmax(jax.lax.stop_gradient(x), axis)

    def to_experts(self, x, expert_axis: int = 0, slot_axis: int = 1):
        """EP: ``[experts, slots, …]`` of local tokens → ``[experts/n, n·slots, …]`` of this device's
        experts (all_to_all). Identity without an expert axis."""
        axis = self.mesh_axes.get("ep")
        return x if axis is None else jax.lax.all_to_all(x, axis, expert_axis, slot_axis, tiled=True)

    def from_experts(self, x, expert_axis: int = 0, slot_axis: int = 1):
        """EP: the inverse of :meth:`to_experts` (all_to_all back to the tokens' devices)."""
        axis = self.mesh_axes.get("ep")
        return x if axis is None else jax.lax.all_to_all(x, axis, slot_axis, expert_axis, tiled=True)


def psum_replicated(grads: Any, axes: Any):
    """Sum over devices the gradients of the leaves whose layout is None (replicated parameters)."""
    return jax.tree.map(lambda a, g: jax.lax.psum(g, AXIS) if a is None else g, axes, grads,
                        is_leaf=lambda a: a is None)


__all__ = ["AXIS", "BATCH_SHARDED", "EXPLICIT", "SEQ_AXIS", "Axes", "Collectives", "base_strategy",
           "fsdp_axis", "is_partitioned", "make_mesh", "psum_replicated",
           "spec"]
