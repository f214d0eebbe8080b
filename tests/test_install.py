"""Installing on an interpreter the pinned stack does not support ends at once, in one line."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import PROJECT_ROOT


def _other_python() -> str:
    """A Python other than 3.11 that runs here: on PATH, or one pyenv installed."""
    candidates = [shutil.which(name) for name in ("python3.12", "python3.13", "python3.10")]
    candidates += sorted(str(p) for p in (Path.home() / ".pyenv" / "versions").glob("3.1*/bin/python3"))
    for path in filter(None, candidates):
        check = subprocess.run([path, "-c", "import sys; sys.exit(sys.version_info[:2] == (3, 11))"],
                               capture_output=True)
        if check.returncode == 0:
            return path
    pytest.skip("no Python other than 3.11 on this machine to try the set-up with")


def test_make_setup_refuses_another_python_in_one_line_before_installing(tmp_path):
    python = _other_python()
    venv = tmp_path / "venv"
    done = subprocess.run(["make", "setup", f"PYTHON={python}", f"VENV={venv}"], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and not venv.exists()
    said = [line for line in done.stderr.splitlines() if "needs Python 3.11" in line]
    assert len(said) == 1 and f"{python} is 3." in said[0] and "Traceback" not in done.stderr


def test_the_package_declares_the_python_it_works_on():
    meta = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]
    assert meta["requires-python"] == ">=3.11,<3.12" and sys.version_info[:2] == (3, 11)
