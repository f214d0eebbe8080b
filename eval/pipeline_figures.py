"""Step times of make demo's program and of every ../shared program under the four splits, to the last digit:
run it before and after a change to the pipeline and compare.

    python eval/pipeline_figures.py > before.json        # on the old checkout
    python eval/pipeline_figures.py --compare before.json # on the new one: the programs whose figures moved

Each line is ``program|split``: step time, exposed communication (s, ``repr``), compute and communication nodes
per device; a program that cannot be simulated records its error. ``--sweep SPEC`` adds every row of that
sweep (``sweep|config id|program|target|fidelity|system``: status, step time, its interval, exposed
communication).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hespas_ml import pipeline, simulate  # noqa: E402
from hespas_ml.split.regions import SPLITS  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "mlir"
DEMO = "zoo:mlp?layers=4&width=2048&batch=512&step=train&devices=4"


def figures() -> dict[str, object]:
    out: dict[str, object] = {}
    for program in [DEMO, *(str(p) for p in sorted(SHARED.rglob("*.mlir")))]:
        n = pipeline.ingest(program).n_devices
        system = f"ring:{n}x150" if n > 1 else None
        for split in SPLITS:
            name = f"{program.replace(str(SHARED.parent), '../shared')}|{split}"
            try:
                r = simulate(program, target="H100", system=system, split=split)
                out[name] = [repr(r.step_time_s), repr(r.exposed_comm_s), r.n_comp_nodes, r.n_comm_nodes]
            except Exception as exc:  # noqa: BLE001 - recorded: an error is a figure too
                out[name] = "error: " + str(exc).splitlines()[0][:120]
    return out


def sweep_figures(spec: str) -> dict[str, object]:
    import pyarrow.parquet as pq
    from hespas_ml.use.sweep import run_sweep

    with tempfile.TemporaryDirectory() as out:
        run_sweep(spec, out, progress=False)
        rows = pq.read_table(Path(out) / "results.parquet").to_pylist()
    return {f"sweep|{r['config_id']}|{r['program']}|{r['target']}|{r['fidelity']}|{r['system']}":
            [r["status"], *(repr(r[k]) for k in ("step_time_s", "step_time_lo_s", "step_time_hi_s", "exposed_comm_s"))]
            for r in rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", help="a JSON file this script wrote earlier: print what moved, exit 1 if any")
    ap.add_argument("--sweep", metavar="SPEC", help="a sweep spec whose rows to add (e.g. eval/sweeps/smoke.yaml)")
    args = ap.parse_args()
    now = figures()
    if args.sweep:
        now.update(sweep_figures(args.sweep))
    if not args.compare:
        print(json.dumps(now, indent=1))
        return 0
    before = json.loads(Path(args.compare).read_text())
    moved = {k: (before.get(k), now.get(k)) for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)}
    for k, (a, b) in moved.items():
        print(f"{k}: {a} -> {b}")
    print(f"{len(now) - len(moved)} of {len(now)} unchanged")
    return 1 if moved else 0


if __name__ == "__main__":
    raise SystemExit(main())
