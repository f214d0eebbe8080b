"""Import NeuSight's measured GPU operator latencies as a measured dataset folder, with provenance.

    python eval/import_neusight.py --mirror NEUSIGHT_GIT_DIR \
        --out datasets/measured/neusight-db1fdc9 [--max-regions N] [--work out/neusight-db1fdc9]

``NEUSIGHT_GIT_DIR``: the git directory of a clone of https://github.com/trsharm25/NeuSight (bare is fine).

Reads the per-GPU operator files (``scripts/asplos/data/dataset/train/collect/<op>/p2.1.0/<Device>.csv``)
and the bmm / linear test files of the NeuSight repository at the pinned commit straight from a git
directory (a bare mirror is enough), chooses a stratified sample of shapes per operator, writes their
single-operation modules and builds them under ``--work`` (git ignores out/; a second run reuses the
build), and writes ``--out`` (replaced as a whole): a dataset folder with the measured times as
``profiling`` labels, plus steps.csv, provenance.json and README.md. See ``hespas_ml.label.neusight``.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hespas_ml.ingest.errors import HespasError  # noqa: E402
from hespas_ml.label import neusight  # noqa: E402


def git(mirror: str, *args: str) -> str:
    out = subprocess.run(["git", f"--git-dir={mirror}", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise neusight.NeuSightError(f"{mirror}: git {' '.join(args)}: {' '.join(out.stderr.split())[:300]}")
    return out.stdout


def neusight_files(mirror: str, commit: str) -> tuple[dict[str, str], dict[str, str]]:
    """``path -> text`` and ``path -> blob id`` of every operator file the importer reads."""
    listing = git(mirror, "ls-tree", "-r", commit, "--", neusight.TRAIN_DIR, neusight.TEST_DIR)
    blobs: dict[str, str] = {}
    for line in listing.splitlines():
        meta, path = line.split("\t", 1)
        _, kind, blob = meta.split()
        op = neusight.op_of_path(path)
        if kind != "blob" or op is None:
            continue
        if path.startswith(neusight.TRAIN_DIR + "/"):
            if f"/{neusight.TORCH_DIR}/" not in path:
                continue                 # merged copies beside the per-GPU files
        elif op not in neusight.TEST_OPS:
            continue
        blobs[path] = blob
    if not blobs:
        raise neusight.NeuSightError(f"{mirror}: no NeuSight operator files at {commit}")
    texts = {path: git(mirror, "cat-file", "blob", blob) for path, blob in sorted(blobs.items())}
    return texts, blobs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mirror", required=True, help="git directory of the NeuSight repository (bare is fine)")
    ap.add_argument("--out", required=True, help="measured dataset folder to write (replaced)")
    ap.add_argument("--work", default=None, help="modules and build (default: out/<name of --out>)")
    ap.add_argument("--max-regions", type=int, default=None,
                    help="scale the per-operator quotas down to at most this many unique regions")
    ap.add_argument("--workers", type=int, default=1, help="processes that split the modules (default 1)")
    args = ap.parse_args(argv)
    work = Path(args.work) if args.work else Path("out") / Path(args.out).name
    given = list(argv if argv is not None else sys.argv[1:])
    shown = ["NEUSIGHT_GIT_DIR" if a == args.mirror and i and given[i - 1] == "--mirror" else a
             for i, a in enumerate(given)]                       # the clone's place is this machine's
    command = "python eval/import_neusight.py " + " ".join(shlex.quote(a) for a in shown)
    started = time.perf_counter()
    try:
        texts, blobs = neusight_files(args.mirror, neusight.COMMIT)
        summary = neusight.import_neusight(texts, args.out, work, quotas=neusight.scaled_quotas(args.max_regions),
                                           workers=args.workers, progress=sys.stderr.isatty(), command=command,
                                           blobs=blobs)
    except HespasError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = {k: v for k, v in summary.items() if k not in ("quotas", "counts")}
    print(json.dumps({**summary, "seconds": round(time.perf_counter() - started, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
