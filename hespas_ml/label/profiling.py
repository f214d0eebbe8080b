"""The profiling fidelity: each compute region compiled by XLA and timed on this machine's own hardware.

A region's ops are cut out of its program as a standalone module (:mod:`hespas_ml.ingest.extract`),
compiled through the PJRT client of jax's backend (CPU here; the GPU where one exists) and executed on
random inputs of the right shapes and element types. The label is the median time of one execution
(``statistic="min"``: the fastest sample, see **Steadiness**); ``meta`` keeps the spread and how it was
measured:

* ``median_s``, ``iqr_s``, ``rel_iqr`` (IQR / median: the noise figure), ``q1_s``, ``q3_s``, ``min_s``,
  ``mean_s``; ``repeats`` (samples), ``calls_per_sample``, ``stop`` (why sampling stopped: ``stable``,
  ``iqr_stable``, ``measure_s``, ``max_repeats``), ``warmup_s``, ``measure_s`` (seconds spent sampling),
  ``load_avg`` (the machine's 1-minute load average when it ended);
* ``compile_s``; XLA's cost analysis ``xla_flops`` / ``xla_bytes``;
* ``backend``, ``device``, ``jax_version``; ``overhead_s``: one execution of a trivial module (the
  dispatch cost included in every label; about 40 µs on this project's 2-core CPU box);
* ``lock_wait_s``, ``cached`` (served from the disk cache), ``module_sha256``, ``label_version``.

A failed label (``status="failed"``, ``seconds`` NaN) has ``reason`` and ``kind``: ``collective``,
``extract``, ``compile`` (e.g. ``custom_call @TopK`` on bf16 on XLA:CPU), ``inputs``, ``run``, ``timeout``
(the region overran ``budget_s``: its worker was killed and a new one started), ``crash``, ``lock``,
``worker``.

**Isolation.** All compiling and timing happens in one worker process
(:mod:`hespas_ml.label.profiling_worker`) that is reused from region to region: x64 and XLA flags never
reach the caller, and a crash or hang of XLA costs one failed label. Regions are timed one at a time,
and every timing holds a file lock (``timing.lock`` under the cache folder) so that two processes on the
machine never time at once.

**Cores.** ``cores=N`` pins the CPU worker to N cores before jax starts (XLA:CPU then runs N threads);
``cores=None`` leaves it every core. The default is one pinned core with 10 ms samples: on a machine of
few cores XLA's hand-offs between threads spread the samples several times wider than one pinned core
does, and labels a model learns from must repeat (``datasets/README.md`` has the figures). The core count
is part of the label's ``device`` (and so of the cache key). Whole-program measurements for studies
(:mod:`hespas_ml.use.study_measure`) keep every core: they are the machine as it runs.

**Memory.** The worker keeps the memory its executions free (``WORKER_MALLOC_ENV``: glibc's allocator
with one arena and no mmap or trim). Otherwise glibc returns a freed buffer over its mmap threshold (up to
32 MiB, following what was freed before) to the kernel, and every execution of a region with such a buffer
page-faults it in anew: a cliff at the threshold that none of the op features explains, and a cost a region
does not pay inside its whole program. Labels of version 1 (``LABEL_VERSION``) include that cost; results and
dataset folders of the two versions never mix. ``eval/eval_profiling_buffers.py`` measures the cliff; the
profiling model card what version 2 changed.

**Steadiness.** Labels repeat only as well as the machine's timings do: a shared VM whose speed wanders with
its neighbours gives labels no surrogate can learn to better than that wandering.
:mod:`hespas_ml.label.steadiness` times reference kernels through :meth:`ProfilingFidelity.time_module`
(exactly as regions are timed) to say so in seconds; a long profiling stage of a dataset build runs it first.
On such a machine ``statistic="min"`` (the fastest sample, the whole ``measure_s`` sampled, no early stop)
repeats far better than the median (``datasets/README.md``, "Before a long profiling build"). The minimum is
the region's time in the machine's fastest state, a few percent below the median; labels of one dataset
folder all use one statistic (it is an option, so part of the folder's fingerprint).

**Targets.** Profiling measures the hardware it runs on: ``host-cpu`` is timed on jax's CPU backend; a
GPU preset (``H100`` …) only when jax's default backend is a GPU of that kind. Any other target raises
:class:`FidelityError`.

**Cache.** Results (and compile failures) are stored under ``$HESPAS_ML_CACHE/profiling`` (default
``~/.cache/hespas-ml/profiling``), one JSON file per key: the extracted module's SHA-256, backend,
device and jax version, plus the sampling options (``measure_s``, ``sample_s``, the repeat limits,
``target_noise``, ``seed``) that differ from their defaults and the whole window ``statistic="min"`` needs, so
a result measured one way never answers a request to measure another. Identical regions (e.g. repeated
layers) are timed once.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import math
import os
import re
import selectors
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .fidelity import FidelityError, Label, options_off_default
from ..host import cache_dir, cpu_model, gpu_facts, machine_identity, package_version, schedulable_cores
from .profiling_worker import CORES_ENV, may_index
from .targets import HOST_CPU, Target

MODULE_NAME = "region"            # every extracted module gets this name, so identical regions share a key
START_TIMEOUT_S = 180.0           # importing jax and starting the backend in the worker
GPU_BACKENDS = ("gpu", "cuda", "rocm")
# what the worker reports of itself that a label keeps as its provenance
PROVENANCE_KEYS = ("jaxlib_version", "platform_version", "timing", "compute_capability", "core_count",
                   "memory_bytes", "cores")
CACHED_FAILURES = ("compile", "inputs")   # failures that another attempt would repeat
STATISTICS = ("median", "min")            # which sample statistic is the label
SAMPLING_OPTIONS = ("measure_s", "sample_s", "min_repeats", "max_repeats", "target_noise", "seed", "xla_flags",
                    "loop")
# the worker's glibc keeps freed memory: one arena, no mmap, no trim (see **Memory** above; ignored elsewhere)
WORKER_MALLOC_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(4 << 30),
                     "MALLOC_TRIM_THRESHOLD_": str(8 << 30)}


@dataclass
class _Item:
    """One region on its way to a label."""

    region: Any
    text: str | None = None
    label: Label | None = None


class ProfilingFidelity:
    """Region times measured by compiling and running each region with XLA (see the module docstring).

    ``measure_s``: seconds of warm-up and sampling per region after which no more samples are taken
    (one at least). ``budget_s``: the most one region may take, compile and timing included; past it
    (XLA stuck, or executions far longer than ``measure_s``) its worker is killed and the label fails.
    ``min_repeats`` / ``max_repeats``: samples taken at least (``measure_s`` permitting) / at most.
    ``target_noise``: sampling stops early once IQR / median is below it and the median has settled.
    ``sample_s``: the shortest sample (short regions are executed several times per sample).
    ``cores``: pin the CPU worker to that many cores (default 1; None: every core; see **Cores** above).
    ``compile_threads``: modules compiled at once, ahead of their timings (None: up to 8 on a GPU, where
    XLA's compile and autotuning take longer than a timing; 1 on the CPU, one module at a time).
    ``statistic``: ``median`` (default) or ``min`` of the samples (then sampling never stops early).
    ``xla_flags``: the worker's ``XLA_FLAGS`` (default none, XLA's own settings; e.g.
    ``--xla_gpu_autotune_level=0`` compiles without autotuning), recorded with every label it takes.
    ``loop``: 0 (default) times one execution of the region per call; K > 0 compiles it to run K + 1 times
    per execution (a ``while`` loop, :func:`~.profiling_worker.looped`) and divides, so the launch of the
    executable is paid once for all of them (a GPU's launch is as long as many regions); whole programs
    (:meth:`time_module`) are timed one execution at a time either way.
    ``cache``: True for the default folder, a path, or False; ``cache_max_noise``: labels whose IQR /
    median exceeds it (timed while the machine was busy) are not cached, so they are timed again next
    time. ``lock_timeout_s``: how long to wait for
    another process's timing. ``stats`` counts regions ``timed``, ``cached`` and ``failed``, and
    ``worker_starts``.
    """

    name = "profiling"
    # options that change how labels are taken, not what they are: a dataset folder resumes across them
    RUN_OPTIONS = ("budget_s", "lock_timeout_s", "cache", "cache_max_noise", "compile_threads")
    # what a label measures, in the result cache's key and a dataset folder's fingerprint (labels of two
    # versions never mix): 2 keeps freed memory in the worker (WORKER_MALLOC_ENV), 1 did not
    LABEL_VERSION = 2
    LABEL_CHANGE = "regions are timed without page faults on buffers over 32 MiB"

    def __init__(self, budget_s: float = 60.0, measure_s: float = 1.0, min_repeats: int = 5,
                 max_repeats: int = 200, target_noise: float = 0.02, sample_s: float = 0.01,
                 cache: bool | str | os.PathLike[str] = True, lock_timeout_s: float = 600.0, seed: int = 0,
                 cache_max_noise: float = 0.10, cores: int | None = 1, statistic: str = "median",
                 compile_threads: int | None = None, xla_flags: str | None = None, loop: int = 0):
        for key, value in (("budget_s", budget_s), ("measure_s", measure_s), ("target_noise", target_noise),
                           ("sample_s", sample_s), ("lock_timeout_s", lock_timeout_s),
                           ("cache_max_noise", cache_max_noise)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise FidelityError(f"profiling: {key} must be a positive number, got {value!r}")
        if not (isinstance(min_repeats, int) and isinstance(max_repeats, int) and 1 <= min_repeats <= max_repeats):
            raise FidelityError(f"profiling: need 1 <= min_repeats <= max_repeats, got {min_repeats}, {max_repeats}")
        if cores is not None and (not isinstance(cores, int) or isinstance(cores, bool) or cores < 1):
            raise FidelityError(f"profiling: cores must be a whole number >= 1 (or null: every core), got {cores!r}")
        if compile_threads is not None and (not isinstance(compile_threads, int) or isinstance(compile_threads, bool)
                                            or compile_threads < 1):
            raise FidelityError(f"profiling: compile_threads must be a whole number >= 1 (or null: automatic), "
                                f"got {compile_threads!r}")
        if xla_flags is not None and (not isinstance(xla_flags, str) or not all(
                f.startswith("--xla_") for f in xla_flags.split())):
            raise FidelityError(f"profiling: xla_flags must be XLA flags (--xla_...) separated by spaces, "
                                f"got {xla_flags!r}")
        if not isinstance(loop, int) or isinstance(loop, bool) or not 0 <= loop <= 100_000:
            raise FidelityError(f"profiling: loop must be a whole number from 0 to 100000, got {loop!r}")
        self.loop = loop
        if statistic not in STATISTICS:
            raise FidelityError(f"profiling: statistic must be one of {', '.join(STATISTICS)}, got {statistic!r}")
        self.statistic = statistic
        self.cores = cores
        self.compile_threads = compile_threads
        self.xla_flags = xla_flags or None
        self.budget_s = float(budget_s)
        self.measure_s = float(measure_s)
        self.min_repeats, self.max_repeats = min_repeats, max_repeats
        self.target_noise = float(target_noise)
        self.sample_s = float(sample_s)
        self.cache = cache
        self.cache_max_noise = float(cache_max_noise)
        self.lock_timeout_s = float(lock_timeout_s)
        self.seed = seed
        self.stats = {"timed": 0, "cached": 0, "failed": 0, "worker_starts": 0}
        self._workers: dict[str, _Worker] = {}      # "cpu" | "default" -> worker
        self._provenance_key: tuple[int, int] | None = None
        self._provenance: dict[str, Any] = {}
        self._lock = threading.Lock()

    # -- public interface ---------------------------------------------------------------------------

    def label(self, region, target: Target) -> Label:
        return self.label_regions([region], target)[0]

    def label_regions(self, regions: Sequence, target: Target) -> list[Label]:
        with self._lock:
            items = [_Item(r) for r in regions]
            self._extract(items)
            todo = [it for it in items if it.label is None]
            for item, label in zip(todo, self._label_texts([it.text for it in todo], target)):
                item.label = label
            self.stats["failed"] += sum(1 for it in items if it.label.status != "ok" and it.text is None)
            return [it.label for it in items]

    def label_modules(self, texts: Sequence[str], target: Target) -> list[Label]:
        """Labels of StableHLO modules given as text (each with a ``@main``), as regions are labelled:
        the cache first, identical modules timed once."""
        with self._lock:
            return self._label_texts(list(texts), target)

    def _label_texts(self, texts: list[str], target: Target) -> list[Label]:
        worker = self._worker_for(target)
        identity = self._identity(worker)
        labels: list[Label | None] = [None] * len(texts)
        digests = [hashlib.sha256(t.encode()).hexdigest() for t in texts]
        # a module that gathers or scatters is timed with its indices spread over their range: its
        # results are kept apart from those timed with the few small indices every integer once got
        identities = {d: {**identity, "index_inputs": "range"} if may_index(t) else identity
                      for d, t in zip(digests, texts)}
        pending: dict[str, list[int]] = {}
        for i, digest in enumerate(digests):
            cached = self._cache_get(digest, identities[digest])
            if cached is not None:
                labels[i] = self._to_label(cached, worker, digest, cached=True)
                self.stats["cached"] += 1
            else:
                pending.setdefault(digest, []).append(i)
        order = list(pending)
        results = self._profile_all(worker, [texts[pending[d][0]] for d in order])
        for digest, result in zip(order, results):
            result = {**result, **self._provenance_of(worker)}        # cached with the result it belongs to
            if "error" in result:
                if result.get("kind") in CACHED_FAILURES:
                    self._cache_put(digest, identities[digest], result)
            elif self._quiet_enough(result):   # a label timed under load is timed again next time
                self._cache_put(digest, identities[digest], result)
            label = self._to_label(result, worker, digest, cached=False)
            if label.status == "ok":
                self.stats["timed"] += 1
            for i in pending[digest]:
                labels[i] = Label(label.seconds, label.status, dict(label.meta))
        self.stats["failed"] += sum(1 for lab in labels if lab.status != "ok")
        self.stats["worker_starts"] = sum(w.starts for w in self._workers.values())
        return labels

    def batch_size(self, target: Target) -> int:
        """Modules compiled ahead as one batch on ``target`` (1 where they are compiled one at a time)."""
        threads = self._threads(self._worker_for(target))
        return 4 * threads if threads > 1 else 1

    def _threads(self, worker: _Worker) -> int:
        if self.compile_threads is not None:
            return self.compile_threads
        if worker.info().get("backend") in GPU_BACKENDS:
            return max(1, min(8, os.cpu_count() or 1))
        return 1

    def _profile_all(self, worker: _Worker, texts: list[str]) -> list[dict[str, Any]]:
        """The worker's result for each module: one at a time, or in batches compiled ahead."""
        threads = self._threads(worker) if texts else 1
        if threads <= 1 or len(texts) <= 1:
            return [worker.profile(self._request(t), self.budget_s, self.lock_timeout_s) for t in texts]
        results: list[dict[str, Any] | None] = [None] * len(texts)
        todo = list(range(len(texts)))
        while todo:
            batch, todo = todo[: 4 * threads], todo[4 * threads:]      # as batch_size
            request = {**self._request(""), "texts": [texts[i] for i in batch], "threads": threads}
            request.pop("text")
            got = worker.profile_batch(request, self.budget_s, self.lock_timeout_s, threads)
            for i, result in zip(batch, got):
                results[i] = result
            left = [i for i in batch if results[i] is None]
            if left and all(results[i] is None for i in batch):    # lost while compiling: one at a time
                for i in left:
                    results[i] = worker.profile(self._request(texts[i]), self.budget_s, self.lock_timeout_s)
            else:
                todo = left + todo
        return [r for r in results if r is not None]

    def time_module(self, text: str, target: Target | str = HOST_CPU, measure_s: float | None = None) -> dict[str, Any]:
        """Time one StableHLO module (text) as a region is timed, never cached: the worker's result
        (``median_s``, ``iqr_s``, … and ``device``); FidelityError when it cannot be compiled or run."""
        with self._lock:
            worker = self._worker_for(target)
            request = {**self._request(text), "loop": 0}
            if measure_s is not None:
                request["measure_s"] = float(measure_s)
            result = worker.profile(request, self.budget_s, self.lock_timeout_s)
            if "error" in result:
                raise FidelityError(f"profiling: {result['error']}")
            return {**result, **self._provenance_of(worker), **self._identity(worker)}

    def check_target(self, target: Target) -> None:
        """Profiling times the hardware it runs on: FidelityError unless ``target`` is this machine's CPU or
        the GPU jax finds here (starts the worker to find out)."""
        self._worker_for(target)

    def provenance(self, target: Target | str = HOST_CPU) -> dict[str, Any]:
        """What labels on ``target`` are measured on: backend, device, jax and jaxlib versions, the
        backend's platform version, GPU facts jax reports (compute capability, multiprocessors, memory)
        and the driver's (:func:`hespas_ml.host.gpu_facts`), how executions are timed, and the machine
        (:func:`hespas_ml.host.machine_identity`). Starts the worker if it is not running."""
        worker = self._worker_for(target)
        return {"fidelity": self.name, "target": getattr(target, "name", str(target)),
                "label_version": self.LABEL_VERSION, "statistic": self.statistic, "measure_s": self.measure_s,
                **self._provenance_of(worker), **self._identity(worker)}

    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones)."""
        for worker in self._workers.values():
            worker.stop()

    def __enter__(self) -> ProfilingFidelity:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- targets ------------------------------------------------------------------------------------

    def _worker_for(self, target: Target) -> _Worker:
        """The worker that runs on ``target``'s hardware; FidelityError if this machine is not it."""
        name = getattr(target, "name", str(target))
        if name == HOST_CPU:
            return self._workers.setdefault("cpu", _Worker(self.lock_path(), platforms="cpu", cores=self.cores,
                                                                 xla_flags=self.xla_flags))
        worker = self._workers.setdefault("default", _Worker(self.lock_path(), platforms=None,
                                                                 xla_flags=self.xla_flags))
        try:
            info = worker.info()
        except FidelityError as exc:
            raise FidelityError(f"profiling cannot check target {name}: {exc}") from None
        kind = info.get("device_kind", "?")
        if info.get("backend") in GPU_BACKENDS and _same_gpu(name, kind):
            return worker
        here = f"{HOST_CPU}" if info.get("backend") == "cpu" else f"a {kind} ({info.get('backend')})"
        worker.stop()
        raise FidelityError(f"profiling measures only the hardware it runs on: this machine is {here}, "
                            f"not target {name} (use --target {HOST_CPU}; --fidelity measured for labels measured "
                            f"on a {name} (datasets/measured); or another fidelity)")

    # -- regions -> modules -------------------------------------------------------------------------

    @staticmethod
    def _extract(items: list[_Item]) -> None:
        """Give each item its extracted module text, or a failed label."""
        for item, module in zip(items, extract_region_modules([it.region for it in items])):
            if isinstance(module, Label):
                item.label = module
            else:
                item.text = module

    # -- requests, results, cache -------------------------------------------------------------------

    def lock_path(self) -> str:
        """The machine-wide timing lock file (under the cache folder)."""
        return str(cache_dir() / "profiling" / "timing.lock")

    def _request(self, text: str) -> dict[str, Any]:
        return {"text": text, "lock": self.lock_path(), "lock_timeout_s": self.lock_timeout_s,
                "measure_s": self.measure_s, "min_repeats": self.min_repeats, "max_repeats": self.max_repeats,
                "target_noise": self.target_noise, "sample_s": self.sample_s, "seed": self.seed,
                "early_stop": self.statistic == "median", "loop": self.loop}

    def _identity(self, worker: _Worker) -> dict[str, str]:
        """Backend, device and jax version the labels are measured on (the cache key's second half)."""
        if worker.platforms == "cpu":          # known without starting jax
            cores = min(self.cores, schedulable_cores()) if self.cores else schedulable_cores()
            pinned = " pinned" if self.cores else ""
            return {"backend": "cpu", "device": f"cpu: {cpu_model()} ({cores}{pinned} cores)",
                    "jax_version": package_version("jax")}
        info = worker.info()
        return {"backend": info["backend"], "device": info["device_kind"], "jax_version": info["jax_version"]}

    def _to_label(self, result: dict[str, Any], worker: _Worker, digest: str, cached: bool) -> Label:
        meta = {k: v for k, v in result.items() if k not in ("event", "id", "error", "index")}
        meta.update(self._identity(worker))
        meta["module_sha256"] = digest
        meta["cached"] = cached
        if "error" in result:
            meta["reason"] = result["error"]
            meta.setdefault("kind", "worker")
            return Label(math.nan, "failed", meta)
        median = float(result["median_s"])
        meta["rel_iqr"] = float(result["iqr_s"]) / median if median > 0 else math.inf
        meta["statistic"] = self.statistic
        meta["label_version"] = self.LABEL_VERSION
        return Label(float(result[f"{self.statistic}_s"]), "ok", meta)

    def _provenance_of(self, worker: _Worker) -> dict[str, Any]:
        """:meth:`provenance` of a running worker, worked out once per worker start."""
        key = (id(worker), worker.starts)
        if self._provenance_key != key:
            info = worker.info()
            facts = {k: info[k] for k in PROVENANCE_KEYS if info.get(k) is not None}
            if info.get("backend") in GPU_BACKENDS:
                facts.update({f"gpu_{k}": v for k, v in (gpu_facts() or {}).items()})
            facts["machine"] = machine_identity()
            if self.xla_flags:
                facts["xla_flags"] = self.xla_flags
            self._provenance_key, self._provenance = key, facts
        return dict(self._provenance)

    def _quiet_enough(self, result: dict[str, Any]) -> bool:
        median = float(result.get("median_s") or 0.0)
        return median > 0 and float(result.get("iqr_s") or 0.0) / median <= self.cache_max_noise

    def _cache_dir(self) -> Path | None:
        if self.cache is False or self.cache is None:
            return None
        return cache_dir() / "profiling" if self.cache is True else Path(self.cache)

    def _cache_key(self, digest: str, identity: dict[str, str]) -> dict[str, Any]:
        window = {"window": "full"} if self.statistic == "min" else {}    # a minimum needs the whole window
        sampling = self._sampling()
        return {"v": ProfilingFidelity.LABEL_VERSION, "module_sha256": digest, **identity, **window,
                **({"sampling": sampling} if sampling else {})}

    def _sampling(self) -> dict[str, Any]:
        """The options that change what a timing measures, where they differ from their defaults (so a
        request at the defaults keeps the key it always had)."""
        return options_off_default(ProfilingFidelity, {k: getattr(self, k) for k in SAMPLING_OPTIONS})

    def _cache_file(self, key: dict[str, Any]) -> Path | None:
        folder = self._cache_dir()
        if folder is None:
            return None
        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return folder / f"{name}.json"

    def _cache_get(self, digest: str, identity: dict[str, str]) -> dict[str, Any] | None:
        key = self._cache_key(digest, identity)
        path = self._cache_file(key)
        if path is None:
            return None
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(stored, dict) or stored.get("key") != key or not isinstance(stored.get("result"), dict):
            return None
        return stored["result"]

    def _cache_put(self, digest: str, identity: dict[str, str], result: dict[str, Any]) -> None:
        key = self._cache_key(digest, identity)
        path = self._cache_file(key)
        if path is None:
            return
        result = {k: v for k, v in result.items() if k not in ("event", "id")}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=path.stem, suffix=".tmp", dir=path.parent)
            with os.fdopen(fd, "w") as handle:
                json.dump({"key": key, "result": result}, handle)
            os.replace(tmp, path)
        except OSError:
            pass                      # a read-only cache folder only costs re-timing


