"""Helpers for tests that use the ASTRA-sim replay vectors in ../shared/astra-vectors (not a test file)."""
from __future__ import annotations

import json
from functools import lru_cache
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import SHARED_DIR, shared_path

from hespas_ml.replay.chakra import EtNode, read_traces
from hespas_ml.replay.system import SystemConfig, load_comm_groups, load_system

VECTORS_DIR = SHARED_DIR / "astra-vectors"


def vector_names() -> list[Any]:
    """Scenario folder names found at collection time (one skipped param when the suite is absent)."""
    if not VECTORS_DIR.is_dir():
        return [pytest.param("absent", marks=pytest.mark.skip(reason=f"{VECTORS_DIR} is absent"))]
    return sorted(p.name for p in VECTORS_DIR.iterdir() if (p / "expected.json").is_file())


@dataclass
class Vector:
    """One scenario: its folder, system, comm groups, per-rank traces and recorded results."""

    name: str
    folder: Path
    system: SystemConfig
    groups: dict[int, list[int]] | None
    traces: list[list[EtNode]]
    scenario: dict[str, Any]
    unaware: dict[str, Any]


@lru_cache(maxsize=None)
def load_vector(name: str) -> Vector:
    """A scenario, read once per test session (callers must not modify it)."""
    folder = shared_path("astra-vectors", name)
    system = load_system(folder)
    groups_file = folder / "comm_group.json"
    groups = load_comm_groups(groups_file) if groups_file.is_file() else None
    traces = read_traces(folder / "et" / "dev", system.n_npus)
    scenario = json.loads((folder / "scenario.json").read_text())
    expected = json.loads((folder / "expected.json").read_text())
    return Vector(name, folder, system, groups, traces, scenario, expected["runs"]["congestion_unaware"])
