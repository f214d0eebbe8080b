"""The README's commands, run as written: a README that drifts from the code fails here."""
from __future__ import annotations

import json
import re

import pytest

from hespas_ml.cli.main import main
from tests.conftest import PROJECT_ROOT, readme_command, readme_commands

pytestmark = pytest.mark.slow   # exports a 32-device program


def test_simulate_out_then_replay_as_the_readme_says(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    simulate = readme_command("hespas-ml simulate 'zoo:mlp?layers=8&width=4096&step=train'")
    assert "--out" in simulate
    assert main([*simulate, "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    replay = readme_command("hespas-ml replay out/run/et")
    assert main([*replay, "--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert replayed["step_time_s"] == pytest.approx(simulated["step_time_s"], rel=1e-9)
    assert main(replay) == 0 and "step time" in capsys.readouterr().out


MORE = [
    "hespas-ml simulate zoo:mlp --target A100-40GB --system ring:4x150 --json",
    "hespas-ml predict 'zoo:resnet?depth=50&batch=32' --fidelity scalesim --target TPUv4",
    "hespas-ml analyze ../shared/mlir/resnet_50_inference_step_4_devices_1024_batch.mlir",
    "hespas-ml simulate ../shared/mlir/resnet_50_inference_step_4_devices_1024_batch.mlir --target H100",
    "hespas-ml simulate 'zoo:llama?layers=2&d_model=512&heads=8&step=train&parallel=fsdp' --target TPUv4",
]


@pytest.mark.parametrize("start", MORE)
def test_more_readme_commands_run_as_written(start, tmp_path, monkeypatch, capsys):
    words = readme_command(start)
    missing = [w for w in words if w.startswith("../shared/") and not (PROJECT_ROOT / w).exists()]
    if missing:
        pytest.skip(f"{missing[0]} is not here")
    monkeypatch.chdir(PROJECT_ROOT)
    assert main(words) == 0
    assert capsys.readouterr().out.strip()


def test_the_readme_shows_what_make_demo_prints():
    """The README's `make demo` block is the demo's own output, and its roofline table the pipeline's
    (eval/readme_figures.py rewrites them)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(PROJECT_ROOT / "eval" / "readme_figures.py"), "--check"],
                          capture_output=True, text=True, cwd=PROJECT_ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_figure_that_drifts_is_caught_and_rewritten(tmp_path):
    """A README whose demo block no longer shows what the demo prints fails the check, naming the figure;
    rewriting puts the demo's own lines back."""
    import subprocess
    import sys

    readme = tmp_path / "README.md"
    text = (PROJECT_ROOT / "README.md").read_text()
    start = text.index("<!-- figure:demo -->")
    shown = re.compile(r"step time +\S+ \S+").search(text, start)
    assert shown and shown.start() < text.index("<!-- /figure -->", start)
    readme.write_text(text[:shown.start()] + "step time     1.0 s" + text[shown.end():])
    script = [sys.executable, str(PROJECT_ROOT / "eval" / "readme_figures.py"), "--only", "demo",
              "--readme", str(readme)]
    done = subprocess.run([*script, "--check"], capture_output=True, text=True, cwd=PROJECT_ROOT)
    assert done.returncode == 1 and "figure demo reads" in done.stdout and "step time 1.0 s" in done.stdout
    assert subprocess.run(script, capture_output=True, text=True, cwd=PROJECT_ROOT).returncode == 0
    assert readme.read_text() == text


def test_the_readme_python_blocks_run_as_written(capsys):
    text = (PROJECT_ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 2
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
        assert capsys.readouterr().out.strip()


def test_every_readme_command_is_run_by_a_test():
    """Each command line of the README's bash blocks is run as written (``readme_command``, its output
    folder swapped for a temporary one) by some test; each ``make`` line names a target make can plan."""
    import subprocess

    tests = "\n".join(p.read_text() for p in (PROJECT_ROOT / "tests").rglob("*.py"))
    used = set(MORE) | set(re.findall(r'readme_command\(\s*"([^"]+)"', tests)) | set(re.findall(r"readme_command\(\s*'([^']+)'", tests))
    lines = readme_commands()
    assert len(lines) > 10
    for line in lines:
        if line.startswith("make "):
            target = line.split()[1]
            done = subprocess.run(["make", "-n", target], cwd=PROJECT_ROOT, capture_output=True, text=True)
            assert done.returncode == 0, f"README: {line!r}: {done.stderr.strip()}"
            continue
        runs = [u for u in used if line.startswith(u)]
        assert len(runs) == 1, f"README: {line!r} is run by {len(runs)} tests (readme_command calls)"
