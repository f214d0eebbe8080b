"""Fidelity cross-validation studies: workloads × targets (× systems) through several sources of step times.

:func:`run_study` reads a study spec (:mod:`.study_spec`), times every configuration — workload, system,
target, source — and writes, into the output folder:

* ``report.html``: one self-contained page (plots as base64 PNG, no external assets; :mod:`.study_report`);
* the tables as CSV beside it (columns in :data:`~.study_metrics.COLUMNS` and ``eval/studies/README.md``):
  ``configs.csv``, ``step_times.csv``, ``regions.csv``, ``errors.csv``, ``error_summary.csv``,
  ``speedups.csv``, ``speedup_summary.csv``, ``rank_agreement.csv``, ``rank_summary.csv``,
  ``family_disagreement.csv``, ``top_regions.csv``; and ``summary.json``;
* ``cache/``: one JSON per finished configuration and per (workload, system, split) region list, so a
  study that is killed keeps what it finished and a second run only re-renders.

A configuration is timed by the stages of :mod:`hespas_ml.pipeline`, as ``simulate`` times a program:
each workload is ingested and split once per system, then labelled and replayed per target and source.
A configuration whose source could not time every region is ``partial`` and left out of the step-time
metrics (its regions still enter the region comparisons). The study is logged to MLflow as one run.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from .. import pipeline
from ..ingest.errors import HespasError
from ..fidelities import changed_label_versions, get_fidelity, surrogate_model
from ..replay.system import load_system
from ..split.signature import signatures
from . import study_metrics as M
from .study_spec import MEASURED, SINGLE, SourceSpec, StudySpec, load_spec, read_measured

CACHE_VERSION = 1
CSV_TABLES = ("configs", "step_times", "regions", "errors", "error_summary", "speedups", "speedup_summary",
              "rank_agreement", "rank_summary", "family_disagreement", "top_regions")
CONFIG_COLUMNS = ["workload", "program", "system", "n_devices", "target", "source", "fidelity", "split", "status",
                  "step_time_s", "compute_s", "exposed_comm_s", "regions", "unique_regions", "failed_regions",
                  "label_s", "label_noise", "replay", "cached", "reason"]


class StudyError(HespasError):
    pass


@dataclass
class ConfigResult:
    """One workload on one system and target, timed by one source."""

    workload: str
    system: str
    target: str
    source: str
    status: str                       # ok | partial | failed | unavailable
    step_time_s: float = math.nan
    compute_s: float = math.nan
    exposed_comm_s: float = math.nan
    n_devices: int = 0
    regions: int = 0
    unique_regions: int = 0
    failed_regions: int = 0
    label_s: float = 0.0
    label_noise: float = math.nan     # time-weighted mean IQR/median of the labels (0 for deterministic ones)
    replay: str = ""
    reason: str = ""                  # why it failed, or what to know about an ok result (a source's caveat)
    cached: bool = False
    region_seconds: dict[str, float | None] = field(default_factory=dict)


@dataclass
class _Prepared:
    """A workload ingested and split for one system: its compute regions and their signatures."""

    rg: Any
    compute: list
    signatures: list[str]
    infos: list[dict[str, Any]]
    n_devices: int


@dataclass
class StudyResult:
    spec: StudySpec
    out_dir: Path
    report: Path
    tables: dict[str, pd.DataFrame]
    summary: dict[str, Any]
    run_id: str | None = None


# ------------------------------------------------------------------------------------------ helpers

def _sha(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:60]


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _reason(exc: BaseException) -> str:
    text = str(exc) if isinstance(exc, HespasError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:500]


def _noise(fidelity: str, prep: _Prepared, times: pipeline.RegionTimes) -> float:
    """Time-weighted mean relative spread (IQR / median) of a configuration's labels; NaN when unknown."""
    from .dataset_labels import label_noise

    count: dict[str, int] = {}
    for r, s in zip(prep.compute, prep.signatures):
        count[s] = count.get(s, 0) + r.count
    num = den = 0.0
    for sig, lab in times.distinct.items():
        noise = label_noise(fidelity, lab.meta) if lab.status == "ok" else None
        if noise is None or not math.isfinite(lab.seconds):
            continue
        w = count[sig] * lab.seconds
        num += w * noise
        den += w
    return num / den if den > 0 else math.nan


# ------------------------------------------------------------------------------------------ runner

