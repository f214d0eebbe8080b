"""The layouts hespas-ml is compared with STAGE on (``eval/eval_stage.py``): each STAGE layout is one the zoo
exports with the same device count, and the script refuses to run without a STAGE checkout."""
from __future__ import annotations

import math

import pytest

from hespas_ml.ingest.zoo.checks import mesh_of
from hespas_ml.ingest.zoo.specs import parse_zoo_spec
from tests.conftest import eval_script

stage = eval_script("eval_stage")


@pytest.mark.parametrize("name, layout, mesh", stage.CONFIGS, ids=[c[0] for c in stage.CONFIGS])
def test_each_stage_layout_is_a_zoo_layout_on_as_many_devices(name, layout, mesh):
    _, params = parse_zoo_spec(stage.zoo_spec(layout, mesh))
    n = stage.devices(layout)
    assert params["devices"] == n == math.prod(mesh_of(params).values())
    shards = mesh_of(params).get("dp", 1) * mesh_of(params).get("fsdp", 1)
    assert params["batch"] // shards == params["microbatch"]          # one microbatch per data-parallel rank
    assert ("fsdp" in mesh) == bool(layout["weight_sharded"]) and params["sp"] == (layout["tp"] > 1)


def test_without_a_stage_checkout_it_says_so(tmp_path, capsys):
    assert stage.main(["--stage", str(tmp_path)]) == 2
    assert "STAGE checkout" in capsys.readouterr().err
