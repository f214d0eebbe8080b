"""Checks shared by the zoo tests: a program that ingests cleanly, its ops of one kind, its matrix FLOPs."""
from __future__ import annotations

from hespas_ml.ingest import OpGraph, load_program
from hespas_ml.costs import graph_cost


def load(spec: str) -> OpGraph:
    """Ingest a zoo program, insisting that nothing in it is unknown to ingest or the cost model."""
    g = load_program(spec)
    assert g.warnings == [], g.warnings
    cost = graph_cost(g)
    assert cost["unmodelled"] == {}, cost["unmodelled"]
    return g


def kinds(g: OpGraph, kind: str):
    return [op for op in g.ops if op.kind == kind]


def matrix_flops(g: OpGraph) -> float:
    return graph_cost(g)["flops_by_unit"]["matrix"]
