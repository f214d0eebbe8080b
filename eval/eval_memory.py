"""The per-device memory model (``hespas_ml.split.memory``) against XLA's buffer assignment and against the
per-GPU memory that published training runs report.

    python eval/eval_memory.py [--only xla|published] [--published eval/measured/published_memory.csv]
                               [--json out.json]

**XLA** (measured in this run, on this machine's CPU backend): small zoo steps, one device each, are compiled
with XLA and its memory analysis read (``get_compiled_memory_stats``: arguments, outputs and the temporary
buffers its heap simulation packs). Printed beside the model's parts. The two count differently in two known
ways: XLA reserves the step's outputs for the whole execution (nothing is donated here), where the model
counts a result from the region that makes it; and XLA's temporaries are laid out for its own fusions,
copies and layouts, the model's are the results of the regions of the fusion split. So both totals are
printed, and the working set beside it: arguments + intermediates + collective buffers against XLA's
arguments + temporaries.

**Published** (``eval/measured/published_memory.csv``, one row per run with its source and what the spec
cannot say the way the run did): the model's peak per device for the run's layout beside the published
figure. The published figures are what the framework logged, which is the most its allocator reserved, not
the tensors alone.
"""
from __future__ import annotations

import argparse
import csv
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hespas_ml.ingest import load_program  # noqa: E402
from hespas_ml.ingest.errors import HespasError  # noqa: E402
from hespas_ml.ingest.zoo import zoo_program  # noqa: E402
from hespas_ml.pipeline import split  # noqa: E402
from hespas_ml.split.memory import memory  # noqa: E402

XLA_SPECS = (
    "zoo:mlp?step=train",
    "zoo:llama?step=infer",
    "zoo:llama?step=train",
    "zoo:llama?step=train&remat=full",
    "zoo:llama?step=train&scan=true&layers=8",
    "zoo:llama?step=train&dtype=bf16&master=f32&optimizer=adam",
    "zoo:gpt?step=train&optimizer=adam",
    "zoo:vit?step=train",
    "zoo:resnet?depth=18&batch=8&step=train",
)
"""Steps small enough to compile on the CPU in seconds: inference and training, unrolled and scanned layers,
recomputation, Adam, f32 master weights, a CNN."""

GIB = 2**30
MIB = 2**20


def ours(spec: str) -> dict[str, int]:
    return memory(split(load_program(spec))).to_dict()


def xla_memory(spec: str) -> dict[str, int]:
    """XLA's memory analysis of the one-device step ``spec`` compiled on this machine's first device."""
    from jax.extend import backend as jeb

    backend = jeb.get_backend()
    options = jeb.get_compile_options(num_replicas=1, num_partitions=1)
    exe = backend.compile_and_load(zoo_program(spec), [backend.local_devices()[0]], options)
    st = exe.get_compiled_memory_stats()
    parts = {"arguments": st.argument_size_in_bytes, "outputs": st.output_size_in_bytes,
             "temporaries": st.temp_size_in_bytes, "aliased": st.alias_size_in_bytes}
    parts["total"] = parts["arguments"] + parts["outputs"] + parts["temporaries"] - parts["aliased"]
    return parts


def compare_xla(specs: tuple[str, ...]) -> list[dict]:
    import jax

    print(f"XLA's buffer assignment on {jax.default_backend()} ({platform.processor() or platform.machine()}, "
          f"jax {jax.__version__}); MiB per device")
    print(f"{'program':<58}{'model: args':>12}{'interm.':>9}{'outputs':>9}{'peak':>9}"
          f"{'XLA: args':>11}{'temps':>9}{'outputs':>9}{'total':>9}{'peak/total':>11}{'working':>9}")
    rows = []
    for spec in specs:
        t0 = time.perf_counter()
        mine, theirs = ours(spec), xla_memory(spec)
        working = (mine["arguments"] + mine["intermediates"] + mine["collective_buffers"]) / \
            (theirs["arguments"] + theirs["temporaries"])
        row = {"spec": spec, "model": mine, "xla": theirs, "peak_over_total": mine["peak"] / theirs["total"],
               "working_set_ratio": working, "wall_s": time.perf_counter() - t0}
        rows.append(row)
        print(f"{spec:<58}{mine['arguments'] / MIB:12.1f}{mine['intermediates'] / MIB:9.1f}"
              f"{mine['outputs'] / MIB:9.1f}{mine['peak'] / MIB:9.1f}{theirs['arguments'] / MIB:11.1f}"
              f"{theirs['temporaries'] / MIB:9.1f}{theirs['outputs'] / MIB:9.1f}{theirs['total'] / MIB:9.1f}"
              f"{row['peak_over_total']:11.2f}{working:9.2f}", flush=True)
    print(f"median model peak / XLA total {statistics.median(r['peak_over_total'] for r in rows):.2f}, "
          f"working sets {statistics.median(r['working_set_ratio'] for r in rows):.2f} "
          f"(range {min(r['working_set_ratio'] for r in rows):.2f}-{max(r['working_set_ratio'] for r in rows):.2f})")
    return rows


def read_published(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    for i, row in enumerate(rows, start=2):
        try:
            float(row["gib"])
        except (TypeError, ValueError, KeyError):
            raise ValueError(f"{path}:{i}: gib {row.get('gib')!r} is not a number") from None
    return rows


def compare_published(path: Path) -> list[dict]:
    print(f"\nPublished per-GPU memory ({path.name}); GiB per device")
    out = []
    for row in read_published(path):
        t0 = time.perf_counter()
        print(f"{row['name']}  ({row['source']})")
        try:
            mine = ours(row["spec"])
        except HespasError as exc:
            print(f"    unavailable: {str(exc).splitlines()[0][:240]}")
            out.append({"name": row["name"], "error": str(exc).splitlines()[0]})
            continue
        published = float(row["gib"])
        error = mine["peak"] / GIB / published - 1.0
        parts = ", ".join(f"{k} {mine[k] / GIB:.1f}" for k in ("parameters", "optimizer_state", "intermediates",
                                                                 "collective_buffers") if k in mine)
        print(f"    published {published:6.1f}   model {mine['peak'] / GIB:6.1f}  {100 * error:+6.1f} %   "
              f"({parts}; {time.perf_counter() - t0:.0f} s)", flush=True)
        out.append({"name": row["name"], "spec": row["spec"], "source": row["source"], "published_gib": published,
                    "model": mine, "relative_error": error})
    errors = [abs(r["relative_error"]) for r in out if "relative_error" in r]
    if errors:
        print(f"median |error| {100 * statistics.median(errors):.1f} % over {len(errors)} run(s)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=("xla", "published"))
    ap.add_argument("--published", type=Path, default=ROOT / "eval" / "measured" / "published_memory.csv")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    result: dict[str, list] = {}
    try:
        if args.only in (None, "xla"):
            result["xla"] = compare_xla(XLA_SPECS)
        if args.only in (None, "published"):
            result["published"] = compare_published(args.published)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
