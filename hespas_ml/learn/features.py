"""Featurisation: a region record (and a hardware target) as tensors for the surrogate.

A region record (:mod:`hespas_ml.label.region_records`) becomes, once per region and cached by its hash,
a :class:`RegionArrays`: per-node features (:data:`NODE_FEATURES`, log-scaled shape statistics, costs,
the attributes that matter — the GEMM ``count, M, N, K`` of a dot or an im2col convolution, windows,
strides, dilations, groups, reduced dims — and one-hots of element type and unit), an opcode index into a
fixed vocabulary (index 0 is the unknown bucket), bidirectional edges with :data:`EDGE_FEATURES`, and
region aggregates (:data:`REGION_FEATURES`). Its kernels and GEMMs are kept as small arrays so that the
*target-dependent* features — the analytical roofline estimate (exactly
:func:`hespas_ml.label.roofline.kernel_seconds` summed the way :class:`RooflineFidelity` does), its
compute and memory parts, and the systolic estimate (:mod:`hespas_ml.learn.estimates`) — are computed
for many regions and one target at once with numpy (:meth:`Featuriser.target_features`). The hardware
vector is :meth:`Target.to_vector` (:data:`HW_FEATURES`).

Everything here is raw (log-scaled, not standardised); the model holds the normalisers.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from math import prod
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch_geometric.data import Data

from ..costs import KNOWN_OPS
from ..label.calibration import FLOOR_OPS
from ..label.roofline import TRANSCENDENTAL_FLOPS
from ..label.targets import Target, load_target
from .config import LearnError
from .estimates import MIN_SECONDS, Estimator, systolic_gemms

DTYPE_GROUPS = ("f64", "f32", "tf32", "bf16", "f16", "f8", "i64", "i32", "i16", "i8", "i1", "other")
UNITS = ("matrix", "vector", "none")
NODE_FEATURES = (
    "log_out_elems", "out_rank", "log_out_last", "log_out_second_last", "n_results",
    "log_in_elems", "log_in_max_elems", "n_operands",
    "log_flops", "log_transcendentals", "log_bytes", "log_intensity",
    "output", "modelled", "n_outside_inputs", "log_outside_bytes", "log_expansion",
    "log_gemm_count", "log_gemm_m", "log_gemm_n", "log_gemm_k",
    "log_window_taps", "log_max_stride", "log_max_lhs_dilation", "log_max_rhs_dilation",
    "log_feature_groups", "log_batch_groups", "n_reduce_dims", "transpose_moves_last",
    "log_kernel_matrix_flops", "log_kernel_vector_flops", "log_kernel_bytes", "log_kernel_nodes",
    *(f"dtype_{d}" for d in DTYPE_GROUPS), *(f"unit_{u}" for u in UNITS),
)
EDGE_FEATURES = ("log_bytes", "operand_0", "operand_1", "operand_2", "operand_3plus", "cross_kernel", "reverse")
REGION_FEATURES = ("log_matrix_flops", "log_vector_flops", "log_transcendentals", "log_bytes",
                   "log_input_bytes", "log_output_bytes", "log_nodes", "log_kernels", "log_edges",
                   "unmodelled", "log_intensity", "log_gemms")
ROOFLINE_FEATURES = ("log_roofline_s", "log_compute_s", "log_memory_s", "log_matrix_s", "log_vector_s",
                     "compute_share")
SYSTOLIC_FEATURES = ("log_systolic_over_roofline", "systolic_utilisation")
HW_FEATURES = tuple(load_target("H100").to_vector())   # key order of Target.to_vector (fixed by targets.py)

_DTYPE_INDEX = {"f64": 0, "f32": 1, "tf32": 2, "bf16": 3, "f16": 4, "i64": 6, "i32": 7, "si32": 7, "ui32": 7,
                "i16": 8, "si16": 8, "ui16": 8, "i8": 9, "si8": 9, "ui8": 9, "i1": 10}
_UNIT_INDEX = {u: i for i, u in enumerate(UNITS)}
_N_NUMERIC = NODE_FEATURES.index("dtype_f64")
_LOG_COLUMNS = [i for i, f in enumerate(NODE_FEATURES[:_N_NUMERIC])
                if f.startswith("log_") and f not in ("log_intensity", "log_expansion")]
_INTENSITY, _EXPANSION = NODE_FEATURES.index("log_intensity"), NODE_FEATURES.index("log_expansion")
_FLOPS, _BYTES = NODE_FEATURES.index("log_flops"), NODE_FEATURES.index("log_bytes")
_WINDOW_KINDS = frozenset({"convolution", "dynamic_conv", "reduce_window", "select_and_scatter"})
_GEMM_KINDS = frozenset({"dot_general", "dot", "convolution", "dynamic_conv", "ragged_dot"})
_CALL_BITS = {kind: 1 << i for i, kind in enumerate(FLOOR_OPS)}


def default_vocabulary() -> list[str]:
    """The opcode vocabulary: every op kind the cost model knows, plus ``custom_call``, sorted."""
    return sorted(KNOWN_OPS | {"custom_call"})


def _dtype_index(dtype: str) -> int:
    idx = _DTYPE_INDEX.get(dtype)
    if idx is not None:
        return idx
    return 5 if dtype.startswith("f8") else 11


def _gemm_dims(node: dict[str, Any]) -> tuple[float, float, float, float] | None:
    """(count, M, N, K) of a dot (batch, free, free, contracted) or a convolution (groups, im2col rows,
    output features per group, input features per group × the mean taps that read real input); else None."""
    kind, attrs, ops = node["kind"], node["attrs"], node["operand_types"]
    try:
        if kind in ("dot_general", "dot"):
            lhs, rhs = ops[0][0], ops[1][0]
            dims = attrs.get("dot_dimension_numbers") or {}
            lb, rb = list(dims.get("lhs_batch") or []), list(dims.get("rhs_batch") or [])
            lc = dims.get("lhs_contract")
            rc = dims.get("rhs_contract")
            lc = [len(lhs) - 1] if lc is None else list(lc)
            rc = [0] if rc is None else list(rc)
            count = prod(lhs[d] for d in lb)
            k = prod(lhs[d] for d in lc)
            m = prod(lhs[d] for d in range(len(lhs)) if d not in lb and d not in lc)
            n = prod(rhs[d] for d in range(len(rhs)) if d not in rb and d not in rc)
            return float(count), float(m), float(n), float(k)
        if kind in ("convolution", "dynamic_conv"):
            dn = attrs["dimension_numbers"]
            lhs, rhs, out = ops[0][0], ops[1][0], node["result_types"][0][0]
            fgc = int(attrs.get("feature_group_count") or 1)
            bgc = int(attrs.get("batch_group_count") or 1)
            groups = fgc * bgc
            m = (lhs[dn["input_batch"]] // bgc) * prod(out[d] for d in dn["output_spatial"])
            n = out[dn["output_feature"]] // groups
            # taps that fall into padding or dilation holes are not computed: the effective K is what the
            # op's FLOPs (which count only real multiply-adds) leave per output element
            k = float(node["flops"]) / (2.0 * groups * m * n) if groups * m * n else 0.0
            if k <= 0:
                k = (lhs[dn["input_feature"]] // fgc) * prod(rhs[d] for d in dn["kernel_spatial"])
            return float(groups), float(m), float(n), float(k)
        if kind == "ragged_dot":
            lhs, rhs = ops[0][0], ops[1][0]
            g = rhs[-3]
            return float(g), float(math.ceil(lhs[-2] / max(g, 1))), float(rhs[-1]), float(rhs[-2])
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError):
        return None
    return None


@dataclass
class RegionArrays:
    """The target-independent features of one region (see the module docstring)."""

    x: np.ndarray            # float32 [nodes, len(NODE_FEATURES)]
    op: np.ndarray           # int64 [nodes]: opcode index, 0 = unknown
    edge_index: np.ndarray   # int64 [2, 2 × edges] (each edge in both directions)
    edge_attr: np.ndarray    # float32 [2 × edges, len(EDGE_FEATURES)]
    region: np.ndarray       # float32 [len(REGION_FEATURES)]
    kernels: np.ndarray      # float64 [kernels, 3]: matrix FLOPs, vector FLOPs + 4 × transcendentals, bytes
    kernel_dtypes: list[tuple[str, str]]   # (matrix dtype, vector dtype) per kernel
    gemms: np.ndarray        # float64 [gemms, 5]: kernel index, count, M, N, K
    kernel_calls: np.ndarray  # int64 [kernels]: bit i set when the kernel holds op kind FLOOR_OPS[i]


class Featuriser:
    """Turns region records into :class:`RegionArrays` (cached by hash) and adds target features.

    ``vocabulary`` fixes the opcode indices (save it with the model); ``cache_size`` bounds the
    per-region cache (least recently used regions are dropped).
    """

    def __init__(self, vocabulary: Sequence[str] | None = None, cache_size: int = 500_000):
        self.vocabulary = list(vocabulary) if vocabulary is not None else default_vocabulary()
        self._op_index = {k: i + 1 for i, k in enumerate(self.vocabulary)}
        self._cache: OrderedDict[str, RegionArrays] = OrderedDict()
        self._cache_size = cache_size
        self.estimator = Estimator()
        self._hardware: tuple[Target | None, np.ndarray] = (None, np.zeros(0))   # last target's vector

    def clear_cache(self) -> None:
        """Forget every featurised region (frees memory; the next call featurises afresh)."""
        self._cache.clear()

    # ------------------------------------------------------------------ per region (target-independent)

    def region(self, record: dict[str, Any]) -> RegionArrays:
        """The features of one record, from the cache when its hash was seen before."""
        return self.regions([record])[0]

    def regions(self, records: Sequence[dict[str, Any]]) -> list[RegionArrays]:
        """The features of many records; those not cached are featurised together (vectorised)."""
        out: list[RegionArrays | None] = [None] * len(records)
        cache = self._cache
        todo: dict[Any, list[int]] = {}
        for i, record in enumerate(records):
            key = record.get("hash") if isinstance(record, dict) else None
            hit = cache.get(key) if key is not None else None
            if hit is not None:
                cache.move_to_end(key)                       # recently used: dropped last
                out[i] = hit
            else:
                todo.setdefault(key if key is not None else ("anon", i), []).append(i)
        if todo:
            made = self._featurise_many([records[idx[0]] for idx in todo.values()])
            for (key, idx), arrays in zip(todo.items(), made):
                for i in idx:
                    out[i] = arrays
                if not isinstance(key, tuple):
                    cache[key] = arrays
            while len(cache) > self._cache_size:
                cache.popitem(last=False)
        return out  # type: ignore[return-value]

    def regions_for(self, hashes: Sequence[str], load: Callable[[str], dict[str, Any]]) -> list[RegionArrays]:
        """Like :meth:`regions` for region hashes; ``load(hash)`` (e.g. ``dataset.region_graph``) is
        called only for hashes not in the cache."""
        found = {h: self._cache[h] for h in dict.fromkeys(hashes) if h in self._cache}
        for h in found:
            self._cache.move_to_end(h)
        missing = [h for h in dict.fromkeys(hashes) if h not in found]
        if missing:
            found.update(zip(missing, self.regions([load(h) for h in missing])))
        return [found[h] for h in hashes]

    def _featurise_many(self, records: Sequence[dict[str, Any]]) -> list[RegionArrays]:
        """Featurise records: one Python pass to collect raw numbers, then numpy over all of them."""
        op_index = self._op_index
        raw: list[float] = []                                # node rows, flattened
        onehot: list[int] = []                               # (dtype group, unit) per node, flattened
        ops: list[int] = []
        first_io: list[tuple[int, int]] = []
        node_kernel: list[int] = []
        kraw: list[tuple[float, float, float, float, float, float]] = []
        kdts: list[tuple[str, str]] = []
        kcalls: list[int] = []                               # FLOOR_OPS bits per kernel
        eraw: list[list[float]] = []
        gemm_rows: list[list[float]] = []
        sizes: list[tuple[int, int, int, int]] = []          # nodes, edges, kernels, gemms per region
        io_bytes: list[tuple[float, float, float]] = []      # input bytes, output bytes, unmodelled
        for record in records:
            try:
                nodes, kernels, edges = record["nodes"], record["kernels"], record["edges"]
                if not nodes:
                    raise ValueError("region has no nodes")
                n, k0, g0 = len(nodes), len(kraw), len(gemm_rows)
                outside_n = [0] * n
                outside_b = [0.0] * n
                in_bytes = 0.0
                for entry in record["inputs"]:
                    b = float(entry["bytes"])
                    in_bytes += b
                    for dst, _ in entry["uses"]:
                        outside_n[dst] += 1
                        outside_b[dst] += b
                unmodelled = 0.0
                for kern in kernels:
                    tr = kern["transcendentals"]
                    kraw.append((kern["matrix_flops"], kern["vector_flops"], tr, kern["bytes"],
                                 len(kern["nodes"]), TRANSCENDENTAL_FLOPS * tr + kern["vector_flops"]))
                    kdts.append((kern["matrix_dtype"] or kern["dtype"], kern["dtype"]))
                    kcalls.append(0)
                    unmodelled += kern["unmodelled"]
                last_kernel = max(len(kernels) - 1, 0)
                for i, node in enumerate(nodes):
                    kind = node["kind"]
                    ops.append(op_index.get(kind, 0))
                    rt, ot = node["result_types"], node["operand_types"]
                    out_sizes = [prod(sh) for sh, _ in rt]
                    in_sizes = [prod(sh) for sh, _ in ot]
                    first_shape = rt[0][0] if rt else ()
                    ki = int(node["kernel"])
                    node_kernel.append(k0 + min(ki, last_kernel))
                    if kind in _CALL_BITS and kernels:
                        kcalls[k0 + min(ki, last_kernel)] |= _CALL_BITS[kind]
                    first_io.append((out_sizes[0] if out_sizes else 0, in_sizes[0] if in_sizes else -1))
                    row = [sum(out_sizes), max((len(sh) for sh, _ in rt), default=0),
                           first_shape[-1] if first_shape else 0, first_shape[-2] if len(first_shape) > 1 else 0,
                           len(rt), sum(in_sizes), max(in_sizes, default=0), len(ot),
                           node["flops"], node["transcendentals"], node["bytes"], 0.0,
                           1.0 if node["output"] else 0.0, 1.0 if node["modelled"] else 0.0,
                           outside_n[i], outside_b[i], 0.0]
                    if kind in _GEMM_KINDS and (gemm := _gemm_dims(node)) is not None:
                        row += gemm
                        gemm_rows.extend(systolic_gemms(node, ki, gemm))
                    else:
                        row += (0, 0, 0, 0)
                    if kind in _WINDOW_KINDS:
                        row += _window(kind, node["attrs"], ot)
                    else:
                        row += (0, 0, 0, 0, 0, 0)
                    attrs = node["attrs"]
                    dims = attrs.get("dimensions") if kind == "reduce" else None
                    perm = attrs.get("permutation") if kind == "transpose" else None
                    row += (len(dims) if isinstance(dims, list) else 0,
                            1.0 if isinstance(perm, list) and perm and perm[-1] != len(perm) - 1 else 0.0)
                    raw.extend(row)
                    onehot.append(_dtype_index(node["dtype"]))
                    onehot.append(_UNIT_INDEX.get(node["unit"], 2))
                eraw.extend(edges)
                io_bytes.append((in_bytes, sum(float(o["bytes"]) for o in record["outputs"]), unmodelled))
                sizes.append((n, len(edges), len(kraw) - k0, len(gemm_rows) - g0))
            except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
                key = record.get("hash") if isinstance(record, dict) else None
                raise LearnError(f"region record {str(key)[:16]}: malformed ({type(exc).__name__}: {exc})") from None
        return _assemble(raw, onehot, ops, first_io, node_kernel, kraw, kdts, kcalls, eraw, gemm_rows, sizes,
                         io_bytes)

    # ------------------------------------------------------------------ per target

    def roofline_parts(self, regions: Sequence[RegionArrays], target: Target) -> dict[str, np.ndarray]:
        """See :meth:`hespas_ml.learn.estimates.Estimator.roofline_parts`."""
        return self.estimator.roofline_parts(regions, target)

    def systolic_seconds(self, regions: Sequence[RegionArrays], target: Target,
                         parts: dict[str, np.ndarray]) -> np.ndarray:
        """See :meth:`hespas_ml.learn.estimates.Estimator.systolic_seconds`."""
        return self.estimator.systolic_seconds(regions, target, parts)

    def target_features(self, regions: Sequence[RegionArrays], target: Target
                        ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Features [regions, len(ROOFLINE_FEATURES + SYSTOLIC_FEATURES + HW_FEATURES)] (float32) of
        ``regions`` on ``target``, and the analytical estimates ``{"roofline", "systolic", "calibrated"}`` as
        log-seconds (float64)."""
        parts = self.estimator.roofline_parts(regions, target)
        roof = np.maximum(parts["roofline"], MIN_SECONDS)
        sys_s = np.maximum(self.estimator.systolic_seconds(regions, target, parts), MIN_SECONDS)
        lg = lambda v: np.log(np.maximum(v, MIN_SECONDS))  # noqa: E731
        feats = np.column_stack([
            np.log(roof), lg(parts["compute"]), lg(parts["memory"]), lg(parts["matrix"]), lg(parts["vector"]),
            parts["compute"] / np.maximum(parts["compute"] + parts["memory"], MIN_SECONDS),
            np.log(sys_s) - np.log(roof), np.minimum(roof / sys_s, 1.0)])
        if self._hardware[0] is not target:
            self._hardware = (target, hardware_vector(target))
        hw = self._hardware[1]
        out = np.concatenate([feats, np.broadcast_to(hw, (len(regions), len(hw)))], axis=1)
        cal_s = np.maximum(self.estimator.calibrated_seconds(regions, target, parts), MIN_SECONDS)
        return out.astype(np.float32), {"roofline": np.log(roof), "systolic": np.log(sys_s),
                                        "calibrated": np.log(cal_s)}

    # ------------------------------------------------------------------ to PyG

    def data(self, record: dict[str, Any], target: Target, base: str = "roofline") -> "RegionData":
        """One region on one target as a :class:`RegionData` with one row (``base``: which estimate)."""
        arrays = self.region(record)
        feats, est = self.target_features([arrays], target)
        return region_data(arrays, feats, est[base])

    def batch(self, records: Sequence[dict[str, Any]], target: Target
              ) -> tuple[Data, dict[str, np.ndarray]]:
        """Many regions on one target as one batched graph (one row per region), built with numpy
        concatenation (faster than collating per-region objects); returns (batch, estimates). The
        batch's ``base`` is the roofline estimate."""
        regions = self.regions(records)
        feats, est = self.target_features(regions, target)
        return collate_arrays(regions, feats, est["roofline"]), est

