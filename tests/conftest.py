"""Shared fixtures. Reference material lives beside the project in ../shared/ (never copied into it)."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shlex
import sys
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


def readme_commands() -> list[str]:
    """Every command line of the README's ``bash`` blocks: continuation lines joined, comments and
    ``[optional]`` parts left out."""
    text = (PROJECT_ROOT / "README.md").read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\[[^\]]*\]", "", line.split(" #")[0]).strip()
            if line and not line.startswith("#"):
                lines.append(" ".join(line.split()))
    return lines


def readme_command(start: str, replace: dict[str, str] | None = None) -> list[str]:
    """The README command line that begins with ``start``, as arguments after ``hespas-ml``; ``replace``
    swaps whole arguments (an output folder for a temporary one). Paths in it are relative to the project
    root: run it :func:`in_project`."""
    found = [line for line in readme_commands() if line.startswith(start)]
    assert len(found) == 1, f"README: {len(found)} command lines begin with {start!r}"
    words = shlex.split(found[0])
    assert words[0] == "hespas-ml"
    return [(replace or {}).get(w, w) for w in words[1:]]


@contextlib.contextmanager
def in_project():
    """Run the body in the project root (where the README's relative paths point)."""
    before = os.getcwd()
    os.chdir(PROJECT_ROOT)
    try:
        yield PROJECT_ROOT
    finally:
        os.chdir(before)


def eval_script(name: str):
    """The module of the script ``eval/<name>.py`` (the dataset importers live there), loaded once."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, PROJECT_ROOT / "eval" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED_DIR.is_dir():
        pytest.skip("../shared/ is absent beside the project root")
    return SHARED_DIR


@pytest.fixture(scope="session")
def smoke_ds(tmp_path_factory):
    """The smoke dataset (datasets/smoke.yaml), built once per session into a temporary folder by the
    README's command (real programs, real fidelities)."""
    from hespas_ml.cli.main import main
    from hespas_ml.label.dataset_tables import load_dataset

    out = tmp_path_factory.mktemp("smoke-dataset") / "ds"
    with in_project():
        command = readme_command("hespas-ml dataset build datasets/smoke.yaml", {"out/datasets/smoke": str(out)})
        assert main([*command, "--no-progress"]) == 0
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


@pytest.fixture
def fast_host(tmp_path) -> Path:
    """A target file named ``host-cpu`` whose rates no real 2-core box measures (1e14 FLOP/s, 10 TB/s):
    the host-cpu of "another machine" for the profiling surrogate."""
    path = tmp_path / "fast-host.yaml"
    path.write_text("name: host-cpu\ndescription: a host CPU far faster than any this project was measured on\n"
                    "matrix_flops: {f32: 1.0e14}\nvector_flops: {f32: 5.0e13}\nmem_bw: 1.0e13\n"
                    "mem_capacity: 1.0e11\nonchip_mem: 1.0e8\nclock_hz: 3.0e9\nsources: [a test]\nnotes: made up\n")
    return path
