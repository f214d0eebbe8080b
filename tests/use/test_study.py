"""Fidelity studies: metrics on hand-checkable tables, strict spec / CSV errors, and the smoke study end to end
(report rendered by a real browser, CSV tables, MLflow run, cache, agreement with ``simulate``)."""
from __future__ import annotations

import csv
import html
import math
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from hespas_ml.cli.main import main as cli_main
from hespas_ml.use import study_metrics as M
from hespas_ml.use.study import CONFIG_COLUMNS, run_study
from hespas_ml.split.families import region_family
from hespas_ml.use.study_spec import StudySpecError, load_spec, read_measured
from tests.conftest import in_project, readme_command

pytestmark = pytest.mark.slow   # exports programs, starts workers, builds datasets or trains

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "eval" / "studies" / "smoke.yaml"


# ------------------------------------------------------------------------------------------ metrics

def _steps(rows):
    return pd.DataFrame(rows, columns=["workload", "system", "target", "source", "step_time_s"])


def test_errors_and_speedups_on_a_hand_checked_table():
    steps = _steps([
        ("w", "single", "T1", "scalesim", 2.0), ("w", "single", "T2", "scalesim", 1.0),
        ("w", "single", "T1", "roofline", 1.0), ("w", "single", "T2", "roofline", 0.8),
        ("w", "single", "T1", "measured", 4.0),           # T1 has a measurement: it is T1's reference
    ])
    err = M.reference_errors(steps, ["measured", "scalesim"], ["measured", "roofline", "scalesim"])
    got = {(r.target, r.source): (r.reference, r.abs_pct_error, r.signed_pct_error) for r in err.itertuples()}
    assert got == {("T1", "roofline"): ("measured", 75.0, -75.0), ("T1", "scalesim"): ("measured", 50.0, -50.0),
                   ("T2", "roofline"): ("scalesim", pytest.approx(20.0), pytest.approx(-20.0))}
    summary = M.error_summary(err).set_index(["source", "reference"])
    assert summary.loc[("roofline", "measured"), "n"] == 1
    assert summary.loc[("roofline", "scalesim"), "mean_abs_pct_error"] == pytest.approx(20.0)

    sp = M.speedups(steps, ["measured", "scalesim"], [("T1", "T2")], ["measured", "roofline", "scalesim"])
    row = sp[sp["source"] == "roofline"].iloc[0]
    # roofline: 1.0 / 0.8 = 1.25x; scalesim (the first of the chain with both ends): 2x -> |1.25/2 - 1| = 0.375
    assert (row.speedup, row.reference, row.reference_speedup) == (1.25, "scalesim", 2.0)
    assert row.speedup_error == pytest.approx(0.375)
    ref_row = sp[sp["source"] == "scalesim"].iloc[0]
    assert ref_row.reference == "" and math.isnan(ref_row.speedup_error)
    assert M.speedup_error(1.0, 0.8, 2.0, 1.0) == pytest.approx(0.375)
    assert M.abs_pct_error(1.1, 1.0) == pytest.approx(10.0)


