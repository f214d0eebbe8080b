"""Buffers over glibc's mmap threshold, timed by the profiling worker: the time per MiB of an elementwise
kernel on a 16 MiB and a 64 MiB vector (the threshold is up to 32 MiB).

    python eval/eval_profiling_buffers.py [--measure-s 0.5]

With the worker's allocator settings (``hespas_ml.label.profiling.WORKER_MALLOC_ENV``: freed memory kept)
the two take about the same time per MiB; without them the 64 MiB one is page-faulted in anew on every
execution, several times slower per MiB. Prints both and their ratio (the fastest sample of each, so that
other work on a shared machine weighs less).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hespas_ml.host import cpu_model, schedulable_cores  # noqa: E402
from hespas_ml.label.profiling import ProfilingFidelity  # noqa: E402


def elementwise_module(mib: int) -> str:
    """x * 2 + 1 over an f32 vector of ``mib`` MiB."""
    t = f"tensor<{mib * 2**18}xf32>"
    return (f"func.func @main(%x: {t}) -> {t} {{\n"
            f"  %two = stablehlo.constant dense<2.0> : {t}\n  %one = stablehlo.constant dense<1.0> : {t}\n"
            f"  %0 = stablehlo.multiply %x, %two : {t}\n  %1 = stablehlo.add %0, %one : {t}\n"
            f"  return %1 : {t}\n}}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measure-s", type=float, default=0.5)
    args = ap.parse_args(argv)
    with ProfilingFidelity(cache=False, statistic="min", measure_s=args.measure_s) as fid:
        per_mib = {mib: fid.time_module(elementwise_module(mib))["min_s"] / mib for mib in (16, 64)}
    print(f"machine: {cpu_model()} ({schedulable_cores()} cores), one pinned core")
    for mib, t in per_mib.items():
        print(f"{mib:>3} MiB: {t * 1e6:8.1f} µs per MiB")
    print(f"ratio 64 / 16 MiB per MiB: {per_mib[64] / per_mib[16]:.2f} (about 1: no page-fault cliff at the threshold)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
