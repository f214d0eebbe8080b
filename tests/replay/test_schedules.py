"""Pipeline schedules as traces: every stage's order, what it holds in flight, and the step the embedded
replay gives for them (the bubble simulated, not assumed)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hespas_ml.replay import chakra as et
from hespas_ml.replay.embedded import replay_embedded
from hespas_ml.replay.errors import TraceError
from hespas_ml.replay.schedules import StageWork, in_flight, schedule_traces, stage_order
from hespas_ml.replay.system import load_system

F, B = 1e-3, 2e-3          # a microbatch through a whole stage, forward and backward


def layouts():
    return st.tuples(st.sampled_from(["gpipe", "1f1b", "interleaved"]), st.integers(1, 6), st.integers(1, 4),
                     st.integers(1, 4)).map(
        lambda t: (t[0], t[1], t[2] * t[1] if t[0] == "interleaved" else t[2] * t[3],
                   t[3] if t[0] == "interleaved" else 1))


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_every_stage_runs_each_unit_once_and_a_backward_after_its_forward(layout):
    schedule, stages, micro, chunks = layout
    for stage in range(stages):
        order = stage_order(schedule, stages, micro, stage, chunks)
        units = {(mb, c) for mb in range(micro) for c in range(chunks)}
        assert sorted(order) == sorted([("B", *u) for u in units] + [("F", *u) for u in units])
        done = set()
        for kind, mb, c in order:
            assert kind == "F" or (mb, c) in done
            done.add((mb, c))
        assert stage_order(schedule, stages, micro, stage, chunks, train=False) == [u for u in order if u[0] == "F"]


@pytest.mark.parametrize("stages, micro", [(4, 8), (4, 2), (8, 16), (2, 1)])
def test_what_a_stage_holds_in_flight(stages, micro):
    """GPipe holds every microbatch, 1F1B P - s on stage s, interleaving (in chunks, each 1/V of a stage)
    2(P - s - 1) + (V - 1)P + 1."""
    for s in range(stages):
        assert in_flight(stage_order("gpipe", stages, micro, s)) == micro
        assert in_flight(stage_order("1f1b", stages, micro, s)) == min(micro, stages - s)
        if micro % stages == 0:
            assert in_flight(stage_order("interleaved", stages, micro, s, 2)) == \
                min(2 * micro, 2 * (stages - s - 1) + stages + 1)


def _step(schedule, stages, micro, chunks=1, work=None, system=None, train=True):
    work = work or [StageWork(F / chunks, B / chunks, 1024)] * (stages * chunks)
    traces = schedule_traces(work, schedule, micro, chunks, train=train)
    return replay_embedded(traces, load_system(system or f"switch:{stages}x450")).step_time_s


@pytest.mark.parametrize("stages, micro", [(4, 8), (2, 6), (8, 8)])
def test_the_replayed_bubble_is_the_schedules(stages, micro):
    """Equal stages, small messages on a fast switch: GPipe and 1F1B take (M + P - 1)(F + B), interleaving
    over V chunks M(F + B) + (P - 1)(F + B)/V, with no more than a message's time per unit on top (a unit
    may wait for its input to arrive)."""
    hop = _step("gpipe", 2, 1, train=False) - 2 * F           # one activation from stage to stage

    def near(step, ideal, hops):
        return ideal <= step + 1e-9 and step <= ideal + hops * hop + 1e-9

    assert 0 < hop < 0.01 * F
    ideal = (micro + stages - 1) * (F + B)
    gpipe, one_f_one_b = _step("gpipe", stages, micro), _step("1f1b", stages, micro)
    assert near(gpipe, ideal, 2 * (micro + stages)) and near(one_f_one_b, ideal, 2 * (micro + stages))
    for chunks in (2, 4):
        interleaved = _step("interleaved", stages, micro, chunks)
        assert near(interleaved, micro * (F + B) + (stages - 1) * (F + B) / chunks, 2 * (micro * chunks + stages))
        assert interleaved < one_f_one_b
    # inference: the forwards alone, M + P - 1 of them on the way through
    assert near(_step("gpipe", stages, micro, train=False), (micro + stages - 1) * F, micro + stages)


def test_the_slowest_stage_and_the_messages_set_the_pace():
    fast, slow = StageWork(F, B, 1024), StageWork(2 * F, 2 * B, 1024)
    micro = 8
    step = _step("1f1b", 4, micro, work=[fast, slow, fast, fast])
    assert step >= micro * 2 * (F + B) > _step("1f1b", 4, micro)
    big = [StageWork(F, B, 256 * 2**20)] * 4                 # 256 MiB activations on a 50 GB/s switch
    assert _step("1f1b", 4, micro, work=big, system="switch:4x50") > 1.5 * _step("1f1b", 4, micro)


def test_traces_talk_by_send_and_recv_and_lose_no_time_to_rounding():
    work = [StageWork(333.4e-6, 666.7e-6, 4096)] * 3
    traces = schedule_traces(work, "1f1b", 6)
    for stage, nodes in enumerate(traces):
        comp = [n for n in nodes if n.type == et.COMP_NODE]
        assert len(comp) == 12 and abs(sum(n.duration_micros for n in comp) - 6 * 1000.1) < 1
        sends = [n for n in nodes if n.type == et.COMM_SEND_NODE]
        recvs = [n for n in nodes if n.type == et.COMM_RECV_NODE]
        # forwards go on and gradients come back, except at the ends of the pipeline
        assert len(sends) == len(recvs) == (6 if stage in (0, 2) else 12)
        assert all(n.attrs["comm_size"] == 4096 and n.attrs["comm_src"] == stage for n in sends)
        assert [n.id for n in nodes] == list(range(len(nodes)))
    tags = [n.attrs["comm_tag"] for nodes in traces for n in nodes if n.type == et.COMM_SEND_NODE]
    assert len(tags) == len(set(tags))


@pytest.mark.parametrize("args, message", [
    (("zigzag", 4, 8, 0), "is not one of gpipe, 1f1b, interleaved"),
    (("interleaved", 4, 6, 0, 2), "6 microbatches are not a multiple of 4 stages"),
    (("1f1b", 4, 8, 0, 2), "1f1b runs one chunk per stage"),
    (("gpipe", 4, 8, 4), "stage 4 of a 4-stage pipeline"),
    (("gpipe", 4, 0, 0), "at least one stage, microbatch and chunk"),
])
def test_impossible_schedules_are_one_line(args, message):
    with pytest.raises(TraceError, match=message) as err:
        stage_order(*args)
    assert "\n" not in str(err.value)
