"""The region-graph generators (issue 29): real graph structures realised as valid modules, the layerwise
model fitted and sampled reproducibly, generation that resumes without duplicates, the distance."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hespas_ml.learn.config import LearnError
from hespas_ml.learn.graph_distance import graph_statistics, mmd
from hespas_ml.learn.layer_dag import LayerDAGGenerator, RandomDagGenerator, load_generator, typed_dag
from hespas_ml.learn.region_programs import (ARITY, InvalidProgram, TypedDag, check_module, dag_layers,
                                             module_text, program_text, realise)
from hespas_ml.use.generate import generate_programs, generate_regions, load_or_fit, program_sizes, real_graphs

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "eval" / "device" / "plans" / "h100"


@pytest.fixture(scope="module")
def graphs():
    return real_graphs(PLAN)


def test_real_region_structures_become_valid_modules(graphs):
    """Every sampled real region graph's structure, shaped by construction, is a module MLIR verifies and
    the pipeline ingests and splits; the regions it splits into keep the graph's op kinds."""
    rng = np.random.default_rng(0)
    shapes = graphs.shapes()
    picks = rng.choice(len(graphs.records), 120, replace=False)
    refused = 0
    for i in picks:
        dag = typed_dag(graphs.records[i])
        if dag is None:
            continue
        r = realise(dag, rng, shapes, dtype="bf16" if i % 2 else "f32")
        try:
            records = check_module(module_text(r))
        except InvalidProgram as exc:
            assert "no compute region" in str(exc)     # only constants: nothing to time
            assert set(dag.kinds) <= {"constant", "iota", "broadcast_in_dim", "reshape"}
            refused += 1
            continue
        kinds = {n["kind"] for rec in records for n in rec["nodes"]}
        assert {k for k in dag.kinds if k not in ("constant",)} <= kinds | {"iota", "broadcast_in_dim",
                                                                               "reshape", "transpose"}
    assert refused < 12


def test_a_typed_dag_rejects_what_is_not_a_dag():
    with pytest.raises(ValueError, match="earlier node"):
        TypedDag(["add"], [[0, None]])
    with pytest.raises(ValueError, match="takes 2 operands"):
        TypedDag(["add"], [[None]])
    dag = TypedDag(["exponential", "add", "tanh"], [[None], [0, None], [1]])
    assert dag.layers == [0, 1, 2]
    # a slot fed by a node of another type is rewired to a parameter, and the module still verifies
    mixed = TypedDag(["compare", "add"], [[None, None], [0, None]])
    r = realise(mixed, np.random.default_rng(0), [(4, 8)])
    assert r.rewired == 1 and len(check_module(module_text(r))) >= 1


def test_the_layerwise_generator_learns_and_samples_reproducibly(graphs, tmp_path):
    dags = [d for d in (typed_dag(r) for r in graphs.only(lambda f: f == "llama").records) if d
            and 2 <= len(d.kinds) <= 8][:40]
    model = LayerDAGGenerator(hidden=16, epochs=3, seed=1, max_layers=8).fit(dags)
    assert len(model.history) == 3 and model.history[-1] < model.history[0]
    drawn = model.sample(6, seed=3)
    assert [d.kinds for d in drawn] == [d.kinds for d in model.sample(6, seed=3)]
    assert [d.kinds for d in drawn[2:4]] == [model.sample_one(3, i).kinds for i in (2, 3)]
    for d in drawn:
        assert d.layers == dag_layers(d.sources)            # each node sits one layer after its latest input
        assert all(len(s) == ARITY[k] for k, s in zip(d.kinds, d.sources))
    model.save(tmp_path / "g.pt", "x")
    again = load_generator(tmp_path / "g.pt")
    assert again.fitted_on == "x" and [d.kinds for d in again.sample(6, seed=3)] == [d.kinds for d in drawn]
    with pytest.raises(LearnError, match="epochs must be a whole number"):
        LayerDAGGenerator(epochs=-1)


