"""The experiment of issue 29 (``eval/eval_synthetic_training.py``) end to end at a tiny size: three
variants trained on the same corpus and scored on the same left-out regions, each an MLflow run."""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_synthetic_regions_experiment_runs_every_variant(tmp_path):
    got = subprocess.run([sys.executable, str(ROOT / "eval" / "eval_synthetic_training.py"), "--fidelity", "roofline",
                          "--target", "H100", "--seeds", "0", "--corpus", "80", "--test", "40", "--synthetic", "20",
                          "--epochs", "2", "--generator-epochs", "1", "--work", str(tmp_path / "work"),
                          "--tracking-uri", str(tmp_path / "mlruns")], capture_output=True, text=True, cwd=ROOT)
    assert got.returncode == 0, got.stderr[-3000:]
    with open(tmp_path / "work" / "roofline-H100" / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["variant"] for r in rows] == ["corpus", "corpus+layerdag", "corpus+random"]
    assert len({r["test_rows"] for r in rows}) == 1                       # the same left-out regions
    corpus, layerdag, rand = (int(r["train_regions"]) for r in rows)
    assert layerdag > corpus and layerdag == rand                         # the same count added
    assert "corpus+layerdag" in got.stdout and (tmp_path / "mlruns" / "mlflow.db").is_file()