def test_kendall_tau_b_by_hand_and_against_scipy():
    from scipy.stats import kendalltau

    assert M.kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)     # 5 concordant, 1 discordant
    assert M.kendall_tau([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert M.kendall_tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / math.sqrt(6))  # one tie on the left
    assert math.isnan(M.kendall_tau([1, 1], [1, 2]))
    a, b = [3.0, 1.0, 4.0, 1.5, 5.0, 9.0, 2.6], [2.7, 1.8, 2.8, 1.8, 4.5, 9.0, 0.5]
    assert M.kendall_tau(a, b) == pytest.approx(kendalltau(a, b).statistic)


def test_rank_agreement_over_designs_and_workloads():
    steps = _steps([
        ("w1", "single", "A", "fast", 3.0), ("w1", "single", "B", "fast", 2.0), ("w1", "single", "C", "fast", 1.0),
        ("w1", "single", "A", "ref", 3.0), ("w1", "single", "B", "ref", 1.0), ("w1", "single", "C", "ref", 2.0),
        ("w2", "single", "A", "fast", 5.0), ("w2", "single", "A", "ref", 6.0),
    ])
    table = M.rank_agreement(steps, ["ref", "fast"])
    by_workload = table[table["group_by"] == "workload"].iloc[0]
    assert (by_workload.group, by_workload.source_a, by_workload.source_b, by_workload.n) == ("w1", "ref", "fast", 3)
    assert by_workload.kendall_tau == pytest.approx(1 / 3)      # C>B swapped: 2 concordant, 1 discordant
    assert (by_workload.best_a, by_workload.best_b, by_workload.same_best) == ("B", "C", False)
    by_design = table[table["group_by"] == "design"].set_index("group")
    assert list(by_design.index) == ["A"]                       # B and C hold one workload each
    assert by_design.loc["A", "kendall_tau"] == pytest.approx(1.0) and by_design.loc["A", "same_best"]
    summary = M.rank_summary(table)
    assert set(summary["group_by"]) == {"workload", "design"}


def test_disagreement_by_family_and_top_regions():
    regions = pd.DataFrame([
        ("w", "single", "T", "a", "fusion", "r1", 2.0), ("w", "single", "T", "b", "fusion", "r1", 1.0),
        ("w", "single", "T", "a", "fusion", "r2", 1.0), ("w", "single", "T", "b", "fusion", "r2", 1.0),
        ("w", "single", "T", "c", "linear", "r1", 9.0),   # another split: never paired with a or b
    ], columns=["workload", "system", "target", "source", "split", "signature", "seconds"])
    infos = pd.DataFrame([("w", "single", "fusion", "r1", 1, "dot", "dot_general", "dot_general 2x2xf32"),
                          ("w", "single", "fusion", "r2", 1, "elementwise", "add", "add 2xf32")],
                         columns=["workload", "system", "split", "signature", "count", "family", "op_kinds", "shape"])
    pairs = M.region_pairs(regions, infos, ["a", "b", "c"])
    assert set(zip(pairs["source_a"], pairs["source_b"])) == {("a", "b")}
    fam = M.family_disagreement(pairs, ["dot", "elementwise"]).set_index("family")
    assert fam.loc["dot", "disagreement_pct"] == pytest.approx(100.0)     # a is 2x b
    assert fam.loc["dot", "ratio_a_over_b"] == pytest.approx(2.0)
    assert fam.loc["elementwise", "disagreement_pct"] == pytest.approx(0.0)
    top = M.top_regions(pairs, 1)
    assert len(top) == 1 and top.iloc[0]["region"] == "r1"
    # |2 - 1| over the slower source's step time (2 + 1 = 3)
    assert top.iloc[0]["step_share_pct"] == pytest.approx(100 / 3)


def test_region_family_prefers_the_heaviest_kind_of_work():
    assert region_family(["dot_general", "add", "broadcast_in_dim"]) == "dot"
    assert region_family(["convolution", "dot_general"]) == "conv"
    assert region_family(["exponential", "reduce", "subtract"]) == "reduction"
    assert region_family(["add", "transpose"]) == "elementwise"
    assert region_family(["transpose", "reshape"]) == "data movement"
    assert region_family(["custom_call"]) == "other"


# ------------------------------------------------------------------------------------------ bad input

SPEC_OK = """name: tiny
workloads:
  - {name: g, program: "zoo:gemm?m=32&n=32&k=32"}
targets: [H100, host-cpu]
fidelities:
  roofline: {}
reference: [roofline]
"""


def _one_line_error(path: Path, origin: Path | None = None) -> str:
    """The error loading the spec at ``path`` raises: one line that starts with ``origin`` (default: path)."""
    with pytest.raises(StudySpecError) as info:
        load_spec(path)
    text = str(info.value)
    assert "\n" not in text and text.startswith(str(origin or path)), text
    return text


@pytest.mark.parametrize("change, expected", [
    (("name: tiny", "name: tiny\nbogus: 1"), "bogus: unknown key"),
    (("zoo:gemm?m=32&n=32&k=32", "zoo:gemm?q=1"), "workloads[0].program: zoo:gemm?q=1: gemm has no parameter 'q'"),
    (("zoo:gemm?m=32&n=32&k=32", "nowhere.mlir"), "workloads[0].program: no such file"),
    (("targets: [H100, host-cpu]", "targets: [H100, H9000]"), "targets[1]: unknown hardware target 'H9000'"),
    (("roofline: {}", "roofline: {}\n  magic: {}"), "fidelities.magic: unknown fidelity 'magic'"),
    (("roofline: {}", "roofline: {speed: 3}"), "fidelities.roofline.speed: unknown key"),
    (("roofline: {}", "roofline: {}\n  scalesim: {targets: [H100]}"),
     "fidelities.scalesim.targets[0]: target H100 has no systolic arrays"),
    (("roofline: {}", "roofline: {splits: [fusion, diagonal]}"), "fidelities.roofline.splits[1]: unknown split"),
    (("reference: [roofline]", "reference: [scalesim]"), "reference[0]: unknown source 'scalesim'"),
    (("reference: [roofline]", "reference: [measured]"), "reference[0]: 'measured' needs a measured CSV"),
    (("reference: [roofline]", "reference: [roofline]\ntransitions: [[H100, TPUv9]]"),
     "transitions[0]: 'TPUv9' is not one of the study's targets"),
    (("{name: g,", "{name: 'a b',"), "workloads[0].name: expected a short name"),
    (("reference: [roofline]", "reference: [roofline]\nmeasured: absent.csv"), "measured: no such file"),
])
def test_spec_errors_are_one_line_naming_file_and_key(tmp_path, change, expected):
    path = tmp_path / "study.yaml"
    path.write_text(SPEC_OK.replace(*change))
    assert expected in _one_line_error(path)


def test_default_reference_is_measured_else_the_first_fidelity(tmp_path):
    path = tmp_path / "study.yaml"
    path.write_text(SPEC_OK.replace("reference: [roofline]\n", ""))
    assert load_spec(path).reference == ["roofline"]
    (tmp_path / "m.csv").write_text("workload,target,system,runtime_s\ng,host-cpu,single,1e-3\n")
    path.write_text(SPEC_OK.replace("reference: [roofline]", "measured: m.csv"))
    spec = load_spec(path)
    assert spec.reference == ["measured"] and spec.transitions == [("H100", "host-cpu")]


def test_an_optional_fidelity_that_does_not_exist_is_not_an_error(tmp_path):
    path = tmp_path / "study.yaml"
    path.write_text(SPEC_OK.replace("roofline: {}", "roofline: {}\n  surrogate:nothing: {optional: true}"))
    spec = load_spec(path)
    assert [s.name for s in spec.sources] == ["roofline", "surrogate:nothing"]


@pytest.mark.parametrize("text, expected", [
    ("workload,target,runtime_s\ng,host-cpu,1e-3\n", "line 1: missing column(s) system"),
    ("workload,target,system,runtime_s,colour\ng,host-cpu,single,1e-3,red\n", "line 1: unknown column 'colour'"),
    ("workload,target,system,runtime_s\ng,host-cpu,single,-2\n", "line 2: runtime_s '-2' is not a positive number"),
    ("workload,target,system,runtime_s\ng,host-cpu,single,fast\n", "line 2: runtime_s 'fast'"),
    ("workload,target,system,runtime_s\nh,host-cpu,single,1e-3\n", "line 2: unknown workload 'h'"),
    ("workload,target,system,runtime_s\ng,TPUv4,single,1e-3\n", "line 2: target 'TPUv4' is not one of"),
    ("workload,target,system,runtime_s\ng,host-cpu,ring:2x100,1e-3\n", "line 2: workload g runs on single"),
    ("workload,target,system,runtime_s\ng,host-cpu,single,1e-3\n# note\ng,host-cpu,single,2e-3\n",
     "line 4: g on host-cpu (single) is measured twice"),
    ("workload,target,system,runtime_s\ng,host-cpu,single\n", "line 2: 3 fields, expected 4"),
    ("workload,target,system,runtime_s,repeats\ng,host-cpu,single,1e-3,many\n", "line 2: repeats 'many'"),
    ("", "empty"),
])
def test_measured_csv_errors_are_one_line_naming_file_and_line(tmp_path, text, expected):
    csv_path = tmp_path / "measured.csv"
    csv_path.write_text(text)
    path = tmp_path / "study.yaml"
    path.write_text(SPEC_OK.replace("reference: [roofline]", "measured: measured.csv\nreference: [measured, roofline]"))
    msg = _one_line_error(path, origin=csv_path)
    assert expected in msg, msg
    spec = load_spec(path, read_measured_csv=False)        # the CSV is also checked on its own
    with pytest.raises(StudySpecError, match=r"^" + str(csv_path)):
        read_measured(csv_path, spec)


def test_cli_reports_a_bad_spec_in_one_line(tmp_path, capsys):
    path = tmp_path / "study.yaml"
    path.write_text(SPEC_OK.replace("roofline: {}", "warp: {}"))
    assert cli_main(["study", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "fidelities.warp: unknown fidelity 'warp'" in err
    assert cli_main(["study", str(SMOKE)]) == 2           # no --out
    assert "--out" in capsys.readouterr().err


def test_a_workload_that_cannot_be_read_fails_alone(tmp_path):
    (tmp_path / "broken.mlir").write_text("this is not MLIR\n")
    path = tmp_path / "study.yaml"
    path.write_text(SPEC_OK.replace("targets:", "  - {name: broken, program: broken.mlir}\ntargets:")
                    .replace("roofline: {}", "roofline: {splits: [fusion, individual]}"))
    res = run_study(path, tmp_path / "out", progress=False, mlflow=False)
    c = res.tables["configs"]
    broken = c[c["workload"] == "broken"]
    assert len(broken) == 4 and set(broken["status"]) == {"failed"}
    assert all("broken.mlir" in r for r in broken["reason"])
    ok = c[c["workload"] == "g"]
    assert set(ok["status"]) == {"ok"} and len(ok) == 4
    # roofline is the reference, so the individual split is scored against it
    err = res.tables["errors"]
    assert set(err["source"]) == {"roofline@individual"} and set(err["reference"]) == {"roofline"}


def test_host_cpu_times_of_another_machine_are_refused_unless_asked_for(tmp_path, capsys):
    """host-cpu is whatever machine runs the study: step times measured elsewhere are not its truth."""
    from hespas_ml.host import machine_name

    (tmp_path / "m.csv").write_text("workload,target,system,runtime_s,machine\n"
                                    "g,host-cpu,single,0.001,Elsewhere CPU (64 cores)\n")
    path = tmp_path / "study.yaml"
    path.write_text(SPEC_OK.replace("reference: [roofline]", "measured: m.csv"))
    assert cli_main(["study", str(path), "--out", str(tmp_path / "out"), "--no-mlflow"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "m.csv: its host-cpu step times were measured on Elsewhere CPU (64 cores)" in err
    assert machine_name() in err and "--other-machine" in err
    res = run_study(path, tmp_path / "out", progress=False, mlflow=False, other_machine=True)
    assert res.summary["measured_elsewhere"] == ["Elsewhere CPU (64 cores)"]
    report = res.report.read_text()
    assert "not on the machine that predicted them" in report and "Elsewhere CPU (64 cores)" in report
    # measured here (or with no machine named): nothing to refuse
    (tmp_path / "m.csv").write_text(f"workload,target,system,runtime_s,machine\ng,host-cpu,single,0.001,{machine_name()}\n")
    here = run_study(path, tmp_path / "out2", progress=False, mlflow=False)
    assert here.summary["measured_elsewhere"] == []
    assert "not on the machine that predicted them" not in here.report.read_text()


# ------------------------------------------------------------------------------------------ smoke study

@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke-study")
    store = tmp_path_factory.mktemp("mlruns")
    with in_project():                     # the README's command line; its host-cpu times are one VM's
        command = readme_command("hespas-ml study eval/studies/smoke.yaml", {"out/study-smoke": str(out)})
        assert cli_main([*command, "--tracking-uri", str(store), "--experiment", "studies-test", "--other-machine",
                         "--no-progress"]) == 0
    first = run_study(SMOKE, out, progress=False, tracking_uri=store, experiment="studies-test",
                      other_machine=True)     # from its cache: the result as an object
    return first, out, store


def _header(path: Path) -> list[str]:
    with open(path, newline="") as fh:
        return next(csv.reader(fh))


def test_smoke_study_writes_the_documented_tables(smoke):
    res, out, _ = smoke
    assert _header(out / "configs.csv") == CONFIG_COLUMNS
    for name, columns in M.COLUMNS.items():
        assert _header(out / f"{name}.csv") == columns, name
    readme = (ROOT / "eval" / "studies" / "README.md").read_text()
    for name, columns in [("configs", CONFIG_COLUMNS), *M.COLUMNS.items()]:
        assert f"| `{name}.csv` | {', '.join(columns)} |" in readme, name
    configs = pd.read_csv(out / "configs.csv")
    spec = load_spec(SMOKE)
    assert len(configs) == sum(len(w.systems) * len(s.targets) for w in spec.workloads for s in spec.sources)
    timed = configs[configs["status"] == "ok"]
    for source in ("roofline", "roofline@individual", "scalesim", "profiling"):
        assert (timed["source"] == source).any(), source
    assert (timed["step_time_s"] > 0).all()
    errors = pd.read_csv(out / "errors.csv")
    assert {"roofline", "profiling"} <= set(errors[errors["reference"] == "measured"]["source"])
    assert set(errors[errors["target"].isin(["TPUv3", "TPUv4"])]["reference"]) == {"scalesim"}
    speedups = pd.read_csv(out / "speedups.csv")
    scored = speedups.dropna(subset=["speedup_error"])
    assert set(zip(scored["from_target"], scored["to_target"])) == {("TPUv3", "TPUv4")}
    fam = pd.read_csv(out / "family_disagreement.csv")
    assert {("roofline", "scalesim"), ("roofline", "profiling")} <= set(zip(fam["source_a"], fam["source_b"]))
    assert {"conv", "dot"} <= set(fam["family"])
    top = pd.read_csv(out / "top_regions.csv")
    assert (top.groupby(["source_a", "source_b"]).size() <= spec.top_regions).all()
    assert top["shape"].str.contains("->").all()
    # the profiling surrogate's caveat (when this host-cpu is not the machine it learned) reaches the report
    from hespas_ml.fidelities import get_fidelity
    caveat = get_fidelity("surrogate:profiling").caveat("host-cpu")
    learned = timed[timed["source"] == "surrogate:profiling"]
    assert len(learned) and set(learned["reason"].fillna("")) == {caveat or ""}
    assert caveat is None or html.escape(caveat) in (out / "report.html").read_text()


def test_smoke_study_agrees_with_simulate(smoke):
    from hespas_ml import simulate

    res, _, _ = smoke
    c = res.tables["configs"].set_index(["workload", "system", "target", "source"])
    one = simulate("zoo:resnet?depth=18&width=0.25&image=16&batch=2&classes=10&step=infer", target="H100")
    assert c.loc[("resnet-tiny", "single", "H100", "roofline"), "step_time_s"] == one.step_time_s
    two = simulate("zoo:mlp?layers=2&width=128&batch=32&step=train&parallel=dp", target="TPUv4",
                   system="ring:4x100")
    assert c.loc[("mlp-dp", "ring:4x100", "TPUv4", "roofline"), "step_time_s"] == two.step_time_s


def test_smoke_study_is_logged_to_mlflow(smoke):
    from hespas_ml.learn.tracking import setup_mlflow

    res, _, store = smoke
    mlflow = setup_mlflow(store)
    run = mlflow.get_run(res.run_id)
    assert run.data.params["study"] == "smoke" and run.data.tags["hespas.kind"] == "study"
    assert run.data.params["reference"] == "measured, profiling, scalesim"
    assert run.data.metrics["configs_ok"] > 0
    assert "mape.profiling.vs.measured" in run.data.metrics
    assert "speedup_error.roofline.vs.scalesim" in run.data.metrics
    artifacts = {f.path for f in mlflow.MlflowClient().list_artifacts(res.run_id)}
    assert {"report.html", "errors.csv", "top_regions.csv", "summary.json", "inputs"} <= artifacts
    inputs = {f.path for f in mlflow.MlflowClient().list_artifacts(res.run_id, "inputs")}
    assert inputs == {"inputs/smoke.yaml", "inputs/measured_smoke.csv"}


def test_smoke_study_resumes_from_its_cache(smoke, tmp_path):
    res, out, _ = smoke
    configs = res.tables["configs"]
    done = int(configs["status"].isin(["ok", "partial"]).sum())
    removed = sorted((out / "cache" / "configs").glob("gemm-256__*.json"))
    assert removed
    for f in removed:
        f.unlink()
    again = run_study(SMOKE, out, progress=False, mlflow=False, other_machine=True)
    c2 = again.tables["configs"]
    assert int(c2["cached"].sum()) == done - len(removed)
    # deterministic fidelities give the same times again; profiling re-times a region whose noisy label it
    # did not cache (the machine may have been busy), so its figures may move
    same = (configs["fidelity"] != "profiling").to_numpy()
    assert same.sum() > 0 and (~same).sum() > 0
    pd.testing.assert_series_equal(configs["step_time_s"][same], c2["step_time_s"][same], check_exact=False,
                                   rtol=1e-12)


def test_a_study_does_not_resume_results_of_labels_that_changed_meaning(smoke, monkeypatch):
    from hespas_ml.label.profiling import ProfilingFidelity

    _, out, _ = smoke
    monkeypatch.setattr(ProfilingFidelity, "LABEL_VERSION", ProfilingFidelity.LABEL_VERSION + 1)
    configs = run_study(SMOKE, out, progress=False, mlflow=False, other_machine=True).tables["configs"]
    profiling = (configs["fidelity"] == "profiling").to_numpy()
    ok = configs["status"].isin(["ok", "partial"]).to_numpy()
    assert (profiling & ok).sum() > 0 and not configs["cached"][profiling].any()
    assert configs["cached"][~profiling & ok].all()


def _chromium() -> str:
    path = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if path is None:
        pytest.skip("chromium is not installed (apt-get install chromium) — the browser rendering test needs it")
    return path


def _browser(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    return subprocess.run([_chromium(), *flags, *args], capture_output=True, text=True, timeout=120)


def test_smoke_report_renders_in_a_real_browser(smoke, tmp_path):
    from PIL import Image

    res, _, _ = smoke
    url = res.report.resolve().as_uri()
    text = res.report.read_text()
    assert "http://" not in text and "https://" not in text and "<script" not in text   # self-contained
    shot = tmp_path / "report.png"
    proc = _browser([f"--screenshot={shot}", "--window-size=1400,2000", url], tmp_path)
    assert shot.is_file() and shot.stat().st_size > 30_000, proc.stderr[-2000:]
    img = Image.open(shot).convert("RGB")
    assert img.size == (1400, 2000)
    colours = img.resize((140, 200)).getcolors(maxcolors=1 << 16)
    assert colours is not None and len(colours) > 50                   # text, tables and plots, not a blank page
    dom = _browser(["--dump-dom", url], tmp_path).stdout
    assert dom.count('src="data:image/png;base64,') >= 4                # parity, error bars, speedups, heat map
    for heading in ("Accuracy against the reference", "Speedups across target transitions", "Rank agreement",
                    "Where fidelities disagree", "Step times"):
        assert heading in dom, heading
    assert dom.count("<table") >= 10 and "mean_abs_pct_error" in dom and "step_share_pct" in dom
