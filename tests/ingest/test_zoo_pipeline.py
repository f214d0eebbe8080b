"""Pipeline parallelism, microbatches and activation recomputation in the transformer families: what the
exported per-device programs hold, and that their steps replay alike on every rank (send/recv included)."""
from __future__ import annotations

import pytest

from hespas_ml import simulate
from hespas_ml.ingest.zoo.specs import parse_zoo_spec
from hespas_ml.ingest.zoo.checks import pipeline_bubble
from hespas_ml.replay import load_system
from hespas_ml.replay.embedded import replay_embedded
from hespas_ml.replay.fast import replay_fast
from hespas_ml.replay.traces import build_traces
from hespas_ml.split.regions import split_program
from tests.ingest.zoo_checks import kinds, load

pytestmark = pytest.mark.slow   # exports programs

LLAMA = "zoo:llama?layers=4&d_model=64&heads=4&kv_heads=2&ffn=128&vocab=256&seq=16&batch=8&step=train"
GPT = "zoo:gpt?layers=4&d_model=64&heads=4&vocab=1000&seq=16&batch=8&step=train"


def groups_of(g, kind: str) -> set[tuple]:
    return {tuple(map(tuple, op.attrs["replica_groups"])) for op in kinds(g, kind)}


def test_a_pipeline_passes_each_tick_to_the_next_stage_around_a_ring():
    # pp 2 outermost: devices 0-1 are the first stage, 2-3 the second; 8 sequences over dp 2 in microbatches
    # of 1: 4 microbatches, so 4 + 2 - 1 = 5 ticks forward and 5 backward
    g = load(f"{LLAMA}&mesh=pp:2,dp:2&devices=4&microbatch=1")
    permutes = kinds(g, "collective_permute")
    # forward to the next stage, backward (the gradients) to the previous one: on two stages, the same ring
    ring = {(0, 2), (1, 3), (2, 0), (3, 1)}
    assert [set(map(tuple, op.attrs["source_target_pairs"])) for op in permutes] == [ring, ring]
    assert sorted(op.count for op in permutes) == [5, 5]
    assert ((0, 1), (2, 3)) in groups_of(g, "all_reduce")         # the gradients over dp, within a stage
    # a device holds its stage's two of the four layers (the stacked 64x64 query weights), and a
    # microbatch of one sequence of 16 tokens is what moves between stages
    assert "2x64x64xf32" in {str(t) for t in g.inputs}
    assert {str(op.operand_types[0]) for op in permutes} == {"1x16x64xf32"}


def test_an_interleaved_pipeline_goes_round_the_ring_once_per_chunk_with_a_shorter_bubble():
    # pp 2 with 2 chunks of one layer each: 4 microbatches go round twice, 2·4 + 2 - 1 = 9 ticks of one
    # layer each way, against GPipe's 4 + 2 - 1 = 5 ticks of two layers
    spec = f"{LLAMA}&mesh=pp:2,dp:2&devices=4&microbatch=1"
    gpipe, interleaved = load(spec), load(f"{spec}&schedule=interleaved:2")
    assert sorted(op.count for op in kinds(interleaved, "collective_permute")) == [9, 9]
    assert {str(op.operand_types[0]) for op in kinds(interleaved, "collective_permute")} == {"1x16x64xf32"}

    def layer_flops(g):        # the blocks' matrix products (the head's and the loss's are alike in both)
        return sum(op.count for op in kinds(g, "dot_general") if "64x64" in str(op.operand_types[1]))

    # each layer's matrix products run once per tick: 9 ticks of one layer against 5 ticks of two
    assert layer_flops(interleaved) * 10 == layer_flops(gpipe) * 9
    assert pipeline_bubble(parse_zoo_spec(spec)[1]) == pytest.approx(1 / 5)
    assert pipeline_bubble(parse_zoo_spec(f"{spec}&schedule=interleaved:2")[1]) == pytest.approx(1 / 9)


def test_a_tied_embedding_sums_its_gradient_over_the_stages_and_an_untied_one_does_not():
    pp_groups = ((0, 2), (1, 3))
    tied = load(f"{GPT}&mesh=pp:2,dp:2&devices=4&microbatch=2")
    untied = load(f"{LLAMA}&mesh=pp:2,dp:2&devices=4&microbatch=2")
    assert pp_groups in groups_of(tied, "all_reduce")
    assert pp_groups not in groups_of(untied, "all_reduce")


def test_microbatches_without_a_pipeline_accumulate_gradients_before_one_all_reduce():
    whole = load(f"{LLAMA}&mesh=dp:2&devices=2")
    parts = load(f"{LLAMA}&mesh=dp:2&devices=2&microbatch=1")
    assert [lp.trip_count for lp in parts.loops] == [4] and not whole.loops
    assert sum(op.count for op in kinds(parts, "all_reduce")) == sum(op.count for op in kinds(whole, "all_reduce"))


def test_recomputation_trades_memory_for_work():
    spec = f"{LLAMA}&mesh=pp:2,dp:2&devices=4&microbatch=1"
    runs = {remat: simulate(f"{spec}&remat={remat}", target="H100", system="switch:4x450")
            for remat in ("none", "selective", "full")}
    assert runs["full"].peak_memory_bytes < runs["selective"].peak_memory_bytes <= runs["none"].peak_memory_bytes
    assert runs["full"].flops > runs["selective"].flops > runs["none"].flops    # the forward again, in part


@pytest.mark.parametrize("spec, system", [
    (f"{LLAMA}&mesh=pp:2,dp:2&devices=4&microbatch=1", "switch:4x450"),
    (f"{LLAMA}&mesh=pp:4,tp:2&devices=8&microbatch=2&scan=true&remat=full", "switch:2x450,switch:4x50"),
    (f"{LLAMA}&mesh=pp:2,dp:2&devices=4&microbatch=1&scan=true&schedule=interleaved:2", "switch:2x450,switch:2x50"),
    (GPT.replace("step=train", "step=infer") + "&mesh=pp:2,fsdp:2&devices=4&microbatch=2", "switch:2x450,switch:2x50"),
])
def test_a_pipeline_replays_rank_zero_alone_to_the_nanosecond(spec, system):
    rg = split_program(load(spec))
    traces = build_traces(rg, [r.flops * 1e-15 + 2e-6 for r in rg.regions])
    assert traces.replay_plan() is not None and not isinstance(traces.replay_plan(), str)
    cfg = load_system(system)
    fast = replay_fast(traces.traces, cfg, traces.comm_groups, traces.replay_plan())
    every_rank = replay_embedded(traces.traces, cfg, traces.comm_groups)
    assert fast.details["engine"] == "fast" and every_rank.details["engine"] == "full"
    assert fast.ranks == every_rank.ranks
