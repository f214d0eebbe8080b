"""SCALE-Sim on one GEMM: the exact fold formula, the simulation itself, and isolated budgeted workers.

A *layer* here is one GEMM ``C[M, N] = A[M, K] · B[K, N]`` on one systolic array. SCALE-Sim encodes it as
a convolution whose input feature map is ``M × K``, with ``N`` filters of ``1 × K`` (one channel, stride
1); its operand matrices are then exactly ``A`` (``M × K``), ``B`` (``K × N``) and ``C`` (``M × N``).

Three ways of getting its cycles, in falling cost and detail:

* ``full`` — SCALE-Sim's :class:`single_layer_sim`: the compute demand plus the double-buffered SRAM and
  DRAM model (pure-Python loops, one iteration per cycle: slow, and it holds per-cycle traces).
  The DRAM interface runs in SCALE-Sim's USER bandwidth mode with the bandwidth we give it, so memory
  stalls and DRAM traffic reflect the target.
* ``compute-only`` — the operand matrices and the dataflow's demand matrices only (what ``full``
  does before the memory model); the cycle count is the number of demand rows. No stalls.
* ``analytical-tail`` — :func:`analytical_cycles`, the closed form of the demand-row count of SCALE-Sim
  v3's three dataflows (equal to ``compute-only`` in the tests), instant for any size.

All three report cycles in the convention of SCALE-Sim's compute report ("Total Cycles"): demand rows
− 1 plus stall cycles, so the three agree exactly when there are no stalls.

:func:`run_isolated` runs ``full`` / ``compute-only`` simulations in worker processes under a
:class:`Budget`: one process per call, forked from a small server that has numpy and scalesim loaded
(see the protocol below). The worker limits its own address space (``RLIMIT_AS`` = its size at the fork
+ the memory budget) and raises after the time budget (``SIGALRM``); the caller kills it outright a grace
period later. Overruns, crashes and kills come back as failure dicts (``{"failed": True, "kind": ...,
"reason": ...}``), never as exceptions, and never take the caller down.

Importing this module is cheap: numpy and scalesim load inside the calls (the worker server loads them
once and every worker it forks inherits them).
"""
from __future__ import annotations

import json
import math
import os
import resource
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

DATAFLOWS = ("ws", "os", "is")
SIM_MODES = ("full", "compute-only")          # the modes that run SCALE-Sim
ANALYTICAL = "analytical-tail"
MODES = (*SIM_MODES, ANALYTICAL)   # from most to least detailed
GRACE_SECONDS = 2.0      # the caller kills a worker this long after its own time limit should have fired


@dataclass(frozen=True)
class Gemm:
    """One GEMM on one array: ``M`` rows of the input, ``N`` output columns, ``K`` contracted."""

    m: int
    n: int
    k: int

    def __post_init__(self) -> None:
        for name in ("m", "n", "k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Gemm.{name} must be a positive int, got {value!r}")

    @property
    def macs(self) -> int:
        return self.m * self.n * self.k


@dataclass(frozen=True)
class ArrayConfig:
    """One systolic array as SCALE-Sim sees it. SRAM sizes are in kilo-*words* (SCALE-Sim's word is
    one element), the DRAM bandwidth in words per cycle per buffer."""

    rows: int
    cols: int
    dataflow: str
    ifmap_kwords: int
    filter_kwords: int
    ofmap_kwords: int
    dram_words_per_cycle: int

    def __post_init__(self) -> None:
        if self.dataflow not in DATAFLOWS:
            raise ValueError(f"dataflow must be one of {DATAFLOWS}, got {self.dataflow!r}")
        for name in ("rows", "cols", "ifmap_kwords", "filter_kwords", "ofmap_kwords", "dram_words_per_cycle"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"ArrayConfig.{name} must be >= 1, got {getattr(self, name)!r}")

    def key(self, mode: str) -> dict[str, Any]:
        """The fields a result in ``mode`` depends on (the memory system matters only to ``full``)."""
        out: dict[str, Any] = {"rows": self.rows, "cols": self.cols, "dataflow": self.dataflow}
        if mode == "full":
            out.update(ifmap_kwords=self.ifmap_kwords, filter_kwords=self.filter_kwords,
                       ofmap_kwords=self.ofmap_kwords, dram_words_per_cycle=self.dram_words_per_cycle)
        return out


