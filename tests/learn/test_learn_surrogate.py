"""The surrogate end to end on the smoke dataset: it learns, saves, loads, reproduces and fails cleanly."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from hespas_ml.ingest import load_program
from hespas_ml.ingest.errors import HespasError
from hespas_ml.label.region_records import region_record
from hespas_ml.learn.config import LearnError
from hespas_ml.learn.splits import make_split
from hespas_ml.learn.surrogate import Surrogate
from hespas_ml.learn.tables import label_rows
from hespas_ml.split.regions import split_program
from hespas_ml.split.signature import region_signature


@pytest.fixture(scope="module")
def learned(smoke_ds):
    """A small roofline surrogate that must learn the roofline function (no estimate as input) on 80 %
    of the regions, and its split."""
    from hespas_ml.learn.config import TrainConfig
    cfg = TrainConfig(hidden=16, layers=2, head_hidden=32, epochs=15, batch_size=16, patience=15, ensemble=3,
                      split="random", seed=0, residual=False, roofline_input=False, lr=5e-3)
    split = make_split(smoke_ds, cfg)
    return Surrogate(cfg).fit(smoke_ds, split[0], split[1]), split


def test_a_tiny_model_beats_a_constant_predictor_on_held_out_regions(smoke_ds, learned):
    model, (tr, _, te) = learned
    rows = label_rows(smoke_ds, "roofline").set_index("pos")
    train, test = rows.loc[tr], rows.loc[te]
    # the best constant per target (median log-seconds of the training regions)
    const = train.groupby("target")["seconds"].apply(lambda s: np.exp(np.median(np.log(s))))
    const_err = np.abs(np.log(test["target"].map(const).to_numpy()) - np.log(test["seconds"].to_numpy()))
    got, pred = model.predict_rows(smoke_ds, te)
    model_err = np.abs(np.log(pred.seconds) - np.log(got["seconds"].to_numpy()))
    assert np.median(model_err) < 0.5 * np.median(const_err)
    report = model.evaluate(smoke_ds, te)
    assert report["n"] == len(te) and report["kendall_tau"] > 0.6
    assert set(report["per_target"]) == set(test["target"])


def test_predictions_carry_intervals_around_the_point(smoke_ds, learned):
    model, (_, _, te) = learned
    _, pred = model.predict_rows(smoke_ds, te)
    assert (pred.lower <= pred.seconds).all() and (pred.seconds <= pred.upper).all()
    assert (pred.lower < pred.upper).all()
    assert pred.spread.shape == pred.seconds.shape and (pred.spread >= 0).all()


def test_save_load_gives_identical_predictions_quickly(smoke_ds, learned, tmp_path):
    model, _ = learned
    records = [smoke_ds.region_graph(h) for h in smoke_ds.regions["hash"]]
    before = model.predict_records(records, "TPUv4")
    model.save(tmp_path / "m")
    assert {p.name for p in (tmp_path / "m").iterdir()} == {"weights.pt", "surrogate.json", "metrics.json"}
    t0 = time.perf_counter()
    loaded = Surrogate.load(tmp_path / "m")
    assert time.perf_counter() - t0 < 1.0
    after = loaded.predict_records(records, "TPUv4")
    for name in ("seconds", "lower", "upper"):
        assert np.array_equal(getattr(before, name), getattr(after, name))
    assert loaded.config == model.config


def test_a_saved_model_keeps_the_estimate_it_learned_over(smoke_ds, tiny_config, tmp_path):
    """``residual_base: auto`` may resolve differently in a later version: the base recorded at save time
    wins, so the weights keep meaning what they were trained to mean."""
    model = Surrogate(tiny_config(epochs=2)).fit(smoke_ds)
    assert model.config.residual_base == "auto" and model.config.base == "roofline"
    records = [smoke_ds.region_graph(h) for h in smoke_ds.regions["hash"][:30]]
    before = model.predict_records(records, "H100").seconds
    folder = model.save(tmp_path / "m")
    meta = json.loads((folder / "surrogate.json").read_text())
    assert meta["base"] == "roofline"
    meta["config"]["residual_base"] = "none"          # as if "auto" now meant "predict log-seconds directly"
    (folder / "surrogate.json").write_text(json.dumps(meta))
    loaded = Surrogate.load(folder)
    assert loaded.config.base == "roofline"
    assert np.allclose(loaded.predict_records(records, "H100").seconds, before)
    del meta["base"]                                   # a file from before the base was recorded
    (folder / "surrogate.json").write_text(json.dumps(meta))
    older = Surrogate.load(folder)
    assert older.config.base is None
    assert not np.allclose(older.predict_records(records, "H100").seconds, before)
    meta["base"] = "magic"
    (folder / "surrogate.json").write_text(json.dumps(meta))
    with pytest.raises(LearnError, match="unknown residual base 'magic'"):
        Surrogate.load(folder)


def test_corrupt_or_mismatched_checkpoints_are_one_line_errors(learned, tmp_path):
    model, _ = learned
    good = model.save(tmp_path / "good")
    bad = tmp_path / "bad"
    model.save(bad)
    (bad / "weights.pt").write_bytes(b"\x00not a checkpoint" * 10)
    with pytest.raises(LearnError, match=r"weights\.pt: corrupt") as err:
        Surrogate.load(bad)
    assert "\n" not in str(err.value)

    model.save(bad)
    meta = json.loads((bad / "surrogate.json").read_text())
    meta["config"]["hidden"] = 24
    (bad / "surrogate.json").write_text(json.dumps(meta))
    with pytest.raises(LearnError, match=r"weights\.pt: does not match"):
        Surrogate.load(bad)

    meta["config"]["hidden"] = 16
    meta["node_features"] = meta["node_features"][:-1]
    (bad / "surrogate.json").write_text(json.dumps(meta))
    with pytest.raises(LearnError, match="node features differ"):
        Surrogate.load(bad)

    (bad / "surrogate.json").write_text("{not json")
    with pytest.raises(LearnError, match=r"surrogate\.json: unreadable"):
        Surrogate.load(bad)
    (good / "weights.pt").unlink()
    with pytest.raises(LearnError, match=r"weights\.pt: missing"):
        Surrogate.load(good)
    with pytest.raises(LearnError, match="no such surrogate directory"):
        Surrogate.load(tmp_path / "nowhere")


def test_two_fits_with_the_same_seed_are_identical(smoke_ds, tiny_config):
    cfg = tiny_config(fidelity="scalesim", epochs=4)
    records = [smoke_ds.region_graph(h) for h in smoke_ds.regions["hash"][:40]]
    a = Surrogate(cfg).fit(smoke_ds).predict_records(records, "TPUv3")
    b = Surrogate(cfg).fit(smoke_ds).predict_records(records, "TPUv3")
    assert np.array_equal(a.seconds, b.seconds) and np.array_equal(a.upper, b.upper)
    c = Surrogate(tiny_config(fidelity="scalesim", epochs=4, seed=1)).fit(smoke_ds).predict_records(records,
                                                                                                   "TPUv3")
    assert not np.array_equal(a.seconds, c.seconds)


def test_predict_regions_dedups_live_regions_and_matches_records(learned, smoke_ds):
    model, _ = learned
    graph = load_program("zoo:mlp?layers=3&width=64&batch=16&step=train")
    regions = split_program(graph, "fusion").compute_regions()
    users = graph.users()
    digests = [region_signature(r, users) for r in regions]
    assert len(set(digests)) < len(digests)             # repeated layers: the same kernel several times
    pred = model.predict_regions(regions, "H100")
    assert len(pred) == len(regions)
    records = [region_record(r, d, users) for r, d in zip(regions, digests)]
    again = model.predict_records(records, "H100")
    assert np.allclose(pred.seconds, again.seconds)
    first = {d: pred.seconds[i] for i, d in reversed(list(enumerate(digests)))}
    assert all(pred.seconds[i] == first[d] for i, d in enumerate(digests))
    # another target: the regions featurised above are answered from the featuriser's cache
    cached = {d: model.featuriser._cache[d] for d in digests}
    other = model.predict_regions(regions, "TPUv3")
    assert all(model.featuriser._cache[d] is a for d, a in cached.items())
    assert np.allclose(other.seconds, model.predict_records(records, "TPUv3").seconds)
    assert not np.allclose(other.seconds, pred.seconds)


def test_bad_requests_are_clean_errors(smoke_ds, learned, tiny_config):
    model, _ = learned
    record = smoke_ds.region_graph(smoke_ds.regions["hash"][0])
    with pytest.raises(HespasError, match="unknown hardware target"):
        model.predict_records([record], "TPUv9")
    with pytest.raises(LearnError, match="not fitted"):
        Surrogate(tiny_config()).predict_records([record], "H100")
    with pytest.raises(LearnError, match="selects no usable"):
        Surrogate(tiny_config()).fit(smoke_ds, train_index=np.array([], dtype=np.int64))
    with pytest.raises(LearnError, match="no labels of fidelity|no usable"):
        Surrogate(tiny_config(fidelity="profiling", targets=None, max_noise=-1.0)).fit(smoke_ds)


def test_a_feature_that_never_varied_in_training_is_ignored():
    """Every training target had the same value (e.g. 128x128 arrays): another value must not move the
    prediction through weights that were never trained on it."""
    import torch

    from hespas_ml.learn.model import Standardise

    norm = Standardise(3)
    train = torch.tensor([[1.0, 7.0, 0.0], [3.0, 7.0, 2.0], [5.0, 7.0, 4.0]])
    norm.fit(train)
    out = norm(torch.tensor([[3.0, 5.0, 2.0], [3.0, 9.0, 2.0]]))
    assert torch.equal(out[:, 1], torch.zeros(2))              # the constant column reads as 0 for any value
    assert torch.allclose(out[:, 0], torch.zeros(2)) and torch.isfinite(out).all()
    varied = norm(torch.tensor([[5.0, 7.0, 4.0]]))
    assert varied[0, 0] > 1.0 and varied[0, 2] > 1.0           # varied columns are standardised as before


def test_clamped_columns_do_not_extrapolate_beyond_training():
    import torch

    from hespas_ml.learn.model import Standardise

    norm = Standardise(2)
    norm.fit(torch.tensor([[0.0, 0.0], [2.0, 2.0], [4.0, 4.0]]), clamp=torch.tensor([True, False]))
    inside, beyond = norm(torch.tensor([[1.0, 1.0]])), norm(torch.tensor([[-10.0, -10.0]]))
    assert torch.equal(beyond[0, 0], norm(torch.tensor([[0.0, 0.0]]))[0, 0])   # clamped to the training minimum
    assert beyond[0, 1] < -3.0                                                 # an unclamped column extrapolates
    assert inside[0, 0] == inside[0, 1]                                        # no effect inside the range
    loaded = Standardise(2)                                   # the bounds (and clamping) survive a state_dict
    loaded.load_state_dict(norm.state_dict())
    assert torch.equal(loaded(torch.tensor([[-10.0, -10.0]])), beyond)


def test_readouts_and_message_sums_are_pygs():
    """The network's own readouts and GINE message sums (index_add_ / index_reduce_, for speed) give what
    PyG's global pools and default "add" aggregation give, values and gradients, an empty graph included."""
    import torch
    from torch_geometric.nn import MessagePassing, global_add_pool, global_max_pool, global_mean_pool

    from hespas_ml.learn.model import _POOLS, MemberGINEConv

    gen = torch.Generator().manual_seed(0)
    members, nodes, hidden, graphs = 3, 11, 4, 5
    batch = torch.tensor([0, 0, 0, 1, 1, 3, 3, 3, 3, 4, 4])            # graph 2 has no nodes
    h = torch.randn(members, nodes, hidden, generator=gen, requires_grad=True)
    h_ref = h.detach().clone().requires_grad_(True)
    weights = torch.randn(members, graphs, hidden, generator=gen)
    for name, reference in (("sum", global_add_pool), ("mean", global_mean_pool), ("max", global_max_pool)):
        ours, theirs = _POOLS[name](h, batch, graphs), reference(h_ref, batch, graphs)
        assert torch.allclose(ours, theirs, atol=1e-6), name
        g_ours, = torch.autograd.grad((ours * weights).sum(), h)
        g_theirs, = torch.autograd.grad((theirs * weights).sum(), h_ref)
        assert torch.allclose(g_ours, g_theirs, atol=1e-6), name

    conv = MemberGINEConv(members, hidden, 2)
    edge_index = torch.tensor([[0, 1, 2, 2, 5, 6], [1, 2, 0, 1, 7, 7]])
    messages = torch.randn(members, edge_index.shape[1], hidden, generator=gen)
    ours = conv.aggregate(messages, edge_index[1], dim_size=nodes)
    theirs = MessagePassing.aggregate(conv, messages, edge_index[1], dim_size=nodes)
    assert torch.allclose(ours, theirs, atol=1e-6) and ours[:, 3:5].abs().sum() == 0
