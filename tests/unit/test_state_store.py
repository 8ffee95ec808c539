"""The SQLite state store: checkpoints with their replicas, and the upgrade of an older database."""

from __future__ import annotations

import sqlite3

from coordinator.store.state import SCHEMA_VERSION, StateStore

V1_CHECKPOINTS = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES ('schema', '1');
CREATE TABLE checkpoints (job TEXT NOT NULL, step INTEGER NOT NULL, attempt INTEGER NOT NULL, node TEXT NOT NULL,
    path TEXT NOT NULL, sha256 TEXT, size INTEGER, valid INTEGER NOT NULL, detail TEXT, created REAL NOT NULL,
    PRIMARY KEY (job, attempt, path));
INSERT INTO checkpoints VALUES ('j', 10, 0, 'n1', '/w/checkpoints/j/attempt-0/0000010_adapters.safetensors',
    'ab', 5, 1, 'ok', 1.0);
"""


def test_a_checkpoint_and_its_replica_are_two_copies(tmp_path):
    store = StateStore(tmp_path / "state.db")
    entry = {"step": 10, "attempt": 0, "path": "/w/c/0000010_adapters.safetensors", "sha256": "ab", "size": 5,
             "valid": True}
    store.add_checkpoint("j", {**entry, "node": "n1"})
    store.add_checkpoint("j", {**entry, "node": "n2", "role": "replica"})
    copies = store.checkpoints("j")
    assert [(c["node"], c["role"]) for c in copies] == [("n1", "primary"), ("n2", "replica")]
    store.remove_checkpoint("j", 0, "n2", entry["path"])
    assert [c["node"] for c in store.checkpoints("j")] == ["n1"]


def test_a_schema_1_database_is_upgraded_with_its_checkpoints_kept(tmp_path):
    path = tmp_path / "state.db"
    old = sqlite3.connect(path)
    old.executescript(V1_CHECKPOINTS)
    old.close()
    store = StateStore(path)
    (copy,) = store.checkpoints("j")
    assert copy["step"] == 10 and copy["node"] == "n1" and copy["role"] == "primary" and copy["valid"]
    store.close()
    again = sqlite3.connect(path)
    assert again.execute("SELECT value FROM meta WHERE key='schema'").fetchone()[0] == str(SCHEMA_VERSION)


def test_a_schema_4_database_keeps_its_metric_points_and_gains_the_scaling_columns(tmp_path):
    from coordinator.observe.metrics.history import MetricsHistory

    path = tmp_path / "state.db"
    StateStore(path).close()
    old = sqlite3.connect(path)  # as schema 4 left it: metric_points without the two columns
    old.executescript("""
        DROP TABLE metric_points;
        CREATE TABLE metric_points (run_id TEXT NOT NULL, series TEXT NOT NULL, step INTEGER NOT NULL,
            attempt INTEGER NOT NULL, ts REAL NOT NULL, loss REAL, learning_rate REAL, tokens_per_second REAL,
            peak_memory_bytes INTEGER, rank_memory TEXT, PRIMARY KEY (run_id, series, step)) WITHOUT ROWID;
        INSERT INTO metric_points VALUES ('r', 'train', 1, 0, 5.0, 2.5, NULL, 100.0, NULL, NULL);
        UPDATE meta SET value='4' WHERE key='schema';
    """)
    old.commit()
    old.close()
    store = StateStore(path)
    history = MetricsHistory(store.connection, runs_of=lambda run_id: [("r", "j")])
    history.add_point("r", "train", {"step": 2, "attempt": 0, "time": 6.0, "loss": 2.0, "samples_per_second": 8.0,
                                     "comm_seconds": 0.01})
    (run,) = history.document(run_id="r")["runs"]
    assert run["train"]["loss"] == [2.5, 2.0] and run["train"]["tokens_per_second"] == [100.0, None]
    assert run["train"]["samples_per_second"] == [None, 8.0] and run["train"]["comm_seconds"] == [None, 0.01]
    store.close()
    assert sqlite3.connect(path).execute("SELECT value FROM meta WHERE key='schema'").fetchone()[0] == "5"
