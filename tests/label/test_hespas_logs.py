"""Hespas's published GPU runtimes: the log parser, Hespas's block split on our graph, and the committed
measured dataset (``datasets/measured/hespas-llama3-100m``)."""
from __future__ import annotations

import json
import math

import pytest

from hespas_ml.ingest.stablehlo import parse_module
from hespas_ml.split.hespas_blocks import hespas_blocks
from hespas_ml.split.regions import split_program
from hespas_ml.split.regions import SplitError
from hespas_ml.split.signature import signatures
from tests.conftest import PROJECT_ROOT, eval_script, shared_path

FOLDER = PROJECT_ROOT / "datasets" / "measured" / "hespas-llama3-100m"


def _importer():
    return eval_script("import_hespas_logs")


SEP = "-" * 59
LOG = f"""Number of non-expanded ops:| 9
Number of splits: 5
Generating MLIR Modules: 0modules\rGenerating MLIR Modules: 3modules
{SEP}
Translating MLIR to HLO:
xla-translate --stablehlo-to-hlo-text -o m/mini_module_4.hlo m/mini_module_4.mlir
{"-" * 48}
Runtime estimate for mini_module_4.mlir - runtime: 5.5120000000000005
{SEP}
Runtime estimate for mini_module_3.mlir - runtime: 10.25
{SEP}
Cache hit (4) for mini_module_0.mlir - runtime: 5.5120000000000005
{"-" * 60}
Cache hits: 1
Compute Runtime Estimation: 21.27 us
Took 1.0s
"""


def test_parse_log_reads_measured_and_cache_hit_lines():
    log = _importer().parse_log(LOG, "t.out")
    assert [(e.line, e.k, e.kind, e.source_k, e.text) for e in log.entries] == [
        (8, 4, "measured", 4, "5.5120000000000005"), (10, 3, "measured", 3, "10.25"),
        (12, 0, "cache_hit", 4, "5.5120000000000005")]
    assert (log.n_ops, log.n_splits, log.cache_hits) == (9, 5, 1)
    assert log.footer_us == 21.27 and math.isclose(log.total_us, 21.2740000000000005)


@pytest.mark.parametrize("change, message", [
    (("21.27 us", "21.30 us"), "footer says 21.30"),
    (("Cache hit (4)", "Cache hit (7)"), "no earlier line measured"),
    (("Cache hit (4) for mini_module_0.mlir - runtime: 5.5120000000000005",
      "Cache hit (4) for mini_module_0.mlir - runtime: 5.6"), "line 8 measured"),
    (("Cache hits: 1", "Cache hits: 2"), "'Cache hits' says 2"),
    (("Compute Runtime Estimation: 21.27 us\n", ""), "no 'Compute Runtime Estimation"),
    (("mini_module_3.mlir - runtime: 10.25", "mini_module_4.mlir - runtime: 10.25"), "measured a second time"),
    (("runtime: 10.25", "runtime: fast"), "t.out:10: runtime 'fast' is not a number"),
])
def test_parse_log_refuses_inconsistent_logs(change, message):
    importer = _importer()
    with pytest.raises(importer.HespasLogError, match=message.replace("(", r"\(")):
        importer.parse_log(LOG.replace(*change), "t.out")


PROGRAM = """module @m attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 2 : i32} {
  func.func private @body(%a: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.multiply %a, %a : tensor<8xf32>
    %1 = stablehlo.add %0, %a : tensor<8xf32>
    return %1 : tensor<8xf32>
  }
  func.func private @nothing(%a: tensor<8xf32>) -> tensor<8xf32> {
    return %a : tensor<8xf32>
  }
  func.func public @main(%x: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.add %x, %x : tensor<8xf32>
    %1 = func.call @body(%0) : (tensor<8xf32>) -> tensor<8xf32>
    %2 = "stablehlo.all_reduce"(%1) <{replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>}> ({
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %s = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }) : (tensor<8xf32>) -> tensor<8xf32>
    %3 = func.call @nothing(%2) : (tensor<8xf32>) -> tensor<8xf32>
    %4 = stablehlo.exponential %3 : tensor<8xf32>
    %5 = func.call @body(%4) : (tensor<8xf32>) -> tensor<8xf32>
    %6 = stablehlo.negate %5 : tensor<8xf32>
    return %6 : tensor<8xf32>
  }
}
"""