@dataclass(frozen=True)
class Budget:
    """Limits on one SCALE-Sim call: wall-clock seconds, and bytes of address space the worker may add
    to what it holds after start-up (numpy and scalesim imported)."""

    seconds: float = 30.0
    memory_bytes: int = 2 * 2**30

    def __post_init__(self) -> None:
        if not self.seconds > 0 or not self.memory_bytes > 0:
            raise ValueError(f"budget must be positive, got {self.seconds!r} s, {self.memory_bytes!r} B")


# ------------------------------------------------------------------------------------------ formula

def fold_shape(gemm: Gemm, rows: int, cols: int, dataflow: str) -> tuple[int, int, int]:
    """(row folds, column folds, demand rows per fold) of ``gemm`` in SCALE-Sim v3's ``dataflow``.

    Each dataflow maps two GEMM dimensions onto the array and streams the third (``T``):

    * ``ws``: K on rows, N on columns, M streamed; a fold takes ``2R + C + M − 2`` rows (R rows of
      weight load, M inputs skewed over R rows and C columns of drain);
    * ``os``: M on rows, N on columns, K streamed; ``R + C + K − 2`` per fold;
    * ``is``: K on rows, M on columns, N streamed; ``2R + C + N − 2`` per fold.
    """
    m, n, k = gemm.m, gemm.n, gemm.k
    if dataflow == "ws":
        return math.ceil(k / rows), math.ceil(n / cols), 2 * rows + cols + m - 2
    if dataflow == "os":
        return math.ceil(m / rows), math.ceil(n / cols), rows + cols + k - 2
    if dataflow == "is":
        return math.ceil(k / rows), math.ceil(m / cols), 2 * rows + cols + n - 2
    raise ValueError(f"dataflow must be one of {DATAFLOWS}, got {dataflow!r}")


def demand_rows(gemm: Gemm, rows: int, cols: int, dataflow: str) -> int:
    """Rows of SCALE-Sim's demand matrices (one per cycle) for ``gemm``: folds × rows per fold."""
    row_folds, col_folds, per_fold = fold_shape(gemm, rows, cols, dataflow)
    return row_folds * col_folds * per_fold


def analytical_cycles(gemm: Gemm, rows: int, cols: int, dataflow: str) -> int:
    """SCALE-Sim's stall-free "Total Cycles" of ``gemm``, without simulating: demand rows − 1."""
    return demand_rows(gemm, rows, cols, dataflow) - 1


def analytical_result(gemm: Gemm, array: ArrayConfig) -> dict[str, Any]:
    """A result dict like :func:`simulate`'s, from the formula (mode ``analytical-tail``)."""
    cycles = analytical_cycles(gemm, array.rows, array.cols, array.dataflow)
    return {"mode": ANALYTICAL, "cycles": cycles, "compute_cycles": cycles, "stall_cycles": 0,
            "utilization": gemm.macs / (cycles * array.rows * array.cols), "sim_seconds": 0.0}


