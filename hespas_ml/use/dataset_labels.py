"""Phase 2 of a dataset build: each (unique region, target, fidelity) the cache lacks gets its label.

Two ways of giving a fidelity its regions:

* **standalone** (roofline, SCALE-Sim: they read only a region's kernels and ops) — each region is rebuilt
  from its stored record (:func:`~hespas_ml.label.region_records.region_from_record`); chunks of regions
  are labelled on every target that still needs them.
* **from a program** (profiling, and any other fidelity: profiling cuts the region's ops out of the
  program it came from and compiles them) — the pending regions are covered greedily by as few of their
  source programs as possible; each of those is ingested and split again in this process, and its
  regions with pending hashes are labelled in chunks.

A fidelity's ``families`` keep only the regions that occur in a program of those families, and its
``max_regions`` then takes the first N of them in hash order. Every chunk is committed to the cache as soon
as it is labelled. Fidelities run one after another, so profiling never times while SCALE-Sim runs, nor
beside itself.
"""
from __future__ import annotations

import hashlib
import json
import math
import sys
import time
import warnings
from typing import Any, Callable, Sequence

from .. import pipeline
from ..ingest.errors import HespasError
from ..units import progress_bar
from ..label.dataset_cache import BuildCache, DatasetError
from ..label.dataset_spec import DatasetSpec, FidelitySpec
from ..label.fidelity import FidelityError, Label, option_defaults
from ..label.registry import get_labeller, labeller_class
from ..label.region_records import region_from_record
from ..split.signature import region_signature

DETERMINISTIC = frozenset({"roofline", "scalesim"})
STANDALONE = frozenset({"roofline", "scalesim"})     # fidelities that can label a rebuilt region
STEADINESS_MIN_LABELS = 500      # a profiling stage this long starts with a timing steadiness check …
STEADINESS_S = 15.0              # … of about this many seconds


def reason_of(exc: BaseException) -> str:
    """One line saying why something failed."""
    text = str(exc) if isinstance(exc, HespasError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:1000]


def make_fidelity(fs: FidelitySpec, workers: int):
    """The fidelity object for a spec entry, with its options applied."""
    if fs.name == "roofline":
        from ..label.roofline import RooflineFidelity
        return RooflineFidelity()
    if fs.name == "scalesim":
        from ..label.scalesim import ScaleSimFidelity
        return ScaleSimFidelity.from_options(fs.options, workers)
    return get_labeller(fs.name, **fs.options)


def target_fingerprint(target, fidelity: str) -> str:
    """What labels depend on in a target: its figures (not for profiling, which measures the real thing)."""
    data: Any = target.name if fidelity == "profiling" else [target.name, target.to_vector()]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def label_noise(fidelity: str, meta: dict[str, Any]) -> float | None:
    """Relative spread of a measured label (IQR / median), 0 for deterministic fidelities, else None."""
    if fidelity in DETERMINISTIC:
        return 0.0
    for key in ("rel_iqr", "noise"):
        value = meta.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    iqr, median = meta.get("iqr_s"), meta.get("median_s")
    if isinstance(iqr, (int, float)) and isinstance(median, (int, float)) and median > 0:
        return float(iqr) / float(median)
    return None


def _failed(reason: str) -> Label:
    return Label(math.nan, "failed", {"reason": reason})


def label_chunk(fidelity, name: str, target, hashes: Sequence[str], regions: Sequence) -> list[dict[str, Any]]:
    """Label ``regions`` on ``target``: rows for the labels table (failures become failed labels)."""
    t0 = time.perf_counter()
    try:
        labels = list(fidelity.label_regions(list(regions), target))
        if len(labels) != len(regions):
            raise HespasError(f"{name} returned {len(labels)} labels for {len(regions)} regions")
        times = [(time.perf_counter() - t0) / max(1, len(regions))] * len(regions)
    except Exception:  # noqa: BLE001 - label one by one to pin the failure on its region
        labels, times = [], []
        for region in regions:
            t1 = time.perf_counter()
            try:
                labels.append(fidelity.label(region, target))
            except Exception as exc:  # noqa: BLE001 - recorded as the label's failure
                labels.append(_failed(reason_of(exc)))
            times.append(time.perf_counter() - t1)
    rows = []
    for digest, label, seconds in zip(hashes, labels, times):
        meta = dict(label.meta or {})
        status = label.status
        value = label.seconds
        if status == "ok" and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            status, meta["reason"] = "failed", f"{name} returned an invalid time {value!r}"
        reason = meta.get("reason") if status != "ok" else None
        rows.append({"hash": digest, "target": target.name, "fidelity": name,
                     "seconds": value if status == "ok" else None,
                     "noise": label_noise(name, meta) if status == "ok" else None, "status": status,
                     "reason": None if reason is None else str(reason)[:2000],
                     "meta": json.dumps(meta, default=str, separators=(",", ":")), "label_s": seconds})
    return rows


