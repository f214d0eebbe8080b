"""ASTRA-sim system configurations: folders, short specs, validation, writing, comm groups."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hespas_ml.replay.errors import SystemConfigError
from hespas_ml.replay.system import (
    DEFAULT_LATENCY_NS, NetworkDim, leading_system, load_comm_groups, load_system, write_comm_groups, write_system,
)


def all_system_folders(shared_dir: Path) -> list[Path]:
    roots = [shared_dir / "hespas-configs" / "systems", shared_dir / "astra-vectors"]
    return sorted(p for root in roots for p in root.iterdir() if (p / "network.yml").is_file())


def test_every_shared_system_folder_loads_as_written(shared_dir: Path) -> None:
    folders = all_system_folders(shared_dir)
    assert len(folders) >= 70
    for folder in folders:
        cfg = load_system(folder)
        network = yaml.safe_load((folder / "network.yml").read_text())
        assert [d.topology for d in cfg.dims] == network["topology"]
        assert [d.npus for d in cfg.dims] == network["npus_count"]
        assert [d.bandwidth_gbps for d in cfg.dims] == network["bandwidth"]
        assert [d.latency_ns for d in cfg.dims] == network["latency"]
        assert cfg.system == json.loads((folder / "system.json").read_text())
        assert cfg.name == folder.name


def test_three_dimensional_cluster_counts_its_npus(shared_dir: Path) -> None:
    cfg = load_system(shared_dir / "hespas-configs" / "systems" / "A100_SXM_40GB_8GPU_32_4")
    assert cfg.n_npus == 8 * 32 * 4


def test_local_mem_bw_argument_overrides_a_folder(shared_dir: Path) -> None:
    cfg = load_system(shared_dir / "hespas-configs" / "systems" / "TPUv3_4_2", local_mem_bw_gbps=900)
    assert cfg.system["local-mem-bw"] == 900.0


def test_specs_build_a_documented_default_system() -> None:
    cfg = load_system("Switch:8x400,RING:4x50@700,fc:2x300")
    assert cfg.dims == [NetworkDim("Switch", 8, 400.0, DEFAULT_LATENCY_NS), NetworkDim("Ring", 4, 50.0, 700.0),
                        NetworkDim("FullyConnected", 2, 300.0, DEFAULT_LATENCY_NS)]
    assert cfg.n_npus == 64 and cfg.name == "Switch:8x400,RING:4x50@700,fc:2x300"
    assert cfg.system["all-reduce-implementation"] == ["ring", "ring", "direct"]
    assert cfg.system["all-to-all-implementation"] == ["ring", "ring", "direct"]
    assert cfg.system["endpoint-delay"] >= 1 and cfg.system["preferred-dataset-splits"] >= 1
    assert load_system("fullyconnected:4x150", local_mem_bw_gbps=2000).system["local-mem-bw"] == 2000.0


@pytest.mark.parametrize("spec, problem", [
    ("ring:1x100", "npus_count[0] must be an integer > 1"),
    ("torus:4x100", "unknown topology 'torus'"),
    ("ring:4", "cannot parse 'ring:4'"),
    ("ring:4x0", "bandwidth[0] must be > 0"),
    ("ring:4x100,", "cannot parse ''"),
    ("no/such/folder", "not an ASTRA-sim system folder"),
])
def test_bad_specs_are_one_line_errors(spec: str, problem: str) -> None:
    with pytest.raises(SystemConfigError) as info:
        load_system(spec)
    assert problem in str(info.value) and spec.split(",")[0] in str(info.value)


def write_folder(folder: Path, network: dict, system: dict, remote: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "network.yml").write_text(yaml.safe_dump(network))
    (folder / "system.json").write_text(json.dumps(system))
    (folder / "remote_memory.json").write_text(json.dumps(remote or {"memory-type": "NO_MEMORY_EXPANSION"}))
    return folder


GOOD_NETWORK = {"topology": ["Ring", "Switch"], "npus_count": [4, 2], "bandwidth": [50.0, 25.0],
                "latency": [500.0, 1000.0]}
GOOD_SYSTEM = {"endpoint-delay": 10, "preferred-dataset-splits": 4, "local-mem-bw": 50,
               "all-reduce-implementation": ["ring", "direct4"], "collective-optimization": "localBWAware"}


@pytest.mark.parametrize("network_change, system_change, problem", [
    ({"latency": [500.0]}, {}, "equal lengths"),
    ({"npus_count": [4, 1]}, {}, "npus_count[1] must be an integer > 1"),
    ({"topology": ["Ring", "Torus"]}, {}, "topology[1] 'Torus'"),
    ({}, {"endpoint-delay": 0}, "endpoint-delay must be >= 1"),
    ({}, {"all-reduce-implementation": ["ring"]}, "all-reduce-implementation has 1 entries"),
    ({}, {"all-gather-implementation": ["ring", "spiral"]}, "unknown implementation 'spiral'"),
    ({}, {"scheduling-policy": "RANDOM"}, "scheduling-policy 'RANDOM'"),
    ({}, {"preferred-dataset-splits": 0}, "preferred-dataset-splits must be an integer >= 1"),
    ({}, {"active-chunks-per-dimension": 1.5}, "active-chunks-per-dimension must be an integer"),
])
def test_invalid_folders_name_the_file_and_key(tmp_path: Path, network_change: dict, system_change: dict,
                                               problem: str) -> None:
    folder = write_folder(tmp_path / "sys", {**GOOD_NETWORK, **network_change}, {**GOOD_SYSTEM, **system_change})
    with pytest.raises(SystemConfigError) as info:
        load_system(folder)
    message = str(info.value)
    assert problem in message and str(folder) in message and "\n" not in message


def test_missing_file_and_bad_json_are_reported(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "sys", GOOD_NETWORK, GOOD_SYSTEM)
    (folder / "system.json").write_text("{not json")
    with pytest.raises(SystemConfigError, match=r"system\.json: invalid JSON"):
        load_system(folder)
    (folder / "remote_memory.json").unlink()
    (folder / "system.json").write_text(json.dumps(GOOD_SYSTEM))
    with pytest.raises(SystemConfigError, match=r"remote_memory\.json: file does not exist"):
        load_system(folder)


def test_written_files_load_back_identically(tmp_path: Path) -> None:
    for spec in ("ring:4x150", "switch:8x400@999.9999999999999,ring:4x50"):
        cfg = load_system(spec, local_mem_bw_gbps=1555.2)
        paths = write_system(cfg, tmp_path / spec.replace(":", "_"))
        assert sorted(paths) == ["network", "remote_memory", "system"]
        again = load_system(paths["network"].parent)
        assert (again.dims, again.system, again.remote_memory) == (cfg.dims, cfg.system, cfg.remote_memory)


def test_comm_groups_round_trip_and_keep_member_order(tmp_path: Path) -> None:
    path = write_comm_groups({1: [6, 0, 4, 2], 2: [1, 3]}, tmp_path / "cg" / "comm_group.json")
    assert json.loads(path.read_text()) == {"1": [6, 0, 4, 2], "2": [1, 3]}
    assert load_comm_groups(path) == {1: [6, 0, 4, 2], 2: [1, 3]}


@pytest.mark.parametrize("content, problem", [
    ({"0": [0, 1]}, "ids must be > 0"),
    ({"a": [0, 1]}, "group key 'a' is not an integer"),
    ({"1": []}, "non-empty list"),
    ({"1": [0, 0]}, "lists a rank twice"),
    ({"1": [0, -1]}, "rank -1"),
    ({"1": [0, 9]}, "outside the 8 NPUs"),
    ([[0, 1]], "must be an object"),
])
def test_bad_comm_groups(tmp_path: Path, content: object, problem: str) -> None:
    path = tmp_path / "comm_group.json"
    path.write_text(json.dumps(content))
    with pytest.raises(SystemConfigError) as info:
        load_comm_groups(path, n_npus=8)
    assert problem in str(info.value) and str(path) in str(info.value)


def test_the_first_npus_of_a_system_make_a_system_of_their_own() -> None:
    """A stage's tp group of 8 on 'switch:8x450,switch:4x50' is the first dimension; 16 NPUs are it and half of
    the second (its bandwidth and latency kept); one NPU is no system; 3 NPUs do not make whole groups."""
    cfg = load_system("switch:8x450,ring:4x50@700")
    eight = leading_system(cfg, 8)
    assert [(d.topology, d.npus, d.bandwidth_gbps) for d in eight.dims] == [("Switch", 8, 450.0)]
    assert eight.implementation("all-reduce") == cfg.implementation("all-reduce")[:1]
    sixteen = leading_system(cfg, 16)
    assert [(d.topology, d.npus, d.latency_ns) for d in sixteen.dims] == [("Switch", 8, 500.0), ("Ring", 2, 700.0)]
    assert sixteen.n_npus == 16 and "the first 16 NPUs of" in sixteen.source
    assert leading_system(cfg, 1) is None
    with pytest.raises(SystemConfigError, match="do not make whole groups") as err:
        leading_system(cfg, 3)
    assert "\n" not in str(err.value)
    with pytest.raises(SystemConfigError, match="fewer than 64"):
        leading_system(cfg, 64)