def _window(kind: str, attrs: dict[str, Any], ot: list) -> tuple[float, ...]:
    """(taps, max stride, max lhs/base dilation, max rhs/window dilation, feature groups, batch groups)."""
    if kind in ("reduce_window", "select_and_scatter"):
        taps = prod(attrs.get("window_dimensions") or [1])
        lhs_d, rhs_d, fg, bg = attrs.get("base_dilations"), attrs.get("window_dilations"), 1, 1
    else:
        dn = attrs.get("dimension_numbers") or {}
        taps = prod(ot[1][0][d] for d in dn.get("kernel_spatial", [])) if len(ot) > 1 else 1
        lhs_d, rhs_d = attrs.get("lhs_dilation"), attrs.get("rhs_dilation")
        fg = int(attrs.get("feature_group_count") or 1)
        bg = int(attrs.get("batch_group_count") or 1)
    return (taps, max(attrs.get("window_strides") or [1]), max(lhs_d or [1]), max(rhs_d or [1]), fg, bg)


def _offsets(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def _assemble(raw, onehot, ops, first_io, node_kernel, kraw, kdts, kcalls, eraw, gemm_rows, sizes, io_bytes
              ) -> list[RegionArrays]:
    """The numpy half of :meth:`Featuriser._featurise_many`: every region's arrays at once, then sliced."""
    size = np.asarray(sizes, dtype=np.int64).reshape(-1, 4)
    n_reg = len(size)
    noff, eoff, koff, goff = (_offsets(size[:, j]) for j in range(4))
    n_nodes = int(noff[-1])
    kv = np.asarray(kraw, dtype=np.float64).reshape(-1, 6)      # mf, vf, tr, bytes, nodes, vf + 4 tr
    nk = np.asarray(node_kernel, dtype=np.int64)
    vals = np.asarray(raw, dtype=np.float64).reshape(n_nodes, -1)
    kstats = kv[nk][:, [0, 1, 3, 4]] if len(kv) else np.zeros((n_nodes, 4))
    kstats[:, 1] += kv[nk, 2] if len(kv) else 0.0              # kernel vector FLOPs + transcendentals
    vals = np.concatenate([vals, kstats], axis=1)
    vals[:, _LOG_COLUMNS] = np.log2(1.0 + np.maximum(vals[:, _LOG_COLUMNS], 0.0))
    vals[:, _INTENSITY] = vals[:, _FLOPS] - vals[:, _BYTES]          # log2((1 + flops) / (1 + bytes))
    fio = np.asarray(first_io, dtype=np.float64)
    vals[:, _EXPANSION] = np.where(fio[:, 1] >= 0, np.log2((1.0 + fio[:, 0]) / (1.0 + np.maximum(fio[:, 1], 0.0))),
                                   0.0)
    x = np.zeros((n_nodes, len(NODE_FEATURES)), dtype=np.float32)
    x[:, :_N_NUMERIC] = vals
    oh = np.asarray(onehot, dtype=np.int64).reshape(n_nodes, 2)
    rows = np.arange(n_nodes)
    x[rows, _N_NUMERIC + oh[:, 0]] = 1.0
    x[rows, _N_NUMERIC + len(DTYPE_GROUPS) + oh[:, 1]] = 1.0
    op = np.asarray(ops, dtype=np.int64)

    # edges: per region its edges forward, then the same edges reversed
    e_all = np.asarray(eraw, dtype=np.float64).reshape(-1, 4)
    n_e = len(e_all)
    ne = size[:, 1]
    reg_of_edge = np.repeat(np.arange(n_reg), ne)
    src = e_all[:, 0].astype(np.int64)
    dst = e_all[:, 1].astype(np.int64)
    feats = np.zeros((n_e, len(EDGE_FEATURES)), dtype=np.float32)
    feats[:, 0] = np.log2(1.0 + e_all[:, 3])
    feats[np.arange(n_e), 1 + np.minimum(e_all[:, 2].astype(np.int64), 3)] = 1.0
    base = noff[:-1][reg_of_edge]
    feats[:, 5] = (nk[base + src] != nk[base + dst]).astype(np.float32)
    reverse = feats.copy()
    reverse[:, 6] = 1.0
    doubled_attr = np.concatenate([feats, reverse])
    doubled_ei = np.concatenate([np.stack([src, dst]), np.stack([dst, src])], axis=1)
    reg2 = np.repeat(np.arange(n_reg), 2 * ne)
    j = np.arange(2 * n_e) - np.repeat(2 * eoff[:-1], 2 * ne)
    sel = np.where(j < ne[reg2], eoff[:-1][reg2] + j, n_e + eoff[:-1][reg2] + j - ne[reg2])
    edge_attr = doubled_attr[sel]
    edge_index = doubled_ei[:, sel]

    # region aggregates
    kreg = np.repeat(np.arange(n_reg), size[:, 2])
    mf, vf, tr, by = (np.bincount(kreg, kv[:, c], n_reg) if len(kv) else np.zeros(n_reg) for c in (0, 1, 2, 3))
    io = np.asarray(io_bytes, dtype=np.float64).reshape(-1, 3)
    l2 = lambda v: np.log2(1.0 + np.maximum(v, 0.0))  # noqa: E731
    region = np.column_stack([l2(mf), l2(vf), l2(tr), l2(by), l2(io[:, 0]), l2(io[:, 1]), l2(size[:, 0]),
                              l2(size[:, 2]), l2(ne), io[:, 2], l2(mf + vf) - l2(by), l2(size[:, 3])]
                             ).astype(np.float32)
    kern = kv[:, [0, 5, 3]] if len(kv) else np.zeros((0, 3))
    gem = np.asarray(gemm_rows, dtype=np.float64).reshape(-1, 5)
    calls = np.asarray(kcalls, dtype=np.int64)
    return [RegionArrays(x[noff[r]:noff[r + 1]], op[noff[r]:noff[r + 1]],
                         edge_index[:, 2 * eoff[r]:2 * eoff[r + 1]], edge_attr[2 * eoff[r]:2 * eoff[r + 1]],
                         region[r], kern[koff[r]:koff[r + 1]], kdts[koff[r]:koff[r + 1]], gem[goff[r]:goff[r + 1]],
                         calls[koff[r]:koff[r + 1]])
            for r in range(n_reg)]


class RegionData(Data):
    """A region graph plus its label rows: node ``x``/``op``, ``edge_index``/``edge_attr``, ``region``
    [1, R] aggregates, and per row ``rows`` (target features), ``base`` (log roofline seconds), ``y``
    (log seconds, when known), ``w`` (per-member weights) and ``row_graph`` (the graph of each row; PyG
    collation turns it into the graph's index in the batch)."""

    def __inc__(self, key: str, value: Any, *args: Any, **kwargs: Any) -> Any:
        if key == "row_graph":
            return 1
        return super().__inc__(key, value, *args, **kwargs)


def region_data(arrays: RegionArrays, feats: np.ndarray, base: np.ndarray, y: np.ndarray | None = None,
                w: np.ndarray | None = None) -> RegionData:
    """A :class:`RegionData` from cached arrays and ``len(feats)`` rows of target features."""
    rows = len(feats)
    data = RegionData(x=torch.from_numpy(arrays.x), op=torch.from_numpy(arrays.op),
                      edge_index=torch.from_numpy(arrays.edge_index), edge_attr=torch.from_numpy(arrays.edge_attr),
                      region=torch.from_numpy(arrays.region).unsqueeze(0),
                      rows=torch.from_numpy(np.ascontiguousarray(feats, dtype=np.float32)),
                      base=torch.from_numpy(np.asarray(base, dtype=np.float32).reshape(rows)),
                      row_graph=torch.zeros(rows, dtype=torch.long), num_nodes=len(arrays.op))
    if y is not None:
        data.y = torch.from_numpy(np.asarray(y, dtype=np.float32).reshape(rows))
    if w is not None:
        data.w = torch.from_numpy(np.array(w, dtype=np.float32).reshape(rows, -1))
    return data


def collate_arrays(regions: Sequence[RegionArrays], feats: np.ndarray, base: np.ndarray) -> Data:
    """The batch of ``regions`` with one row each (row ``i`` belongs to graph ``i``): one PyG ``Data``
    holding the disjoint union of the graphs and the ``batch`` vector (what a ``Batch`` holds for the
    network, without the bookkeeping that splits it back into graphs, which prediction never does)."""
    sizes = np.fromiter((len(r.op) for r in regions), dtype=np.int64, count=len(regions))
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    esizes = np.fromiter((r.edge_index.shape[1] for r in regions), dtype=np.int64, count=len(regions))
    ei = np.concatenate([r.edge_index for r in regions], axis=1) + np.repeat(offsets, esizes)
    return Data(x=torch.from_numpy(np.concatenate([r.x for r in regions])),
                op=torch.from_numpy(np.concatenate([r.op for r in regions])),
                edge_index=torch.from_numpy(ei),
                edge_attr=torch.from_numpy(np.concatenate([r.edge_attr for r in regions])),
                region=torch.from_numpy(np.stack([r.region for r in regions])),
                rows=torch.from_numpy(np.ascontiguousarray(feats, dtype=np.float32)),
                base=torch.from_numpy(np.asarray(base, dtype=np.float32)),
                row_graph=torch.arange(len(regions)),
                batch=torch.from_numpy(np.repeat(np.arange(len(regions)), sizes)),
                num_graphs=len(regions))


def hardware_vector(target: Target) -> np.ndarray:
    """``target.to_vector()`` as float32 in :data:`HW_FEATURES` order."""
    vec = target.to_vector()
    if tuple(vec) != HW_FEATURES:
        raise LearnError(f"target {target.name}: its hardware vector has keys {list(vec)[:3]}…, "
                         f"not the {len(HW_FEATURES)} this surrogate knows")
    return np.asarray(list(vec.values()), dtype=np.float32)


def resolve_target(target: Target | str) -> Target:
    """A :class:`Target` from itself, a preset name or a target YAML path (errors are one line)."""
    if isinstance(target, Target):
        return target
    if isinstance(target, str):
        return load_target(target)
    raise LearnError(f"target must be a Target or a name/path, got {type(target).__name__}")