def failed_rows(name: str, target, hashes: Sequence[str], reason: str) -> list[dict[str, Any]]:
    """Failed label rows for ``hashes`` (e.g. their program can no longer be read)."""
    return [{"hash": h, "target": target.name, "fidelity": name, "seconds": None, "noise": None,
             "status": "failed", "reason": reason[:2000], "meta": json.dumps({"reason": reason}), "label_s": 0.0}
            for h in hashes]


# ------------------------------------------------------------------------------------------ sources

def cover_programs(todo: set[str], sources: dict[str, list[str]], order: dict[str, int]) -> list[tuple[str, list[str]]]:
    """Greedy set cover: programs (spec order breaks ties) and the pending hashes each one is to label."""
    by_program: dict[str, set[str]] = {}
    for digest in todo:
        for source in sources.get(digest, ()):
            by_program.setdefault(source, set()).add(digest)
    left, plan = set(todo), []
    while left and by_program:
        best = max(by_program, key=lambda s: (len(by_program[s] & left), -order.get(s, 0)))
        mine = by_program.pop(best) & left
        if not mine:
            break
        plan.append((best, sorted(mine)))
        left -= mine
    if left:
        plan.append(("", sorted(left)))           # no program of the spec holds these any more
    return plan


def program_regions(source: str, split: str, wanted: set[str]) -> dict[str, Any]:
    """The first region of each wanted hash in ``source`` (through the pipeline's ingest and split stages
    again, in this process)."""
    rg = pipeline.split(pipeline.ingest(source), split)
    users = rg.graph.users()
    found: dict[str, Any] = {}
    for region in rg.compute_regions():
        digest = region_signature(region, users)
        if digest in wanted and digest not in found:
            found[digest] = region
            if len(found) == len(wanted):
                break
    return found


# ------------------------------------------------------------------------------------------ phase 2

def _pending(spec: DatasetSpec, fs: FidelitySpec, cache: BuildCache, hashes: list[str],
             targets: dict[str, Any]) -> list[tuple[Any, set[str]]]:
    from ..label.targets import load_target

    scope = hashes                                  # the same regions on every target
    if fs.families:
        of_families = _hashes_of_families(spec, cache, fs.families)
        scope = [h for h in hashes if h in of_families]
    scope = scope[: fs.max_regions] if fs.max_regions else scope
    pending: list[tuple[Any, set[str]]] = []
    names: dict[str, str] = {}
    for ref in fs.targets:
        target = targets.get(ref.loadable) or load_target(ref.loadable)
        targets[ref.loadable] = target
        if names.setdefault(target.name, ref.loadable) != ref.loadable:
            raise DatasetError(f"{spec.path}: fidelities.{fs.name}.targets: two targets are named "
                               f"{target.name} ({names[target.name]} and {ref.loadable})")
        of_target = target_fingerprint(target, fs.name)
        version = fs.label_version()
        first_forms = [f + of_target for f in fs.older_fingerprints()]      # of version 1 labels
        if not cache.check_config(fs.name, target.name, fs.fingerprint() + of_target,
                                  older=first_forms if version == 1 else (),
                                  record={"options": fs.counted_options(), "labels": version}):
            recorded = cache.label_record(fs.name, target.name)
            if recorded is None and cache.stored_fingerprint(fs.name, target.name) in first_forms:
                recorded = {"options": fs.counted_options(), "labels": 1}
            raise DatasetError(f"{cache.dir}: its {fs.name} labels on {target.name} were made with "
                               f"{_what_changed(fs, recorded)}; build into a new folder")
        done = cache.labelled(fs.name, target.name)
        todo = {h for h in scope if h not in done}
        if todo:
            pending.append((target, todo))
    return pending


def _hashes_of_families(spec: DatasetSpec, cache: BuildCache, families: list[str]) -> set[str]:
    """The regions that occur in at least one of the spec's programs of ``families``."""
    sources = {p.source for p in spec.programs if p.family in families}
    return {h for s, sp, h, _, _ in cache.occurrences() if sp == spec.split and s in sources}


def _what_changed(fs: FidelitySpec, recorded: dict[str, Any] | None) -> str:
    """What the labels of a folder were made with (``recorded``: options and label version) that ``fs``
    asks otherwise, in words."""
    if recorded is None:
        return "other options or another definition of the target"
    cls = labeller_class(fs.name)
    old, version = recorded.get("labels", 1), fs.label_version()
    if old != version:
        return (f"an older {fs.name} labeller (labels version {old}; since version {version} "
                f"{getattr(cls, 'LABEL_CHANGE', 'its labels measure something else')})")
    made, wanted = recorded.get("options", {}), fs.counted_options()
    if made == wanted:
        return "another definition of the target (its figures changed)"
    defaults = option_defaults(cls)

    def shown(options: dict[str, Any], key: str) -> str:
        if key in options:
            return json.dumps(options[key])
        return f"the default {json.dumps(defaults[key])}" if key in defaults else "the default"

    keys = sorted(set(made) | set(wanted), key=lambda k: (k not in made, k))
    return ", ".join(f"{k} {shown(made, k)} (this spec: {shown(wanted, k)})"
                     for k in keys if made.get(k, ...) != wanted.get(k, ...))