# ------------------------------------------------------------------------------------------ cost model
#
# What a SCALE-Sim call costs, from the GEMM shape. Calibrated with run_isolated on the project's 2-core
# machine (shared; ±30 % between runs) on 128x128 and 32x32 arrays and all three dataflows:
#  * both modes first build the operand address matrices, whose index arithmetic holds ~10 int64
#    temporaries of the M x K input, then demand matrices of (demand rows) x (R + 2C) float64 "cells";
#  * os / is grow their demand matrices fold by fold with np.concatenate (quadratic in the folds);
#  * the full memory model loops in Python once per demand row (~0.9 us per cell of the row), handles
#    every operand request (~1 us each), walks the ws input prefetch element by element (~1 us each) and
#    keeps ~4.5 copies of the demand data plus ~20 bytes per request (traces, service cycles).
# Measured (sim s, MiB peak RSS incl. ~40 MiB start-up):
#   compute-only ws 128x128: 1024^3 1.3-2.3 s 406; 2048x2048x1024 3.8-5.7 s 1309; 16384x128x1152 6.4 s 2141;
#     is 1024^3 1.9 s 512; os 32x32 1024^3 (1024 folds) > 60 s
#   full ws 128x128: 128^3 0.2-0.3 s 34; 256^3 1.2-1.7 s 64; 4096x128x128 2.9 s 153; 512^3 4.7-6.2 s 207;
#     128x1024x1024 13.2 s 414; 256x250x2048 9.8 s 315; 13952x64x84 11.8 s 355; 3456x128x768 17.9 s 680;
#     os / is 512^3 5.2 / 6.0 s 187 / 215; full ws 32x32 256^3 3.0 s 105
_BASE_SECONDS = 0.05
_CELL_SECONDS = 5e-8              # compute-only, per demand cell
_OPERAND_SECONDS = 2.5e-7         # operand address arithmetic, per element of M x K
_COPY_SECONDS = 4e-10             # per byte copied while os / is concatenate fold by fold
_FULL_CELL_SECONDS = 9e-7         # full memory model, per demand cell
_FULL_REQUEST_SECONDS = 1e-6      # full memory model, per operand request
_FULL_PREFETCH_SECONDS = 1e-6     # full: per element of the ws input prefetch walk
_CELL_BYTES = 1.4 * 8             # compute-only peak, per demand cell
_FULL_CELL_BYTES = 4.5 * 8        # full peak, per demand cell
_FULL_REQUEST_BYTES = 20          # full peak, per operand request
_OPERAND_BYTES = 10 * 8           # per element of M x K (index temporaries)


def operand_requests(gemm: Gemm, array: ArrayConfig) -> int:
    """Operand words the array requests over the whole GEMM: each operand once per fold that reuses it
    (e.g. ws re-streams the input for every column fold and writes the output for every row fold)."""
    m, n, k = gemm.m, gemm.n, gemm.k
    rows, cols = array.rows, array.cols
    if array.dataflow == "ws":
        return m * k * math.ceil(n / cols) + k * n + m * n * math.ceil(k / rows)
    if array.dataflow == "os":
        return m * k * math.ceil(n / cols) + k * n * math.ceil(m / rows) + m * n
    return m * k + k * n * math.ceil(m / cols) + m * n * math.ceil(k / rows)


def predict_cost(gemm: Gemm, array: ArrayConfig, mode: str) -> tuple[float, float]:
    """Predicted (seconds, bytes above start-up) of simulating ``gemm`` on ``array`` in ``mode``."""
    if mode == ANALYTICAL:
        return 0.0, 0.0
    row_folds, col_folds, per_fold = fold_shape(gemm, array.rows, array.cols, array.dataflow)
    cells = float(row_folds * col_folds * per_fold) * (array.rows + 2 * array.cols)
    inputs = float(gemm.m) * gemm.k
    seconds = _BASE_SECONDS + _CELL_SECONDS * cells + _OPERAND_SECONDS * inputs
    if array.dataflow in ("os", "is"):
        seconds += _COPY_SECONDS * (row_folds * col_folds) * cells * 8 / 2
    if mode == "full":
        requests = float(operand_requests(gemm, array))
        prefetch = float(gemm.m) * math.ceil(gemm.k / array.rows) * array.rows if array.dataflow == "ws" else 0.0
        seconds += (_FULL_CELL_SECONDS * cells + _FULL_REQUEST_SECONDS * requests
                    + _FULL_PREFETCH_SECONDS * prefetch)
        return seconds, _FULL_CELL_BYTES * cells + _FULL_REQUEST_BYTES * requests + _OPERAND_BYTES * inputs
    if mode == "compute-only":
        return seconds, _CELL_BYTES * cells + _OPERAND_BYTES * inputs
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def fits(gemm: Gemm, array: ArrayConfig, mode: str, budget: Budget, margin: float = 0.8) -> bool:
    """Whether ``mode`` is predicted to finish within ``margin`` of ``budget`` (time and memory)."""
    seconds, nbytes = predict_cost(gemm, array, mode)
    return seconds <= margin * budget.seconds and nbytes <= margin * budget.memory_bytes


