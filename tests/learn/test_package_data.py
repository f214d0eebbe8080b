"""The shipped surrogates and search spaces are package data: a wheel installed away from the checkout
predicts with them."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hespas_ml.learn.registry import models_dir
from hespas_ml.learn.search import default_space_path
from tests.conftest import PROJECT_ROOT


def test_models_and_search_spaces_are_found_inside_the_package():
    import hespas_ml

    package = os.path.dirname(hespas_ml.__file__)
    assert str(models_dir()).startswith(package) and (models_dir() / "roofline" / "weights.pt").is_file()
    assert str(default_space_path("scalesim")).startswith(package) and default_space_path("scalesim").is_file()


@pytest.mark.slow
def test_a_wheel_installed_elsewhere_predicts_with_the_shipped_surrogates(tmp_path):
    wheels, site, away = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    away.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(PROJECT_ROOT)], check=True, capture_output=True, timeout=600)
    (wheel,) = wheels.glob("hespas_ml-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=600)
    code = ("import hespas_ml; from hespas_ml import simulate\n"
            "r = simulate('zoo:mlp?layers=2&width=4096&batch=1024', target='H100', fidelity='surrogate:roofline')\n"
            "print(hespas_ml.__file__); print(r.step_time_s); print(r.step_time_interval_s)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HESPAS_ML_MODELS")}
    env["PYTHONPATH"] = str(site)
    out = subprocess.run([sys.executable, "-c", code], cwd=away, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    where, step, interval = out.stdout.strip().splitlines()[-3:]
    assert where.startswith(str(site)) and float(step) > 0 and interval != "None"