_LIVE_WORKERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_workers() -> None:
    for worker in list(_LIVE_WORKERS):
        worker.stop()


def extract_region_modules(regions: Sequence) -> list[str | Label]:
    """Each compute region cut out of its program as a standalone module (StableHLO text with a
    ``@main``, named alike so identical regions give identical text), or a failed label saying why not."""
    from ..ingest.errors import HespasError
    from ..ingest.extract import extract_region, extract_regions, program_data
    from ..ingest.zoo import is_zoo_spec

    out: list[str | Label | None] = [None] * len(regions)
    by_graph: dict[int, list[int]] = {}
    for i, region in enumerate(regions):
        if getattr(region, "kind", "compute") != "compute":
            out[i] = _failed("collective", "collectives are not profiled (the network replay times them)")
        elif getattr(region, "graph", None) is None:
            out[i] = _failed("extract", "the region does not know its program (region.graph is None)")
        else:
            by_graph.setdefault(id(region.graph), []).append(i)
    for group in by_graph.values():
        graph = regions[group[0]].graph
        try:
            data = program_data(graph)
            trusted = is_zoo_spec(graph.source)
            try:
                texts = extract_regions(data, [regions[i].op_ids for i in group], source=graph.source,
                                        names=[MODULE_NAME] * len(group), trusted=trusted)
            except HespasError:          # pin the failure on its region
                texts = []
                for i in group:
                    try:
                        texts.append(extract_region(data, regions[i].op_ids, source=graph.source,
                                                    name=MODULE_NAME, trusted=trusted))
                    except HespasError as exc:
                        texts.append(_failed("extract", str(exc)))
        except HespasError as exc:
            texts = [_failed("extract", str(exc))] * len(group)
        for i, text in zip(group, texts):
            out[i] = text
    return out