def choose_mode(gemm: Gemm, array: ArrayConfig, budget: Budget) -> str:
    """The most detailed mode predicted to fit ``budget``: ``full``, else ``compute-only``, else
    ``analytical-tail``."""
    for mode in SIM_MODES:
        if fits(gemm, array, mode, budget):
            return mode
    return ANALYTICAL


# ------------------------------------------------------------------------------------------ simulate

def _scalesim_objects(gemm: Gemm, array: ArrayConfig):
    """SCALE-Sim's config, topology and layout objects describing ``gemm`` on ``array``."""
    from scalesim.layout_utils import layouts
    from scalesim.scale_config import scale_config
    from scalesim.topology_utils import topologies

    config = scale_config()
    config.run_name = "hespas_gemm"
    config.array_rows, config.array_cols, config.df = array.rows, array.cols, array.dataflow
    config.ifmap_sz_kb = array.ifmap_kwords
    config.filter_sz_kb = array.filter_kwords
    config.ofmap_sz_kb = array.ofmap_kwords
    # USER bandwidth mode: SCALE-Sim feeds the ifmap and filter buffers at the layout's "bank bandwidth"
    # and drains the ofmap buffer at bandwidths[0]; all three get the array's DRAM share.
    config.use_user_bandwidth = True
    config.bandwidths = [array.dram_words_per_cycle]
    config.ifmap_sram_bank_bandwidth = array.dram_words_per_cycle
    config.filter_sram_bank_bandwidth = array.dram_words_per_cycle
    # Banks only matter to custom-layout evaluation (off), but the bandwidth must divide among them.
    config.ifmap_sram_bank_num = config.filter_sram_bank_num = 1
    # Address ranges of the three operands must not overlap (the defaults are 0 / 10M / 20M words).
    config.ifmap_offset = 0
    config.filter_offset = gemm.m * gemm.k
    config.ofmap_offset = gemm.m * gemm.k + gemm.k * gemm.n
    config.valid_conf_flag = True          # else every getter prints "not valid" and returns None
    topology = topologies()
    # name, ifmap h, ifmap w, filter h, filter w, channels, filters, stride h, stride w, sparsity N:M
    topology.load_layer_params_from_list("gemm", ["gemm", gemm.m, gemm.k, 1, gemm.k, 1, gemm.n, 1, 1, 1, 1])
    return config, topology, layouts()


def _compute_only(gemm: Gemm, array: ArrayConfig) -> dict[str, Any]:
    from scalesim.compute.operand_matrix import operand_matrix
    from scalesim.compute.systolic_compute_is import systolic_compute_is
    from scalesim.compute.systolic_compute_os import systolic_compute_os
    from scalesim.compute.systolic_compute_ws import systolic_compute_ws

    config, topology, layout = _scalesim_objects(gemm, array)
    operands = operand_matrix()
    operands.set_params(layer_id=0, config_obj=config, topoutil_obj=topology, layoututil_obj=layout)
    _, ifmap = operands.get_ifmap_matrix()
    _, filt = operands.get_filter_matrix()
    _, ofmap = operands.get_ofmap_matrix()
    compute = {"ws": systolic_compute_ws, "os": systolic_compute_os, "is": systolic_compute_is}[array.dataflow]()
    compute.set_params(config_obj=config, ifmap_op_mat=ifmap, filter_op_mat=filt, ofmap_op_mat=ofmap)
    _, _, ofmap_demand = compute.get_demand_matrices()
    cycles = int(ofmap_demand.shape[0]) - 1
    return {"mode": "compute-only", "cycles": cycles, "compute_cycles": cycles, "stall_cycles": 0,
            "utilization": gemm.macs / (cycles * array.rows * array.cols),
            "mapping_efficiency": float(compute.get_avg_mapping_efficiency()),
            "compute_utilization": float(compute.get_avg_compute_utilization())}


