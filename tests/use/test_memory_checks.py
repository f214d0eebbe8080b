"""The published per-GPU memory the memory model is checked against (``eval/eval_memory.py``,
``eval/measured/published_memory.csv``): every row is a layout the zoo exports, with its source."""
from __future__ import annotations

import math

import pytest

from hespas_ml.ingest.zoo.checks import mesh_of
from hespas_ml.ingest.zoo.specs import parse_zoo_spec
from tests.conftest import PROJECT_ROOT, eval_script

checks = eval_script("eval_memory")
ROWS = checks.read_published(PROJECT_ROOT / "eval" / "measured" / "published_memory.csv")


@pytest.mark.parametrize("row", ROWS, ids=[r["name"] for r in ROWS])
def test_each_published_row_is_a_layout_the_zoo_exports(row):
    _, params = parse_zoo_spec(row["spec"])           # raises with one line on a layout it cannot export
    assert params["devices"] == math.prod(mesh_of(params).values())
    assert float(row["gib"]) > 0 and row["source"] and row["note"]


def test_a_bad_row_is_one_line_naming_the_file_and_line(tmp_path):
    bad = tmp_path / "memory.csv"
    bad.write_text("name,spec,gib,source,note\nx,zoo:gpt,lots,s,n\n")
    with pytest.raises(ValueError, match=r"memory.csv:2: gib 'lots' is not a number"):
        checks.read_published(bad)
