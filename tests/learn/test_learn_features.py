"""Featurisation of real region records from the smoke dataset: shapes, determinism, attributes, the
hardware vector and the analytical estimates."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch_geometric.loader import DataLoader

from hespas_ml.ingest.errors import HespasError
from hespas_ml.label.roofline import RooflineFidelity
from hespas_ml.label.targets import load_target, read_target_file
from hespas_ml.learn.config import LearnError
from hespas_ml.learn.features import (EDGE_FEATURES, HW_FEATURES, NODE_FEATURES, REGION_FEATURES,
                                      ROOFLINE_FEATURES, SYSTOLIC_FEATURES, Featuriser, hardware_vector,
                                      resolve_target)
from hespas_ml.learn.tables import dataset_targets, label_rows

N_ROW = len(ROOFLINE_FEATURES) + len(SYSTOLIC_FEATURES) + len(HW_FEATURES)


def _records(ds):
    return [ds.region_graph(h) for h in ds.regions["hash"]]


def test_region_arrays_have_documented_shapes(smoke_ds):
    f = Featuriser()
    records = _records(smoke_ds)
    for rec, arr in zip(records, f.regions(records)):
        n, e = len(rec["nodes"]), len(rec["edges"])
        assert arr.x.shape == (n, len(NODE_FEATURES)) and arr.x.dtype == np.float32
        assert np.isfinite(arr.x).all()
        assert arr.op.shape == (n,) and arr.op.min() >= 0 and arr.op.max() <= len(f.vocabulary)
        assert arr.edge_index.shape == (2, 2 * e) and arr.edge_attr.shape == (2 * e, len(EDGE_FEATURES))
        if e:
            assert arr.edge_index.max() < n
            # the second half is the first reversed and flagged
            assert np.array_equal(arr.edge_index[:, e:], arr.edge_index[::-1, :e])
            assert (arr.edge_attr[:e, -1] == 0).all() and (arr.edge_attr[e:, -1] == 1).all()
        assert arr.region.shape == (len(REGION_FEATURES),)
        # one dtype and one unit per node
        assert np.allclose(arr.x[:, NODE_FEATURES.index("dtype_f64"):].sum(1), 2.0)


def test_featurisation_is_deterministic_and_batch_equals_single(smoke_ds):
    records = _records(smoke_ds)
    many = Featuriser().regions(records)
    for rec, a in zip(records[::7], many[::7]):
        b = Featuriser().region(rec)
        for name in ("x", "op", "edge_index", "edge_attr", "region", "kernels", "gemms"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_the_cache_answers_by_hash_until_cleared(smoke_ds):
    records = _records(smoke_ds)[:5]
    f = Featuriser()
    first = f.regions(records)
    assert all(a is b for a, b in zip(f.regions(records), first))          # same objects: from the cache
    f.clear_cache()
    again = f.regions(records)
    assert all(a is not b for a, b in zip(again, first))                 # featurised afresh
    assert all(np.array_equal(a.x, b.x) for a, b in zip(again, first))


def test_the_cache_drops_the_least_recently_used_region(smoke_ds):
    a, b, c = _records(smoke_ds)[:3]
    f = Featuriser(cache_size=2)
    first_a = f.region(a)
    f.region(b)
    assert f.region(a) is first_a                  # a used again: b is now the least recent
    f.region(c)                                     # over the bound: b goes
    assert list(f._cache) == [a["hash"], c["hash"]]

    def not_called(h):
        raise AssertionError(f"{h} should have come from the cache")
    assert f.regions_for([a["hash"]], not_called)[0] is first_a     # by hash: a hit, now the most recent
    assert list(f._cache) == [c["hash"], a["hash"]]


def test_dot_attributes_are_its_gemm_dimensions(smoke_ds):
    f = Featuriser()
    seen = 0
    for rec in _records(smoke_ds):
        arr = f.region(rec)
        for i, node in enumerate(rec["nodes"]):
            if node["kind"] != "dot_general":
                continue
            (lhs, _), (rhs, _) = node["operand_types"][:2]
            dims = node["attrs"]["dot_dimension_numbers"]
            k = math.prod(lhs[d] for d in dims["lhs_contract"])
            batch = math.prod(lhs[d] for d in dims["lhs_batch"])
            m = math.prod(lhs) // (k * batch)
            n = math.prod(rhs) // (k * batch)
            assert 2 * batch * m * n * k == node["flops"]
            got = arr.x[i, [NODE_FEATURES.index(c) for c in ("log_gemm_count", "log_gemm_m", "log_gemm_n",
                                                              "log_gemm_k")]]
            assert np.allclose(got, np.log2(1.0 + np.array([batch, m, n, k])), atol=1e-5)
            seen += 1
    assert seen > 0


def test_unknown_opcode_goes_to_the_unknown_bucket_and_bad_records_are_clean_errors(smoke_ds):
    rec = _records(smoke_ds)[0]
    odd = {**rec, "hash": "odd", "nodes": [{**rec["nodes"][0], "kind": "frobnicate"}, *rec["nodes"][1:]]}
    assert Featuriser().region(odd).op[0] == 0
    assert Featuriser(vocabulary=["add"]).region(rec).op.max() <= 1
    broken = {**rec, "hash": "broken", "nodes": [{"kind": "add"}]}
    with pytest.raises(LearnError, match="broken"):
        Featuriser().region(broken)
    with pytest.raises(LearnError):
        Featuriser().region({**rec, "hash": "empty", "nodes": []})


def test_roofline_estimate_is_exactly_the_roofline_fidelity(smoke_ds):
    rows = label_rows(smoke_ds, "roofline")
    targets = dataset_targets(smoke_ds)
    f = Featuriser()
    for name in ("H100", "TPUv4", "host-cpu"):
        sel = rows[rows["target"] == name]
        arrays = f.regions_for(sel["hash"].to_numpy(), smoke_ds.region_graph)
        _, est = f.target_features(arrays, targets[name])
        assert np.allclose(np.exp(est["roofline"]), sel["seconds"].to_numpy(), rtol=1e-9)
    # and on a live region rebuilt from its record
    region = smoke_ds.region(rows["hash"].iloc[0])
    target = load_target("H100")
    arr = f.region(smoke_ds.region_graph(rows["hash"].iloc[0]))
    _, est = f.target_features([arr], target)
    assert math.isclose(math.exp(est["roofline"][0]), RooflineFidelity().label(region, target).seconds,
                        rel_tol=1e-9)


def test_calibrated_estimate_is_exactly_the_calibrated_roofline_fidelity(smoke_ds):
    """On a target with a calibration the estimate charges its efficiencies, kernel overhead and the floors of
    library calls, as the fidelity does on the live regions; on one without, it is the roofline."""
    from hespas_ml.label.roofline import CalibratedRooflineFidelity

    hashes = list(smoke_ds.regions["hash"])[:300]
    f = Featuriser()
    arrays = f.regions([smoke_ds.region_graph(h) for h in hashes])
    h100 = load_target("H100")
    _, est = f.target_features(arrays, h100)
    labels = [CalibratedRooflineFidelity().label(smoke_ds.region(h), h100) for h in hashes]
    assert np.allclose(np.exp(est["calibrated"]), [lab.seconds for lab in labels], rtol=1e-9)
    assert any(lab.meta["floored_kernels"] for lab in labels)             # the floors were exercised
    assert (est["calibrated"] > est["roofline"]).all()                   # overhead on every kernel
    _, tpu = f.target_features(arrays, load_target("TPUv4"))
    assert np.array_equal(tpu["calibrated"], tpu["roofline"])


def test_hardware_vector_is_the_targets_vector_and_separates_targets():
    h100, tpu = load_target("H100"), load_target("TPUv4")
    vec = hardware_vector(h100)
    assert vec.shape == (len(HW_FEATURES),)
    assert np.allclose(vec, list(h100.to_vector().values()))
    assert not np.allclose(vec, hardware_vector(tpu))
    assert hardware_vector(tpu)[HW_FEATURES.index("dataflow_ws")] == 1.0
    assert resolve_target("h100") == h100
    with pytest.raises(HespasError):
        resolve_target("no-such-accelerator")


def test_target_features_for_a_target_never_seen(smoke_ds, tmp_path):
    """A user-defined systolic target (not in any dataset) gets features and estimates."""
    path = tmp_path / "sa16.yaml"
    path.write_text("""name: SA-16x16