def _full(gemm: Gemm, array: ArrayConfig) -> dict[str, Any]:
    from scalesim.single_layer_sim import single_layer_sim

    config, topology, layout = _scalesim_objects(gemm, array)
    sim = single_layer_sim()
    sim.set_params(layer_id=0, config_obj=config, topology_obj=topology, layout_obj=layout, verbose=False)
    sim.run()
    overall, total, stalls, util_pct, mapping_pct, compute_pct = sim.get_compute_report_items()
    detail = sim.get_detail_report_items()      # (start, stop, count) × ifmap/filter/ofmap SRAM, then DRAM
    return {"mode": "full", "cycles": int(total), "compute_cycles": int(total) - int(stalls),
            "stall_cycles": int(stalls), "overall_cycles": int(overall),
            "utilization": float(util_pct) / 100.0, "mapping_efficiency": float(mapping_pct) / 100.0,
            "compute_utilization": float(compute_pct) / 100.0,
            "dram_ifmap_reads": int(detail[11]), "dram_filter_reads": int(detail[14]),
            "dram_ofmap_writes": int(detail[17])}


def simulate(gemm: Gemm, array: ArrayConfig, mode: str) -> dict[str, Any]:
    """Cycles of ``gemm`` on ``array`` in ``mode``, in this process (no budget: see :func:`run_isolated`).

    Keys: ``mode``, ``cycles`` (incl. stalls), ``compute_cycles``, ``stall_cycles``, ``utilization`` (MAC
    utilisation of the array over ``cycles``, 0..1), ``sim_seconds``; ``full`` adds ``overall_cycles``
    (first DRAM read to last DRAM write), ``dram_{ifmap,filter}_reads`` and ``dram_ofmap_writes`` (words),
    and both SCALE-Sim modes add ``mapping_efficiency`` and ``compute_utilization`` (0..1).
    """
    start = time.perf_counter()
    with warnings.catch_warnings():
        # scalesim 3.0.0 converts 1-element arrays to ints, which numpy >= 1.25 deprecates (and 2.4 breaks)
        warnings.simplefilter("ignore", DeprecationWarning)
        if mode == "full":
            out = _full(gemm, array)
        elif mode == "compute-only":
            out = _compute_only(gemm, array)
        elif mode == ANALYTICAL:
            out = analytical_result(gemm, array)
        else:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    out["sim_seconds"] = time.perf_counter() - start
    return out


# ------------------------------------------------------------------------------------------ isolation
#
# A worker *server* is ``python -m hespas_ml.label.scalesim_worker``: it imports numpy and scalesim once,
# then forks one child per task (so a task starts in milliseconds and dies alone). It speaks JSON lines:
#   caller -> server (stdin):  {"id", "gemm": [m, n, k], "array": {...}, "mode", "seconds", "memory_bytes"}
#   server -> caller (stdout): {"id", "event": "start", "pid"}        after forking the child,
#                              {"id", "event": "result", "result"}    written by the child,
#                              {"id", "event": "exit", "status"}      once the child is reaped
#                                                                     (exit code, or -signal number).
# Being started with -m, the server never re-imports the caller's main script (as multiprocessing's spawn
# and forkserver would), so callers need no ``if __name__ == "__main__"`` guard.

class _TimeBudgetExceeded(Exception):
    pass


def _on_alarm(signum, frame):  # noqa: ARG001 - signal handler signature
    raise _TimeBudgetExceeded()


