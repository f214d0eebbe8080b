"""``hespas-ml`` command line: one sub-command per job; bad input is one line on stderr and exit code 2."""
from __future__ import annotations

import argparse
import os
import sys

from ..ingest.errors import HespasError
from . import dataset_cmds, generate_cmds, layout_cmds, learn_cmds, pipeline_cmds, study_cmds, sweep_cmds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hespas-ml",
        description="Predict the step time of distributed ML workloads from their StableHLO programs.")
    parser.add_argument("--version", action="version", version=f"hespas-ml {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    pipeline_cmds.register(sub)
    dataset_cmds.register(sub)
    study_cmds.register(sub)
    sweep_cmds.register(sub)
    layout_cmds.register(sub)
    generate_cmds.register(sub)
    learn_cmds.register(sub)
    return parser


def _version() -> str:
    from .. import __version__
    return __version__


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except HespasError as exc:
        print(f"hespas-ml: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hespas-ml: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