matrix_flops: {bf16: 0.512e12}
vector_flops: {f32: 16e9}
mem_bw: 16e9
mem_capacity: 1e9
onchip_mem: 262144
clock_hz: 1e9
systolic: {rows: 16, cols: 16, count: 1, dataflow: os, ifmap_sram_kb: 64, filter_sram_kb: 64, ofmap_sram_kb: 64}
sources: [test]
""")
    target = read_target_file(path)
    f = Featuriser()
    arrays = f.regions(_records(smoke_ds))
    feats, est = f.target_features(arrays, target)
    assert feats.shape == (len(arrays), N_ROW) and np.isfinite(feats).all()
    assert (est["systolic"] >= est["roofline"] - 1e-9).all()     # an array is never faster than its peak
    assert np.allclose(feats[:, -len(HW_FEATURES):], hardware_vector(target))


def test_region_data_collates_with_pyg(smoke_ds):
    f = Featuriser()
    target = load_target("TPUv4")
    data = [f.data(r, target) for r in _records(smoke_ds)[:10]]
    assert data[0].rows.shape == (1, N_ROW)
    batch = next(iter(DataLoader(data, batch_size=10)))
    assert batch.num_graphs == 10
    assert torch.equal(batch.row_graph, torch.arange(10))
    assert batch.x.shape[0] == sum(d.num_nodes for d in data)
    fast, est = f.batch(_records(smoke_ds)[:10], target)
    assert torch.equal(fast.x, batch.x) and torch.equal(fast.edge_index, batch.edge_index)
    assert torch.equal(fast.batch, batch.batch) and torch.allclose(fast.rows, batch.rows)
