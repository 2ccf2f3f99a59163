"""The job table: one SQLite file (WAL, busy timeout) and one NDJSON event log per job.

Rows carry what a listing shows (status, progress, last message, error); the log carries every
event in order, so a late subscriber can replay a job's history. Used from one event loop
thread; each call is one short statement.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from modelhost.paths import modelhost_home

JobStatus = Literal["queued", "running", "done", "failed", "zombie"]
TERMINAL: frozenset[str] = frozenset({"done", "failed", "zombie"})
ZOMBIE_ERROR = "job interrupted by a previous process exit"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  id TEXT PRIMARY KEY, kind TEXT NOT NULL, status TEXT NOT NULL, config_json TEXT NOT NULL,
  progress REAL NOT NULL DEFAULT 0, message TEXT, log_path TEXT NOT NULL, output_path TEXT,
  error TEXT, started_at TEXT NOT NULL DEFAULT (datetime('now')), ended_at TEXT);
CREATE INDEX IF NOT EXISTS idx_jobs_status_started ON jobs(status, started_at DESC);
"""
_COLUMNS = (
    "id, kind, status, config_json, progress, message, log_path, output_path, error, "
    "started_at, ended_at"
)


def utc_now() -> str:
    """SQLite's own `datetime('now')` shape, so rows and events compare as text."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())


def new_job_id() -> str:
    return f"job_{secrets.token_hex(8)}"


class JobStore:
    """`MODELHOST_HOME/db/jobs.sqlite` and `MODELHOST_HOME/jobs/<id>.log` unless told otherwise."""

    def __init__(self, db_path: Path | None = None, logs_dir: Path | None = None) -> None:
        home = modelhost_home()
        self.db_path = db_path or home / "db" / "jobs.sqlite"
        self.logs_dir = logs_dir or home / "jobs"
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        # The loop thread owns the connection; check_same_thread off lets a test's thread close it.
        self._db = sqlite3.connect(self.db_path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    # ---- rows -------------------------------------------------------------------------------

    def create(self, kind: str, config: Mapping[str, Any]) -> dict[str, Any]:
        """A queued row and its empty log."""
        job_id = new_job_id()
        log_path = self.logs_dir / f"{job_id}.log"
        log_path.touch()
        self._db.execute(
            "INSERT INTO jobs (id, kind, status, config_json, log_path, started_at) "
            "VALUES (?, ?, 'queued', ?, ?, ?)",
            (job_id, kind, json.dumps(dict(config)), str(log_path), utc_now()),
        )
        row = self.get(job_id)
        assert row is not None
        return row

    def get(self, job_id: str) -> dict[str, Any] | None:
        cursor = self._db.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (job_id,))
        found = cursor.fetchone()
        return None if found is None else _row(found)

    def recent(self, limit: int = 50, kind: str | None = None) -> list[dict[str, Any]]:
        """Newest first (rowid breaks ties within one second)."""
        where, args = ("WHERE kind = ?", [kind]) if kind else ("", [])
        cursor = self._db.execute(
            f"SELECT {_COLUMNS} FROM jobs {where} ORDER BY started_at DESC, rowid DESC LIMIT ?",
            (*args, max(0, limit)),
        )
        return [_row(found) for found in cursor.fetchall()]

    def update(self, job_id: str, **fields: Any) -> None:
        if not fields:
            return
        names = ", ".join(f"{name} = ?" for name in fields)
        self._db.execute(f"UPDATE jobs SET {names} WHERE id = ?", (*fields.values(), job_id))

    def mark_zombies(self) -> int:
        """Rows a previous process left queued or running: nothing will ever finish them."""
        cursor = self._db.execute(
            "UPDATE jobs SET status = 'zombie', error = ?, ended_at = ? "
            "WHERE status IN ('queued', 'running')",
            (ZOMBIE_ERROR, utc_now()),
        )
        return cursor.rowcount

    # ---- events -----------------------------------------------------------------------------

    def log_path(self, job_id: str) -> Path:
        return self.logs_dir / f"{job_id}.log"

    def append_event(self, job_id: str, event: Mapping[str, Any]) -> None:
        """One NDJSON line; a reader tailing the file never sees half of one written line
        as a whole one, since it waits for the newline."""
        line = json.dumps(dict(event), ensure_ascii=False, separators=(",", ":")) + "\n"
        with self.log_path(job_id).open("a", encoding="utf-8") as log:
            log.write(line)


def _row(found: sqlite3.Row) -> dict[str, Any]:
    row = dict(found)
    row["config"] = json.loads(row.pop("config_json"))
    return row
