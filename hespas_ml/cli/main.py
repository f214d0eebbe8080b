"""``hespas-ml`` command line: one sub-command per job; bad input is one line on stderr and exit code 2."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

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


class OutputError(HespasError):
    """An output path the command could not write to."""


def check_out(path: str | None, folder: bool = True) -> None:
    """Before any work: that ``--out`` can be written, as a folder (created with its parents) or, with
    ``folder`` False, as a file. Raises :class:`OutputError` naming it."""
    if not path:
        return
    out = Path(path)
    if folder and out.exists() and not out.is_dir():
        raise OutputError(f"--out {path}: exists and is not a folder")
    if not folder and out.is_dir():
        raise OutputError(f"--out {path}: is a folder; give the file to write")
    where = out if folder else out.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        raise OutputError(f"--out {path}: {where} is not a folder")
    if not os.access(where, os.W_OK | os.X_OK):
        raise OutputError(f"--out {path}: {where} is not writable")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_out(getattr(args, "out", None), folder=not getattr(args, "out_is_file", False))
        return int(args.func(args) or 0)
    except HespasError as exc:
        print(f"hespas-ml: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hespas-ml: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as exc:          # a file the command reads or writes: one line, what is done stays done
        print(f"hespas-ml: error: {exc.filename or ''}{': ' if exc.filename else ''}{exc.strerror or exc}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
