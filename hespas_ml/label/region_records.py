"""Region records: a compute region as plain JSON — for the GNN, for the dataset tables, and for labelling.

:func:`program_records` (run in worker processes by the dataset builder on each split program) returns,
per distinct :func:`~hespas_ml.split.signature.region_signature`, how often it occurs and
its *record*. A record is self-contained; its schema (``RECORD_VERSION``)::

    {"version": 2, "hash": "<sha256>", "n_nodes": N,
     "nodes": [{"opcode", "kind", "dtype", "result_types": [[shape, dtype], …],
                "operand_types": [[shape, dtype], …], "attrs": {…}, "unit": matrix|vector|none,
                "flops", "transcendentals", "bytes", "modelled", "kernel": k, "output": bool}, …],
     "edges": [[src, dst, operand_index, bytes], …],         # inside the region
     "inputs": [{"uses": [[dst, operand_index], …], "shape", "dtype", "bytes"}, …],   # outside tensors
     "outputs": [{"node": n, "shape", "dtype", "bytes"}, …],  # results leaving the region
     "kernels": [{"nodes": [...], "matrix_flops", "vector_flops", "transcendentals", "bytes", "dtype",
                  "matrix_dtype", "unmodelled"}, …]}

Nodes are in the signature's canonical order, so equal hashes give equal records. Node ``flops`` /
``bytes`` are the op's own cost (as if it ran alone); the kernel entries hold the fused costs the
fidelities use. :func:`region_from_record` turns a record back into a standalone
:class:`~hespas_ml.split.regions.Region` (its own small :class:`OpGraph`, outside tensors as program
inputs) that every fidelity can label.
"""
from __future__ import annotations

import json
from typing import Any

from ..ingest.graph import Op, OpGraph, TensorType, program_users
from ..split.regions import Kernel, Region, RegionGraph
from ..split.signature import canonical_order, escaping_ops, signature_parts
from ..costs import program_costs

# 2: kernel costs count only the demanded part of each op's result (hespas_ml.split.regions._demand)
RECORD_VERSION = 2


def _tt(t: TensorType) -> list[Any]:
    return [list(t.shape), t.dtype]


def _jsonable(value: Any) -> Any:
    kind = type(value)
    if kind is int or kind is str or kind is bool or value is None:      # the common leaves, first
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def region_record(region: Region, digest: str, users: list[list[int]], order: list[int] | None = None,
                  escapes: set[int] | None = None) -> dict[str, Any]:
    """The JSON record of ``region`` (a compute region carrying its program's graph); ``order`` and
    ``escapes`` are its :func:`~hespas_ml.split.signature.canonical_order` and
    :func:`~hespas_ml.split.signature.escaping_ops` where the caller has them already
    (:func:`~hespas_ml.split.signature.signature_parts` gives both)."""
    ops = region.graph.ops
    order = canonical_order(region) if order is None else order
    index = {i: n for n, i in enumerate(order)}
    escapes = escaping_ops(region, users) if escapes is None else escapes
    kernel_of: dict[int, int] = {}
    kernels = sorted(region.kernels, key=lambda k: min((index[i] for i in k.op_ids if i in index), default=0))
    for ki, k in enumerate(kernels):
        for i in k.op_ids:
            kernel_of[i] = ki
    nodes, edges = [], []
    inputs: dict[Any, dict[str, Any]] = {}
    costs = program_costs(region.graph)
    for n, i in enumerate(order):
        op = ops[i]
        c = costs[i]
        nodes.append({"opcode": op.opcode, "kind": op.kind, "dtype": op.dtype,
                      "result_types": [_tt(t) for t in op.result_types],
                      "operand_types": [_tt(t) for t in op.operand_types],
                      "attrs": _jsonable(op.attrs) if op.attrs else {},
                      "unit": c.unit, "flops": c.flops, "transcendentals": c.transcendentals, "bytes": c.bytes,
                      "modelled": c.modelled, "kernel": kernel_of.get(i, 0), "output": i in escapes})
        for j, (p, t) in enumerate(zip(op.operands, op.operand_types)):
            if p >= 0 and p in index:
                edges.append([index[p], n, j, t.nbytes])
            else:
                key = (p, str(t)) if p >= 0 else ("arg", i, j)
                entry = inputs.setdefault(key, {"uses": [], "shape": list(t.shape), "dtype": t.dtype,
                                                "bytes": t.nbytes})
                entry["uses"].append([n, j])
    outputs = [{"node": index[i], "shape": list(t.shape), "dtype": t.dtype, "bytes": t.nbytes}
               for i in order if i in escapes for t in ops[i].result_types]
    kern = [{"nodes": sorted(index[i] for i in k.op_ids if i in index), "matrix_flops": k.matrix_flops,
             "vector_flops": k.vector_flops, "transcendentals": k.transcendentals, "bytes": k.bytes,
             "dtype": k.dtype, "matrix_dtype": k.matrix_dtype, "unmodelled": k.unmodelled} for k in kernels]
    return {"version": RECORD_VERSION, "hash": digest, "n_nodes": len(nodes), "nodes": nodes, "edges": edges,
            "inputs": list(inputs.values()), "outputs": outputs, "kernels": kern}


