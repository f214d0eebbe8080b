"""The build cache of a dataset folder: one SQLite database (``cache.sqlite``, WAL journal).

Everything the builder finishes is committed at once — a program's regions in one transaction, labels
chunk by chunk as their fidelity returns them — so a build killed at any point (SIGKILL included) loses
nothing it finished, and the next run resumes from here. SQLite's WAL journal keeps the file consistent
across such kills. The final tables are written from this cache.

A folder is built by one process at a time (an ``flock`` on ``.lock``; the kernel drops it when the
process dies).
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import sqlite3
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..ingest.errors import HespasError

CACHE_FILE = "cache.sqlite"
LOCK_FILE = ".lock"
SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS programs (
    source TEXT NOT NULL, split TEXT NOT NULL, family TEXT NOT NULL, status TEXT NOT NULL, reason TEXT,
    n_ops INTEGER, n_regions INTEGER, n_unique INTEGER, n_collectives INTEGER, n_skipped INTEGER,
    truncated INTEGER, warnings TEXT, seconds REAL, finished_at REAL,
    PRIMARY KEY (source, split));
CREATE TABLE IF NOT EXISTS occurrences (
    source TEXT NOT NULL, split TEXT NOT NULL, hash TEXT NOT NULL, occurrences INTEGER NOT NULL,
    executions INTEGER NOT NULL, PRIMARY KEY (source, split, hash));
CREATE TABLE IF NOT EXISTS regions (hash TEXT PRIMARY KEY, record TEXT NOT NULL, features TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS labels (
    hash TEXT NOT NULL, target TEXT NOT NULL, fidelity TEXT NOT NULL, seconds REAL, noise REAL,
    status TEXT NOT NULL, reason TEXT, meta TEXT, label_s REAL, finished_at REAL NOT NULL,
    PRIMARY KEY (hash, target, fidelity));
CREATE TABLE IF NOT EXISTS label_configs (
    fidelity TEXT NOT NULL, target TEXT NOT NULL, fingerprint TEXT NOT NULL, PRIMARY KEY (fidelity, target));
"""


class DatasetError(HespasError):
    """A dataset folder (or its cache) is unusable: ``<path>: <problem>``."""


