"""`hespas-ml ui` serves the MLflow UI of the project's store and says where."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import readme_command

pytestmark = pytest.mark.slow   # starts an MLflow server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ui_serves_the_store_and_prints_its_address(tmp_path):
    port = free_port()
    command = readme_command("hespas-ml ui")          # the README's line, on a store of its own
    proc = subprocess.Popen([sys.executable, "-m", "hespas_ml.cli.main", *command, "--tracking-uri",
                             str(tmp_path / "store"), "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        first = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}" in first and "mlflow.db" in first
        deadline, status = time.monotonic() + 120, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    status = response.status
                    break
            except OSError:
                time.sleep(0.5)
        assert status == 200, f"no answer from the UI (exit status {proc.poll()})"
        assert (tmp_path / "store" / "mlflow.db").is_file()
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