def region_from_record(record: dict[str, Any]) -> Region:
    """A standalone region (its own :class:`OpGraph`; outside tensors are program inputs, operand ``-1``)
    with the record's kernel costs, ready for any fidelity."""
    producer: dict[tuple[int, int], int] = {(dst, j): src for src, dst, j, _ in record["edges"]}
    ops = []
    for n, node in enumerate(record["nodes"]):
        operand_types = [TensorType(tuple(s), d) for s, d in node["operand_types"]]
        ops.append(Op(n, node["opcode"], [producer.get((n, j), -1) for j in range(len(operand_types))],
                      operand_types, [TensorType(tuple(s), d) for s, d in node["result_types"]],
                      dict(node["attrs"])))
    outputs = sorted({o["node"] for o in record["outputs"]})
    graph = OpGraph(name=f"region_{record['hash'][:12]}", ops=ops, outputs=outputs,
                    inputs=[TensorType(tuple(x["shape"]), x["dtype"]) for x in record["inputs"]],
                    source=f"region:{record['hash']}")
    kernels = [Kernel(op_ids=list(k["nodes"]), matrix_flops=k["matrix_flops"], vector_flops=k["vector_flops"],
                      transcendentals=k["transcendentals"], bytes=k["bytes"], dtype=k["dtype"],
                      matrix_dtype=k["matrix_dtype"], unmodelled=k["unmodelled"]) for k in record["kernels"]]
    return Region(0, "compute", list(range(len(ops))), count=1, kernels=kernels, graph=graph)


def region_features(record: dict[str, Any]) -> dict[str, Any]:
    """The scalar summary of a record: a row of ``regions.parquet`` without the provenance columns."""
    counts: dict[str, int] = {}
    for node in record["nodes"]:
        counts[node["kind"]] = counts.get(node["kind"], 0) + 1
    kernels = record["kernels"]
    matrix = sum(k["matrix_flops"] for k in kernels)
    vector = sum(k["vector_flops"] for k in kernels)
    heaviest = max(kernels, key=lambda k: k["matrix_flops"] + k["vector_flops"], default=None)
    if heaviest is None:
        dtype = "f32"
    elif heaviest["matrix_flops"] and heaviest["matrix_dtype"]:
        dtype = heaviest["matrix_dtype"]
    else:
        dtype = heaviest["dtype"]
    return {
        "n_ops": record["n_nodes"], "n_kernels": len(kernels), "n_edges": len(record["edges"]),
        "op_counts": json.dumps(dict(sorted(counts.items()))),
        "matrix_flops": float(matrix), "vector_flops": float(vector), "flops": float(matrix + vector),
        "transcendentals": float(sum(k["transcendentals"] for k in kernels)),
        "bytes": float(sum(k["bytes"] for k in kernels)), "dtype": dtype,
        "input_shapes": json.dumps([f"{'x'.join(map(str, x['shape']))}x{x['dtype']}" if x["shape"] else x["dtype"]
                                    for x in record["inputs"]]),
        "output_shapes": json.dumps([f"{'x'.join(map(str, x['shape']))}x{x['dtype']}" if x["shape"] else x["dtype"]
                                     for x in record["outputs"]]),
        "input_bytes": float(sum(x["bytes"] for x in record["inputs"])),
        "output_bytes": float(sum(x["bytes"] for x in record["outputs"])),
        "unmodelled": int(sum(k["unmodelled"] for k in kernels)),
    }


def is_empty(region: Region) -> bool:
    """Whether ``region`` does no work at all (no FLOPs, transcendentals or bytes in any kernel): a dataset
    build skips such regions (``caps.skip_empty_regions``)."""
    return all(k.flops == 0 and k.transcendentals == 0 and k.bytes == 0 for k in region.kernels)


def program_records(rg: RegionGraph, caps: dict[str, Any] | None = None, with_records: bool = True) -> dict[str, Any]:
    """The compute regions of a split program, grouped by signature.

    Returns ``{"n_ops", "n_regions" (compute regions seen), "n_collectives", "n_skipped" (empty or over a
    cap), "truncated", "warnings", "regions": {hash: {"occurrences", "executions", "record"}}}``
    (``record`` only ``with_records``).
    """
    caps = caps or {}
    graph = rg.graph
    users = program_users(graph)
    compute = rg.compute_regions()
    limit = caps.get("max_regions_per_program")
    truncated = limit is not None and len(compute) > limit
    if truncated:
        compute = compute[:limit]
    max_ops = caps.get("max_ops_per_region")
    skip_empty = caps.get("skip_empty_regions", True)
    out: dict[str, dict[str, Any]] = {}
    skipped = 0
    for region in compute:
        if (max_ops is not None and len(region.op_ids) > max_ops) or (skip_empty and is_empty(region)):
            skipped += 1
            continue
        digest, order, escapes = signature_parts(region, users)
        entry = out.get(digest)
        if entry is None:
            entry = out[digest] = {"occurrences": 0, "executions": 0}
            if with_records:
                entry["record"] = region_record(region, digest, users, order, escapes)
        entry["occurrences"] += 1
        entry["executions"] += region.count
    return {"n_ops": len(graph.ops), "n_regions": len(compute), "n_collectives": len(rg.collectives()),
            "n_skipped": skipped, "truncated": truncated, "warnings": list(dict.fromkeys(graph.warnings))[:20],
            "regions": out}