def _address_space() -> int:
    """This process's virtual size in bytes (what RLIMIT_AS limits), 0 where /proc is missing."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _failure(kind: str, reason: str, **extra: Any) -> dict[str, Any]:
    return {"failed": True, "kind": kind, "reason": reason, **extra}


def _run_limited(gemm: Gemm, array: ArrayConfig, mode: str, seconds: float, memory_bytes: int) -> dict[str, Any]:
    """Simulate under this process's own limits (call it in a throw-away child): address space = the
    current size + ``memory_bytes``, SIGALRM after ``seconds``, and a CPU-time backstop."""
    message: dict[str, Any]
    try:
        baseline = _address_space()
        if baseline:
            limit = baseline + int(memory_bytes)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        cpu = int(math.ceil(seconds + GRACE_SECONDS)) + 1   # in case the caller is gone
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, float(seconds))
        try:
            message = simulate(gemm, array, mode)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0.0)
    except _TimeBudgetExceeded:
        message = _failure("time", f"{mode} SCALE-Sim run exceeded its time budget of {seconds:g} s")
    except MemoryError:
        message = _failure("memory", f"{mode} SCALE-Sim run exceeded its memory budget of "
                                     f"{memory_bytes / 2**30:.3g} GiB")
    except BaseException as exc:  # noqa: BLE001 - reported to the caller, which decides
        text = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        message = _failure("error", f"{mode} SCALE-Sim run raised {text}")
    message["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return message


def _write_line(fd: int, message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def serve() -> None:
    """The worker server's main loop (see the protocol above); returns at end of input."""
    protocol = os.dup(1)
    os.dup2(2, 1)              # whatever scalesim prints goes to stderr, never into the protocol
    sys.stdout = sys.stderr
    import numpy  # noqa: F401 - preload once; every forked child inherits it
    import scalesim.compute.operand_matrix  # noqa: F401
    import scalesim.single_layer_sim  # noqa: F401
    for line in sys.stdin:
        if not line.strip():
            continue
        task = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                result = _run_limited(Gemm(*task["gemm"]), ArrayConfig(**task["array"]), task["mode"],
                                      float(task["seconds"]), int(task["memory_bytes"]))
                _write_line(protocol, {"id": task["id"], "event": "result", "result": result})
            finally:
                os._exit(0)
        _write_line(protocol, {"id": task["id"], "event": "start", "pid": pid})
        _, status = os.waitpid(pid, 0)
        _write_line(protocol, {"id": task["id"], "event": "exit", "status": os.waitstatus_to_exitcode(status)})


