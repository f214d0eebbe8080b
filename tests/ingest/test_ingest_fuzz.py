"""Fuzz test: ≥1,000 seeded mutations of the shared programs each ingest or raise a clean IngestError.

The cases run in a worker subprocess (``_ingest_fuzz_worker.py``) supervised from here, so a hard crash of
MLIR's C++ (abort, segfault) or a hang shows up as a failed case instead of killing pytest.
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import shared_path

pytestmark = pytest.mark.slow   # exports programs, starts workers, builds datasets or trains

WORKER = Path(__file__).with_name("_ingest_fuzz_worker.py")
SEED = 20261122
N_CASES = 1200
CASE_TIMEOUT_S = 20.0     # per case, generous for a loaded 2-core machine (cases take milliseconds)
STARTUP_TIMEOUT_S = 60.0  # jax import + building the case list


def run_fuzz(shared_mlir: Path, seed: int, n: int, case_timeout: float = CASE_TIMEOUT_S) -> dict:
    """Run cases 0..n-1, restarting the worker after a crash or hang. Returns counts and failures."""
    counts = {"ok": 0, "err": 0, "bad": 0, "crash": 0, "hang": 0}
    failures: list[str] = []
    start = 0
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONFAULTHANDLER="1")
    while start < n:
        proc = subprocess.Popen([sys.executable, str(WORKER), str(shared_mlir), str(seed), str(n), str(start)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        current, deadline = None, time.monotonic() + STARTUP_TIMEOUT_S
        next_start = n
        try:
            while True:
                if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    i = current if current is not None else start
                    counts["hang"] += 1
                    failures.append(f"case {i}: no answer within {case_timeout:.0f} s")
                    next_start = i + 1
                    break
                line = proc.stdout.readline()
                if not line:  # the worker died
                    proc.wait()
                    i = current if current is not None else start
                    if current is None and start >= n:
                        break
                    counts["crash"] += 1
                    err = proc.stderr.read()[-600:].strip().replace("\n", " | ")
                    failures.append(f"case {i}: worker exited with {proc.returncode}: {err}")
                    next_start = i + 1
                    break
                tag, _, rest = line.rstrip("\n").partition(" ")
                if tag == "S":
                    current, deadline = int(rest), time.monotonic() + case_timeout
                elif tag == "R":
                    idx, outcome, info = rest.split(" ", 2)
                    counts[outcome] += 1
                    if outcome == "bad":
                        failures.append(f"case {idx}: {json.loads(info)}")
                    current, deadline = None, time.monotonic() + case_timeout
                    if int(idx) == n - 1:
                        break
                elif tag == "READY":
                    deadline = time.monotonic() + case_timeout
        finally:
            sel.close()
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        start = next_start
    counts["failures"] = failures
    return counts


def test_fuzzed_programs_ingest_or_fail_cleanly():
    shared_mlir = shared_path("mlir")
    t0 = time.perf_counter()
    result = run_fuzz(shared_mlir, SEED, N_CASES)
    wall = time.perf_counter() - t0
    failures = result.pop("failures")
    total = sum(result.values())
    print(f"\nfuzz: {total} cases in {wall:.1f} s: {result}")
    assert total == N_CASES
    assert not failures, "\n".join(failures[:20])
    # The mutations must exercise both outcomes, else the test proves nothing.
    assert result["ok"] >= 50 and result["err"] >= 300, result


def test_worker_cases_are_deterministic():
    shared_mlir = shared_path("mlir")
    sys.path.insert(0, str(WORKER.parent))
    import _ingest_fuzz_worker as _fuzz_worker

    a = _fuzz_worker.cases(shared_mlir, 7, 40)
    b = _fuzz_worker.cases(shared_mlir, 7, 40)
    c = _fuzz_worker.cases(shared_mlir, 8, 40)
    assert a == b
    assert a != c
