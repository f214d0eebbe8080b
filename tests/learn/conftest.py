"""Fixtures of the learned-surrogate tests: the smoke dataset, built once per session by the project's
builder (real programs, real fidelities), and small training configurations."""
from __future__ import annotations

from pathlib import Path

import pytest

from hespas_ml.label.dataset import build_dataset, load_dataset
from hespas_ml.learn.config import TrainConfig

SMOKE_SPEC = Path(__file__).resolve().parents[2] / "datasets" / "smoke.yaml"


@pytest.fixture(scope="session")
def smoke_ds(tmp_path_factory):
    """The smoke dataset (datasets/smoke.yaml), built into a session temporary folder."""
    out = tmp_path_factory.mktemp("learn-smoke") / "ds"
    build_dataset(SMOKE_SPEC, out, progress=False)
    return load_dataset(out)


@pytest.fixture
def tiny_config():
    """A factory of configurations that train in a second or two on the smoke dataset."""
    def make(**overrides) -> TrainConfig:
        base = dict(hidden=16, layers=2, head_hidden=32, epochs=12, batch_size=16, patience=12, ensemble=3,
                    split="random", seed=0)
        base.update(overrides)
        return TrainConfig(**base)
    return make
