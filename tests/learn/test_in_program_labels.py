"""Training on device labels as times inside a program (``TrainConfig.in_program``): each profiling label of
the committed H100 measurements less the dispatch overhead it records, and none learned that nothing is left of."""
from __future__ import annotations

import json

import numpy as np
import pytest

from hespas_ml.label.dataset_tables import load_dataset
from hespas_ml.learn.config import LearnError, TrainConfig
from hespas_ml.learn.tables import in_program_labels, label_rows
from tests.conftest import PROJECT_ROOT

H100 = PROJECT_ROOT / "datasets" / "measured" / "h100-2026-11-27"


def test_each_label_loses_the_overhead_it_records_and_none_is_learned_at_zero():
    raw = load_dataset(H100)
    inside = in_program_labels(raw)
    before, after = label_rows(raw, "profiling"), label_rows(inside, "profiling")
    assert len(after) < len(before)                      # some unlooped regions took no longer than a launch
    merged = before.merge(after, on="hash", suffixes=("_raw", "_in"))
    meta = raw.labels["meta"].to_numpy()[merged["pos_raw"].to_numpy()]
    for (s_raw, s_in), m in zip(merged[["seconds_raw", "seconds_in"]].to_numpy(), meta):
        facts = json.loads(m)
        overhead = facts["pass_overhead_s"] if facts.get("loop") else facts["overhead_s"] / (facts.get("loop", 0) + 1)
        assert s_in == pytest.approx(s_raw - overhead, rel=1e-9) and s_in > 0
    assert (after["seconds"] > 0).all() and set(after["target"]) == {"H100"}
    # the other fidelities' labels and the folder itself are as they were
    others = raw.labels["fidelity"] != "profiling"
    assert np.array_equal(raw.labels.loc[others, "seconds"].to_numpy(), inside.labels.loc[others, "seconds"].to_numpy())
    assert len(load_dataset(H100).labels) == len(raw.labels)


def test_in_program_is_a_train_config_field():
    assert TrainConfig.from_dict({"in_program": True}).in_program
    with pytest.raises(LearnError, match="unknown TrainConfig field 'in_programme'"):
        TrainConfig.from_dict({"in_programme": True})
