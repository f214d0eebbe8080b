"""A pipelined step from its stages' own programs (``simulate --pipeline stages``): the role programs the zoo
exports, and the step their schedule gives when replayed."""
from __future__ import annotations

import json

import pytest

from hespas_ml import simulate
from hespas_ml.cli.main import main
from hespas_ml.costs import graph_cost
from hespas_ml.ingest.errors import IngestError
from hespas_ml.ingest.zoo import parse_zoo_spec
from hespas_ml.pipeline import ingest
from hespas_ml.pipeline_stages import StagedPipelineError, simulate_stages
from tests.conftest import readme_command

pytestmark = pytest.mark.slow   # exports programs

TINY = "zoo:llama?layers={layers}&d_model=64&heads=2&vocab=256&seq=32&step={step}"
TRAIN = TINY.format(layers=8, step="train") + "&batch=8&remat=full&scan=true"
SYSTEM = "switch:4x450"
CARD = "L4"      # a slow card: the tiny model's units take tens of µs, well above a message's µs


def test_the_stage_programs_add_up_to_the_model():
    """One microbatch forward: the first stage's layer, two middle ones and the last stage's layer do the
    FLOPs of the whole 4-layer model (all but its loop counters' few); a backward takes about two forwards for
    the gradients, and under remat=full a third to make each layer again from the input the stage kept,
    which is all it keeps of the many intermediates it keeps without recomputation."""
    unit = TINY.format(layers=1, step="infer") + "&batch=2"
    flops = {role: graph_cost(ingest(f"{unit}&role=forward:{role}"))["flops"] for role in ("first", "middle", "last")}
    whole = graph_cost(ingest(TINY.format(layers=4, step="infer") + "&batch=2"))["flops"]
    assert flops["first"] + 2 * flops["middle"] + flops["last"] == pytest.approx(whole, abs=16)
    train = TINY.format(layers=1, step="train") + "&batch=2"
    ratio, kept = {}, {}
    for remat in ("none", "full"):
        forward, backward = (ingest(f"{train}&remat={remat}&role={k}:middle") for k in ("forward", "backward"))
        ratio[remat] = graph_cost(backward)["flops"] / graph_cost(forward)["flops"]
        kept[remat] = sum(t.nbytes for t, role in zip(backward.inputs, backward.input_roles) if role == "kept")
    assert ratio["none"] == pytest.approx(2.0, rel=0.03) and 2.6 < ratio["full"] < 3.05
    assert kept["none"] > 10 * kept["full"] > 0
    update = ingest(f"{train}&optimizer=adam&role=update:last")
    assert set(update.input_roles) == {"parameters", "gradients", "optimizer_state"}


@pytest.mark.parametrize("extra, message", [
    ("&step=train&batch=2&role=update:first&devices=2&mesh=dp:2", r"takes tp alone \(and dp, its shards, with "
                                                                   r"dist_opt=true\), not dp"),
    ("&step=train&batch=2&role=forward:first&devices=2&mesh=dp:2&dist_opt=true", "takes tp alone, not dp"),
    ("&step=infer&batch=2&dist_opt=true", "needs step=train"),
    ("&step=train&batch=2&role=update:first&devices=2", "give mesh=tp:T for 2 devices"),
    ("&step=train&batch=4&role=forward:first&microbatch=2", "at one microbatch: leave microbatch and schedule out"),
    ("&step=infer&batch=2&role=backward:middle", "belongs to a training step"),
])
def test_a_role_program_that_cannot_be_is_one_line(extra, message):
    with pytest.raises((IngestError, ValueError), match=message) as err:
        parse_zoo_spec(TINY.format(layers=1, step="x").replace("&step=x", "") + extra)
    assert "\n" not in str(err.value)