def _failed(kind: str, reason: str) -> Label:
    return Label(math.nan, "failed", {"reason": reason, "kind": kind})


def _same_gpu(target_name: str, device_kind: str) -> bool:
    """Whether a GPU preset names the device jax reports (``H100`` ~ ``NVIDIA H100 80GB HBM3``)."""
    model = re.match(r"[A-Za-z]*\d+[A-Za-z]?", target_name)
    if not model:
        return False
    token = model.group(0).lower()
    words = re.findall(r"[a-z0-9]+", device_kind.lower())
    return any(w == token or w.startswith(token) for w in words)


class _Worker:
    """The profiling worker process: started on first use, restarted after a kill or a crash."""

    def __init__(self, lock_path: str, platforms: str | None, cores: int | None = None,
                 xla_flags: str | None = None):
        self.lock_path = lock_path
        self.xla_flags = xla_flags
        self.platforms = platforms
        self.cores = cores
        self.proc: subprocess.Popen | None = None
        self.stderr = None
        self.ready: dict[str, Any] | None = None
        self.starts = 0
        self.next_id = 0
        self._buffer = b""
        self._eof = False

    def info(self) -> dict[str, Any]:
        """The worker's ``ready`` message (backend, device kind, jax version, dispatch overhead)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        return dict(self.ready or {})

    def _send(self, request: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """Start the worker if needed and write ``request`` to it: (its ready message, the request id).
        FidelityError when it does not start, OSError when it died before taking the request."""
        ready = self.info()
        self.next_id += 1
        self.proc.stdin.write((json.dumps({"id": self.next_id, **request}) + "\n").encode())
        self.proc.stdin.flush()
        return ready, self.next_id

    def profile(self, request: dict[str, Any], budget_s: float, lock_timeout_s: float) -> dict[str, Any]:
        """Send one module; its result, or a failure dict (``error``, ``kind``) when it was killed
        ``budget_s`` after it got the timing lock, or when the worker crashed."""
        try:
            ready, rid = self._send(request)
        except FidelityError as exc:
            return {"error": str(exc), "kind": "worker"}
        except OSError:
            return self._died("the worker died before taking the region")
        deadline = time.monotonic() + lock_timeout_s + 30.0     # the worker gives up on the lock first
        while True:
            message = self._message(deadline)
            if message is None:
                if self.proc.poll() is not None or self._eof:
                    return self._died("the worker died while profiling the region")
                self.stop()
                return {"error": f"the region took more than its budget of {budget_s:g} s (compile + timing): "
                                 "its worker was killed", "kind": "timeout"}
            if message.get("id") != rid:
                continue
            if message.get("event") == "locked":
                deadline = time.monotonic() + budget_s
            elif message.get("event") == "result":
                message["overhead_s"] = ready.get("overhead_s")
                return message

    def profile_batch(self, request: dict[str, Any], budget_s: float, lock_timeout_s: float,
                      threads: int) -> list[dict[str, Any] | None]:
        """Send a batch (``request["texts"]``): one result per module, None for the modules the worker
        never got to because it was killed or died. A module that was being timed when that happened gets
        the failure; while compiling, every module stays None (the caller then finds the culprit)."""
        n = len(request["texts"])
        results: list[dict[str, Any] | None] = [None] * n
        try:
            ready, rid = self._send(request)
        except FidelityError as exc:
            return [{"error": str(exc), "kind": "worker"}] * n
        except OSError:
            self.stop()
            return results
        deadline = time.monotonic() + lock_timeout_s + 30.0
        current: int | None = None                  # the module being timed
        while True:
            message = self._message(deadline)
            if message is None:
                died = self.proc.poll() is not None or self._eof
                failure = (self._died("the worker died while profiling the region") if died else
                           {"error": f"the region took more than its budget of {budget_s:g} s (compile + "
                                     "timing): its worker was killed", "kind": "timeout"})
                self.stop()
                if current is not None:
                    results[current] = failure
                return results
            if message.get("id") != rid:
                continue
            event = message.get("event")
            if event == "locked":                   # compiling: budget_s per round of threads
                deadline = time.monotonic() + budget_s * math.ceil(n / max(1, threads))
            elif event == "compiled":
                current, deadline = 0, time.monotonic() + budget_s
            elif event == "result" and "index" not in message:      # the lock stayed busy
                return [dict(message)] * n
            elif event == "result":
                message["overhead_s"] = ready.get("overhead_s")
                results[message["index"]] = message
                current = message["index"] + 1
                if current >= n:
                    return results
                deadline = time.monotonic() + budget_s

    def _message(self, deadline: float) -> dict[str, Any] | None:
        """The worker's next ``@@`` message; None at the deadline or when its output ends."""
        while True:
            newline = self._buffer.find(b"\n")
            while newline >= 0:
                line, self._buffer = self._buffer[:newline], self._buffer[newline + 1:]
                if line.startswith(b"@@ "):
                    try:
                        return json.loads(line[3:])
                    except ValueError:
                        pass
                newline = self._buffer.find(b"\n")
            left = deadline - time.monotonic()
            if left <= 0 or self._eof:
                return None
            fd = self.proc.stdout.fileno()
            with selectors.DefaultSelector() as sel:
                sel.register(fd, selectors.EVENT_READ)
                if not sel.select(timeout=left):
                    continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self._eof = True
            self._buffer += chunk

    def _died(self, what: str) -> dict[str, Any]:
        tail = self._stderr_tail()
        code = self.proc.poll() if self.proc is not None else None
        self.stop()
        how = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        return {"error": f"{what} ({how}){': ' + tail if tail else ''}", "kind": "crash"}

    def _start(self) -> None:
        self.stop()
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env.pop("XLA_FLAGS", None)                 # no fake device counts: one real device
        if self.xla_flags:
            env["XLA_FLAGS"] = self.xla_flags
        env.update(WORKER_MALLOC_ENV)
        if self.platforms:
            env["JAX_PLATFORMS"] = self.platforms
        else:
            env.pop("JAX_PLATFORMS", None)
        env.pop(CORES_ENV, None)
        if self.cores:
            env[CORES_ENV] = str(self.cores)
        self.stderr = tempfile.TemporaryFile()
        self.starts += 1
        self._buffer, self._eof = b"", False
        self.proc = subprocess.Popen([sys.executable, "-m", "hespas_ml.label.profiling_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, env=env)
        _LIVE_WORKERS.add(self)
        message = self._message(time.monotonic() + START_TIMEOUT_S)
        while message is not None and message.get("event") != "ready":
            message = self._message(time.monotonic() + START_TIMEOUT_S)
        if message is not None:
            self.ready = message
            return
        tail = self._stderr_tail()
        self.stop()
        raise FidelityError(f"the profiling worker did not start{': ' + tail if tail else ''}")

    def _stderr_tail(self) -> str:
        if self.stderr is None:
            return ""
        try:
            self.stderr.seek(0)
            lines = [ln.strip() for ln in self.stderr.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        interesting = [ln for ln in lines if "Error" in ln or "error" in ln or "Check failed" in ln]
        return ((interesting or lines or [""])[-1])[:300]

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
        if self.stderr is not None:
            self.stderr.close()
            self.stderr = None
        self.ready = None
