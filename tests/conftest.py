"""Shared fixtures. Reference material lives beside the project in ../shared/ (never copied into it)."""
from __future__ import annotations

from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = (PROJECT_ROOT / ".." / "shared").resolve()


def shared_path(*parts: str) -> Path:
    """Path inside ../shared/, skipping the calling test when that material is absent."""
    path = SHARED_DIR.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"reference material {path} is absent (../shared/ not beside the project)")
    return path


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED_DIR.is_dir():
        pytest.skip("../shared/ is absent beside the project root")
    return SHARED_DIR


@pytest.fixture(scope="session")
def smoke_ds(tmp_path_factory):
    """The smoke dataset (datasets/smoke.yaml), built once per session into a temporary folder by the
    project's builder (real programs, real fidelities)."""
    from hespas_ml.label.dataset import build_dataset, load_dataset

    out = tmp_path_factory.mktemp("smoke-dataset") / "ds"
    build_dataset(PROJECT_ROOT / "datasets" / "smoke.yaml", out, progress=False)
    return load_dataset(out)


@pytest.fixture
def tiny_config():
    """A factory of surrogate configurations that train in a second or two on the smoke dataset."""
    from hespas_ml.learn.config import TrainConfig

    def make(**overrides) -> TrainConfig:
        base = dict(hidden=16, layers=2, head_hidden=32, epochs=12, batch_size=16, patience=12, ensemble=3,
                    split="random", seed=0)
        base.update(overrides)
        return TrainConfig(**base)
    return make
