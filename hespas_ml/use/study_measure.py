"""Measured host-cpu step times for a study: each one-device workload run whole on this machine with XLA.

:func:`measure_host_cpu` exports each workload of a spec that runs on one device (zoo programs through the
zoo's JAX export, .mlir files as they are), compiles the *whole* program with jax's XLA:CPU client in a
separate process (``JAX_PLATFORMS=cpu``, no XLA flags) and times it on random inputs with the profiling
worker's sampler (:func:`hespas_ml.label.profiling_worker.measure`: warm-up, then samples of back-to-back
executions until the spread settles), holding the machine-wide timing lock the profiling fidelity uses, so
nothing else of this project times at the same moment. Each program is timed in several rounds; its step
time is the lowest round median. The CSV keeps that round's interquartile range and number of samples, the
CPU, the date and the method (with every round's median).

Run it as ``hespas-ml study SPEC --measure-host-cpu CSV``.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..ingest.errors import HespasError
from .study_spec import SINGLE, StudySpec

METHOD = ("whole program compiled by XLA:CPU (jax {jax}) and run on random inputs; lowest of {rounds} round "
          "medians, each of >= {min_repeats} samples of back-to-back executions, machine-wide timing lock held")


class MeasureError(HespasError):
    pass


def _program_text(program: str) -> str | bytes:
    from ..ingest.zoo import is_zoo_spec, zoo_program

    return zoo_program(program) if is_zoo_spec(program) else Path(program).read_bytes()


def measure_host_cpu(spec: StudySpec, out_csv: str | os.PathLike[str], *, measure_s: float = 3.0,
                     min_repeats: int = 30, rounds: int = 3, progress: bool = True) -> list[dict[str, Any]]:
    """Measure every one-device workload of ``spec`` on this machine's CPU; write and return the rows.

    Each program is timed in ``rounds`` rounds (round-robin over the programs, so a burst of load from
    other processes hits one round of several programs rather than every round of one); its step time is
    the lowest round median, which filters interference from other work on a shared machine."""
    from ..label.profiling import ProfilingFidelity
    from ..host import machine_name, package_version
    from ..label.targets import HOST_CPU

    if not (measure_s > 0 and rounds >= 1 and min_repeats >= 1):
        raise MeasureError(f"{spec.path}: measuring needs measure_s > 0, rounds >= 1 and min_repeats >= 1")
    if not any(t.name == HOST_CPU for t in spec.targets):
        raise MeasureError(f"{spec.path}: the study has no {HOST_CPU} target to measure")
    todo = [w for w in spec.workloads if SINGLE in w.systems]
    if not todo:
        raise MeasureError(f"{spec.path}: no workload runs on a single device")
    programs = []
    for w in todo:
        text = _program_text(w.program)
        programs.append({"workload": w.name, "bytecode": isinstance(text, bytes),
                         "text": text.decode("latin-1") if isinstance(text, bytes) else text})
    request = {"programs": programs, "rounds": rounds, "measure_s": measure_s, "min_repeats": min_repeats,
               "lock": ProfilingFidelity(cache=False).lock_path(), "progress": progress}
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "hespas_ml.use.study_measure"], input=json.dumps(request),
                          stdout=subprocess.PIPE, stderr=None if progress else subprocess.PIPE, text=True, env=env,
                          timeout=3600)
    line = next((ln[3:] for ln in proc.stdout.splitlines() if ln.startswith("@@ ")), None)
    if line is None:
        raise MeasureError(f"{spec.path}: the measuring process ended without a result (exit status {proc.returncode})")
    results = json.loads(line)
    if "error" in results:
        raise MeasureError(f"{spec.path}: {results['error']}")
    machine = machine_name()
    method = METHOD.format(jax=package_version("jax"), min_repeats=min_repeats, rounds=rounds)
    rows = []
    for prog, runs in zip(programs, results["runs"]):
        best = min(runs, key=lambda r: r["median_s"])
        medians = " / ".join(f"{r['median_s'] * 1e3:.3f}" for r in runs)
        rows.append({"workload": prog["workload"], "target": HOST_CPU, "system": SINGLE,
                     "runtime_s": f"{best['median_s']:.6g}", "iqr_s": f"{best['iqr_s']:.3g}",
                     "repeats": best["repeats"], "machine": machine, "date": time.strftime("%Y-%m-%d"),
                     "method": f"{method}; round medians {medians} ms, load average {best.get('load_avg')}"})
    with open(out_csv, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows


def _worker() -> None:
    """Child process: read the request on stdin, time every program ``rounds`` times, print ``@@ {json}``."""
    from ..units import progress_bar
    from ..label.profiling_worker import Profiler, TimingLock

    req = json.loads(sys.stdin.read())
    profiler = Profiler()
    texts = []
    for prog in req["programs"]:
        text = prog["text"]
        if prog["bytecode"]:
            from jax.extend.mlir import ir
            from jax.interpreters import mlir as jmlir

            with jmlir.make_ir_context():
                text = str(ir.Module.parse(text.encode("latin-1")))
        texts.append(text)
    runs: list[list[dict[str, Any]]] = [[] for _ in texts]
    bar = progress_bar(len(texts) * req["rounds"], "measure host-cpu", "run", req["progress"])
    for _ in range(req["rounds"]):
        for i, text in enumerate(texts):
            lock = TimingLock(req["lock"])
            if lock.acquire(600.0) is None:
                print("@@ " + json.dumps({"error": f"the timing lock {req['lock']} stayed busy for 600 s"}))
                return
            try:
                result = profiler.profile({"text": text, "measure_s": req["measure_s"],
                                           "min_repeats": req["min_repeats"], "max_repeats": 5000,
                                           "target_noise": 0.01, "sample_s": 0.005, "seed": 0})
            finally:
                lock.release()
            if "error" in result:
                print("@@ " + json.dumps({"error": f"workload {req['programs'][i]['workload']}: {result['error']}"}))
                return
            runs[i].append(result)
            bar.update(1)
    bar.close()
    print("@@ " + json.dumps({"runs": runs}))


if __name__ == "__main__":
    _worker()
