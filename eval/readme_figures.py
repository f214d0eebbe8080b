"""The README's figures that the pipeline computes, regenerated from it: the `make demo` output block and
the op-by-op vs fusion-aware roofline table of the ResNet-50 program in ../shared.

    python eval/readme_figures.py           # rewrite the blocks in README.md
    python eval/readme_figures.py --check   # exit 1 (and say which line) when the README differs

The demo is the Makefile's ``demo`` command; its block is the first lines it prints. Both come from the
roofline, which is deterministic, so they are the same on every machine. ``tests/cli/test_readme_commands.py``
runs the check.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hespas_ml.cli.main import main as cli_main  # noqa: E402

HEAD = "`make demo` prints (`python eval/readme_figures.py` regenerates this block; a test checks it):\n\n```\n"
LINES = 12            # the summary and the first region of the table


def demo_argv() -> list[str]:
    """The Makefile's demo command, as arguments after ``hespas-ml`` (its ``--out`` left out)."""
    text = (ROOT / "Makefile").read_text()
    line = next(line for line in text.splitlines() if "hespas-ml simulate" in line and "--out" in line)
    words = shlex.split(line.split("hespas-ml", 1)[1])
    i = words.index("--out")
    return words[:i] + words[i + 2:]


def demo_lines() -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if cli_main(demo_argv()) != 0:
            raise SystemExit("the demo failed")
    return out.getvalue().splitlines()[:LINES]


def readme_block(text: str) -> tuple[int, int]:
    """(start, end) offsets of the block's lines in the README text."""
    start = text.index(HEAD) + len(HEAD)
    end = text.index(" …\n```", start)
    return start, end


RESNET = ROOT.parent / "shared" / "mlir" / "resnet_50_inference_step_4_devices_1024_batch.mlir"
TABLE_HEAD = "| split | bytes per device | roofline step time |\n|---|---|---|\n"
TABLE_END = " The fusion-aware split groups ops"


def table_lines() -> list[str]:
    """The table's rows and the sentence that compares them: the shared ResNet-50 inference step on H100
    under the linear and fusion splits (kernel bytes per device, roofline step time)."""
    from hespas_ml import simulate

    linear, fusion = (simulate(str(RESNET), "H100", "ring:4x150", split=s) for s in ("linear", "fusion"))
    return [f"| op by op (`linear`, Hespas-style) | {linear.kernel_bytes / 1e9:.3g} GB (XLA's own unoptimised "
            f"count: {linear.bytes / 1e9:.3g} GB) | {linear.step_time_s * 1e3:.1f} ms |",
            f"| fusion-aware (`fusion`, default) | {fusion.kernel_bytes / 1e9:.3g} GB | "
            f"{fusion.step_time_s * 1e3:.1f} ms |",
            "",
            f"The op-by-op count over-states memory traffic {linear.kernel_bytes / fusion.kernel_bytes:.0f}-fold "
            f"and the time {linear.step_time_s / fusion.step_time_s:.0f}-fold."]


def table_block(text: str) -> tuple[int, int]:
    start = text.index(TABLE_HEAD) + len(TABLE_HEAD)
    return start, text.index(TABLE_END, start)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only check: exit 1 where the README differs")
    args = ap.parse_args(argv)
    path = ROOT / "README.md"
    text = path.read_text()
    blocks = [("the make demo block", readme_block, demo_lines, "\n")]
    if RESNET.is_file():
        blocks.append(("the roofline table", table_block, table_lines, ""))
    for what, where, lines, tail in blocks:
        start, end = where(text)
        now = lines()
        shown = text[start:end].rstrip("\n").splitlines()
        if args.check:
            for i, (a, b) in enumerate(zip(shown, now)):
                if re.sub(r"\s+", " ", a) != re.sub(r"\s+", " ", b):
                    print(f"README.md: {what}'s line {i + 1} reads {a!r}; the pipeline gives {b!r} "
                          "(python eval/readme_figures.py rewrites it)")
                    return 1
            if len(shown) != len(now):
                print(f"README.md: {what} has {len(shown)} lines, the pipeline gives {len(now)}")
                return 1
            continue
        text = text[:start] + "\n".join(now) + tail + text[end:]
        print(f"README.md: {what} rewritten ({len(now)} lines)")
    if not args.check:
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
