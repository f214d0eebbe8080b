"""Slow labellers show progress: labelling in chunks gives the labels one call gives, with a bar and an ETA."""
from __future__ import annotations

from hespas_ml.ingest import load_program
from hespas_ml.label.fidelity import label_in_chunks
from hespas_ml.label.registry import get_labeller
from hespas_ml.label.targets import load_target
from hespas_ml.split.regions import split_program


def test_chunks_with_a_progress_bar_label_as_one_call(capsys):
    regions = split_program(load_program("zoo:mlp?layers=4&width=64&batch=8&step=train"), "fusion").compute_regions()
    assert len(regions) > 10
    fid, target = get_labeller("roofline"), load_target("TPUv4")
    whole = fid.label_regions(regions, target)
    capsys.readouterr()
    chunked = label_in_chunks(fid, regions, target, desc="roofline labels", progress=True, chunk=4)
    assert [(lab.seconds, lab.meta) for lab in chunked] == [(lab.seconds, lab.meta) for lab in whole]
    err = capsys.readouterr().err
    assert "roofline labels" in err and f"{len(regions)}/{len(regions)}" in err
    label_in_chunks(fid, regions, target, desc="quiet", progress=False, chunk=4)
    assert capsys.readouterr().err == ""
