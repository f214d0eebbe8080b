"""The README's `make demo` output block, regenerated from the demo itself.

    python eval/readme_figures.py           # rewrite the block in README.md
    python eval/readme_figures.py --check   # exit 1 (and say which line) when the README differs

The demo is the Makefile's ``demo`` command; the block is the first lines it prints (the roofline is
deterministic, so they are the same on every machine). ``tests/cli/test_readme_commands.py`` runs the check.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only check: exit 1 where the README differs")
    args = ap.parse_args(argv)
    path = ROOT / "README.md"
    text = path.read_text()
    start, end = readme_block(text)
    now = demo_lines()
    shown = text[start:end].splitlines()
    if args.check:
        for i, (a, b) in enumerate(zip(shown, now)):
            if re.sub(r"\s+", " ", a) != re.sub(r"\s+", " ", b):
                print(f"README.md: the make demo block's line {i + 1} reads {a!r}; the demo prints {b!r} "
                      "(python eval/readme_figures.py rewrites it)")
                return 1
        if len(shown) != len(now):
            print(f"README.md: the make demo block has {len(shown)} lines, the demo's first {len(now)}")
            return 1
        return 0
    path.write_text(text[:start] + "\n".join(now) + "\n" + text[end:])
    print(f"README.md: the make demo block rewritten ({len(now)} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
