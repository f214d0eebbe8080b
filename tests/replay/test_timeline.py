"""The step timeline: spans from the embedded replay, the exposed communication it shows, and the picture."""
from __future__ import annotations

import pytest

from hespas_ml import pipeline
from hespas_ml.replay.embedded import replay_embedded
from hespas_ml.replay.timeline import Span, exposed, step_spans, write_timeline

pytestmark = pytest.mark.slow   # exports zoo programs

DP = "zoo:mlp?layers=3&width=512&batch=128&step=train&parallel=dp"


def test_exposed_is_communication_that_no_compute_hides():
    spans = [Span(0, 10, "compute", "a"), Span(5, 30, "comm", "ar"), Span(20, 25, "compute", "b"),
             Span(28, 40, "comm", "ag")]
    assert exposed(spans) == [(10, 20), (25, 40)]
    assert exposed([Span(0, 10, "compute", "a")]) == []


def test_the_timeline_shows_the_replays_finish_and_exposed_communication(tmp_path):
    q = pipeline.Question.resolve(DP, "A100-40GB", "ring:4x50")
    regions = pipeline.split(pipeline.ingest(q.program, q.system))
    times = pipeline.label(regions, q.fidelity, q.target)
    step = pipeline.replay(pipeline.trace(regions, times), q.system, "embedded", record_nodes=True)
    spans = step_spans(step.traces.point.traces, q.system, step.traces.point.comm_groups or None)
    assert sorted(spans) == [0, 1, 2, 3]
    # the ticks the step's own replay recorded draw the same picture, without a second replay
    assert step_spans(step.traces.point.traces, q.system, None, step.node_ticks) == spans
    ranks = replay_embedded(step.traces.point.traces, q.system, step.traces.point.comm_groups or None).ranks
    for r in ranks:
        assert max(s.end_ns for s in spans[r.rank]) == r.finish_ns
        assert sum(b - a for a, b in exposed(spans[r.rank])) == r.exposed_comm_ns > 0
    png = write_timeline(tmp_path / "t.png", spans, "title")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_one_device_runs_its_compute_nodes_one_after_another():
    q = pipeline.Question.resolve("zoo:mlp?layers=2&width=256&batch=64&step=train", "H100")
    regions = pipeline.split(pipeline.ingest(q.program))
    step = pipeline.replay(pipeline.trace(regions, pipeline.label(regions, q.fidelity, q.target)), None)
    spans = step_spans(step.traces.point.traces, None)[0]
    assert all(a.end_ns == b.start_ns for a, b in zip(spans, spans[1:]))
    assert spans[-1].end_ns == round(step.traces.point.encoded_compute_s * 1e9)
