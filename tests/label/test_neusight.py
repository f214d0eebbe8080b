"""NeuSight's measured GPU latencies: rows in NeuSight's CSV formats -> single-operation modules -> labels,
and the committed measured folder datasets/measured/neusight-db1fdc9."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from hespas_ml.ingest import parse_module
from hespas_ml.label.targets import load_target, preset_path
from hespas_ml.split.regions import split_program
from tests.conftest import eval_script

ns = eval_script("import_neusight")
NeuSightError, module_text, op_cost, read_rows = ns.NeuSightError, ns.module_text, ns.op_cost, ns.read_rows

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "datasets" / "measured" / "neusight-db1fdc9"

LEAD = "OPName,Latency,Device,Torch Version,CUDNN Version,Kernel Name,Warps per SM,Blocks per SM,Grid x,Grid y," \
       "Grid z,Block x,Block y,Block z,CUDA Version"
# Format A (bmm, linear), B (conv), C (ln: with Kernels), D (softmax and elementwise: no Kernels).
FORMAT_A = LEAD + ",Kernels,B,M,N,K\n"
FORMAT_B = LEAD + ",Kernels,B,Input_Channel,Output_Channel,Kernel_Szie,Input_Size,Stride,Padding\n"
FORMAT_C = LEAD + ",Kernels,B,H\n"
FORMAT_D = LEAD + ",B,H\n"
SW = "p2.1.0,8902"


def row_a(op: str, ms: float, device: str, dims: str, kernel: str = "ampere_sgemm_128x128_nn") -> str:
    return f"{op},{ms},{device},{SW},{kernel},1.5,0.2,4,1,6,256,1,1,cu121,;{kernel},{dims}\n"


def row_b(ms: float, device: str, dims: str) -> str:
    kernels = '"void implicit_convolve_sgemm<float, float, 128, 5, 5, 3, 3, 3, 1, false, false, true>(int, int)"'
    return (f"conv,{ms},{device},{SW},{kernels},6.1,3.05,30,11,1,8,8,1,cu121,"
            f'";void cudnn::winograd::generateWinogradTilesKernel<0, float, float>(int);ampere_sgemm_128x128_nn",'
            f"{dims}\n")


def row_c(ms: float, device: str, dims: str) -> str:
    kernel = "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(int, float)"
    return f'ln,{ms},{device},{SW},"{kernel}",2.2,0.55,60,1,1,32,4,1,cu121,";{kernel}",{dims}\n'


def row_d(op: str, ms: float, device: str, dims: str) -> str:
    kernel = '"void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int)"'
    return f"{op},{ms},{device},{SW},{kernel},1.55,0.39,42,1,1,128,1,1,cu121,{dims}\n"


A100, T4, P4 = "NVIDIA A100-PCIE-40GB", "Tesla T4", "Tesla P4"

# (op, text of a file holding one row of it, dims, FLOPs and transcendentals written out by hand)
CASES = [
    ("bmm", FORMAT_A + row_a("bmm", 0.0358, A100, "6,27,21,390"), (6, 27, 21, 390), 2 * 6 * 27 * 21 * 390, 0),
    ("linear", FORMAT_A + row_a("linear", 0.0545, A100, "1,58,141,13", "ampere_sgemm_32x128_tn"),
     (1, 58, 141, 13), 2 * 58 * 141 * 13 + 58 * 13, 0),
    # 3x3, stride 1, padding 1 on 7x7: each output row/column reads 3 taps but 2 at the borders -> 3*7-2 = 19
    ("conv", FORMAT_B + row_b(0.967, "NVIDIA A100 80GB PCIe", "2,3,8,3,7,1,1"), (2, 3, 8, 3, 7, 1, 1),
     2 * 2 * 3 * 8 * 19 ** 2, 0),
    ("ln", FORMAT_C + row_c(0.0469, A100, "60,272"), (60, 272), 7 * 60 * 272 + 60, 60),
    ("softmax", FORMAT_D + row_d("softmax", 0.0319, A100, "127,168"), (127, 168), 4 * 127 * 168 - 2 * 127,
     127 * 168),
    *[(op, FORMAT_D + row_d(op, 0.0268, A100, "127,168"), (127, 168), 127 * 168, 0)
      for op in ("add", "mul", "div", "addu", "mulu", "divu", "relu")],
    *[(op, FORMAT_D + row_d(op, 0.0273, A100, "127,168"), (127, 168), 0, 127 * 168) for op in ("pow", "powu", "tanh")],
    ("gelu", FORMAT_D + row_d("gelu", 0.0242, A100, "127,168"), (127, 168), 4 * 127 * 168, 127 * 168),
]


def compute_regions(text: str):
    graph = parse_module(text)
    return [r for r in split_program(graph, "fusion").regions if r.kind == "compute"]


@pytest.mark.parametrize(("op", "csv_text", "dims", "flops", "transcendentals"), CASES, ids=[c[0] for c in CASES])
def test_row_becomes_a_module_with_the_ops_cost(op, csv_text, dims, flops, transcendentals) -> None:
    (m,) = read_rows(csv_text, f"train/{op}.csv", op)
    assert (m.op, m.dims, m.device, m.row) == (op, dims, A100 if op != "conv" else "NVIDIA A100 80GB PCIe", 1)
    assert m.seconds == pytest.approx(float(csv_text.splitlines()[1].split(",")[1]) / 1000)
    assert op_cost(op, dims) == (flops, transcendentals)
    regions = compute_regions(module_text(op, dims))
    total = sum(k.flops for r in regions for k in r.kernels)
    assert total == flops
    assert sum(k.transcendentals for r in regions for k in r.kernels) == transcendentals
    if op in ns.REGIONS_PER_MODULE:
        # the fusion split cuts a reduction and its consumers apart; PyTorch runs one kernel: the importer
        # sends such rows to steps.csv as whole programs
        assert len(regions) == ns.REGIONS_PER_MODULE[op]
    else:
        assert len(regions) == 1 and len(regions[0].kernels) == 1
    assert all(k.dtype == "f32" for r in regions for k in r.kernels)


def _only(text: str, kind: str):
    (op,) = [op for op in parse_module(text).ops if op.kind == kind]
    return op


def test_module_shapes_follow_the_row() -> None:
    dot = _only(module_text("bmm", (6, 27, 21, 390)), "dot_general")
    assert [t.shape for t in dot.operand_types] == [(6, 27, 21), (6, 21, 390)]
    assert [t.shape for t in dot.result_types] == [(6, 27, 390)]        # N contracted, K the output columns
    dot = _only(module_text("linear", (2, 5, 7, 3)), "dot_general")
    assert [t.shape for t in dot.operand_types] == [(10, 7), (3, 7)]   # B*M rows, weight [K, N]
    assert [t.shape for t in dot.result_types] == [(10, 3)]
    # the row's kernel, stride and padding, not a fixed 3x3/1/1: 9x9 input, 5x5 kernel, stride 2, pad 2 -> 5x5
    conv = _only(module_text("conv", (2, 3, 4, 5, 9, 2, 2)), "convolution")
    assert [t.shape for t in conv.operand_types] == [(2, 3, 9, 9), (4, 3, 5, 5)]
    assert [t.shape for t in conv.result_types] == [(2, 4, 5, 5)]
    (region,) = compute_regions(module_text("conv", (2, 3, 4, 5, 9, 2, 2)))
    assert region.flops == op_cost("conv", (2, 3, 4, 5, 9, 2, 2))[0]
    assert module_text("addu", (3, 4)) != module_text("add", (3, 4)) != module_text("mul", (3, 4))


def test_devices_map_to_presets_that_load() -> None:
    expected = {"NVIDIA A100-PCIE-40GB": "A100-40GB", "NVIDIA A100 80GB PCIe": "A100-80GB-PCIe",
                "NVIDIA H100 80GB HBM3": "H100", "NVIDIA L4": "L4", "Tesla P100-PCIE-16GB": "P100-16GB-PCIe",
                "Tesla P4": "P4", "Tesla T4": "T4", "Tesla V100-PCIE-32GB": "V100-32GB-PCIe"}
    for device, target in expected.items():
        assert ns.DEVICES[device] == target
    for device, target in ns.DEVICES.items():
        assert preset_path(target) is not None, target
        assert load_target(target).name == target
    text = FORMAT_A + row_a("bmm", 0.5, T4, "2,3,4,5") + row_a("bmm", 0.9, P4, "2,3,4,5")
    assert [m.target for m in read_rows(text, "t.csv", "bmm")] == ["T4", "P4"]
    # PCIe cards whose datasheet figures differ from the SXM preset have their own
    assert load_target("A100-80GB-PCIe").mem_bw < load_target("A100-80GB").mem_bw
    assert load_target("V100-32GB-PCIe").clock_hz < load_target("V100-32GB").clock_hz


@pytest.mark.parametrize(("text", "op", "expected"), [
    (FORMAT_D + row_d("add", 0.03, A100, "2,3") + row_d("sigmoid", 0.03, A100, "2,3"), None,
     r"bad\.csv: row 2: unknown op 'sigmoid'"),
    (FORMAT_A.replace(",K\n", "\n") + row_a("bmm", 0.03, A100, "2,3,4"), None,
     r"bad\.csv: row 1: no column 'K' \(bmm rows need B, M, N, K\)"),
    (FORMAT_A + row_a("bmm", 0.03, A100, "2,3,x4,5"), None, r"bad\.csv: row 1: column 'N' is not a number: 'x4'"),
    (FORMAT_A + row_a("bmm", 0.03, A100, "2,3,,5"), None, r"bad\.csv: row 1: column 'N' is empty"),
    (FORMAT_A + row_a("bmm", 0.03, A100, "2,3.5,4,5"), None, r"bad\.csv: row 1: column 'M' is not a whole number"),
    (FORMAT_A + row_a("bmm", 0.03, A100, "2,3,4,5") + row_a("bmm", "fast", A100, "2,3,4,5"), None,
     r"bad\.csv: row 2: column 'Latency' is not a number: 'fast'"),
    (FORMAT_A + row_a("bmm", -1, A100, "2,3,4,5"), None, r"bad\.csv: row 1: column 'Latency' must be a positive"),
    (FORMAT_A + row_a("bmm", 0.03, "Tesla K80", "2,3,4,5"), None, r"bad\.csv: row 1: unknown device 'Tesla K80'"),
    (FORMAT_A + row_a("bmm", 0.03, A100, "2,3,4,5,6"), None, r"bad\.csv: row 1: 21 fields, the header has 20"),
    (FORMAT_A + row_a("linear", 0.03, A100, "1,3,4,5"), "bmm", r"bad\.csv: row 1: op 'linear' in a file of 'bmm'"),
    (FORMAT_A + row_a("bmm", 0.03, A100, "0,3,4,5"), None, r"bad\.csv: row 1: column 'B' must be at least 1"),
    ("B,H\n1,2\n", None, r"bad\.csv: header: no column 'OPName'"),
    ("", None, r"bad\.csv: empty file"),
])
def test_bad_rows_name_the_file_and_row(text: str, op, expected: str) -> None:
    with pytest.raises(NeuSightError, match=expected) as err:
        read_rows(text, "bad.csv", op)
    assert "\n" not in str(err.value)


def test_repeated_rows_and_meta() -> None:
    text = FORMAT_C + row_c(0.0470, A100, "116,328") + row_c(0.0507, A100, "116,328")
    first, again = read_rows(text, f"{ns.TRAIN_DIR}/ln/p2.1.0/{A100}.csv", "ln")
    meta = ns.label_meta(first, [again])
    assert meta["source"] == {"repository": ns.REPOSITORY, "path": f"{ns.TRAIN_DIR}/ln/p2.1.0/{A100}.csv",
                              "commit": ns.COMMIT, "row": 1}
    assert meta["device"] == A100 and (meta["torch"], meta["cuda"], meta["cudnn"]) == ("p2.1.0", "cu121", "8902")
    assert meta["kernels"] == [first.kernel] and "launch" in meta["note"]
    assert meta["also_measured"] == [{"path": again.path, "row": 2, "seconds": again.seconds}]
    (add,) = read_rows(FORMAT_D + row_d("add", 0.03, A100, "2,3"), "x.csv")
    assert "kernels" not in ns.label_meta(add)          # format D does not list the kernels launched


def _files(n_shapes: int = 40) -> dict[str, str]:
    """Training files of bmm on two GPUs (the second lacking some shapes), add on one, and a test file."""
    bmm = {A100: FORMAT_A, T4: FORMAT_A}
    for i in range(n_shapes):
        dims = f"{1 + i % 5},{8 * (1 + i)},{3 + i},{2 ** (i % 10)}"
        bmm[A100] += row_a("bmm", 0.03 + i / 100, A100, dims)
        if i % 4:
            bmm[T4] += row_a("bmm", 0.05 + i / 100, T4, dims)
    files = {ns.train_path("bmm", d): t for d, t in bmm.items()}
    files[ns.train_path("add", A100)] = FORMAT_D + "".join(row_d("add", 0.03, A100, f"{i + 1},{7 * i + 1}")
                                                          for i in range(n_shapes))
    files[ns.test_path("bmm")] = FORMAT_A + row_a("bmm", 0.2, "NVIDIA H100 80GB HBM3", "192,96,196,196") + \
        row_a("bmm", 0.3, "NVIDIA L4", "192,96,196,196") + row_a("bmm", 0.1, "NVIDIA H100 80GB HBM3", "2,16,4,2")
    return files


def test_sampling_is_stratified_deterministic_and_keeps_every_gpu() -> None:
    groups = ns.group(ns.read_files(_files()))
    quotas = {"bmm": 10, "add": 5, "bmm-test": 5}
    chosen = ns.choose_shapes(groups, quotas)
    assert chosen == ns.choose_shapes(groups, quotas)
    by_op = {op: [k for k in chosen if k[0] == op] for op in ("bmm", "add")}
    assert len(by_op["add"]) == 5 and len(by_op["bmm"]) == 11     # 10 training shapes + the test-only one
    sizes = sorted({ns.stratum(*k)[0] for k in by_op["bmm"]})
    assert len(sizes) >= 4                                          # spread over sizes, not the first rows
    # a shape in the training and the test files belongs to the training pool, with both rows
    both = groups[("bmm", (2, 16, 4, 2))]
    assert [m.path for m in both] == [ns.train_path("bmm", A100), ns.train_path("bmm", T4), ns.test_path("bmm")]
    assert ns.pool_of(("bmm", (2, 16, 4, 2)), both) == "bmm"
    assert ns.pool_of(("bmm", (192, 96, 196, 196)), groups[("bmm", (192, 96, 196, 196))]) == "bmm-test"
    scaled = ns.scaled_quotas(600)
    regions = sum(q * ns.REGIONS_PER_MODULE.get(p.removesuffix("-test"), 1) for p, q in scaled.items())
    assert 0 < regions <= 600 and ns.scaled_quotas(10 ** 9) == ns.DEFAULT_QUOTAS
    full = sum(q * ns.REGIONS_PER_MODULE.get(p.removesuffix("-test"), 1) for p, q in ns.DEFAULT_QUOTAS.items())
    assert full <= 12_000


def test_import_writes_a_measured_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hespas_ml.label.dataset_tables import load_dataset

    monkeypatch.chdir(tmp_path)
    files = _files(12)
    files[ns.train_path("softmax", A100)] = FORMAT_D + row_d("softmax", 0.04, A100, "4,100")
    summary = ns.import_neusight(files, tmp_path / "measured", tmp_path / "work",
                                 quotas={"bmm": 4, "bmm-test": 2, "add": 2, "softmax": 1}, command="import it")
    ds = load_dataset(tmp_path / "measured")
    prof = ds.labels[ds.labels.fidelity == "profiling"]
    assert summary["labels"] == len(prof) and summary["steps"] == 1 and summary["skipped"] == 0
    assert set(prof.target) == {"A100-40GB", "T4", "H100", "L4"} and (prof.status == "ok").all()
    assert not prof.duplicated(["hash", "target"]).any() and set(prof.hash) <= set(ds.regions.hash)
    roof = ds.labels[ds.labels.fidelity == "roofline"]
    assert len(roof) == len(ds.regions) * len(summary["targets"])
    assert set(ds.regions.family) >= {"neusight-bmm", "neusight-add", "neusight-softmax"}
    assert not any(s.startswith("/") for s in ds.programs.source)          # sources relative to the checkout
    for meta in map(json.loads, prof.meta):
        assert meta["source"]["commit"] == ns.COMMIT and meta["source"]["row"] >= 1
        row = files[meta["source"]["path"]].splitlines()[meta["source"]["row"]]
        assert float(row.split(",")[1]) == pytest.approx(meta["latency_ms"])
    steps = pd.read_csv(tmp_path / "measured" / "steps.csv")
    (step,) = steps.itertuples()
    assert step.family == "neusight-softmax" and step.step_s == pytest.approx(0.04e-3) and step.roofline_s > 0
    assert ds.manifest["measured"]["commit"] == ns.COMMIT
    readme = (tmp_path / "measured" / "README.md").read_text()
    assert ns.REPOSITORY in readme and "MIT" in readme and "import it" in readme
    provenance = json.loads((tmp_path / "measured" / "provenance.json").read_text())
    assert {f["path"] for f in provenance["files"]} == set(files)


# ------------------------------------------------------------------------------- the committed folder

@pytest.fixture(scope="module")
def committed():
    from hespas_ml.label.dataset_tables import load_dataset

    assert COMMITTED.is_dir(), f"{COMMITTED} is missing (python eval/import_neusight.py writes it)"
    return load_dataset(COMMITTED)


def test_committed_folder_loads_and_is_small(committed) -> None:
    assert 0 < len(committed.regions) <= 12_000
    assert (COMMITTED / "graphs.parquet").stat().st_size <= 8 * 2 ** 20
    assert set(committed.labels.fidelity) == {"roofline", "profiling"}
    assert not committed.labels.duplicated(["hash", "target", "fidelity"]).any()
    assert (committed.programs.status == "ok").all()
    assert all(f.startswith("neusight-") for f in committed.regions.family)
    for name in ("README.md", "provenance.json", "steps.csv"):
        assert (COMMITTED / name).is_file()


def test_committed_labels_name_their_source_and_preset(committed) -> None:
    prof = committed.labels[committed.labels.fidelity == "profiling"]
    assert len(prof) > 10_000 and (prof.status == "ok").all()
    assert set(prof.hash) <= set(committed.regions.hash)
    assert prof.seconds.between(1e-6, 100).all()
    for target in set(committed.labels.target):
        assert preset_path(target) is not None and load_target(target).name == target
    devices = {}
    for meta in map(json.loads, prof.meta):
        src = meta["source"]
        assert src["repository"] == ns.REPOSITORY and src["commit"] == ns.COMMIT
        assert isinstance(src["row"], int) and src["row"] >= 1
        assert src["path"].startswith((ns.TRAIN_DIR + "/", ns.TEST_DIR + "/")) and src["path"].endswith(".csv")
        assert meta["kernel"] and meta["note"] and meta["torch"] == "p2.1.0"
        devices[meta["device"]] = ns.DEVICES[meta["device"]]
    assert devices.keys() <= ns.DEVICES.keys() and {"H100", "L4", "T4", "P4"} <= set(devices.values())
    steps = pd.read_csv(COMMITTED / "steps.csv")
    assert set(steps.family) == {"neusight-softmax", "neusight-ln"}
    assert set(steps.source) <= set(committed.programs.source)
    assert all(json.loads(m)["source"]["row"] >= 1 for m in steps.meta)
    assert math.isfinite(steps.roofline_s.sum())
