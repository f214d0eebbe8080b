"""Layouts: every pp x dp x fsdp x tp mesh (x ep with experts) of a zoo program on N devices, ranked; impossible
and too-big ones said."""
from __future__ import annotations

import json

import pytest

from hespas_ml import simulate
from hespas_ml.cli.main import main
from hespas_ml.pipeline import Question
from hespas_ml.ingest.zoo import ZOO
from hespas_ml.ingest.zoo.checks import all_meshes, search_axes
from hespas_ml.use.layouts import rank_layouts
from tests.conftest import PROJECT_ROOT, readme_command

pytestmark = pytest.mark.slow   # exports programs

LLAMA = "zoo:llama?layers=2&d_model=128&heads=4&vocab=512&seq=64&batch=8&step=train"
SYSTEM = "switch:4x450,switch:2x50"


def test_meshes_are_every_factorisation():
    assert [tuple(m.values()) for m in all_meshes(4)] == [
        (1, 4, 1, 1), (1, 2, 2, 1), (1, 1, 4, 1), (1, 2, 1, 2), (1, 1, 2, 2), (1, 1, 1, 4),
        (2, 2, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2), (4, 1, 1, 1)]
    assert all(m["pp"] * m["dp"] * m["fsdp"] * m["tp"] == 12 for m in all_meshes(12)) and len(all_meshes(12)) == 40
    assert search_axes(ZOO["llama"]) == ("pp", "dp", "fsdp", "tp") and "ep" in search_axes(ZOO["moe"])
    with_ep = all_meshes(4, search_axes(ZOO["moe"]))
    assert len(with_ep) == 15 and len({tuple(m.items()) for m in with_ep}) == 15     # 4 = 2 x 2 over 5 axes
    assert all(list(m) == ["pp", "dp", "fsdp", "ep", "tp"] and m["pp"] * m["dp"] * m["fsdp"] * m["ep"] * m["tp"] == 4
               for m in with_ep)
    assert [{a: s for a, s in m.items() if a != "ep"} for m in with_ep if m["ep"] == 1] == all_meshes(4)


def test_a_model_with_experts_is_laid_out_over_ep_too():
    moe = "zoo:moe?layers=2&d_model=64&heads=4&experts=4&vocab=256&seq=16&batch=8&step=train"
    ranked = rank_layouts(moe, 4, Question.resolve(None, "H100", "switch:4x450"))
    by_mesh = {lay.mesh: lay for lay in ranked}
    assert len(ranked) == 15 and {"ep:4", "dp:2,ep:2", "ep:2,tp:2", "pp:2,ep:2"} <= set(by_mesh)
    assert by_mesh["pp:4"].status == "invalid" and all(by_mesh[m].status == "ok" for m in ("ep:4", "dp:2,ep:2"))
    res = simulate(by_mesh["ep:4"].program, target="H100", system="switch:4x450")
    assert res.step_time_s == by_mesh["ep:4"].step_time_s
    assert res.step_time_s == simulate(moe + "&devices=4&parallel=ep", target="H100", system="switch:4x450").step_time_s


def test_layouts_are_ranked_by_step_time_as_simulate_times_them(capsys):
    ranked = rank_layouts(LLAMA, 8, Question.resolve(None, "H100", SYSTEM))
    ok = [lay for lay in ranked if lay.status == "ok"]
    assert len(ok) == 15 and [lay.step_time_s for lay in ok] == sorted(lay.step_time_s for lay in ok)
    assert sum("pp:2" in lay.mesh for lay in ok) == 6 and all("microbatch=1" in lay.program
                                                             for lay in ok if "pp:" in lay.mesh)
    by_mesh = {lay.mesh: lay for lay in ranked}
    # 8 sequences over dp 2: 4 microbatches through 2 stages, 1 idle tick of 5; no pipeline, no bubble
    assert by_mesh["pp:2,dp:2,tp:2"].bubble == pytest.approx(1 / 5) and by_mesh["dp:2,tp:4"].bubble == 0
    for lay in (ok[0], ok[-1]):
        res = simulate(lay.program, target="H100", system=SYSTEM)
        assert (res.step_time_s, res.exposed_comm_s, res.peak_memory_bytes) == \
               (lay.step_time_s, lay.exposed_comm_s, lay.peak_memory_bytes)
        assert 0 < lay.utilisation < 1
    piped = simulate(by_mesh["pp:2,dp:2,tp:2"].program, target="H100", system=SYSTEM)   # simulate says it too
    assert piped.pipeline_bubble == pytest.approx(1 / 5) == piped.to_dict()["pipeline_bubble"]
    assert simulate(by_mesh["dp:2,tp:4"].program, target="H100", system=SYSTEM).pipeline_bubble == 0
    assert main(["simulate", by_mesh["pp:2,dp:2,tp:2"].program, "--system", SYSTEM]) == 0
    assert "pipeline      bubble 20.0% of the ticks" in capsys.readouterr().out
    invalid = [lay for lay in ranked if lay.status == "invalid"]
    assert [(lay.mesh, lay.reason) for lay in invalid] == [("tp:8", "tp 8 does not divide heads 4")] + [
        (mesh, f"pp {mesh[3]} does not divide layers 2") for mesh in ("pp:4,dp:2", "pp:4,fsdp:2", "pp:4,tp:2", "pp:8")]


