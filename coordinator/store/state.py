"""The daemon's durable state: SQLite in the state dir.

It holds what must survive a daemon restart: the nodes as last seen, their facts,
and a timestamped event log. Writes are small and few (a node changes state, an
event happens), so they run on the event loop's thread; WAL keeps readers apart.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from shared.agent_api.calibration import CalibrationReply
from shared.agent_api.common import JsonObject

SCHEMA_VERSION = 5

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    name TEXT PRIMARY KEY,
    address TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT,
    facts TEXT,
    last_seen REAL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,
    node TEXT,
    message TEXT NOT NULL,
    data TEXT
);
CREATE INDEX IF NOT EXISTS events_ts ON events (ts);
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,  -- what every file of the run, on the head and on the nodes, is keyed by
    name TEXT NOT NULL,       -- the job name the user typed; run again, it is a new run
    spec TEXT NOT NULL,
    state TEXT NOT NULL,
    record TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_name ON runs (name, created);
CREATE TABLE IF NOT EXISTS checkpoints (
    job TEXT NOT NULL,  -- the run id
    step INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    node TEXT NOT NULL,
    path TEXT NOT NULL,
    sha256 TEXT,
    size INTEGER,
    valid INTEGER NOT NULL,
    detail TEXT,
    created REAL NOT NULL,
    role TEXT NOT NULL DEFAULT 'primary',  -- 'primary' where rank 0 wrote it, 'replica' for its copy
    PRIMARY KEY (job, attempt, node, path)
);
CREATE TABLE IF NOT EXISTS durable_checkpoints (  -- committed in the run's checkpoint store
    job TEXT NOT NULL,  -- the run id
    step INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    url TEXT NOT NULL,  -- the checkpoint's prefix in the store
    bytes INTEGER NOT NULL,
    seconds REAL NOT NULL,
    committed REAL NOT NULL,
    PRIMARY KEY (job, step, attempt)
);
CREATE TABLE IF NOT EXISTS calibrations (
    node TEXT PRIMARY KEY,
    record TEXT NOT NULL,
    measured_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS links (
    a TEXT NOT NULL,
    b TEXT NOT NULL,
    role TEXT NOT NULL,  -- 'baseline': coord doctor's reference for the link; 'last': its latest figures
    record TEXT NOT NULL,
    measured_at REAL NOT NULL,
    PRIMARY KEY (a, b, role)
);
"""

# Schema 4: the metrics history (coordinator/observe/metrics/history.py). New tables only, so an older
# database gains them as they are; their rows are thinned as coordinator/observe/metrics/thinning.py says.
_METRICS_SCHEMA = """
CREATE TABLE IF NOT EXISTS metric_points (
    run_id TEXT NOT NULL,
    series TEXT NOT NULL,           -- 'train' or 'val'
    step INTEGER NOT NULL,          -- the run's global step: one point per step, whichever attempt wrote it
    attempt INTEGER NOT NULL,
    ts REAL NOT NULL,
    loss REAL,                      -- the validation loss in the 'val' series
    learning_rate REAL,
    tokens_per_second REAL,
    peak_memory_bytes INTEGER,      -- rank 0's MLX peak memory
    samples_per_second REAL,        -- schema 5: what `coord bench scaling` reads
    comm_seconds REAL,              -- schema 5: a step's mean time in its gradient exchange
    rank_memory TEXT,               -- JSON {rank: bytes}: each rank's largest RSS since the point before
    PRIMARY KEY (run_id, series, step)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS metric_attempts (
    run_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    start_step INTEGER NOT NULL,    -- the step it resumed from (0: from the start)
    ts REAL NOT NULL,
    nodes TEXT NOT NULL,            -- JSON list, rank by rank
    detail TEXT,                    -- why the attempt before it ended
    PRIMARY KEY (run_id, attempt)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS node_samples (
    node TEXT NOT NULL,
    ts REAL NOT NULL,
    memory_used_bytes INTEGER,
    memory_total_bytes INTEGER,
    gpu_utilization REAL,           -- percent
    gpu_memory_bytes INTEGER,
    power_watts REAL,
    temperature_c REAL,
    PRIMARY KEY (node, ts)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS node_samples_ts ON node_samples (ts);
"""


class StateError(Exception):
    pass


class NodeRow(TypedDict):
    """A node as last seen (``nodes``)."""

    name: str
    address: str
    state: str
    reason: str | None
    facts: JsonObject | None  # as the node's agent reported them: free-form, kept as sent
    last_seen: float | None
    updated: float


