"""How durations, memory sizes and progress are shown to people: one formatter each for every command, report
and benchmark, and one progress bar (rate and ETA) for long work."""
from __future__ import annotations


def format_seconds(seconds: float | None, digits: int = 3) -> str:
    """``1.234 s``, ``12.345 ms``, ``56.7 µs`` or ``890.0 ns`` (``digits`` for s and ms); ``-`` for None."""
    if seconds is None:
        return "-"
    if seconds >= 1.0:
        return f"{seconds:.{digits}f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.{digits}f} ms"
    if seconds >= 1e-6 or seconds <= 0.0:
        return f"{seconds * 1e6:.1f} µs"
    return f"{seconds * 1e9:.1f} ns"


def format_bytes(value: float) -> str:
    """A memory size in binary units: ``152.06 MiB``, ``80.00 GiB``, ``512 B``."""
    for scale, prefix in ((2**40, "Ti"), (2**30, "Gi"), (2**20, "Mi"), (2**10, "Ki")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}B"
    return f"{value:.0f} B"


def progress_bar(total: int, desc: str, unit: str, enabled: bool):
    """A tqdm bar (rate and ETA) on stderr; silent when not ``enabled``."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, dynamic_ncols=True, mininterval=0.5,
                smoothing=0.1)
