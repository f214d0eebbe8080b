"""Synthetic traces: drawn from the statistics of a real step's traces, reproducible, and replayable."""
from __future__ import annotations

import json

import pytest

from conftest import shared_path
from hespas_ml.cli.main import main
from hespas_ml.ingest.stablehlo import parse_file
from hespas_ml.replay import chakra, replay
from hespas_ml.replay.synthetic import TraceModel, generate_traces, summary
from hespas_ml.replay.traces import build_traces
from hespas_ml.split.regions import split_program


@pytest.fixture(scope="module")
def source():
    """The MaxText LLaMA-3 100M training step on 4 devices, split and traced at 1 µs + 1 ns per FLOP/1000."""
    rg = split_program(parse_file(shared_path("mlir", "maxtext", "llama3-100m-4dev.mlir")))
    ts = build_traces(rg, [1e-6 + r.flops * 1e-12 for r in rg.regions])
    return [ts.traces[r] for r in range(ts.n_ranks)], ts.comm_groups


def test_synthetic_traces_follow_the_source_and_replay(source):
    traces, groups = source
    model = TraceModel.fit(traces, groups)
    fitted = model.summary()
    assert fitted["coll_nodes"] > 10 and fitted["comp_nodes"] > 100
    syn, syn_groups = generate_traces(model, 8, seed=1)
    got = summary(syn)
    assert got["nodes"] == fitted["nodes"] and len(syn) == 8
    # drawn from the source's own values: every duration is one of the source's, and the share of
    # collectives is the source's within a few points
    assert {n.duration_micros for n in syn[0] if n.type == chakra.COMP_NODE} <= {c[0] for c in model.comp}
    assert abs(got["coll_nodes"] / got["nodes"] - fitted["coll_nodes"] / fitted["nodes"]) < 0.05
    assert 0.5 < got["comp_us"] / fitted["comp_us"] < 2 and 0.5 < got["comm_bytes"] / fitted["comm_bytes"] < 2
    assert all(d < n.id for n in syn[0] for d in n.data_deps)                          # a DAG in id order
    res = replay(syn, "switch:4x450,switch:2x50", syn_groups, backend="embedded")
    assert len(res.ranks) == 8 and res.step_time_s > 0


def test_the_same_seed_writes_the_same_traces_and_another_does_not(source):
    model = TraceModel.fit(*source)
    one, two, other = (generate_traces(model, 4, seed=s)[0] for s in (7, 7, 8))
    assert chakra.encode_trace(one[0]) == chakra.encode_trace(two[0]) != chakra.encode_trace(other[0])


def test_generate_traces_command(tmp_path, capsys):
    prefix = tmp_path / "src" / "et" / "step"
    chakra.write_traces(prefix, build_traces(split_program(parse_file(shared_path("mlir", "jax_example.mlir"))),
                                             [2e-6] * 64, n_ranks=2).traces)
    assert main(["generate", "traces", "--like", str(prefix.parent), "--ranks", "4", "--out",
                 str(tmp_path / "syn"), "--seed", "5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ranks"] == 4 and report["seed"] == 5
    assert len(chakra.read_traces(tmp_path / "syn" / "et" / "synthetic")) == 4
    assert main(["generate", "traces", "--like", str(tmp_path / "none"), "--ranks", "4", "--out",
                 str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "none" in err and len(err.splitlines()) == 1
