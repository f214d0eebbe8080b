"""Collective device groups: ``replica_groups`` / ``source_target_pairs`` turned into logical device ids.

Ids are ``replica * num_partitions + partition``. Groups written in replica or partition ids are expanded
following XLA's collective group modes; mesh-axes groups (``#stablehlo.replica_group_mesh_axes``) are
resolved against the module's ``sdy.mesh`` symbols. Ids outside the program's devices are an error, except
that a module declaring no device count takes its count from the groups it uses.
"""
from __future__ import annotations

import re
from typing import Callable

import numpy as np

from .bindings import line_of, mlir, text_of
from .errors import IngestError

MAX_DEVICES = 65_536
# Collectives whose ops carry a use_global_device_ids flag (XLA's group-mode rules differ for the rest).
GLOBAL_ID_KINDS = {"all_reduce", "all_gather", "reduce_scatter"}


class DeviceGroups:
    """The program's device counts and meshes, and the resolution of each collective's groups."""

    def __init__(self, source: str):
        self.source = source
        self.replicas = 1
        self.partitions = 1
        self.implicit_devices = False             # no device count declared: inferred from groups
        self.inferred_devices = False
        self.meshes: dict[str, list[tuple[str, int]]] = {}
        self.mesh_device_ids: dict[str, list[int]] = {}

    def fail(self, op, message: str) -> IngestError:
        return IngestError(self.source, f"{op.name} at {line_of(op)}: {message}")

    def read_mesh(self, op) -> None:
        """Record an ``sdy.mesh`` symbol: its axes and explicit device ids."""
        name = text_of(op.attributes["sym_name"])
        axes, ids = mesh_from_attr(op.attributes["mesh"])
        for axis, size in axes:
            if size < 1:
                raise self.fail(op, f"mesh axis '{axis}' has size {size}")
        size = int(np.prod([s for _, s in axes], dtype=object)) if axes else 1
        if size > MAX_DEVICES:
            raise self.fail(op, f"mesh @{name} has {size} devices (more than {MAX_DEVICES})")
        if ids is not None and len(ids) != size:
            raise self.fail(op, f"mesh @{name} lists {len(ids)} device ids for {size} devices")
        self.meshes[name] = axes
        if ids is not None:
            self.mesh_device_ids[name] = ids

    def mesh_size(self, name: str) -> int:
        """Devices a mesh spans (its explicit ids may name more than the product of its axes)."""
        ids = self.mesh_device_ids.get(name)
        size = int(np.prod([s for _, s in self.meshes[name]], dtype=object)) if self.meshes[name] else 1
        return max(size, max(ids) + 1 if ids else 0)

    def replica_groups(self, op, attr) -> list[list[int]] | dict:
        """Dense groups as written (``-1`` padding dropped), or mesh-axes groups resolved to device ids."""
        _, ir, _ = mlir()
        if isinstance(attr, ir.DenseIntElementsAttr):
            arr = np.array(attr)
            if arr.size == 0:
                return []
            if arr.ndim != 2:
                raise self.fail(op, f"replica_groups must be a 2-d array, got shape {list(arr.shape)}")
            if arr.size > MAX_DEVICES * 4:
                raise self.fail(op, f"replica_groups has {arr.size} entries")
            return [[int(x) for x in row if x != -1] for row in arr]
        text = str(attr)
        if "replica_group_mesh_axes" not in text:
            raise self.fail(op, f"replica_groups in an unknown form: {text[:80]}")
        groups = self._mesh_axes_groups(op, text)
        return {"mesh_axes": groups}  # marker: already device ids (replaced in resolve)

    def _mesh_axes_groups(self, op, text: str) -> list[list[int]]:
        m = re.search(r'mesh\s*=\s*@(?:"((?:[^"\\]|\\.)*)"|([\w.$-]+))', text)
        if not m:
            raise self.fail(op, f"replica_groups names no mesh: {text[:100]}")
        mesh_name = m.group(1) if m.group(1) is not None else m.group(2)
        if mesh_name not in self.meshes:
            raise self.fail(op, f"replica_groups refer to an unknown mesh @{mesh_name}")
        mesh = self.meshes[mesh_name]
        sizes = {a: s for a, s in mesh}
        axes_text = text[text.find("axes", m.end()):]
        refs: list[tuple[str, int, int]] = []   # (axis, pre_size, size)
        for r in re.finditer(r'"((?:[^"\\]|\\.)*)"(?:\s*:\s*\((\d+)\)\s*(\d+)|\s*,\s*sub_axis_info\s*=\s*'
                             r'\((\d+)\)\s*(\d+))?', axes_text):
            axis = r.group(1)
            if axis not in sizes:
                raise self.fail(op, f"replica_groups use axis '{axis}' that mesh @{mesh_name} does not have")
            pre = r.group(2) or r.group(4)
            sub = r.group(3) or r.group(5)
            if pre is None:
                refs.append((axis, 1, sizes[axis]))
            else:
                pre_i, sub_i = int(pre), int(sub)
                if pre_i < 1 or sub_i < 1 or sizes[axis] % (pre_i * sub_i):
                    raise self.fail(op, f"sub-axis '{axis}':({pre_i}){sub_i} does not divide axis size {sizes[axis]}")
                refs.append((axis, pre_i, sub_i))
        # Split each mesh axis into the pieces the references need (major to minor).
        cuts: dict[str, set[int]] = {a: {1, s} for a, s in mesh}
        for axis, pre, size in refs:
            cuts[axis] |= {pre, pre * size}
        piece_shape: list[int] = []
        piece_of: dict[tuple[str, int], int] = {}   # (axis, cumulative size before piece) -> piece index
        for axis, total in mesh:
            bounds = sorted(cuts[axis])
            for lo, hi in zip(bounds, bounds[1:]):
                if hi % lo:
                    raise self.fail(op, f"sub-axes of '{axis}' overlap inconsistently")
                piece_of[(axis, lo)] = len(piece_shape)
                piece_shape.append(hi // lo)
        group_pieces: list[int] = []
        for axis, pre, size in refs:
            bounds = sorted(b for b in cuts[axis] if pre <= b < pre * size)
            for b in bounds:
                p = piece_of[(axis, b)]
                if p in group_pieces:
                    raise self.fail(op, f"replica_groups use axis '{axis}' twice")
                group_pieces.append(p)
        total = int(np.prod(piece_shape, dtype=object)) if piece_shape else 1
        ids = np.array(self.mesh_device_ids.get(mesh_name, list(range(total))), dtype=np.int64)
        ids = ids.reshape(piece_shape) if piece_shape else ids.reshape(())
        other = [i for i in range(len(piece_shape)) if i not in group_pieces]
        group_size = int(np.prod([piece_shape[i] for i in group_pieces], dtype=object)) if group_pieces else 1
        return np.transpose(ids, other + group_pieces).reshape(-1, group_size).tolist()

    def resolve(self, op, kind: str, attrs: dict) -> None:
        """Turn replica/partition ids into logical device ids (XLA group modes) and check their range.

        Modes: without a channel, ids are replica ids (groups repeat for every partition); with a channel,
        all_reduce/all_gather/reduce_scatter use flattened device ids when ``use_global_device_ids`` is
        set, else replica ids spanning all partitions; the other collectives use partition ids.
        """
        handle = attrs.get("channel_handle")
        has_channel = isinstance(handle, dict) and isinstance(handle.get("handle"), int) and handle["handle"] > 0
        if kind in GLOBAL_ID_KINDS and has_channel:
            mode = "flat" if attrs.get("use_global_device_ids") else "replica_and_partition"
        else:
            mode = "partition" if has_channel else "replica"
        if "replica_groups" in attrs:
            groups = attrs["replica_groups"]
            if isinstance(groups, dict):   # resolved mesh-axes form: device ids already
                groups, mode = groups["mesh_axes"], "flat"
            elif not isinstance(groups, list) or any(not isinstance(g, list) for g in groups):
                raise self.fail(op, "replica_groups is not a list of groups")
            if not groups:                 # empty: every participant in one group
                groups = [list(range(self._bound(mode)))]
            for g in groups:
                if len(set(g)) != len(g):
                    raise self.fail(op, f"replica group {g[:16]} names the same id twice")
                self._check_ids(op, g, mode)
            if mode == "replica_and_partition":
                P = self.partitions
                attrs["replica_groups"] = [[r * P + p for r in g for p in range(P)] for g in groups]
            else:
                attrs["replica_groups"] = [[f(x) for x in g] for f in self._copies(mode) for g in groups]
        if "source_target_pairs" in attrs:
            pairs = attrs["source_target_pairs"]
            if not isinstance(pairs, list) or any(not isinstance(q, list) or len(q) != 2 for q in pairs):
                raise self.fail(op, "source_target_pairs is not a list of [source, target] pairs")
            self._check_ids(op, [x for q in pairs for x in q], mode)
            attrs["source_target_pairs"] = [[f(s), f(t)] for f in self._copies(mode) for s, t in pairs]

    def _bound(self, mode: str) -> int:
        R, P = self.replicas, self.partitions
        return {"replica": R, "partition": P, "replica_and_partition": R, "flat": R * P}[mode]

    def _check_ids(self, op, ids: list[int], mode: str) -> None:
        what = {"partition": "partition", "flat": "device"}.get(mode, "replica")
        for x in ids:
            if x < 0:
                raise self.fail(op, f"negative {what} id {x} in its device groups")
            if x >= self._bound(mode):
                if self.implicit_devices and self.partitions == 1 and mode in ("replica", "flat") \
                        and x < MAX_DEVICES:
                    self.replicas = x + 1
                    self.inferred_devices = True
                    continue
                raise self.fail(op, f"{what} id {x} in its device groups, but the program has "
                                f"{self._bound(mode)} {what}s")

    def _copies(self, mode: str) -> list[Callable[[int], int]]:
        """One id -> device-id map per copy of the groups (per partition / per replica)."""
        R, P = self.replicas, self.partitions
        if mode == "replica" and P > 1:
            return [lambda x, p=p: x * P + p for p in range(P)]
        if mode == "partition" and R > 1:
            return [lambda x, r=r: r * P + x for r in range(R)]
        return [lambda x: x]


def mesh_from_attr(attr) -> tuple[list[tuple[str, int]], list[int] | None]:
    """Axes ``[(name, size)]`` and explicit device ids (or None) of an ``#sdy.mesh`` attribute."""
    try:
        from jax.extend.mlir.dialects import sdy

        mesh = sdy.MeshAttr(attr)
        axes = [(a.name, int(a.size)) for a in (sdy.MeshAxisAttr(x) for x in mesh.axes)]
        ids = [int(i) for i in mesh.device_ids]
        return axes, (ids or None)
    except Exception:  # older bindings: read the printed form
        text = str(attr)
        axes = [(a, int(s)) for a, s in re.findall(r'"((?:[^"\\]|\\.)*)"\s*=\s*(\d+)', text)]
        m = re.search(r'device_ids\s*=\s*\[([-\d,\s]*)\]', text)
        ids = [int(x) for x in m.group(1).split(",") if x.strip()] if m else None
        return axes, (ids or None)
