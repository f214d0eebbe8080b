"""Splits of the smoke dataset's labels: by region, disjoint, deterministic from the seed."""
from __future__ import annotations

import numpy as np
import pytest

from hespas_ml.learn.config import LearnError, TrainConfig
from hespas_ml.learn.splits import make_split
from hespas_ml.learn.tables import label_rows


def _regions(ds, pos):
    return set(ds.labels["hash"].to_numpy()[pos])


def _check_disjoint(ds, split):
    tr, va, te = split
    assert len(tr) and len(va) and len(te)
    a, b, c = _regions(ds, tr), _regions(ds, va), _regions(ds, te)
    assert not (a & b) and not (a & c) and not (b & c)
    assert not set(tr) & set(te)


@pytest.mark.parametrize("fidelity", ["roofline", "scalesim", "profiling"])
def test_family_split_holds_out_every_region_of_the_family(smoke_ds, fidelity):
    cfg = TrainConfig(fidelity=fidelity, split="family", holdout=["vit"])
    split = make_split(smoke_ds, cfg)
    _check_disjoint(smoke_ds, split)
    rows = label_rows(smoke_ds, fidelity).set_index("pos")
    tr, va, te = split
    assert all("vit" in f for f in rows.loc[te, "families"])
    assert not any("vit" in f for f in rows.loc[np.concatenate([tr, va]), "families"])
    assert (smoke_ds.labels.loc[np.concatenate(split), "fidelity"] == fidelity).all()


def test_splits_are_deterministic_from_the_seed(smoke_ds):
    for kind in ("family", "size", "random"):
        a = make_split(smoke_ds, TrainConfig(split=kind, seed=3))
        b = make_split(smoke_ds, TrainConfig(split=kind, seed=3))
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    c = make_split(smoke_ds, TrainConfig(split="random", seed=4))
    a = make_split(smoke_ds, TrainConfig(split="random", seed=3))
    assert not np.array_equal(a[2], c[2])


def test_size_split_tests_the_largest_regions(smoke_ds):
    split = make_split(smoke_ds, TrainConfig(split="size", holdout=["0.25"]))
    _check_disjoint(smoke_ds, split)
    work = label_rows(smoke_ds, "roofline").drop_duplicates("hash").set_index("hash")["work"]
    tr, va, te = (_regions(smoke_ds, p) for p in split)
    assert work[list(te)].min() >= work[list(tr | va)].max()
    assert abs(len(te) / len(work) - 0.25) < 0.02


def test_array_split_holds_out_a_systolic_target(smoke_ds):
    cfg = TrainConfig(fidelity="scalesim", split="array", holdout=["SA-32x32"])
    tr, va, te = make_split(smoke_ds, cfg)
    _check_disjoint(smoke_ds, (tr, va, te))
    targets = smoke_ds.labels["target"].to_numpy()
    assert set(targets[te]) == {"SA-32x32"}
    assert set(targets[tr]) | set(targets[va]) == {"TPUv3", "TPUv4"}


def test_bad_split_requests_are_clean_errors(smoke_ds):
    with pytest.raises(LearnError, match="no family 'gpt'"):
        make_split(smoke_ds, TrainConfig(split="family", holdout=["gpt"]))
    with pytest.raises(LearnError, match="no scalesim labels on target 'H100'"):
        make_split(smoke_ds, TrainConfig(fidelity="scalesim", split="array", holdout=["H100"]))
    with pytest.raises(LearnError, match="every target is held out"):
        make_split(smoke_ds, TrainConfig(fidelity="profiling", split="array", holdout=["host-cpu"]))
    with pytest.raises(LearnError, match="target 'B300'"):
        label_rows(smoke_ds, "roofline", targets=["B300"])
    with pytest.raises(LearnError, match="fidelity"):
        TrainConfig(fidelity="astrology")