def test_a_layout_that_does_not_fit_is_not_timed(tmp_path):
    """On a card whose memory lies between what dp:8 and fsdp:8 need per device, dp:8 is not timed and says
    why; fsdp:8 (weights and optimizer state sharded) is timed."""
    import yaml

    need = {m: simulate(f"{LLAMA}&mesh={m}&devices=8", target="H100", system=SYSTEM).peak_memory_bytes
            for m in ("dp:8", "fsdp:8")}
    assert need["fsdp:8"] < need["dp:8"]
    card = yaml.safe_load((PROJECT_ROOT / "hespas_ml" / "label" / "targets" / "H100.yaml").read_text())
    card.update(name="half", aliases=[], mem_capacity=(need["dp:8"] + need["fsdp:8"]) // 2)
    (tmp_path / "half.yaml").write_text(yaml.safe_dump(card))
    ranked = rank_layouts(LLAMA, 8, Question.resolve(None, str(tmp_path / "half.yaml"), SYSTEM))
    by_mesh = {lay.mesh: lay for lay in ranked}
    assert by_mesh["dp:8"].status == "too-big" and "half has" in by_mesh["dp:8"].reason
    too_big = by_mesh["dp:8"]
    assert too_big.peak_memory_bytes == need["dp:8"] and too_big.step_time_s != too_big.step_time_s   # NaN
    assert by_mesh["fsdp:8"].status == "ok" and by_mesh["fsdp:8"].peak_memory_bytes == need["fsdp:8"]
    assert ranked[0].status == "ok"


def test_layouts_out_writes_the_ranking_and_its_picture(tmp_path, capsys):
    """--out keeps the --json object and draws it; on a card of 4.5 MiB some layouts do not fit and are drawn
    (memory, not time) after the timed ones."""
    import yaml
    from matplotlib.image import imread

    small = yaml.safe_load((PROJECT_ROOT / "hespas_ml" / "label" / "targets" / "H100.yaml").read_text())
    small.update(name="tiny", aliases=[], mem_capacity=int(4.5 * 2**20))
    target = tmp_path / "tiny.yaml"
    target.write_text(yaml.safe_dump(small))
    argv = ["layouts", LLAMA, "--devices", "8", "--system", SYSTEM, "--target", str(target)]
    assert main([*argv, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    assert "layouts.png written" in capsys.readouterr().out
    kept = json.loads((tmp_path / "out" / "layouts.json").read_text())
    assert kept == printed
    statuses = {lay["status"] for lay in kept["layouts"]}
    assert statuses == {"ok", "too-big", "invalid"}
    picture = imread(tmp_path / "out" / "layouts.png")
    rows = sum(lay["status"] != "invalid" for lay in kept["layouts"])
    assert picture.shape[0] > 110 * (1.4 + 0.28 * rows) * 0.9 and picture.shape[1] > 1000


@pytest.mark.parametrize("argv, expected", [
    (["zoo:mlp?layers=2", "--devices", "4", "--system", "ring:4x100"], "mlp takes no mesh"),
    ([f"{LLAMA}&devices=8", "--devices", "8", "--system", SYSTEM], "leave devices, parallel and mesh out"),
    ([LLAMA, "--devices", "4", "--system", SYSTEM], "the system must have the 4 devices"),
])
def test_bad_requests_are_one_line(argv, expected, capsys):
    assert main(["layouts", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1


def test_the_readmes_layouts_line(capsys):
    command = readme_command("hespas-ml layouts")
    assert main([*command, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["devices"] == 8 and len(data["layouts"]) == 20 and data["layouts"][0]["status"] == "ok"
    assert main(command) == 0 and "rank  mesh" in capsys.readouterr().out


def test_layouts_time_each_layout_with_the_split_and_fidelity_given(capsys):
    """--split merged --fidelity calibrated-roofline: every layout is timed as simulate times it with them, and
    the report says which split it used."""
    argv = ["layouts", LLAMA, "--devices", "4", "--system", "switch:4x450", "--fidelity", "calibrated-roofline",
            "--split", "merged"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["split"] == "merged" and report["fidelity"] == "calibrated-roofline"
    best = report["layouts"][0]
    res = simulate(best["program"], target="H100", system="switch:4x450", fidelity="calibrated-roofline",
                   split="merged")
    assert res.step_time_s == best["step_time_s"]
    assert res.step_time_s != simulate(best["program"], target="H100", system="switch:4x450",
                                       fidelity="calibrated-roofline").step_time_s
    assert main(argv) == 0 and "calibrated-roofline (merged split)" in capsys.readouterr().out


def test_layouts_with_pipelines_from_their_stages_programs(capsys):
    """--pipeline stages: a pipelined layout is timed as simulate --pipeline stages times it, its bubble the
    busiest stage's idle share; the others as before."""
    from hespas_ml.pipeline_stages import simulate_stages

    program = f"{LLAMA}&remat=full&scan=true"
    argv = ["layouts", program, "--devices", "2", "--system", "switch:2x450", "--pipeline", "stages", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    by_mesh = {lay["mesh"]: lay for lay in report["layouts"]}
    assert report["pipeline"] == "stages" and set(by_mesh) == {"pp:2", "dp:2", "fsdp:2", "tp:2"}
    staged = simulate_stages(by_mesh["pp:2"]["program"], "H100", "switch:2x450")
    assert by_mesh["pp:2"]["step_time_s"] == staged.step_time_s and by_mesh["pp:2"]["bubble"] == staged.bubble > 0
    plain = simulate(by_mesh["dp:2"]["program"], target="H100", system="switch:2x450")
    assert by_mesh["dp:2"]["step_time_s"] == plain.step_time_s