def test_schedules_replayed_from_the_stages_programs():
    """mesh=pp:4, 8 microbatches: GPipe and 1F1B take the same time, 1F1B holds P - s microbatches on stage s
    where GPipe holds all 8 (and no more memory), interleaving two chunks a stage shortens the bubble; every
    stage is busy 8 forwards and backwards and its update, the busiest idle for (P - 1) units' worth."""
    spec = f"{TRAIN}&mesh=pp:4&devices=4&microbatch=1"
    runs = {s: simulate_stages(f"{spec}&schedule={s}", CARD, SYSTEM) for s in ("gpipe", "1f1b", "interleaved:2")}
    gpipe, one, inter = runs["gpipe"], runs["1f1b"], runs["interleaved:2"]
    assert one.step_time_s == pytest.approx(gpipe.step_time_s, rel=0.01)
    assert gpipe.in_flight == [8] * 4 and one.in_flight == [4, 3, 2, 1]
    assert all(o["peak"] <= g["peak"] for o, g in zip(one.memory, gpipe.memory))
    assert one.memory[0]["kept"] / 4 == gpipe.memory[0]["kept"] / 8 > 0
    assert one.memory[1]["kept"] / 3 == gpipe.memory[1]["kept"] / 8 > 0
    assert inter.step_time_s < one.step_time_s and inter.bubble < one.bubble
    unit = {spec.split("role=")[1]: t for spec, t in one.units.items()}
    middle = unit["forward:middle"] + unit["backward:middle"]
    assert one.busy_s[1] == pytest.approx(8 * middle + unit["update:middle"])
    assert one.step_time_s >= max(one.busy_s) and one.bubble == pytest.approx(1 - max(one.busy_s) / one.step_time_s)
    assert one.bubble > 0.5 * 3 / (8 + 3)
    # each unit is the role program's own simulated time
    role_spec = next(s for s in one.units if s.endswith("role=backward:middle"))
    assert simulate(role_spec, target=CARD).step_time_s == one.units[role_spec]


def test_data_parallel_replicas_all_reduce_their_stage_gradients():
    spec = f"{TRAIN}&mesh=pp:2,dp:2&devices=4&microbatch=2&schedule=1f1b"
    fast = simulate_stages(spec, "H100", "switch:2x450,switch:2x450")
    slow = simulate_stages(spec, "H100", "switch:2x1,switch:2x450")       # the replicas 1 GB/s apart
    assert fast.replicas == 2 and fast.microbatches == 2
    assert slow.step_time_s > fast.step_time_s
    assert slow.busy_s == fast.busy_s


def test_a_stage_on_a_tensor_parallel_group():
    """mesh=pp:2,dp:2,tp:2: each unit runs on its tp pair (half the weights, all-reduces inside it, replayed on
    the system's first two NPUs), so a unit costs less compute and more communication as the tp link slows."""
    from hespas_ml.pipeline import ingest as read

    spec = f"{TRAIN}&mesh=pp:2,dp:2,tp:2&devices=8&microbatch=2&schedule=1f1b"
    near = simulate_stages(spec, CARD, "switch:2x450,switch:4x50")
    far = simulate_stages(spec, CARD, "switch:2x5,switch:4x50")
    assert near.tp == 2 and near.replicas == 2
    role = next(s for s in near.units if s.endswith("role=backward:last"))
    program = read(role)
    assert program.n_devices == 2 and any(op.kind == "all_reduce" for op in program.ops)
    one = simulate_stages(f"{TRAIN}&mesh=pp:2,dp:2&devices=4&microbatch=2&schedule=1f1b", CARD,
                          "switch:2x450,switch:2x50")
    assert near.memory[0]["parameters"] < one.memory[0]["parameters"]
    assert far.units[role] > near.units[role] and far.step_time_s > near.step_time_s


