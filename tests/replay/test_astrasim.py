"""The real-binary runner: output parsing on recorded runs and `replay_astrasim` with stand-in executables.

The real ASTRA-sim binaries are not available in CI; the stand-ins written here print the console output
that the real congestion-unaware binary recorded for a vector, after checking the command line they get.
"""
from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

import pytest
from vector_cases import load_vector, vector_names

import hespas_ml.replay as replay_pkg
from hespas_ml.replay.astrasim import UNAWARE_BINARY, find_binary, parse_output, replay_astrasim
from hespas_ml.replay.errors import ReplayError
from hespas_ml.replay.system import load_system


@pytest.mark.parametrize("name", vector_names())
def test_recorded_output_parses_to_the_expected_results(name: str) -> None:
    vector = load_vector(name)
    text = (vector.folder / "stdout.congestion_unaware.txt").read_text()
    result = parse_output(text, vector.system.n_npus, name)
    assert result.backend == "astra-sim"
    assert result.details["finish_order"] == vector.unaware["finish_order"]
    for rank in result.ranks:
        want = vector.unaware["ranks"][str(rank.rank)]
        stats = want["stats"]
        assert (rank.finish_ns, rank.exposed_comm_ns) == (want["finished_cycles"], want["exposed_comm_cycles"])
        assert (rank.gpu_ns, rank.comm_ns) == (stats.get("GPU time", 0), stats.get("Comm time", 0))
        assert result.details["stats"][rank.rank] == stats
        if "Total compute-communication overlap" in stats:
            assert rank.overlap_ns == stats["Total compute-communication overlap"]


RECORDED = "dag_overlap_ring4"


def recorded_text() -> str:
    return (load_vector(RECORDED).folder / "stdout.congestion_unaware.txt").read_text()


def test_spdlog_prefixes_are_accepted() -> None:
    prefixed = "".join(f"[2026-03-26 10:00:00.000] [workload] [info] {line}\n"
                       for line in recorded_text().splitlines())
    plain = parse_output(recorded_text(), 4, "plain")
    assert parse_output(prefixed, 4, "prefixed").ranks == plain.ranks
    assert plain.ranks[0].finish_ns == 289720 and plain.ranks[0].overlap_ns == 108720


def test_a_rank_without_finished_line_is_named() -> None:
    text = "\n".join(line for line in recorded_text().splitlines() if not line.startswith("sys[2] finished"))
    with pytest.raises(ReplayError, match=r"1 of 4 rank\(s\) never printed 'finished'.*ranks 2$"):
        parse_output(text, 4, "run")


# --- stand-in executables ------------------------------------------------------------------------------
def stand_in(folder: Path, body: str, name: str = UNAWARE_BINARY) -> Path:
    """An executable Python script named like the binary."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!{sys.executable}\nimport sys, os, time, pathlib\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


CHECKING_BODY = """
args = dict(a[2:].split('=', 1) for a in sys.argv[1:])
for key in ('system-configuration', 'network-configuration', 'remote-memory-configuration'):
    if not pathlib.Path(args[key]).is_file():
        sys.exit(3)
n = 1
for count in pathlib.Path(args['network-configuration']).read_text().split('npus_count: [')[1].split(']')[0].split(','):
    n *= int(count)
for rank in range(n):
    if not pathlib.Path(f"{args['workload-configuration']}.{rank}.et").is_file():
        print(f"workload file: {args['workload-configuration']}.{rank}.et does not exist")
        sys.exit(1)
if 'comm-group-configuration' in args and not pathlib.Path(args['comm-group-configuration']).is_file():
    sys.exit(4)