class _Server:
    """The caller's handle on one worker server: its process, line buffer and current task."""

    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen([sys.executable, "-m", __spec__.name if __spec__ else
                                         "hespas_ml.label.scalesim_worker"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                        env=env, close_fds=True)
        self.buffer = b""
        self.clear()

    def clear(self) -> None:
        self.task: int | None = None
        self.pid: int | None = None
        self.result: dict[str, Any] | None = None
        self.deadline = math.inf
        self.seconds = 0.0
        self.killed = False

    def submit(self, index: int, gemm: Gemm, array: ArrayConfig, mode: str, budget: Budget) -> None:
        payload = {"id": index, "gemm": [gemm.m, gemm.n, gemm.k], "array": asdict(array), "mode": mode,
                   "seconds": budget.seconds, "memory_bytes": budget.memory_bytes}
        self.clear()
        self.task = index
        self.seconds = budget.seconds
        self.deadline = time.monotonic() + budget.seconds + GRACE_SECONDS
        self.process.stdin.write((json.dumps(payload) + "\n").encode())
        self.process.stdin.flush()

    def read(self) -> list[dict[str, Any]] | None:
        """The complete messages that have arrived; None once the server's output has ended."""
        chunk = os.read(self.process.stdout.fileno(), 65536)
        if not chunk:
            return None
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def stderr_tail(self, limit: int = 300) -> str:
        try:
            self.stderr.seek(0)
            text = self.stderr.read().decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""
        return text[-limit:].replace("\n", " | ")

    def close(self) -> None:
        if self.task is not None and self.pid is not None:     # a task still running: end it first
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()
        self.stderr.close()


def _exit_failure(status: int, mode: str) -> dict[str, Any]:
    """The failure dict of a child that exited without sending a result."""
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        kind = "time" if name == "SIGXCPU" else "crash"
        return _failure(kind, f"{mode} SCALE-Sim worker was killed by {name}", exitcode=status)
    return _failure("crash", f"{mode} SCALE-Sim worker exited with code {status} without a result",
                    exitcode=status)


def run_isolated(tasks: Sequence[tuple[Gemm, ArrayConfig, str]], budget: Budget, workers: int = 1,
                 on_start: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """Run each ``(gemm, array, mode)`` task in its own worker process under ``budget``.

    At most ``workers`` tasks run at a time. Returns one dict per task, in order: :func:`simulate`'s
    result plus ``peak_rss_bytes``, or a failure ``{"failed": True, "kind": "time" | "memory" | "crash" |
    "error", "reason": ...}``. ``analytical-tail`` tasks are computed here. ``on_start(task_index, pid)`` is
    called as each task's process starts (the pid may be killed; the task then fails as a crash).
    """
    results: list[dict[str, Any] | None] = [None] * len(tasks)
    pending: deque[int] = deque()
    for index, (gemm, array, mode) in enumerate(tasks):
        if mode in SIM_MODES:
            pending.append(index)
        else:
            results[index] = simulate(gemm, array, mode)
    servers: list[_Server] = []
    selector = selectors.DefaultSelector()
    starts_left = max(1, workers) + len(pending)      # bounds restarts after servers die
    try:
        while pending or any(s.task is not None for s in servers):
            while pending and len(servers) < max(1, workers) and starts_left > 0:
                server = _Server()
                starts_left -= 1
                servers.append(server)
                selector.register(server.process.stdout, selectors.EVENT_READ, server)
            if not servers:      # no server could be kept alive
                for index in pending:
                    results[index] = _failure("crash", "SCALE-Sim worker servers keep dying")
                break
            for server in servers:
                if server.task is None and pending:
                    index = pending.popleft()
                    try:
                        server.submit(index, *tasks[index], budget)
                    except OSError:          # the server is gone; its EOF is handled below
                        pending.appendleft(index)
                        server.task = None
            busy = [s for s in servers if s.task is not None]
            soonest = min((s.deadline for s in busy), default=math.inf)
            timeout = None if soonest == math.inf else max(0.0, soonest - time.monotonic())
            for key, _ in selector.select(timeout):
                server = key.data
                messages = server.read()
                if messages is None:         # the server died
                    if server.task is not None:
                        mode = tasks[server.task][2]
                        results[server.task] = _failure(
                            "crash", f"{mode} SCALE-Sim worker server died: {server.stderr_tail()}")
                    selector.unregister(server.process.stdout)
                    server.close()
                    servers.remove(server)
                    continue
                for message in messages:
                    _handle(server, message, tasks, results, on_start)
            now = time.monotonic()
            for server in servers:
                if server.task is not None and now >= server.deadline and not server.killed:
                    server.killed = True
                    server.deadline = math.inf
                    if server.pid is not None:
                        try:
                            os.kill(server.pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    else:                    # stuck before forking: take the server down
                        server.process.kill()
    finally:
        for server in servers:
            server.close()
        selector.close()
    return [r if r is not None else _failure("crash", "no result") for r in results]


def _handle(server: _Server, message: dict[str, Any], tasks, results, on_start) -> None:
    """Apply one protocol message from ``server``."""
    index, event = message.get("id"), message.get("event")
    if index != server.task:
        return
    if event == "start":
        server.pid = int(message["pid"])
        if on_start is not None:
            on_start(index, server.pid)
    elif event == "result":
        server.result = message["result"]
    elif event == "exit":
        mode = tasks[index][2]
        if server.result is not None:
            results[index] = server.result
        elif server.killed:
            results[index] = _failure("time", f"{mode} SCALE-Sim worker ran past its time budget of "
                                              f"{server.seconds:g} s and was killed")
        else:
            results[index] = _exit_failure(int(message["status"]), mode)
        server.clear()


if __name__ == "__main__":
    serve()
