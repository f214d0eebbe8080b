"""Every way to lay one zoo program out on N devices, ranked: the pp × dp × fsdp × tp meshes its family accepts
(× ep for a family with experts).

A pipeline (pp > 1) runs microbatches of one sequence unless the program names its own ``microbatch``.

Each mesh is checked by the family's own rules (an impossible one says why), then ingested and split; a
layout whose per-device memory does not fit the target is reported without being timed; the rest are
labelled and replayed with the pipeline's stages on one system, and ranked by step time. With ``stages``, a
pipelined layout is simulated from its stages' own programs instead (its memory known once they are).
:func:`plot_layouts` draws the ranking: each layout's step time (the exposed communication apart, the pipeline
bubble written beside it) and its peak memory per device against the target's.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import pipeline
from ..costs import graph_cost
from ..ingest.errors import HespasError
from ..ingest.zoo import ZOO, is_zoo_spec, parse_zoo_spec
from ..ingest.zoo.checks import all_meshes, format_mesh, pipeline_bubble, search_axes
from ..ingest.zoo.specs import named_params
from ..pipeline_stages import simulate_stages
from ..split.memory import memory
from ..units import format_bytes, progress_bar

class LayoutError(HespasError):
    pass


@dataclass
class Layout:
    """One mesh of the program: ``status`` ok (timed), too-big (does not fit, not timed) or invalid."""

    mesh: str
    program: str
    status: str
    reason: str = ""
    step_time_s: float = math.nan
    exposed_comm_s: float = math.nan
    peak_memory_bytes: int = 0
    utilisation: float = math.nan     # per-device FLOPs / (step time × the target's peak for the program's dtype)
    bubble: float = 0.0               # share of the pipeline's ticks in which a stage has no microbatch

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rank_layouts(program: str, devices: int, question: pipeline.Question, *, progress: bool = False,
                 stages: bool = False) -> list[Layout]:
    """Every layout of the zoo ``program`` (a spec without devices, parallel or mesh) on ``devices``, timed
    on ``question``'s target, fidelity and system (its program is ignored), best first. ``stages``: a
    pipelined layout is simulated from its stages' own programs (:mod:`hespas_ml.pipeline_stages`); one that
    way cannot lay out is invalid, with the reason."""
    if not is_zoo_spec(program):
        raise LayoutError(f"{program}: layouts are enumerated for zoo programs (a .mlir file has one layout)")
    family, params = parse_zoo_spec(program)
    if ZOO[family].param("mesh") is None:
        raise LayoutError(f"{program}: {family} takes no mesh (families that do: "
                          f"{', '.join(n for n, e in ZOO.items() if e.param('mesh') is not None)})")
    named = named_params(program)
    if named & {"devices", "parallel", "mesh"}:
        raise LayoutError(f"{program}: leave devices, parallel and mesh out: the layouts set them")
    if question.system is None or question.system.n_npus != devices:
        raise LayoutError(f"the system must have the {devices} devices the layouts span")
    peak = question.target.peak_flops(str(params.get("dtype", "f32")), "matrix")
    out: list[Layout] = []
    candidates = all_meshes(devices, search_axes(ZOO[family]))
    sep = "&" if "?" in program else "?"
    with progress_bar(len(candidates), "layouts", "layout", progress) as bar:
        for mesh in candidates:
            text = format_mesh(mesh)
            spec = f"{program}{sep}mesh={text}&devices={devices}"
            if mesh["pp"] > 1 and "microbatch" not in named:
                spec += "&microbatch=1"
            bar.set_postfix_str(text, refresh=False)
            out.append(_staged_layout(spec, text, question, peak) if stages and mesh["pp"] > 1
                       else _layout(spec, text, question, peak))
            bar.update(1)
    order = {"ok": 0, "too-big": 1, "invalid": 2}
    return sorted(out, key=lambda lay: (order[lay.status], lay.step_time_s if lay.status == "ok" else 0.0,
                                        lay.peak_memory_bytes))


def _layout(spec: str, text: str, q: pipeline.Question, peak: float) -> Layout:
    try:
        bubble = pipeline_bubble(parse_zoo_spec(spec)[1])
    except HespasError as exc:
        return Layout(text, spec, "invalid", str(exc).removeprefix(f"{spec}: "))
    try:
        regions = pipeline.split(pipeline.ingest(spec, q.system), q.split)
        footprint = memory(regions)
        too_big = footprint.shortfall(q.target.mem_capacity, q.target.name)
        if too_big:
            return Layout(text, spec, "too-big", too_big, peak_memory_bytes=footprint.peak, bubble=bubble)
        times = pipeline.label(regions, q.fidelity, q.target)
        step = pipeline.replay(pipeline.trace(regions, times, interval=False), q.system, q.replay)
    except HespasError as exc:
        return Layout(text, spec, "invalid", str(exc))
    flops = graph_cost(regions.graph)["flops"]
    util = flops / (step.step_time_s * peak) if step.step_time_s > 0 and peak > 0 else math.nan
    return Layout(text, spec, "ok", "; ".join(times.caveats), step.step_time_s, step.exposed_comm_s, footprint.peak,
                  util, bubble)


def _staged_layout(spec: str, text: str, q: pipeline.Question, peak: float) -> Layout:
    try:
        staged = simulate_stages(spec, q.target, q.system, fidelity=q.fidelity, split=q.split, replay_backend=q.replay)
    except HespasError as exc:
        return Layout(text, spec, "invalid", str(exc).removeprefix(f"{spec}: "))
    if not staged.fits:
        return Layout(text, spec, "too-big", f"{staged.peak_memory_bytes / 2**30:.2f} GiB at the peak on its fullest "
                      f"stage, the {q.target.name} has {q.target.mem_capacity / 2**30:.2f} GiB",
                      peak_memory_bytes=staged.peak_memory_bytes, bubble=staged.bubble)
    util = staged.flops / (staged.step_time_s * peak) if staged.step_time_s > 0 and peak > 0 else math.nan
    return Layout(text, spec, "ok", "; ".join(staged.warnings), staged.step_time_s, staged.exposed_comm_s,
                  staged.peak_memory_bytes, util, staged.bubble)


MAX_PLOTTED = 40


def plot_layouts(path: str | Path, layouts: list[Layout], title: str, memory_bytes: float) -> Path:
    """A PNG of ranked ``layouts``: the timed ones best first (at most :data:`MAX_PLOTTED`), then those that
    do not fit; left, the step time split into what is not exposed communication and what is, with the
    bubble beside a pipeline's bar; right, the peak memory per device against ``memory_bytes``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ok = [lay for lay in layouts if lay.status == "ok"]
    big = [lay for lay in layouts if lay.status == "too-big"]
    shown = (ok + big)[:MAX_PLOTTED]
    rows = list(range(len(shown)))[::-1]
    fig, (left, right) = plt.subplots(1, 2, sharey=True, figsize=(12, 1.4 + 0.28 * max(len(shown), 1)),
                                      gridspec_kw={"width_ratios": [3, 2]})
    scale = 1e3 if ok and max(lay.step_time_s for lay in ok) < 1 else 1.0
    unit = "ms" if scale == 1e3 else "s"
    for y, lay in zip(rows, shown):
        if lay.status == "ok":
            hidden = (lay.step_time_s - lay.exposed_comm_s) * scale
            left.barh(y, hidden, color="#4C72B0")
            left.barh(y, lay.exposed_comm_s * scale, left=hidden, color="#DD8452")
            if lay.bubble:
                left.text(lay.step_time_s * scale, y, f"  bubble {lay.bubble:.0%}", va="center", fontsize=7)
        else:
            left.text(0, y, "  does not fit: not timed", va="center", fontsize=7, color="#C44E52")
    most = max([lay.peak_memory_bytes for lay in shown] + [1])
    mem_scale, mem_unit = (2**30, "GiB") if most >= 2**30 else (2**20, "MiB")
    for y, lay in zip(rows, shown):
        right.barh(y, lay.peak_memory_bytes / mem_scale, color="#55A868" if lay.status == "ok" else "#C44E52")
    capacity = memory_bytes / mem_scale
    if memory_bytes <= 3 * most:
        right.axvline(capacity, color="black", linestyle="--", linewidth=1)
        right.set_xlabel(f"peak memory per device ({mem_unit}); dashed: {format_bytes(memory_bytes)}")
    else:
        right.set_xlabel(f"peak memory per device ({mem_unit}); the target has {format_bytes(memory_bytes)}")
    left.set_yticks(rows, [lay.mesh for lay in shown], fontsize=8)
    left.set_xlabel(f"step time ({unit})")
    left.legend(handles=[Patch(color="#4C72B0", label="compute and hidden communication"),
                         Patch(color="#DD8452", label="exposed communication"),
                         Patch(color="#55A868", label="memory: fits"), Patch(color="#C44E52", label="does not fit")],
                fontsize=7, loc="upper center", bbox_to_anchor=(0.8, -0.6 / max(len(shown), 1) - 0.06), ncol=4,
                frameon=False)
    impossible = sum(lay.status == "invalid" for lay in layouts)
    beyond = len(ok) + len(big) - len(shown)
    left_out = ([f"{impossible} impossible"] if impossible else []) + ([f"{beyond} beyond the first {MAX_PLOTTED}"]
                                                                       if beyond else [])
    fig.suptitle(title + (f"\n(not drawn: {', '.join(left_out)})" if left_out else ""), fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["Layout", "LayoutError", "MAX_PLOTTED", "plot_layouts", "rank_layouts"]