def test_generation_resumes_without_duplicates_and_never_writes_a_refused_graph(graphs, tmp_path):
    llama = graphs.only(lambda f: f == "llama")
    gen = RandomDagGenerator().fit([typed_dag(r) for r in llama.records])
    whole = generate_regions(gen, llama, 12, tmp_path / "whole", seed=5)
    part = tmp_path / "part"
    generate_regions(gen, llama, 7, part, seed=5)
    lines = (part / "manifest.jsonl").read_text().splitlines()
    (part / "manifest.jsonl").write_text("\n".join(lines[:5]) + "\n" + lines[5][:20])   # killed mid-line
    resumed = generate_regions(gen, llama, 12, part, seed=5)
    rows = [json.loads(x) for x in (part / "manifest.jsonl").read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == list(range(12))
    assert {k: resumed[k] for k in ("drawn", "valid", "regions")} == {k: whole[k] for k in ("drawn", "valid", "regions")}
    for r in rows:
        written = part / f"region-{r['index']:05d}.mlir"
        assert written.is_file() == r["valid"]
        if r["valid"]:
            assert written.read_text() == (tmp_path / "whole" / written.name).read_text()


def test_a_folder_drawn_from_one_generator_refuses_another(graphs, tmp_path):
    llama = graphs.only(lambda f: f == "llama")
    small = type(llama)(llama.records[:20], llama.families[:20])
    model = load_or_fit(tmp_path / "generator.pt", small, epochs=1, seed=0, hidden=8)
    generate_regions(model, small, 2, tmp_path, seed=0)
    assert load_or_fit(tmp_path / "generator.pt", small, epochs=1, seed=0, hidden=8).fitted_on == model.fitted_on
    other = type(llama)(llama.records[20:40], llama.families[20:40])
    with pytest.raises(LearnError, match="drawn from a generator fitted on other graphs"):
        load_or_fit(tmp_path / "generator.pt", other, epochs=1, seed=0, hidden=8)


def test_generate_regions_command(tmp_path):
    out = tmp_path / "gen"
    cmd = [sys.executable, "-m", "hespas_ml.cli.main", "generate", "regions", "--like", str(PLAN), "--n", "4",
           "--out", str(out), "--families", "mlp", "--generator", "random", "--json"]
    got = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert got.returncode == 0, got.stderr
    report = json.loads(got.stdout)
    assert report["drawn"] == 4 and report["valid"] == len(list(out.glob("region-*.mlir")))
    bad = subprocess.run(cmd[:6] + [str(tmp_path / "none")] + cmd[7:], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1
    assert "graphs.parquet: no such file" in bad.stderr
    programs = subprocess.run([sys.executable, "-m", "hespas_ml.cli.main", "generate", "programs", "--like",
                               str(PLAN), "--n", "1", "--out", str(tmp_path / "programs"), "--families", "mlp",
                               "--generator", "random", "--max-ops", "60", "--json"],
                              capture_output=True, text=True, cwd=ROOT)
    assert programs.returncode == 0, programs.stderr
    assert json.loads(programs.stdout)["valid"] == len(list((tmp_path / "programs").glob("program-*.mlir")))


def test_the_distance_is_zero_for_the_same_graphs_and_grows_with_a_shift(graphs):
    stats = [graph_statistics(r) for r in graphs.records[:200]]
    flops = np.stack([s["flops"] for s in stats])
    assert mmd(flops, flops) == pytest.approx(0.0, abs=1e-12)
    near = mmd(flops[:100], flops[100:])
    assert mmd(flops[:100], flops[100:] + 3.0) > 5 * near


def test_a_synthetic_program_chains_generated_graphs_to_a_real_program_size(graphs, tmp_path):
    """Each part reads earlier parts' results where their types meet (fewer parameters than the parts
    have), the program is at least as large as the size it drew (or the cap), and the pipeline splits it."""
    mlp = graphs.only(lambda f: f == "mlp")
    gen = RandomDagGenerator().fit([typed_dag(r) for r in mlp.records])
    rng = np.random.default_rng(0)
    parts = [realise(gen.sample_one(1, j), rng, [(8, 64)], dtype="f32") for j in range(6)]
    text = program_text(parts, "p")
    assert text.count("%a") and text.count("func.func") == 1
    header = text.splitlines()[1]
    assert header.count("%a") < sum(len(p.params) for p in parts)
    assert len(check_module(text)) >= 2
    sizes = program_sizes(PLAN, lambda f: f == "mlp")
    counts = generate_programs(gen, mlp, sizes, 2, tmp_path, seed=0, max_ops=150)
    rows = [json.loads(x) for x in (tmp_path / "manifest.jsonl").read_text().splitlines()]
    assert counts["drawn"] == 2 and all(r["nodes"] >= min(min(sizes), 150) for r in rows)
    assert all((tmp_path / r["file"]).is_file() for r in rows if r["valid"])