class BuildCache:
    """The cache database of one dataset folder, locked for this process while open."""

    def __init__(self, out_dir: str | os.PathLike[str]):
        self.dir = Path(out_dir)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DatasetError(f"{self.dir}: cannot create the output folder: {exc.strerror}") from None
        self.path = self.dir / CACHE_FILE
        self._lock = open(self.dir / LOCK_FILE, "a+")
        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise DatasetError(f"{self.dir}: another build is writing to this folder") from None
        try:
            self.db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")     # WAL + NORMAL: durable across process kills
            self.db.executescript(SCHEMA)
            version = self.get_meta("schema")
            if version is None:
                self.set_meta("schema", str(SCHEMA_VERSION))
            elif version != str(SCHEMA_VERSION):
                self.close()
                raise DatasetError(f"{self.path}: cache schema {version}, this version writes {SCHEMA_VERSION}; "
                                   f"build into a new folder")
            self._check_records()
        except sqlite3.DatabaseError as exc:
            self.close()
            raise DatasetError(f"{self.path}: not a usable cache database ({exc})") from None

    def _check_records(self) -> None:
        """Refuse a folder whose regions were recorded by another version of the records (their kernel
        costs, which the roofline and SCALE-Sim labels follow, would mix with this version's)."""
        from .region_records import RECORD_VERSION

        records = self.get_meta("records")
        if records is None:            # a new folder, or one written before records had a version (1)
            if self.db.execute("SELECT 1 FROM regions LIMIT 1").fetchone() is None:
                self.set_meta("records", str(RECORD_VERSION))
                return
            records = "1"
        if records != str(RECORD_VERSION):
            self.close()
            raise DatasetError(f"{self.path}: its regions are records version {records} (older kernel costs), this "
                               f"version writes {RECORD_VERSION}; build into a new folder")

    # -- plumbing -----------------------------------------------------------------------------------

    def close(self) -> None:
        db = getattr(self, "db", None)
        if db is not None:
            try:
                db.execute("PRAGMA wal_checkpoint(PASSIVE)")
            except sqlite3.Error:
                pass
            db.close()
            self.db = None
        if not self._lock.closed:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_UN)
            self._lock.close()

    def __enter__(self) -> "BuildCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _transaction(self, statements: Iterable[tuple[str, Any]]) -> None:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            for sql, args in statements:
                self.db.execute(sql, args)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def get_meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    # -- programs -----------------------------------------------------------------------------------

    def program_status(self) -> dict[tuple[str, str], str]:
        return {(s, sp): st for s, sp, st in self.db.execute("SELECT source, split, status FROM programs")}

    def forget_failed_programs(self) -> int:
        return self.db.execute("DELETE FROM programs WHERE status='failed'").rowcount

    def add_program(self, source: str, split: str, family: str, result: dict[str, Any]) -> None:
        """Store one finished program (its regions, their occurrences and the program row) atomically."""
        statements: list[tuple[str, Any]] = []
        for digest, entry in result["regions"].items():
            record = entry.get("record")
            if record is not None:
                from .region_records import region_features
                statements.append(("INSERT OR IGNORE INTO regions VALUES (?, ?, ?)",
                                   (digest, json.dumps(record, separators=(",", ":")),
                                    json.dumps(region_features(record)))))
            statements.append(("INSERT OR REPLACE INTO occurrences VALUES (?, ?, ?, ?, ?)",
                               (source, split, digest, entry["occurrences"], entry["executions"])))
        statements.append(("INSERT OR REPLACE INTO programs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                           (source, split, family, "ok", None, result["n_ops"], result["n_regions"],
                            len(result["regions"]), result["n_collectives"], result["n_skipped"],
                            int(result["truncated"]), json.dumps(result["warnings"]), result["seconds"],
                            time.time())))
        self._transaction(statements)

    def add_failed_program(self, source: str, split: str, family: str, reason: str, seconds: float) -> None:
        self.db.execute("INSERT OR REPLACE INTO programs (source, split, family, status, reason, seconds, "
                        "finished_at) VALUES (?,?,?,?,?,?,?)",
                        (source, split, family, "failed", reason, seconds, time.time()))

    def programs(self) -> list[dict[str, Any]]:
        cur = self.db.execute("SELECT * FROM programs")
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row)) for row in cur]

    def occurrences(self) -> list[tuple[str, str, str, int, int]]:
        return list(self.db.execute("SELECT source, split, hash, occurrences, executions FROM occurrences"))

    # -- regions ------------------------------------------------------------------------------------

    def region_record(self, digest: str) -> dict[str, Any]:
        row = self.db.execute("SELECT record FROM regions WHERE hash=?", (digest,)).fetchone()
        if row is None:
            raise DatasetError(f"{self.path}: region {digest} is missing from the cache")
        return json.loads(row[0])

    def region_rows(self, hashes: Iterable[str] | None = None) -> Iterator[tuple[str, str, str]]:
        """(hash, record JSON, features JSON), for ``hashes`` or every region."""
        if hashes is None:
            yield from self.db.execute("SELECT hash, record, features FROM regions ORDER BY hash")
            return
        for digest in hashes:
            row = self.db.execute("SELECT hash, record, features FROM regions WHERE hash=?", (digest,)).fetchone()
            if row is not None:
                yield row

    # -- labels -------------------------------------------------------------------------------------

    def check_config(self, fidelity: str, target: str, fingerprint: str, older: Iterable[str] = (),
                     record: dict[str, Any] | None = None) -> bool:
        """Record the fingerprint of (fidelity, target) and the ``record`` of what it stands for (options,
        label version); False when labels were made with another one. A folder that recorded the same
        labels in an older form (one of ``older``) is brought up to date."""
        stored = self.stored_fingerprint(fidelity, target)
        if stored is None:
            self.db.execute("INSERT INTO label_configs VALUES (?, ?, ?)", (fidelity, target, fingerprint))
        elif stored != fingerprint and stored in set(older):
            self.db.execute("UPDATE label_configs SET fingerprint=? WHERE fidelity=? AND target=?",
                            (fingerprint, fidelity, target))
        elif stored != fingerprint:
            return False
        if record is not None:
            self.set_meta(f"label_config/{fidelity}/{target}", json.dumps(record, sort_keys=True))
        return True

    def stored_fingerprint(self, fidelity: str, target: str) -> str | None:
        row = self.db.execute("SELECT fingerprint FROM label_configs WHERE fidelity=? AND target=?",
                              (fidelity, target)).fetchone()
        return row[0] if row else None

    def label_record(self, fidelity: str, target: str) -> dict[str, Any] | None:
        """What the (fidelity, target) labels were made with, as :meth:`check_config` recorded it (None for
        folders built before it was recorded)."""
        text = self.get_meta(f"label_config/{fidelity}/{target}")
        return None if text is None else json.loads(text)

    def labelled(self, fidelity: str, target: str, include_failed: bool = True) -> set[str]:
        sql = "SELECT hash FROM labels WHERE fidelity=? AND target=?"
        if not include_failed:
            sql += " AND status='ok'"
        return {row[0] for row in self.db.execute(sql, (fidelity, target))}

    def forget_failed_labels(self) -> int:
        return self.db.execute("DELETE FROM labels WHERE status!='ok'").rowcount

    def add_labels(self, rows: list[dict[str, Any]]) -> None:
        """Store finished labels in one transaction (each a dict with the labels table's columns)."""
        now = time.time()
        self._transaction(("INSERT OR REPLACE INTO labels VALUES (?,?,?,?,?,?,?,?,?,?)",
                           (r["hash"], r["target"], r["fidelity"], _real(r["seconds"]), _real(r.get("noise")),
                            r["status"], r.get("reason"), r.get("meta"), r.get("label_s"), now)) for r in rows)

    def labels(self) -> list[tuple]:
        return list(self.db.execute("SELECT hash, target, fidelity, seconds, noise, status, reason, meta, label_s, "
                                    "finished_at FROM labels ORDER BY hash, target, fidelity"))


def _real(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return None if math.isnan(x) else x
