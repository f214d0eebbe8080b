"""Is this machine steady enough to take profiling labels? A short check before a long profiling build.

Profiling labels are only as good as the machine's timings repeat: a shared VM whose speed wanders with
its neighbours gives labels no surrogate learns to better than that wandering (``datasets/README.md``,
"Before a long profiling build", has the figures). The damage shows only after an hour of labelling and
another of training; this check shows it in seconds.

:func:`check_steadiness` times three reference kernels (a GEMM, a streaming elementwise kernel and a
reduction, lowered with ``jax.jit(...).lower(...)``) in rounds, exactly as the profiling labeller times a
region (its worker, pinned cores, sampling and timing lock), for about ``seconds``. Each kernel's round
times are divided by that kernel's median over the rounds; the spread of those ratios around 1 (median
and 90th percentile of ``|ratio - 1|``) is how far one timing of a region may be from another taken a few
seconds later: the floor under any profiling surrogate's error on this machine. ``drift`` compares the
second half of the rounds with the first.

``hespas-ml host-cpu --steadiness`` runs it; a dataset build runs a short one before a long profiling
stage, records it in the manifest and in the folder's ``steadiness.jsonl``. The 5 % line (``STEADY_P90``)
is what the labeller repeated to on the steadiest machine it ran on.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .fidelity import FidelityError

STEADY_P90 = 0.05          # |round / median - 1| at the 90th percentile above this: unsteady
ROUND_MEASURE_S = 0.2      # seconds of sampling per kernel per round
LOG_FILE = "steadiness.jsonl"   # in a dataset folder: one JSON line per check that opened a profiling stage


@dataclass
class Steadiness:
    """What :func:`check_steadiness` measured (all spreads are fractions: 0.05 is 5 %)."""

    rounds: int                                   # complete rounds (every kernel timed once)
    seconds: float                                # wall time of the rounds
    median_dev: float                             # median |round time / kernel median - 1|
    p90_dev: float                                # its 90th percentile
    drift: float                                  # median ratio of the second half's times to the first's, - 1
    within: float                                 # median IQR / median inside one timing (sample noise)
    load_avg: float | None                        # 1-minute load average after the last timing
    kernels: dict[str, dict[str, float]] = field(default_factory=dict)   # name -> median_s, p90_dev
    times: dict[str, list[float]] = field(default_factory=dict)     # name -> seconds of each round
    device: str = ""

    @property
    def steady(self) -> bool:
        return self.p90_dev <= STEADY_P90

    def summary(self, statistic: str = "median") -> str:
        """One line: the verdict and the figures behind it (and, on an unsteady machine, what to do about it:
        the fastest-sample statistic is suggested unless the labels already use it)."""
        verdict = "steady" if self.steady else "UNSTEADY"
        line = (f"timing steadiness: {verdict}: {self.rounds} rounds in {self.seconds:.0f} s, one timing of a "
                f"kernel differs from its median by {100 * self.median_dev:.1f} % (median), "
                f"{100 * self.p90_dev:.1f} % (p90); drift {100 * self.drift:+.1f} %")
        if not self.steady:
            line += (f"; profiling medians taken here will be that noisy (above {100 * STEADY_P90:.0f} % p90): "
                     "stop other work, label on a quieter machine"
                     + (", or take the fastest sample (profiling options statistic: min, measure_s: 2)"
                        if statistic != "min" else " (the fastest sample, taken here, repeats better)"))
        return line

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "steady": self.steady}

    @classmethod
    def from_times(cls, times: dict[str, list[float]], seconds: float, within: float, device: str = "",
                   load_avg: float | None = None) -> Steadiness:
        """The figures of round times (``times``: kernel -> seconds of each round, two rounds at least)."""
        dev = deviations(times)
        half = min(len(t) for t in times.values()) // 2
        drift = float(np.median([np.median(t[half:]) / np.median(t[:half]) for t in times.values()])) - 1.0
        kernels = {name: {"median_s": float(np.median(t)), "p90_dev": float(np.quantile(deviations({name: t}), 0.9))}
                   for name, t in times.items()}
        return cls(rounds=min(len(t) for t in times.values()), seconds=seconds, median_dev=float(np.median(dev)),
                   p90_dev=float(np.quantile(dev, 0.9)), drift=drift, within=within, load_avg=load_avg,
                   kernels=kernels, times={k: [float(x) for x in t] for k, t in times.items()}, device=device)


def reference_modules() -> dict[str, str]:
    """StableHLO text of the reference kernels: compute-bound, memory-bound and a reduction."""
    import jax
    import jax.numpy as jnp

    f32 = jnp.float32
    specs = {
        "gemm_256": (lambda a, b: a @ b, [(256, 256), (256, 256)]),
        "stream_4m": (lambda a: a * 1.5 + 1.0, [(1 << 22,)]),
        "reduce_rows": (lambda a: a.sum(-1), [(8, 512, 1024)]),
    }
    return {name: jax.jit(fn).lower(*[jax.ShapeDtypeStruct(s, f32) for s in shapes]).as_text()
            for name, (fn, shapes) in specs.items()}


def deviations(times: dict[str, list[float]]) -> np.ndarray:
    """``|t / median(t) - 1|`` of every round of every kernel (``times``: kernel -> round times)."""
    out = [np.abs(np.asarray(t, dtype=float) / np.median(t) - 1.0) for t in times.values() if len(t)]
    return np.concatenate(out) if out else np.zeros(0)


def check_steadiness(seconds: float = 20.0, fidelity=None, progress: bool = False) -> Steadiness:
    """Time the reference kernels in rounds for about ``seconds`` (at least three rounds) with the
    profiling labeller (``fidelity``: a :class:`~hespas_ml.label.profiling.ProfilingFidelity`, default
    the labeller's defaults) and report how well the timings repeat. Raises FidelityError when the
    kernels cannot be timed."""
    from tqdm import tqdm

    from .profiling import ProfilingFidelity
    from .targets import HOST_CPU

    if not seconds > 0:
        raise FidelityError(f"steadiness check: seconds must be positive, got {seconds!r}")
    own = fidelity is None
    fidelity = fidelity or ProfilingFidelity(cache=False)
    modules = reference_modules()
    times: dict[str, list[float]] = {name: [] for name in modules}
    noise: list[float] = []
    last: dict[str, Any] = {}
    bar = tqdm(total=round(seconds), desc="timing steadiness", unit="s", disable=not progress, leave=False,
               bar_format="{desc}: {n:.0f}/{total} s |{bar}|")
    start = time.perf_counter()
    try:
        while True:
            for name, text in modules.items():
                last = fidelity.time_module(text, HOST_CPU, measure_s=ROUND_MEASURE_S)
                times[name].append(float(last["median_s"]))
                noise.append(float(last["iqr_s"]) / float(last["median_s"]))
            rounds = min(len(t) for t in times.values())
            elapsed = time.perf_counter() - start
            bar.update(min(elapsed, seconds) - bar.n)
            bar.set_description_str(f"timing steadiness, round {rounds}")
            if rounds >= 3 and elapsed >= seconds:
                break
    finally:
        bar.close()
        if own:
            fidelity.close()
    return Steadiness.from_times(times, time.perf_counter() - start, float(np.median(noise)), last.get("device", ""),
                                 last.get("load_avg"))


def append_log(folder: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Add one check to a dataset folder's :data:`LOG_FILE`."""
    with open(Path(folder) / LOG_FILE, "a", encoding="utf-8") as log:
        log.write(json.dumps(record) + "\n")


def read_log(folder: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The checks logged in a dataset folder (none: an empty list); ValueError naming the file and line
    when a line is not a check."""
    path = Path(folder) / LOG_FILE
    if not path.is_file():
        return []
    checks = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            check = json.loads(line)
            if not isinstance(check, dict) or not isinstance(check.get("p90_dev"), (int, float)):
                raise ValueError("no p90_dev")
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: not a steadiness check ({exc})") from None
        checks.append(check)
    return checks


def describe_log(checks: list[dict[str, Any]]) -> str:
    """One phrase on the labelling machine's steadiness, for dataset info and model cards."""
    if not checks:
        return "not checked (built before the check existed, or no profiling stage of 500+ labels)"
    p90 = [100 * c["p90_dev"] for c in checks]
    unsteady = sum(1 for v in p90 if v > 100 * STEADY_P90)
    spread = f"{min(p90):.1f} %" if len(p90) == 1 else f"{min(p90):.1f}-{max(p90):.1f} %"
    verdict = "steady" if not unsteady else f"UNSTEADY in {unsteady} of {len(p90)}"
    return f"{len(p90)} check(s), p90 {spread} between timings of a kernel ({verdict}; line {100 * STEADY_P90:.0f} %)"


__all__ = ["LOG_FILE", "STEADY_P90", "Steadiness", "append_log", "check_steadiness", "describe_log", "deviations",
           "read_log", "reference_modules"]
