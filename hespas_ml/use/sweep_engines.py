"""Where sweep tasks run: a local pool of worker processes (default) or a Dask cluster.

Both offer the same three calls — :meth:`submit`, :meth:`wait` (the futures finished so far) and
:meth:`close` — so the sweep driver does not know which one it talks to. ``dask`` connects to an
existing scheduler with ``address`` (``tcp://host:8786``) or, without one, starts a
``dask.distributed.LocalCluster`` of ``workers`` processes for the duration of the sweep.

Dask was chosen over Ray for the distributed engine: ``dask[distributed]`` is a ~5 MB download
(~32 MB installed, mostly pure Python, 15 s to install here) and a local cluster starts in ~3 s,
where Ray is a ~79 MB download (~240 MB installed) and starts a much heavier runtime.
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
from typing import Any, Callable, Iterable

from ..ingest.errors import HespasError

ENGINES = ("local", "dask")


class EngineError(HespasError):
    """A sweep engine cannot be started or reached."""


def default_workers() -> int:
    return max(1, os.cpu_count() or 1)


class LocalEngine:
    """Spawned worker processes on this machine (``concurrent.futures``)."""

    name = "local"

    def __init__(self, workers: int | None = None):
        self.workers = workers or default_workers()
        self.pool = cf.ProcessPoolExecutor(max_workers=self.workers,
                                           mp_context=multiprocessing.get_context("spawn"))

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future:
        return self.pool.submit(fn, *args)

    def wait(self, futures: Iterable[Any], timeout: float | None = None) -> set[Any]:
        done, _ = cf.wait(list(futures), timeout=timeout, return_when=cf.FIRST_COMPLETED)
        return done

    def close(self, wait: bool = True) -> None:
        self.pool.shutdown(wait=wait, cancel_futures=True)


class DaskEngine:
    """A Dask cluster: an existing one at ``address``, or a LocalCluster started here."""

    name = "dask"

    def __init__(self, workers: int | None = None, address: str | None = None):
        try:
            from dask.distributed import Client, LocalCluster
        except ImportError:
            raise EngineError("engine dask: dask.distributed is not installed "
                              "(pip install 'dask[distributed]')") from None
        self.cluster = None
        try:
            if address:
                self.client = Client(address, timeout="20s")
            else:
                self.cluster = LocalCluster(n_workers=workers or default_workers(), threads_per_worker=1,
                                            processes=True, dashboard_address=None)
                self.client = Client(self.cluster)
        except (OSError, TimeoutError) as exc:
            raise EngineError(f"engine dask: cannot reach the scheduler at {address or 'a local cluster'} "
                              f"({' '.join(str(exc).split())[:200]})") from None
        info = self.client.scheduler_info()
        self.workers = max(1, sum(w.get("nthreads", 1) for w in info.get("workers", {}).values()))

    def submit(self, fn: Callable[..., Any], *args: Any):
        return self.client.submit(fn, *args, pure=False)

    def wait(self, futures: Iterable[Any], timeout: float | None = None) -> set[Any]:
        from dask.distributed import wait
        futures = list(futures)
        try:
            done, _ = wait(futures, timeout=timeout, return_when="FIRST_COMPLETED")
        except TimeoutError:
            return set()
        return set(done)

    def close(self, wait: bool = True) -> None:
        self.client.close()
        if self.cluster is not None:
            self.cluster.close()


def make_engine(name: str, workers: int | None = None, address: str | None = None):
    """The engine called ``name`` (see :data:`ENGINES`)."""
    if name == "local":
        if address:
            raise EngineError("engine local takes no --address (use --engine dask)")
        return LocalEngine(workers)
    if name == "dask":
        return DaskEngine(workers, address)
    raise EngineError(f"unknown engine '{name}' (choose from {', '.join(ENGINES)})")