def test_blocks_count_top_level_ops_of_main_with_calls_inlined():
    graph = parse_module(PROGRAM, name="m")
    # main's body: add, call, all_reduce, call (no ops), exp, call, negate, return
    assert [op.main_op for op in graph.ops] == [0, 1, 1, 2, 4, 5, 5, 6]
    blocks = hespas_blocks(graph)
    assert [(b.kind, b.first, b.n_top, b.op_ids) for b in blocks] == [
        ("compute", 0, 2, [0, 1, 2]), ("collective", 2, 1, [3]), ("compute", 3, 5, [4, 5, 6, 7])]
    capped = hespas_blocks(graph, limit=2)
    assert [(b.kind, b.first, b.n_top, b.op_ids) for b in capped] == [
        ("compute", 0, 2, [0, 1, 2]), ("collective", 2, 1, [3]), ("compute", 3, 2, [4]),
        ("compute", 5, 2, [5, 6, 7]), ("compute", 7, 1, [])]              # the last: main's return alone
    rg = split_program(graph, "hespas")
    assert [(r.kind, r.op_ids, r.deps) for r in rg.regions] == [
        ("compute", [0, 1, 2], []), ("collective", [3], [0]), ("compute", [4, 5, 6, 7], [1])]
    assert [sorted(i for k in r.kernels for i in k.op_ids) for r in rg.compute_regions()] == [[0, 1, 2], [4, 5, 6, 7]]
    with pytest.raises(SplitError, match="at least 1"):
        hespas_blocks(graph, limit=0)


def test_blocks_need_to_know_where_each_op_came_from():
    graph = parse_module(PROGRAM, name="m")
    graph.ops[3].main_op = -1
    with pytest.raises(SplitError, match="does not say which top-level op"):
        hespas_blocks(graph)


def test_llama3_100m_splits_like_hespas_logs_say():
    graph = parse_module(shared_path("mlir", "maxtext", "llama3-100m-4dev.mlir").read_bytes(),
                         source="llama3-100m-4dev.mlir")
    blocks = hespas_blocks(graph)
    compute = [b for b in blocks if b.kind == "compute"]
    assert (len(blocks), len(compute)) == (746, 374)
    assert sum(b.n_top for b in blocks) == 5124            # "Number of non-expanded ops" (func.return included)
    assert max(b.n_top for b in compute) == 1024 and [b.index for b in compute if b.n_top == 1024] == [436]
    regions = split_program(graph, "hespas").compute_regions()
    hashes = signatures(regions)
    assert len(regions) == 374 and len(set(hashes)) == 71
    assert sorted(i for r in regions for i in r.op_ids) == [
        op.id for op in graph.ops if op.kind not in ("all_reduce", "all_gather")]


@pytest.fixture(scope="module")
def measured():
    from hespas_ml.label.dataset_tables import load_dataset
    return load_dataset(FOLDER)


def test_committed_folder_loads_and_every_label_names_its_source_line(measured):
    importer = _importer()
    labels = measured.labels[measured.labels["fidelity"] == "profiling"]
    assert len(labels) == 7 * 71 and set(labels["status"]) == {"ok"}
    assert set(labels["target"]) == {"A100-40GB", "H100", "H200", "B200"}
    assert set(labels["hash"]) == set(measured.regions["hash"]) and len(measured.regions) == 71
    raw = {}
    for run in importer.RUNS:
        raw[run["run"]] = (FOLDER / "raw" / f"{run['run']}.out").read_bytes().decode().split("\n")
    runs = {r["run"]: r for r in importer.RUNS}
    for _, row in labels.iterrows():
        meta = json.loads(row["meta"])
        source, run = meta["source"], runs[meta["run"]]
        assert source["repository"] == "imec-int/hespas_workloads"
        assert (source["path"], source["commit"], row["target"]) == (run["path"], run["commit"], run["target"])
        line = raw[meta["run"]][source["line"] - 1]
        assert meta["line_kind"] == "measured"
        assert line == f"Runtime estimate for mini_module_{meta['hespas_k']}.mlir - runtime: {meta['runtime_us']}"
        assert row["seconds"] == float(meta["runtime_us"]) * 1e-6
        for hit in meta["cache_hits"]:
            assert raw[meta["run"]][hit["line"] - 1].startswith(f"Cache hit ({meta['hespas_k']}) for mini_module_"
                                                                 f"{hit['hespas_k']}.mlir")


def test_committed_labels_sum_to_each_log_footer(measured):
    importer = _importer()
    block_hashes = [line.split(",")[-1] for line in (FOLDER / "blocks.csv").read_text().splitlines()[1:]]
    assert len(block_hashes) == 374
    labels = measured.labels[measured.labels["fidelity"] == "profiling"]
    by_run: dict[str, dict[str, float]] = {}
    for _, row in labels.iterrows():
        by_run.setdefault(json.loads(row["meta"])["run"], {})[row["hash"]] = row["seconds"]
    for run in importer.RUNS:
        log = importer.parse_log((FOLDER / "raw" / f"{run['run']}.out").read_bytes().decode(), run["run"])
        total = math.fsum(by_run[run["run"]][h] for h in block_hashes) * 1e6
        assert abs(total - log.footer_us) <= importer.FOOTER_TOLERANCE_US, run["run"]
    assert all(r["footer_check"] for r in measured.manifest["measured"]["runs"])
