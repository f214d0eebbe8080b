"""A picture of one replayed step: on each rank, when compute and communication ran, and which stretches of
communication no compute hid (the exposed communication of the step time).

The times are the embedded replay's (node issue and finish ticks); one device runs its compute nodes one
after another in trace order.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from hespas_ml.replay import chakra as et
from hespas_ml.replay.embedded import replay_embedded
from hespas_ml.replay.system import SystemConfig

MAX_RANKS = 8           # ranks drawn (the first ones)


@dataclass(frozen=True, slots=True)
class Span:
    start_ns: int
    end_ns: int
    kind: str            # "compute" | "comm"
    name: str


def step_spans(traces: Sequence[Sequence[et.EtNode]], system: SystemConfig | None,
               comm_groups: dict[int, list[int]] | None = None,
               ticks: dict[int, dict[int, tuple[int, int]]] | None = None) -> dict[int, list[Span]]:
    """The spans of every node of the replayed ranks (all of them, or rank 0 alone where the replay
    simulated one rank for all), by rank. ``ticks``: the embedded replay's node ticks when a replay of
    these traces recorded them (``details["nodes"]``); else the traces are replayed here."""
    if system is None or system.n_npus == 1:
        spans, t = [], 0
        for node in traces[0]:
            if node.type == et.COMP_NODE:
                end = t + int(node.duration_micros) * 1000
                spans.append(Span(t, end, "compute", node.name))
                t = end
        return {0: spans}
    if ticks is None:
        ticks = replay_embedded(traces, system, comm_groups, record_nodes=True).details["nodes"]
    out: dict[int, list[Span]] = {}
    for rank, by_id in ticks.items():
        nodes = {n.id: n for n in traces[rank]}
        out[rank] = sorted((Span(start, end, "compute" if nodes[nid].type == et.COMP_NODE else "comm", nodes[nid].name)
                            for nid, (start, end) in by_id.items() if end > start), key=lambda s: s.start_ns)
    return out


def exposed(spans: Sequence[Span]) -> list[tuple[int, int]]:
    """The stretches of a rank's communication during which it computes nothing."""
    busy = _union((s.start_ns, s.end_ns) for s in spans if s.kind == "compute")
    out = []
    for start, end in _union((s.start_ns, s.end_ns) for s in spans if s.kind == "comm"):
        t = start
        for b0, b1 in busy:
            if b1 <= t or b0 >= end:
                continue
            if b0 > t:
                out.append((t, b0))
            t = max(t, b1)
        if t < end:
            out.append((t, end))
    return out


def _union(intervals) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def write_timeline(path: str | Path, spans: dict[int, list[Span]], title: str) -> Path:
    """A PNG of ``spans``: per rank, a compute lane and a communication lane with its exposed stretches."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted(spans)[:MAX_RANKS]
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.7 * len(ranks)))
    for row, rank in enumerate(ranks):
        y = len(ranks) - 1 - row
        for kind, lane, colour in (("compute", 0.38, "#4C72B0"), ("comm", 0.0, "#DD8452")):
            bars = [(s.start_ns / 1e6, (s.end_ns - s.start_ns) / 1e6) for s in spans[rank] if s.kind == kind]
            ax.broken_barh(bars, (y + lane, 0.32), facecolors=colour)
        ax.broken_barh([(a / 1e6, (b - a) / 1e6) for a, b in exposed(spans[rank])], (y - 0.06, 0.06),
                       facecolors="#C44E52")
    ax.set_yticks([len(ranks) - 1 - i + 0.35 for i in range(len(ranks))], [f"rank {r}" for r in ranks])
    ax.set_xlabel("time in the step (ms)")
    ax.set_title(title, fontsize=10)
    shown = f"the first {len(ranks)} ranks" if len(spans) > len(ranks) else None
    ax.legend(handles=[Patch(color="#4C72B0", label="compute"), Patch(color="#DD8452", label="communication"),
                       Patch(color="#C44E52", label="exposed communication")],
              loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.3 / len(ranks)), ncol=3, fontsize=8, frameon=False,
              title=shown, title_fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["MAX_RANKS", "Span", "exposed", "step_spans", "write_timeline"]
