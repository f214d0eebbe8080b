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