def _label_all(fidelity, fs: FidelitySpec, cache: BuildCache, pending, chunk_hashes: list[str], regions: dict,
               bar, on_chunk) -> None:
    """Label one chunk of regions on every target that still needs them, committing per target."""
    for target, todo in pending:
        mine = [h for h in chunk_hashes if h in todo]
        if not mine:
            continue
        found = [h for h in mine if h in regions]
        rows = label_chunk(fidelity, fs.name, target, found, [regions[h] for h in found]) if found else []
        missing = [h for h in mine if h not in regions]
        if missing:
            rows += failed_rows(fs.name, target, missing, regions.get("__reason__") or
                                "the region was not found again in its program")
        cache.add_labels(rows)
        bar.update(len(rows))
        if on_chunk is not None:
            on_chunk(fs.name, len(rows))


def build_labels(spec: DatasetSpec, cache: BuildCache, hashes: list[str], workers: int, progress: bool = True,
                 on_chunk: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """Phase 2: label every (region in ``hashes``, target, fidelity) of the spec that the cache lacks."""
    targets: dict[str, Any] = {}
    stats: dict[str, Any] = {}
    sources: dict[str, list[str]] | None = None
    order = {p.source: i for i, p in enumerate(spec.programs)}
    for fs in spec.fidelities:
        pending = _pending(spec, fs, cache, hashes, targets)
        total = sum(len(t) for _, t in pending)
        union = sorted(set().union(*(t for _, t in pending))) if pending else []
        t0 = time.perf_counter()
        if not pending:
            stats[fs.name] = {"labels_new": 0, "seconds": 0.0}
            continue
        fidelity = make_fidelity(fs, workers)
        stats[fs.name] = {}
        bar = None
        try:
            if fs.name == "profiling" and total >= STEADINESS_MIN_LABELS:
                stats[fs.name]["steadiness"] = _steadiness_first(fidelity, total, cache.dir)
            bar = progress_bar(total, f"label {fs.name}", "label", progress)
            if fs.name in STANDALONE:
                for start in range(0, len(union), fs.chunk):
                    chunk = union[start:start + fs.chunk]
                    regions = {h: region_from_record(cache.region_record(h)) for h in chunk}
                    _label_all(fidelity, fs, cache, pending, chunk, regions, bar, on_chunk)
            else:
                if sources is None:
                    ok = {s for (s, sp), st in cache.program_status().items() if st == "ok" and sp == spec.split}
                    sources = {}
                    for s, sp, digest, _, _ in cache.occurrences():
                        if sp == spec.split and s in ok and s in order:
                            sources.setdefault(digest, []).append(s)
                for source, wanted in cover_programs(set(union), sources, order):
                    regions: dict[str, Any] = {}
                    try:
                        if source:
                            regions = program_regions(source, spec.split, set(wanted))
                    except Exception as exc:  # noqa: BLE001 - the labels fail with the reason
                        regions = {"__reason__": f"its program {source} could not be read again: {reason_of(exc)}"}
                    for start in range(0, len(wanted), fs.chunk):
                        _label_all(fidelity, fs, cache, pending, wanted[start:start + fs.chunk], regions, bar,
                                   on_chunk)
        finally:
            if bar is not None:
                bar.close()
            close = getattr(fidelity, "close", None)
            if callable(close):
                close()
        stats[fs.name].update(labels_new=total, seconds=time.perf_counter() - t0)
    return stats


def _steadiness_first(fidelity, pending: int, folder) -> dict[str, Any] | None:
    """Before a long profiling stage: how well this machine's timings repeat (see
    :mod:`~hespas_ml.label.steadiness`), printed, warned about when unsteady, appended to the build
    folder's ``steadiness.jsonl`` (one JSON line per check, so every stage's conditions stay on record) and
    returned for the manifest."""
    from ..label.steadiness import append_log, check_steadiness

    try:
        report = check_steadiness(STEADINESS_S, fidelity)
    except FidelityError as exc:
        print(f"timing steadiness: not checked ({exc})", file=sys.stderr, flush=True)
        return None
    statistic = getattr(fidelity, "statistic", "median")
    print(f"{report.summary(statistic)} ({pending} profiling labels to take, statistic {statistic})", file=sys.stderr,
          flush=True)
    append_log(folder, {"checked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "pending": pending,
                        **report.to_dict()})
    if not report.steady:
        warnings.warn(f"profiling labels will be taken on an unsteady machine: {100 * report.p90_dev:.0f} % p90 "
                      "between timings of the same kernel (hespas-ml host-cpu --steadiness checks it again)",
                      RuntimeWarning, stacklevel=3)
    return report.to_dict()