class _Runner:
    """Times every configuration of a spec, reading and writing the per-configuration cache."""

    def __init__(self, spec: StudySpec, out: Path, progress: bool):
        from ..host import package_version
        from ..label.targets import load_target

        self.spec, self.out, self.progress = spec, out, progress
        self.cache = out / "cache"
        (self.cache / "configs").mkdir(parents=True, exist_ok=True)
        (self.cache / "regions").mkdir(parents=True, exist_ok=True)
        self.targets = {t.name: load_target(t.load) for t in spec.targets}
        self.systems: dict[tuple[str, str | None], Any] = {}
        self.jax = package_version("jax")
        self.fidelities: dict[str, Any] = {}
        self.unavailable: dict[str, str] = {}

    # -- keys -----------------------------------------------------------------------------------------
    def _program_id(self, program: str) -> list[str]:
        if program.startswith("zoo:"):
            return [program, self.jax]
        return [program, hashlib.sha256(Path(program).read_bytes()).hexdigest()]

    def _target_id(self, name: str, fidelity: str) -> list[Any]:
        from ..host import cpu_model
        from ..label.targets import HOST_CPU

        t = self.targets[name]
        ident: list[Any] = [t.name, t.to_vector(), asdict(t.systolic) if t.systolic else None]
        if name == HOST_CPU or fidelity == "profiling":
            ident.append(cpu_model())
        return ident

    # -- fidelities -----------------------------------------------------------------------------------
    def build_fidelities(self) -> None:
        """Build each source's fidelity now: a bad option is a spec error; an optional fidelity that
        cannot be built is noted as unavailable."""
        from .dataset_labels import make_fidelity
        from ..label.dataset_spec import FidelitySpec
        from .study_spec import StudySpecError

        workers = max(1, (os.cpu_count() or 2) // 2)
        built: dict[tuple[str, str], Any] = {}
        for src in self.spec.sources:
            key = (src.fidelity, json.dumps(src.options, sort_keys=True))
            if key in built:
                self.fidelities[src.name] = built[key]
                continue
            try:
                if surrogate_model(src.fidelity) is not None:
                    fid = get_fidelity(src.fidelity, **src.options)
                else:
                    fid = make_fidelity(FidelitySpec(src.fidelity, [], dict(src.options)), workers)
            except (HespasError, ImportError, TypeError, ValueError) as exc:
                if not src.optional:
                    raise StudySpecError(str(self.spec.path), src.origin, _reason(exc)) from None
                self.unavailable[src.name] = _reason(exc)
                continue
            built[key] = self.fidelities[src.name] = fid

    def close(self) -> None:
        for fid in {id(f): f for f in self.fidelities.values()}.values():
            close = getattr(fid, "close", None)
            if callable(close):
                close()

    def _system(self, name: str, target: str | None = None):
        """The system called ``name`` (None for one device), with ``target``'s local memory bandwidth;
        loaded once."""
        if name == SINGLE:
            return None
        key = (name, target)
        if key not in self.systems:
            bw = self.targets[target].mem_bw / 1e9 if target else None
            self.systems[key] = load_system(name, local_mem_bw_gbps=bw)
        return self.systems[key]

    # -- preparation ----------------------------------------------------------------------------------
    def _prepare(self, program: str, system: str, split: str) -> _Prepared:
        from .study_regions import region_infos

        graph = pipeline.ingest(program, self._system(system) or 1)
        rg = pipeline.split(graph, split)
        compute = rg.compute_regions()
        sigs = signatures(compute)
        return _Prepared(rg, compute, sigs, region_infos(rg, compute, sigs), graph.n_devices)

    # -- one configuration ----------------------------------------------------------------------------
    def _time(self, prep: _Prepared, w, system: str, target: str, src: SourceSpec) -> ConfigResult:
        res = ConfigResult(w.name, system, target, src.name, "failed", n_devices=prep.n_devices,
                           regions=len(prep.compute), unique_regions=len(set(prep.signatures)))
        fid = self.fidelities[src.name]
        tgt = self.targets[target]
        t0 = time.perf_counter()
        try:
            times = pipeline.label(prep.rg, fid, tgt, region_signatures=prep.signatures)
        except HespasError as exc:
            res.status, res.reason = "unavailable", _reason(exc)
            return res
        except Exception as exc:  # noqa: BLE001 - one broken configuration must not end the study
            res.reason = _reason(exc)
            return res
        res.label_s = time.perf_counter() - t0
        res.reason = "; ".join(times.caveats)
        res.region_seconds = {s: float(lab.seconds) if times.ok(s) else None for s, lab in times.distinct.items()}
        res.label_noise = _noise(src.fidelity, prep, times)
        res.failed_regions = sum(v is None for v in res.region_seconds.values())
        try:
            step = pipeline.replay(pipeline.trace(prep.rg, times, interval=False), self._system(system, target),
                                   self.spec.replay)
        except Exception as exc:  # noqa: BLE001
            res.reason = _reason(exc)
            return res
        res.step_time_s, res.exposed_comm_s = step.step_time_s, step.exposed_comm_s
        res.compute_s, res.replay = step.compute_time_s, step.backend
        res.status = "ok" if res.failed_regions == 0 else "partial"
        if res.failed_regions:
            failed = f"{res.failed_regions} of {len(res.region_seconds)} distinct regions could not be timed"
            res.reason = f"{failed}; {res.reason}" if res.reason else failed
        return res

    # -- the whole plan -------------------------------------------------------------------------------
    def plan_size(self) -> int:
        return sum(len(w.systems) * len(s.targets) for w in self.spec.workloads for s in self.spec.sources)

    def run(self) -> tuple[list[ConfigResult], list[dict[str, Any]]]:
        from ..units import progress_bar

        spec = self.spec
        results: list[ConfigResult] = []
        infos: list[dict[str, Any]] = []
        splits = list(dict.fromkeys(s.split for s in spec.sources))
        bar = progress_bar(self.plan_size(), f"study {spec.name}", "config", self.progress)
        try:
            for w in spec.workloads:
                pid = self._program_id(w.program)
                for system in w.systems:
                    for split in splits:
                        self._group(w, pid, system, split, results, infos, bar)
        finally:
            bar.close()
        return results, infos

    def _group(self, w, pid, system: str, split: str, results: list, infos: list, bar) -> None:
        spec = self.spec
        prep: _Prepared | None = None
        failure = ""
        key = _sha([CACHE_VERSION, pid, system, split])
        info_path = self.cache / "regions" / f"{_slug(w.name)}__{_slug(system)}__{split}__{key}.json"
        group_infos = _read_json(info_path)

        def prepared() -> _Prepared | None:
            nonlocal prep, failure
            if prep is None and not failure:
                try:
                    prep = self._prepare(w.program, system, split)
                    _write_json(info_path, prep.infos)
                except Exception as exc:  # noqa: BLE001 - a workload that cannot be read fails its configurations
                    failure = _reason(exc)
            return prep

        if group_infos is None and prepared() is not None:
            group_infos = prep.infos
        for info in group_infos or []:
            infos.append({"workload": w.name, "system": system, "split": split, **info})
        for target in (t.name for t in spec.targets):
            for src in (s for s in spec.sources if s.split == split and target in s.targets):
                bar.set_postfix_str(f"{w.name} {target} {src.name}", refresh=False)
                results.append(self._config(w, pid, system, target, src, prepared, lambda: failure))
                bar.update(1)

    def _config(self, w, pid, system, target, src, prepared, failure) -> ConfigResult:
        if src.name in self.unavailable:
            return ConfigResult(w.name, system, target, src.name, "unavailable", reason=self.unavailable[src.name])
        changed = changed_label_versions([src.fidelity])        # so results of older labels are not reused
        key = _sha([CACHE_VERSION, pid, system, src.split, self._target_id(target, src.fidelity), src.fidelity,
                    src.options, self.spec.replay if system != SINGLE else None] + ([changed] if changed else []))
        path = self.cache / "configs" / f"{_slug(w.name)}__{_slug(target)}__{_slug(src.name)}__{key}.json"
        data = _read_json(path)
        if isinstance(data, dict) and data.get("status") in ("ok", "partial"):
            res = ConfigResult(**data)
            res.cached = True
            return res
        prep = prepared()
        if prep is None:
            return ConfigResult(w.name, system, target, src.name, "failed", reason=failure())
        res = self._time(prep, w, system, target, src)
        if res.status in ("ok", "partial"):
            _write_json(path, asdict(res))
        return res


# ------------------------------------------------------------------------------------------ tables

def build_tables(spec: StudySpec, results: list[ConfigResult], infos: list[dict[str, Any]],
                 measured: list) -> dict[str, pd.DataFrame]:
    """Every table of the study from the configurations' results, the region infos and measurements."""
    programs = {w.name: w.program for w in spec.workloads}
    fid_of = {s.name: (s.fidelity, s.split) for s in spec.sources}
    configs = pd.DataFrame([{
        "workload": r.workload, "program": programs[r.workload], "system": r.system, "n_devices": r.n_devices,
        "target": r.target, "source": r.source, "fidelity": fid_of[r.source][0], "split": fid_of[r.source][1],
        "status": r.status, "step_time_s": r.step_time_s, "compute_s": r.compute_s,
        "exposed_comm_s": r.exposed_comm_s, "regions": r.regions, "unique_regions": r.unique_regions,
        "failed_regions": r.failed_regions, "label_s": r.label_s, "label_noise": r.label_noise,
        "replay": r.replay, "cached": r.cached,
        "reason": r.reason} for r in results], columns=CONFIG_COLUMNS)
    order = [MEASURED] + spec.source_names()
    steps = pd.DataFrame(
        [{"workload": r.workload, "system": r.system, "target": r.target, "source": r.source,
          "step_time_s": r.step_time_s} for r in results if r.status == "ok"]
        + [{"workload": m.workload, "system": m.system, "target": m.target, "source": MEASURED,
            "step_time_s": m.runtime_s} for m in measured],
        columns=M.KEYS + ["source", "step_time_s"])
    step_times = _wide(steps, spec, order)
    region_rows = [{"workload": r.workload, "system": r.system, "target": r.target, "source": r.source,
                    "split": fid_of[r.source][1], "signature": sig, "seconds": math.nan if s is None else s}
                   for r in results if r.status in ("ok", "partial") for sig, s in r.region_seconds.items()]
    regions = pd.DataFrame(region_rows, columns=["workload", "system", "target", "source", "split", "signature",
                                                 "seconds"])
    info_df = pd.DataFrame(infos, columns=["workload", "system", "split", "signature", "count", "occurrences",
                                           "family", "op_kinds", "shape", "flops", "bytes"])
    from ..split.families import FAMILIES

    errors = M.reference_errors(steps, spec.reference, order)
    speedups = M.speedups(steps, spec.reference, spec.transitions, order)
    ranks = M.rank_agreement(steps, order)
    pairs = M.region_pairs(regions, info_df, order)
    return {
        "configs": configs, "step_times": step_times, "regions": _regions_wide(regions, info_df),
        "errors": errors, "error_summary": M.error_summary(errors),
        "speedups": speedups, "speedup_summary": M.speedup_summary(speedups),
        "rank_agreement": ranks, "rank_summary": M.rank_summary(ranks),
        "family_disagreement": M.family_disagreement(pairs, FAMILIES),
        "top_regions": M.top_regions(pairs, spec.top_regions),
    }


def _wide(steps: pd.DataFrame, spec: StudySpec, order: list[str]) -> pd.DataFrame:
    """Step times, one row per workload × system × target, one column per source."""
    rows = []
    look = {(r.workload, r.system, r.target, r.source): r.step_time_s for r in steps.itertuples(index=False)}
    present = [s for s in order if any(k[3] == s for k in look)]
    for w in spec.workloads:
        for system in w.systems:
            for t in spec.targets:
                row = {"workload": w.name, "system": system, "target": t.name}
                row.update({s: look.get((w.name, system, t.name, s), math.nan) for s in present})
                if any(not math.isnan(row[s]) for s in present):
                    rows.append(row)
    return pd.DataFrame(rows, columns=M.KEYS + present)


def _regions_wide(regions: pd.DataFrame, infos: pd.DataFrame) -> pd.DataFrame:
    cols = ["workload", "system", "split", "target", "signature", "family", "op_kinds", "shape", "count"]
    if regions.empty:
        return pd.DataFrame(columns=cols)
    wide = regions.set_index(["workload", "system", "split", "target", "signature", "source"])["seconds"]
    wide = wide[~wide.index.duplicated()].unstack("source").reset_index()
    wide.columns.name = None
    merged = wide.merge(infos[["workload", "system", "split", "signature", "family", "op_kinds", "shape", "count"]],
                        on=["workload", "system", "split", "signature"], how="left")
    sources = [c for c in wide.columns if c not in cols]
    return merged[cols + sources]


def summary_metrics(tables: dict[str, pd.DataFrame]) -> dict[str, float]:
    """Flat ``name -> value`` summary (what MLflow gets as metrics)."""
    out: dict[str, float] = {}
    c = tables["configs"]
    out["configs"] = float(len(c))
    for status in ("ok", "partial", "failed", "unavailable"):
        out[f"configs_{status}"] = float((c["status"] == status).sum())
    out["configs_cached"] = float(c["cached"].sum())
    for r in tables["error_summary"].itertuples(index=False):
        out[f"mape.{r.source}.vs.{r.reference}"] = r.mean_abs_pct_error
        out[f"median_ape.{r.source}.vs.{r.reference}"] = r.median_abs_pct_error
    for r in tables["speedup_summary"].itertuples(index=False):
        out[f"speedup_error.{r.source}.vs.{r.reference}"] = r.mean_speedup_error
    for r in tables["rank_summary"].itertuples(index=False):
        out[f"kendall_tau.{r.group_by}.{r.source_a}.{r.source_b}"] = r.mean_kendall_tau
        out[f"same_best.{r.group_by}.{r.source_a}.{r.source_b}"] = r.same_best_rate
    for r in tables["family_disagreement"].itertuples(index=False):
        out[f"disagreement_pct.{r.source_a}.{r.source_b}.{r.family}"] = r.disagreement_pct
    return {k: float(v) for k, v in out.items() if v is not None and math.isfinite(float(v))}


# ------------------------------------------------------------------------------------------ MLflow

def _metric_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_-./" else "_" for c in name)


def log_study(spec: StudySpec, out: Path, metrics: dict[str, float], files: list[Path], *,
              tracking_uri: str | os.PathLike[str] | None = None, experiment: str = "studies") -> str:
    """One MLflow run: the spec's parameters, the summary metrics, the report, CSVs and spec as artifacts."""
    from ..learn.tracking import setup_mlflow
    from ..host import cpu_model, package_version

    mlflow = setup_mlflow(tracking_uri, experiment=experiment)
    params = {
        "study": spec.name, "spec": str(spec.path), "split": spec.split,
        "workloads": ", ".join(w.name for w in spec.workloads), "targets": ", ".join(t.name for t in spec.targets),
        "sources": ", ".join(spec.source_names()), "reference": ", ".join(spec.reference),
        "transitions": ", ".join(f"{a}->{b}" for a, b in spec.transitions),
        "measured": str(spec.measured or ""), "replay": spec.replay, "top_regions": spec.top_regions,
        "host_cpu": cpu_model(), "jax_version": package_version("jax"), "out_dir": str(out.resolve()),
    }
    with mlflow.start_run(run_name=f"study-{spec.name}") as run:
        mlflow.set_tag("hespas.kind", "study")
        mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
        mlflow.log_metrics({_metric_name(k): v for k, v in metrics.items()})
        for f in files:
            mlflow.log_artifact(str(f))
        mlflow.log_artifact(str(spec.path), artifact_path="inputs")
        if spec.measured:
            mlflow.log_artifact(str(spec.measured), artifact_path="inputs")
        return run.info.run_id


# ------------------------------------------------------------------------------------------ entry point

def measured_elsewhere(measured: list) -> list[str]:
    """The machines other than this one on which ``measured``'s host-cpu step times were taken (host-cpu is
    whatever machine runs the study: its predictions are this machine's)."""
    from ..host import machine_name

    here = machine_name()
    return sorted({m.extra.get("machine", "") for m in measured if m.target == "host-cpu"} - {"", here})


def run_study(spec_path: str | os.PathLike[str], out: str | os.PathLike[str], *, progress: bool = True,
              mlflow: bool = True, tracking_uri: str | os.PathLike[str] | None = None,
              experiment: str = "studies", other_machine: bool = False) -> StudyResult:
    """Run (or resume) the study of ``spec_path`` into ``out``; see the module docstring. Host-cpu step times
    measured on another machine are refused (StudyError) unless ``other_machine``; then the report says so."""
    from ..host import machine_name
    from .study_report import write_report

    t0 = time.perf_counter()
    spec = load_spec(spec_path)
    measured = read_measured(spec.measured, spec) if spec.measured else []
    elsewhere = measured_elsewhere(measured)
    if elsewhere and not other_machine:
        raise StudyError(f"{spec.measured}: its host-cpu step times were measured on {', '.join(elsewhere)}, this "
                         f"machine is {machine_name()}: host-cpu predictions are this machine's; measure here "
                         "(hespas-ml study SPEC --measure-host-cpu CSV) or compare anyway with --other-machine")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    runner = _Runner(spec, out_dir, progress)
    runner.build_fidelities()
    try:
        results, infos = runner.run()
    finally:
        runner.close()
    tables = build_tables(spec, results, infos, measured)
    files = []
    for name in CSV_TABLES:
        path = out_dir / f"{name}.csv"
        tables[name].to_csv(path, index=False)
        files.append(path)
    metrics = summary_metrics(tables)
    metrics["wall_s"] = time.perf_counter() - t0
    summary = {"study": spec.name, "spec": str(spec.path), "metrics": metrics,
               "unavailable": runner.unavailable, "measurements": [asdict(m) for m in measured],
               "measured_elsewhere": elsewhere, "machine": machine_name()}
    report = write_report(out_dir / "report.html", spec, tables, summary)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    files += [out_dir / "summary.json", report]
    run_id = log_study(spec, out_dir, metrics, files, tracking_uri=tracking_uri, experiment=experiment) \
        if mlflow else None
    return StudyResult(spec, out_dir, report, tables, summary, run_id)