class RebootMark(TypedDict):
    """A node that needs a reboot before it takes part in a job again (``meta`` key reboot_marks)."""

    reason: str
    fix: str
    boot_id: str | None  # its boot when it was marked: a new one clears the mark
    since: float


class EventRecord(TypedDict):
    """One event of the log (``events``), as the daemon keeps, shows and sends it."""

    id: int | None
    ts: float
    kind: str
    node: str | None
    message: str
    data: JsonObject | None  # what the recorder attached: free-form, its keys depend on the kind


class RunRow(TypedDict):
    """One run (``runs``)."""

    run_id: str
    name: str
    spec: dict[str, Any]  # the job spec as the jobs layer saved it (JobSpec.as_dict)
    state: str
    record: dict[str, Any]  # the jobs layer's JobRecord as JSON (coordinator/jobs/record.py), a layer above this one
    created: float
    updated: float


class CheckpointEntry(TypedDict):
    """A checkpoint copy to catalogue; what is left out is taken as unknown, now, primary."""

    step: int
    attempt: int
    node: str
    path: str
    valid: bool
    sha256: NotRequired[str | None]
    size: NotRequired[int | None]
    detail: NotRequired[str | None]
    created: NotRequired[float]
    role: NotRequired[str]  # 'primary' where rank 0 wrote it, 'replica' for its copy


class CheckpointRow(TypedDict):
    """A catalogued checkpoint copy (``checkpoints``)."""

    step: int
    attempt: int
    node: str
    path: str
    sha256: str | None
    size: int | None
    valid: bool
    detail: str | None
    created: float
    role: str


class DurableRow(TypedDict):
    """A checkpoint committed in the run's checkpoint store (``durable_checkpoints``)."""

    attempt: int
    step: int
    url: str  # the checkpoint's prefix in the store, as a URL
    bytes: int
    seconds: float  # how long its upload took
    committed: float  # wall clock
    senders: NotRequired[list[str]]  # who put the parts (the nodes, or the head): said, not kept


class CalibrationKey(TypedDict):
    """The node facts a calibration holds for (coordinator.readiness.calibration.CALIBRATION_KEY_FIELDS)."""

    chip: str | None
    os_version: str | None
    os_build: str | None
    mlx_version: str | None
    python_executable: str | None
    gpu: str | None


class CalibrationRecord(TypedDict):
    """What is kept of a node's calibration (``calibration_record``): its key and the result."""

    key: CalibrationKey
    result: CalibrationReply  # the agent's calibrate answer as it reported it (agent/calibrate.py)


class StoredCalibration(CalibrationRecord):
    """A record read back, with when it was measured. One written by an older coord may lack
    ``key``: the calibration policy checks it before use."""

    measured_at: float


class StateStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise StateError(f"state database {path} cannot be opened: {exc}; "
                             "move it aside to start with empty state") from None
        row = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        if row is None:
            self._db.executescript(_METRICS_SCHEMA)
            self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        elif int(row[0]) > SCHEMA_VERSION:
            raise StateError(f"state database {path} is from a newer coord (schema {row[0]})")
        elif int(row[0]) < SCHEMA_VERSION:
            self._migrate(int(row[0]))

    def _migrate(self, version: int) -> None:
        if version < 2:
            # Replicas: a checkpoint may now be in two places (the key gains the node), with a role.
            self._db.executescript("""
                BEGIN;
                ALTER TABLE checkpoints RENAME TO checkpoints_v1;
                CREATE TABLE checkpoints (job TEXT NOT NULL, step INTEGER NOT NULL, attempt INTEGER NOT NULL,
                    node TEXT NOT NULL, path TEXT NOT NULL, sha256 TEXT, size INTEGER, valid INTEGER NOT NULL,
                    detail TEXT, created REAL NOT NULL, role TEXT NOT NULL DEFAULT 'primary',
                    PRIMARY KEY (job, attempt, node, path));
                INSERT INTO checkpoints (job, step, attempt, node, path, sha256, size, valid, detail, created)
                    SELECT job, step, attempt, node, path, sha256, size, valid, detail, created FROM checkpoints_v1;
                DROP TABLE checkpoints_v1;
                COMMIT;
            """)
        if version < 3:
            # Runs: a job name may be run again. Each earlier job is a run whose id is its name,
            # which is also what its files on the nodes and its checkpoints are keyed by.
            exists = self._db.execute("SELECT name FROM sqlite_master WHERE type='table' AND name='jobs'").fetchone()
            if exists:
                self._db.executescript("""
                    BEGIN;
                    INSERT OR IGNORE INTO runs (run_id, name, spec, state, record, created, updated)
                        SELECT name, name, spec, state, record, created, updated FROM jobs;
                    DROP TABLE jobs;
                    COMMIT;
                """)
        if version < 4:
            self._db.executescript(_METRICS_SCHEMA)  # made with schema 5's columns already
        elif version < 5:
            self._db.executescript("""
                BEGIN;
                ALTER TABLE metric_points ADD COLUMN samples_per_second REAL;
                ALTER TABLE metric_points ADD COLUMN comm_seconds REAL;
                COMMIT;
            """)
        self._db.execute("UPDATE meta SET value=? WHERE key='schema'", (str(SCHEMA_VERSION),))

    @property
    def connection(self) -> sqlite3.Connection:
        """For the stores that keep their own tables in this database (the metrics history)."""
        return self._db

    def close(self) -> None:
        self._db.close()

    def save_node(self, name: str, address: str, state: str, reason: str | None,
                  facts: JsonObject | None, last_seen: float | None) -> None:
        """Upsert a node; ``facts`` as its agent reported them (None keeps the last known)."""
        self._db.execute(
            "INSERT INTO nodes (name, address, state, reason, facts, last_seen, updated) VALUES (?,?,?,?,?,?,?) "
            "ON CONFLICT(name) DO UPDATE SET address=excluded.address, state=excluded.state, "
            "reason=excluded.reason, facts=COALESCE(excluded.facts, nodes.facts), "
            "last_seen=COALESCE(excluded.last_seen, nodes.last_seen), updated=excluded.updated",
            (name, address, state, reason, json.dumps(facts) if facts is not None else None, last_seen, time.time()),
        )

    def nodes(self) -> dict[str, NodeRow]:
        rows = self._db.execute("SELECT name, address, state, reason, facts, last_seen, updated FROM nodes")
        return {
            name: {"name": name, "address": address, "state": state, "reason": reason,
                   "facts": json.loads(facts) if facts else None, "last_seen": last_seen, "updated": updated}
            for name, address, state, reason, facts, last_seen, updated in rows
        }

    def reboot_marks(self) -> dict[str, RebootMark]:
        """Nodes that need a reboot, kept across daemon restarts (a JSON object in ``meta``)."""
        row = self._db.execute("SELECT value FROM meta WHERE key='reboot_marks'").fetchone()
        marks = json.loads(row[0]) if row else {}
        return marks if isinstance(marks, dict) else {}

    def set_reboot_mark(self, node: str, mark: RebootMark | None) -> None:
        marks = self.reboot_marks()
        if mark is None:
            marks.pop(node, None)
        else:
            marks[node] = mark
        self._db.execute("INSERT INTO meta (key, value) VALUES ('reboot_marks', ?) "
                         "ON CONFLICT(key) DO UPDATE SET value=excluded.value", (json.dumps(marks),))

    def add_event(self, kind: str, message: str, *, node: str | None = None,
                  data: JsonObject | None = None, ts: float | None = None) -> EventRecord:
        ts = time.time() if ts is None else ts
        cursor = self._db.execute(
            "INSERT INTO events (ts, kind, node, message, data) VALUES (?,?,?,?,?)",
            (ts, kind, node, message, json.dumps(data) if data else None),
        )
        return {"id": cursor.lastrowid, "ts": ts, "kind": kind, "node": node, "message": message, "data": data}

    def recent_events(self, limit: int = 20) -> list[EventRecord]:
        rows = self._db.execute(
            "SELECT id, ts, kind, node, message, data FROM events ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        return [{"id": i, "ts": ts, "kind": kind, "node": node, "message": message,
                 "data": json.loads(data) if data else None} for i, ts, kind, node, message, data in reversed(rows)]

    def save_calibration(self, node: str, record: CalibrationRecord, measured_at: float | None = None) -> None:
        self._db.execute("INSERT OR REPLACE INTO calibrations (node, record, measured_at) VALUES (?,?,?)",
                         (node, json.dumps(record), time.time() if measured_at is None else measured_at))

    def calibration(self, node: str) -> StoredCalibration | None:
        row = self._db.execute("SELECT record, measured_at FROM calibrations WHERE node=?", (node,)).fetchone()
        if row is None:
            return None
        record: StoredCalibration = json.loads(row[0])
        record["measured_at"] = row[1]
        return record

    # --- links (coord doctor) ----------------------------------------------------------

    def save_link(self, a: str, b: str, role: str, record: JsonObject, measured_at: float | None = None) -> None:
        """A link's baseline or last figures (coordinator/readiness/link_verdict.py's shapes, a layer
        above), keyed by its two nodes in the order measured."""
        if role not in ("baseline", "last"):
            raise ValueError(f"a link record is a baseline or the last figures, not {role!r}")
        self._db.execute("INSERT OR REPLACE INTO links (a, b, role, record, measured_at) VALUES (?,?,?,?,?)",
                         (a, b, role, json.dumps(record), time.time() if measured_at is None else measured_at))

    def forget_link(self, a: str, b: str, role: str) -> None:
        self._db.execute("DELETE FROM links WHERE a=? AND b=? AND role=?", (a, b, role))

    def links(self, role: str) -> dict[tuple[str, str], JsonObject]:
        rows = self._db.execute("SELECT a, b, record FROM links WHERE role=?", (role,)).fetchall()
        return {(a, b): json.loads(record) for a, b, record in rows}

    # --- jobs ---------------------------------------------------------------------------

    def save_run(self, run_id: str, name: str, spec: dict[str, Any], state: str, record: dict[str, Any]) -> None:
        now = time.time()
        self._db.execute(
            "INSERT INTO runs (run_id, name, spec, state, record, created, updated) VALUES (?,?,?,?,?,?,?) "
            "ON CONFLICT(run_id) DO UPDATE SET spec=excluded.spec, state=excluded.state, record=excluded.record, "
            "updated=excluded.updated", (run_id, name, json.dumps(spec), state, json.dumps(record), now, now))

    def runs(self) -> list[RunRow]:
        """Every run, oldest first."""
        rows = self._db.execute("SELECT run_id, name, spec, state, record, created, updated FROM runs "
                                "ORDER BY created, rowid")
        return [{"run_id": run_id, "name": name, "spec": json.loads(spec), "state": state,
                 "record": json.loads(record), "created": created, "updated": updated}
                for run_id, name, spec, state, record, created, updated in rows]

    def run_ids(self) -> set[str]:
        return {row[0] for row in self._db.execute("SELECT run_id FROM runs")}

    def forget_run(self, run_id: str) -> int:
        """Every row of a run, its events too (coord drill's rehearsal leaves no record behind), in one
        transaction; how many events went."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            for table, column in (("runs", "run_id"), ("checkpoints", "job"), ("durable_checkpoints", "job"),
                                  ("metric_points", "run_id"), ("metric_attempts", "run_id")):
                self._db.execute(f"DELETE FROM {table} WHERE {column}=?", (run_id,))  # noqa: S608 - names above
            events = self._db.execute("DELETE FROM events WHERE data IS NOT NULL AND json_valid(data) "
                                      "AND json_extract(data, '$.run')=?", (run_id,)).rowcount
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return events

    def add_checkpoint(self, job: str, entry: CheckpointEntry) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO checkpoints (job, step, attempt, node, path, sha256, size, valid, detail, created, "
            "role) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (job, entry["step"], entry["attempt"], entry["node"], entry["path"], entry.get("sha256"),
             entry.get("size"), int(bool(entry["valid"])), entry.get("detail"), entry.get("created", time.time()),
             entry.get("role", "primary")))

    def checkpoints(self, job: str) -> list[CheckpointRow]:
        rows = self._db.execute("SELECT step, attempt, node, path, sha256, size, valid, detail, created, role "
                                "FROM checkpoints WHERE job=? ORDER BY step, attempt, role", (job,))
        return [{"step": step, "attempt": attempt, "node": node, "path": path, "sha256": sha, "size": size,
                 "valid": bool(valid), "detail": detail, "created": created, "role": role}
                for step, attempt, node, path, sha, size, valid, detail, created, role in rows]

    def remove_checkpoint(self, job: str, attempt: int, node: str, path: str) -> None:
        self._db.execute("DELETE FROM checkpoints WHERE job=? AND attempt=? AND node=? AND path=?",
                         (job, attempt, node, path))

    def add_durable(self, job: str, row: DurableRow) -> None:
        self._db.execute("INSERT OR REPLACE INTO durable_checkpoints (job, step, attempt, url, bytes, seconds, "
                         "committed) VALUES (?,?,?,?,?,?,?)", (job, row["step"], row["attempt"], row["url"],
                                                               row["bytes"], row["seconds"], row["committed"]))

    def durable_checkpoints(self, job: str) -> list[DurableRow]:
        rows = self._db.execute("SELECT step, attempt, url, bytes, seconds, committed FROM durable_checkpoints "
                                "WHERE job=? ORDER BY step, attempt", (job,))
        return [{"step": step, "attempt": attempt, "url": url, "bytes": size, "seconds": seconds,
                 "committed": committed} for step, attempt, url, size, seconds, committed in rows]

    def remove_durable(self, job: str, attempt: int, step: int) -> None:
        self._db.execute("DELETE FROM durable_checkpoints WHERE job=? AND attempt=? AND step=?", (job, attempt, step))
