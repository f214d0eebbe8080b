"""Running the real ASTRA-sim analytical binaries (users build them; the project never ships them).

`replay_astrasim` writes the system files into a work folder, runs
`AstraSim_Analytical_Congestion_Unaware` (or `_Aware`) with the flags of astra-sim.md section 2,
enforces a timeout, and parses the `sys[i] finished, T cycles, exposed communication E cycles.` and
statistics lines.  The binaries exit 0 even when ranks never finish, so every rank's `finished` line is
required; a missing one is an error naming the ranks.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

from hespas_ml.replay.chakra import trace_path
from hespas_ml.replay.embedded import RankResult, ReplayResult
from hespas_ml.replay.errors import ReplayError
from hespas_ml.replay.system import SystemConfig, write_system

UNAWARE_BINARY = "AstraSim_Analytical_Congestion_Unaware"
AWARE_BINARY = "AstraSim_Analytical_Congestion_Aware"
BINARY_ENV = "ASTRA_SIM_BIN"

_FINISHED = re.compile(r"sys\[(\d+)\] finished, (\d+) cycles, exposed communication (-?\d+) cycles\.")
_STAT = re.compile(r"sys\[(\d+)\], (Wall time|GPU time|CPU time|Comm time|Remote mem time|Invalid time|"
                   r"Replay time|Total compute-communication overlap): (-?\d+)")


def _usable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_binary(explicit: str | None = None, congestion_aware: bool = False) -> Path | None:
    """The ASTRA-sim binary to run: `explicit` (a path or a name on PATH), else the analytical binary on
    PATH, else $ASTRA_SIM_BIN (a binary, or a folder holding it); None when none is found.

    An explicit binary that does not exist or is not executable is an error.
    """
    name = AWARE_BINARY if congestion_aware else UNAWARE_BINARY
    if explicit:
        candidate = Path(explicit).expanduser()
        if _usable(candidate):
            return candidate.resolve()
        found = shutil.which(explicit)
        if found:
            return Path(found).resolve()
        raise ReplayError(f"{explicit}: ASTRA-sim binary not found or not executable")
    found = shutil.which(name)
    if found:
        return Path(found).resolve()
    env = os.environ.get(BINARY_ENV)
    if env:
        candidate = Path(env).expanduser()
        if candidate.is_dir():
            candidate = candidate / name
        if _usable(candidate):
            return candidate.resolve()
    return None


def parse_output(text: str, n_ranks: int, source: str) -> ReplayResult:
    """Per-rank results from ASTRA-sim console output (with or without spdlog prefixes).

    Raises ReplayError naming the ranks that never printed their `finished` line.
    """
    finished: dict[int, tuple[int, int]] = {}
    order: list[int] = []
    stats: dict[int, dict[str, int]] = {}
    for line in text.splitlines():
        match = _FINISHED.search(line)
        if match:
            rank = int(match.group(1))
            if rank not in finished:
                order.append(rank)
            finished[rank] = (int(match.group(2)), int(match.group(3)))
            continue
        match = _STAT.search(line)
        if match:
            stats.setdefault(int(match.group(1)), {})[match.group(2)] = int(match.group(3))
    extra = sorted(r for r in finished if r >= n_ranks)
    if extra:
        raise ReplayError(f"{source}: output reports rank(s) {extra} but the system has {n_ranks} NPUs")
    missing = [r for r in range(n_ranks) if r not in finished]
    if missing:
        shown = ", ".join(map(str, missing[:16])) + (", ..." if len(missing) > 16 else "")
        raise ReplayError(f"{source}: {len(missing)} of {n_ranks} rank(s) never printed 'finished' "
                          f"(deadlock or crash in ASTRA-sim): ranks {shown}")
    ranks = []
    for rank in range(n_ranks):
        finish, exposed = finished[rank]
        rank_stats = stats.get(rank, {})
        gpu = rank_stats.get("GPU time")
        comm = rank_stats.get("Comm time")
        wall = rank_stats.get("Wall time", finish)
        if "Total compute-communication overlap" in rank_stats:
            overlap = rank_stats["Total compute-communication overlap"]
        elif gpu is not None and comm is not None:
            overlap = gpu + comm - wall
        else:
            overlap = 0
        ranks.append(RankResult(rank, finish, exposed, gpu or 0, comm or 0, overlap))
    return ReplayResult(ranks, "astra-sim", {"finish_order": order, "stats": stats})


def _is_aware(binary: Path) -> bool:
    return "congestion_aware" in binary.name.lower()


def _tail(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def replay_astrasim(trace_prefix: str | Path, system: SystemConfig, comm_groups_file: Path | None,
                    binary: Path, workdir: Path, timeout_s: float = 600) -> ReplayResult:
    """Run an ASTRA-sim analytical binary on `<trace_prefix>.<r>.et` and parse its results.

    The network, system and remote-memory files are written into `workdir` (which also gets the
    `log/` folder and `stdout.txt`).  A run past `timeout_s` is killed; a non-zero exit, a crash or a
    rank without `finished` line raises ReplayError.
    """
    binary = Path(binary)
    if not _usable(binary):
        raise ReplayError(f"{binary}: ASTRA-sim binary not found or not executable")
    if _is_aware(binary) and len(system.dims) > 1:
        raise ReplayError(f"{binary.name}: the congestion-aware binary accepts 1-D networks only, "
                          f"but {system.name} has {len(system.dims)} dimensions")
    workdir = Path(workdir).resolve()
    prefix = Path(trace_prefix).resolve()
    missing = [r for r in range(system.n_npus) if not trace_path(prefix, r).is_file()]
    if missing:
        raise ReplayError(f"{trace_path(prefix, missing[0])}: ET file does not exist "
                          f"({len(missing)} of {system.n_npus} ranks missing)")
    paths = write_system(system, workdir)
    command = [str(binary), f"--workload-configuration={prefix}",
               f"--system-configuration={paths['system']}",
               f"--network-configuration={paths['network']}",
               f"--remote-memory-configuration={paths['remote_memory']}",
               f"--logging-folder={workdir / 'log'}"]
    if comm_groups_file is not None:
        groups = Path(comm_groups_file).resolve()
        if not groups.is_file():
            raise ReplayError(f"{groups}: communicator-group file does not exist")
        if "empty" in str(groups):  # ASTRA-sim treats any path containing "empty" as no file
            copy = workdir / "comm_group.json"
            shutil.copyfile(groups, copy)
            groups = copy
        if "empty" in str(groups):
            raise ReplayError(f"{groups}: ASTRA-sim ignores comm-group paths that contain 'empty'; "
                              "use a work folder whose path does not")
        command.append(f"--comm-group-configuration={groups}")
    try:
        process = subprocess.Popen(command, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, start_new_session=True)
    except OSError as exc:
        raise ReplayError(f"{binary}: cannot start ({exc.strerror or exc})") from None
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.communicate()
        raise ReplayError(f"{binary}: no result within {timeout_s:g} s; the run was killed") from None
    (workdir / "stdout.txt").write_text(stdout)
    if process.returncode < 0:
        name = signal.Signals(-process.returncode).name if -process.returncode in signal.valid_signals() \
            else str(-process.returncode)
        raise ReplayError(f"{binary}: crashed with signal {name} ({_tail(stderr or stdout)})")
    if process.returncode != 0:
        raise ReplayError(f"{binary}: exited with status {process.returncode} ({_tail(stderr or stdout)})")
    return parse_output(stdout, system.n_npus, str(binary))