def test_simulate_pipeline_stages_prints_and_says_why_not(capsys):
    spec = f"{TRAIN}&mesh=pp:2&devices=2&microbatch=2&schedule=1f1b"
    assert main(["simulate", spec, "--system", "switch:2x450", "--pipeline", "stages", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["pipeline"] == "stages" and data["stages"] == 2 and data["in_flight"] == [2, 1] and data["fits"]
    assert main(["simulate", spec, "--system", "switch:2x450", "--pipeline", "stages"]) == 0
    out = capsys.readouterr().out
    assert "each stage's own programs" in out and "stage 1: busy" in out
    for bad, why in ((spec.replace("mesh=pp:2", "mesh=pp:2,cp:2").replace("devices=2", "devices=4"),
                      "cp inside a stage is not handled"),
                     ("zoo:mlp?layers=2", "the mlp family has no pipeline stages")):
        assert main(["simulate", bad, "--system", "switch:4x450", "--pipeline", "stages"]) == 2
        err = capsys.readouterr().err.strip()
        assert why in err and len(err.splitlines()) == 1
    with pytest.raises(StagedPipelineError, match="needs a pipeline"):
        simulate_stages(f"{TRAIN}&mesh=dp:2&devices=2", "H100", "switch:2x450")


def test_the_readmes_pipeline_stages_line(capsys):
    command = readme_command("hespas-ml simulate 'zoo:llama?layers=8&d_model=256&heads=4&vocab=1024&seq=128")
    assert command[-2:] == ["--pipeline", "stages"]
    assert main([*command, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["replicas"] == 2 and data["in_flight"] == [4, 3, 2, 1] and 0 < data["bubble"] < 1


def test_one_rank_per_stage_replays_the_step_of_every_rank():
    """Switch dimensions: a stage's ranks run alike, so one rank per stage (its peers along one dimension, its
    replicas' all-reduce timed along another) gives every rank's step to within the microsecond the
    all-reduce's wait is rounded to; where a ring or a group spread over two dimensions would make it
    differ, every rank is replayed and the result says so."""
    spec = f"{TRAIN}&mesh=pp:2,dp:2,tp:2&devices=8&microbatch=2&schedule=1f1b"
    one = simulate_stages(spec, CARD, "switch:2x450,switch:4x50")
    every = simulate_stages(spec, CARD, "switch:2x450,switch:4x50", every_rank=True)
    assert (one.replay_engine, every.replay_engine) == ("one rank per stage", "every rank")
    assert abs(one.step_time_s - every.step_time_s) <= 1e-6
    for system, why in (("ring:8x50", "a Ring dimension"), ("switch:2x450,switch:4x50", "span 2 network dimensions")):
        spread = simulate_stages(f"{TRAIN}&mesh=pp:2,dp:4&devices=8&microbatch=1", CARD, system)
        assert spread.replay_engine == "every rank" and any(why in w for w in spread.warnings)


def test_sequence_parallel_stages_with_master_weights():
    """sp=true on a tp pair: a stage sends and keeps its half of the sequence (little more than half what the
    plain tp stage keeps), and its update sums its norms' gradients over the pair; master=f32 keeps f32 weights, gradients
    and Adam state beside the bf16 copy the units compute with."""
    base = f"{TRAIN}&dtype=bf16&optimizer=adam&mesh=pp:2,tp:2&devices=4&microbatch=2&schedule=1f1b"
    plain = simulate_stages(base, CARD, "switch:2x450,switch:2x50")
    seq = simulate_stages(f"{base}&sp=true&master=f32", CARD, "switch:2x450,switch:2x50")
    assert seq.memory[0]["kept"] < 0.6 * plain.memory[0]["kept"]
    update = ingest(next(s for s in seq.units if s.endswith("role=update:middle") or s.endswith("role=update:last")))
    assert any(op.kind == "all_reduce" for op in update.ops)
    assert seq.memory[0]["parameters"] == 2 * seq.memory[0]["compute_copy"]          # f32 beside bf16
    assert "compute_copy" not in plain.memory[0]


def test_the_distributed_optimizer_shards_each_stages_state_over_its_replicas():
    """dist_opt=true on 2 replicas of a tp pair: each device updates half of its part of the stage's f32
    weights and Adam state (the update program's arguments), its f32 gradient buffer stays whole until it is
    reduce-scattered, and the replicas all-gather the bf16 copy after the update; one rank per stage gives
    every rank's step. The one-program step refuses it in one line."""
    base = (f"{TRAIN}&dtype=bf16&optimizer=adam&master=f32&mesh=pp:2,dp:2,tp:2&devices=8&microbatch=1"
            "&schedule=1f1b")
    whole = simulate_stages(base, CARD, "switch:2x450,switch:4x50")
    sharded = simulate_stages(f"{base}&dist_opt=true", CARD, "switch:2x450,switch:4x50")
    every = simulate_stages(f"{base}&dist_opt=true", CARD, "switch:2x450,switch:4x50", every_rank=True)
    for s in range(2):
        w, d = whole.memory[s], sharded.memory[s]
        assert d["optimizer_state"] == pytest.approx(w["optimizer_state"] / 2, abs=64)
        assert d["parameters"] == pytest.approx(w["parameters"] / 2, abs=64)
        assert (d["gradients"], d["compute_copy"]) == (w["gradients"], w["compute_copy"])
    update = ingest(next(s for s in sharded.units if "update:first" in s))
    shard = sum(t.nbytes for t, role in zip(update.inputs, update.input_roles) if role == "parameters")
    assert shard == pytest.approx(whole.memory[0]["parameters"] / 2, abs=64)
    assert abs(sharded.step_time_s - every.step_time_s) <= 1e-6
    with pytest.raises(Exception, match="dist_opt=true is laid out from each pipeline stage's own programs") as err:
        simulate(f"{base}&dist_opt=true", target=CARD, system="switch:2x450,switch:4x50")
    assert "\n" not in str(err.value)


def test_fsdp_inside_a_stage_shards_its_state_over_the_fsdp_group(tmp_path):
    """mesh=pp:2,dp:2,fsdp:2: each stage's f32 weights and Adam state sharded over its fsdp pair (the update on
    half of them), its gradients whole until they are reduce-scattered over the pair; the pairs all-reduce
    their shards over dp, then gather the compute copy. Every rank's replay puts each collective on its own
    communicator (stage 0's rank 0: its pair, ranks 0 and 1; the other pair's same shard, ranks 0 and 2) and
    one rank per stage gives the same step; fsdp in an inference step is one line."""
    from hespas_ml.replay import chakra as et

    base = f"{TRAIN}&dtype=bf16&optimizer=adam&master=f32&devices=8&microbatch=1&schedule=1f1b"
    system = "switch:2x450,switch:4x50"
    fsdp = simulate_stages(f"{base}&mesh=pp:2,dp:2,fsdp:2", CARD, system)
    every = simulate_stages(f"{base}&mesh=pp:2,dp:2,fsdp:2", CARD, system, every_rank=True, out=tmp_path)
    whole = simulate_stages(f"{base}&mesh=pp:2,dp:4", CARD, system)
    assert fsdp.optimizer_shards == 2 and fsdp.replicas == 4 and fsdp.microbatches == whole.microbatches
    for s in range(2):
        f, w = fsdp.memory[s], whole.memory[s]
        assert f["optimizer_state"] == pytest.approx(w["optimizer_state"] / 2, abs=64)
        assert (f["gradients"], f["compute_copy"]) == (w["gradients"], w["compute_copy"])
    assert abs(fsdp.step_time_s - every.step_time_s) <= 1e-6
    groups = json.loads((tmp_path / "comm_group.json").read_text())
    rank0 = et.read_traces(tmp_path / "et" / "llama_stages", 8)[0]
    colls = [(n.attrs["comm_type"], sorted(groups[n.attrs["pg_name"]])) for n in rank0
             if n.type == et.COMM_COLL_NODE]
    assert colls == [(et.REDUCE_SCATTER, [0, 1]), (et.ALL_REDUCE, [0, 2]), (et.ALL_GATHER, [0, 1])]
    both = simulate_stages(f"{base}&mesh=pp:2,dp:2,fsdp:2&dist_opt=true", CARD, system)
    assert both.optimizer_shards == 4
    with pytest.raises(StagedPipelineError, match="an inference step has none") as err:
        simulate_stages(TINY.format(layers=8, step="infer") + "&batch=8&mesh=pp:2,fsdp:2&devices=4"
                        "&microbatch=1", CARD, "switch:2x450,switch:2x50")
    assert "\n" not in str(err.value)


def test_simulate_pipeline_stages_out_keeps_the_traces_it_replayed(tmp_path, capsys):
    """--out: one trace per stage (the ranks replayed), the part of the system they ran on, result.json and a
    timeline; `replay` of those files gives the step again."""
    spec = f"{TRAIN}&mesh=pp:2,dp:2&devices=4&microbatch=1&schedule=1f1b"
    assert main(["simulate", spec, "--system", "switch:2x450,switch:2x50", "--target", CARD, "--pipeline",
                 "stages", "--out", str(tmp_path / "run"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "et").iterdir()) == ["llama_stages.0.et", "llama_stages.1.et"]
    assert (run / "timeline.png").stat().st_size > 0
    assert json.loads((run / "result.json").read_text())["step_time_s"] == got["step_time_s"]
    assert main(["replay", str(run / "et"), "--system", str(run / "system"), "--replay", "embedded",
                 "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["step_time_s"] == pytest.approx(got["step_time_s"], abs=1e-9)