pathlib.Path(args['logging-folder']).mkdir(exist_ok=True)
sys.stdout.write(pathlib.Path(os.environ['RECORDED_STDOUT']).read_text())
"""


@pytest.fixture()
def recorded(monkeypatch) -> Path:
    path = load_vector(RECORDED).folder / "stdout.congestion_unaware.txt"
    monkeypatch.setenv("RECORDED_STDOUT", str(path))
    return path


def test_replay_astrasim_runs_the_binary_and_parses_it(tmp_path: Path, recorded: Path) -> None:
    vector = load_vector(RECORDED)
    binary = stand_in(tmp_path / "bin", CHECKING_BODY)
    result = replay_astrasim(vector.folder / "et" / "dev", vector.system, None, binary, tmp_path / "work")
    assert [r.finish_ns for r in result.ranks] == [289720] * 4
    assert (tmp_path / "work" / "network.yml").is_file() and (tmp_path / "work" / "stdout.txt").is_file()
    embedded = replay_pkg.replay_embedded(vector.traces, vector.system)
    assert embedded.ranks == result.ranks


def test_missing_finished_line_is_an_error(tmp_path: Path, recorded: Path) -> None:
    vector = load_vector(RECORDED)
    body = CHECKING_BODY.replace(
        "sys.stdout.write(pathlib.Path(os.environ['RECORDED_STDOUT']).read_text())",
        "sys.stdout.write(''.join(l for l in pathlib.Path(os.environ['RECORDED_STDOUT']).read_text()"
        ".splitlines(True) if 'sys[3] finished' not in l))")
    binary = stand_in(tmp_path / "bin", body)
    with pytest.raises(ReplayError, match=r"never printed 'finished'.*ranks 3"):
        replay_astrasim(vector.folder / "et" / "dev", vector.system, None, binary, tmp_path / "work")


def test_a_hung_binary_is_killed_at_the_timeout(tmp_path: Path) -> None:
    vector = load_vector(RECORDED)
    binary = stand_in(tmp_path / "bin", "import subprocess\nsubprocess.run(['sleep', '30'])")
    start = time.monotonic()
    with pytest.raises(ReplayError, match=r"no result within 1 s; the run was killed"):
        replay_astrasim(vector.folder / "et" / "dev", vector.system, None, binary, tmp_path / "work", timeout_s=1)
    assert time.monotonic() - start < 15


def test_non_zero_exit_and_crash_are_errors(tmp_path: Path) -> None:
    vector = load_vector(RECORDED)
    prefix = vector.folder / "et" / "dev"
    failing = stand_in(tmp_path / "a", "print('workload file: x does not exist'); sys.exit(1)")
    with pytest.raises(ReplayError, match=r"exited with status 1 \(workload file: x does not exist\)"):
        replay_astrasim(prefix, vector.system, None, failing, tmp_path / "w1")
    crashing = stand_in(tmp_path / "b", "import signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(ReplayError, match="crashed with signal SIGSEGV"):
        replay_astrasim(prefix, vector.system, None, crashing, tmp_path / "w2")


def test_aware_binary_refuses_multi_dimensional_networks(tmp_path: Path) -> None:
    aware = stand_in(tmp_path / "bin", "sys.exit(0)", name="AstraSim_Analytical_Congestion_Aware")
    with pytest.raises(ReplayError, match="accepts 1-D networks only"):
        replay_astrasim(tmp_path / "et" / "dev", load_system("ring:2x50,ring:2x50"), None, aware, tmp_path / "w")


def test_missing_trace_files_are_reported_before_running(tmp_path: Path) -> None:
    binary = stand_in(tmp_path / "bin", "sys.exit(0)")
    with pytest.raises(ReplayError, match=r"dev\.0\.et: ET file does not exist \(4 of 4 ranks missing\)"):
        replay_astrasim(tmp_path / "et" / "dev", load_system("ring:4x50"), None, binary, tmp_path / "w")


# --- finding the binary and choosing the backend ------------------------------------------------------
def test_find_binary_order(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    monkeypatch.delenv("ASTRA_SIM_BIN", raising=False)
    assert find_binary() is None
    env_bin = stand_in(tmp_path / "env", "sys.exit(0)")
    monkeypatch.setenv("ASTRA_SIM_BIN", str(env_bin.parent))
    assert find_binary() == env_bin.resolve()
    on_path = stand_in(tmp_path / "onpath", "sys.exit(0)")
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert find_binary() == on_path.resolve()
    explicit = stand_in(tmp_path / "explicit", "sys.exit(0)", name="my-astra")
    assert find_binary(str(explicit)) == explicit.resolve()
    with pytest.raises(ReplayError, match="not found or not executable"):
        find_binary(str(tmp_path / "nope"))


def test_replay_backend_selection(tmp_path: Path, monkeypatch, recorded: Path) -> None:
    vector = load_vector(RECORDED)
    monkeypatch.delenv("ASTRA_SIM_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    embedded = replay_pkg.replay(vector.traces, vector.folder)
    assert embedded.backend == "embedded"
    with pytest.raises(ReplayError, match="backend astra-sim: no AstraSim_Analytical_Congestion_Unaware"):
        replay_pkg.replay(vector.traces, vector.folder, backend="astra-sim")
    binary = stand_in(tmp_path / "bin", CHECKING_BODY)
    monkeypatch.setenv("PATH", f"{binary.parent}{os.pathsep}{os.environ['PATH']}")
    from_lists = replay_pkg.replay(vector.traces, vector.folder, workdir=tmp_path / "work")
    assert from_lists.backend == "astra-sim" and (tmp_path / "work" / "et" / "rank.3.et").is_file()
    from_prefix = replay_pkg.replay(vector.folder / "et" / "dev", vector.folder, backend="auto")
    assert from_prefix.ranks == from_lists.ranks == embedded.ranks
    forced = replay_pkg.replay(vector.folder / "et" / "dev", vector.folder, backend="embedded")
    assert forced.backend == "embedded"
    with pytest.raises(ReplayError, match="unknown replay backend"):
        replay_pkg.replay(vector.traces, vector.folder, backend="gpu")


def test_comm_group_files_reach_the_binary(tmp_path: Path, monkeypatch) -> None:
    vector = load_vector("pg_pairs_adjacent_ring4")
    monkeypatch.setenv("RECORDED_STDOUT", str(vector.folder / "stdout.congestion_unaware.txt"))
    binary = stand_in(tmp_path / "bin", CHECKING_BODY)
    result = replay_pkg.replay(vector.traces, vector.folder, vector.groups, binary=binary,
                               workdir=tmp_path / "work")
    assert (tmp_path / "work" / "comm_group.json").is_file()
    assert result.ranks == replay_pkg.replay(vector.traces, vector.folder, vector.groups,
                                             backend="embedded").ranks
