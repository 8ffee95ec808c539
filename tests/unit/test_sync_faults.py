"""The head's side of a sync that fails on a node: every upload it started is ended on the node, the
report credits a node with what landed only, and the summary says why each node failed."""

from __future__ import annotations

import hashlib
import io
import os
from types import SimpleNamespace

import anyio
import pytest

from coordinator.commands.sync import render_sync
from coordinator.readiness import push
from shared import protocol as p
from shared.rpc import RemoteError


def _source(tmp_path, files: dict[str, bytes]) -> dict:
    for rel, data in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    return {rel: [len(data), 0o644, hashlib.sha256(data).hexdigest()] for rel, data in files.items()}


def _session(call):
    return SimpleNamespace(node=SimpleNamespace(name="n1", workdir="/w"), call=call)


def test_an_upload_whose_chunk_fails_on_the_node_is_aborted_there(tmp_path):
    source = _source(tmp_path, {"w.bin": os.urandom(push.CHUNK_BYTES * 2)})
    calls = []

    async def call(method, args, timeout=None):
        calls.append((method, args))
        if method == "upload_begin":
            return {"upload": 7}
        if method == "upload_chunk" and args["offset"] > 0:
            raise RemoteError(p.NO_SPACE, "no space left in /w")
        return {}

    with pytest.raises(RemoteError, match="no space left"):
        anyio.run(push.sync_node, _session(call), str(tmp_path), source, push.plan_sync(source, {}, delete=False))
    assert [m for m, _ in calls] == ["upload_begin", "upload_chunk", "upload_chunk", "upload_abort"]
    assert calls[-1][1] == {"upload": 7}


def test_an_upload_cancelled_by_another_files_failure_is_aborted_too(tmp_path):
    """A batch refused on the node cancels the large file being sent beside it: that upload is ended on
    the node, not left open holding a descriptor and a temporary until the session ends."""
    source = _source(tmp_path, {"a.py": b"x = 1\n", "w.bin": os.urandom(push.CHUNK_BYTES * 3)})
    calls = []
    chunk_started = anyio.Event()

    async def call(method, args, timeout=None):
        calls.append(method)
        if method == "upload_begin":
            return {"upload": 9}
        if method == "upload_chunk":
            chunk_started.set()
            await anyio.sleep(30)  # still being written when the batch fails
        if method == "put_files":
            await chunk_started.wait()
            raise RemoteError(p.REFUSED, "refused path")
        return {}

    with pytest.raises(RemoteError, match="refused path"):
        anyio.run(push.sync_node, _session(call), str(tmp_path), source, push.plan_sync(source, {}, delete=False))
    assert "upload_abort" in calls and "upload_finish" not in calls


def test_a_node_is_credited_with_what_it_holds_afterwards_not_with_what_it_was_sent():
    source = {"a.py": [10, 0o644, "ha"], "b.py": [20, 0o644, "hb"], "w.bin": [3000, 0o644, "hw"]}
    after = {"a.py": [10, 0o644, "ha"], "b.py": [20, 0o644, "old"], "other.txt": [1, 0o644, "ho"]}
    assert push.landed_count(["a.py", "b.py", "w.bin"], source, after) == {
        "files": 1, "bytes": 10, "planned_files": 3, "planned_bytes": 3030}
    assert push.landed_count([], source, after)["files"] == 0


def _rendered(report) -> str:
    from rich.console import Console

    out = io.StringIO()
    render_sync(report, Console(file=out, width=200))
    return out.getvalue()


def test_the_report_shows_what_landed_on_a_failed_node():
    plan = push.SyncPlan(send=["a.py", "b.py", "w.bin"], bytes_to_send=3030).as_dict()
    report = {"source": "/src", "source_files": 3, "source_bytes": 3030, "hook": None, "status": "failed",
              "detail": "not synced: n2 (no space left in /w/n2)",
              "nodes": {"n1": {"plan": plan, "status": "synced",
                               "landed": {"files": 3, "bytes": 3030, "planned_files": 3, "planned_bytes": 3030}},
                        "n2": {"plan": plan, "status": "failed", "detail": "no space left in /w/n2",
                               "landed": {"files": 1, "bytes": 10, "planned_files": 3, "planned_bytes": 3030}},
                        "n3": {"plan": plan, "status": "failed", "detail": "not verified: node n3 is not up"}}}
    text = _rendered(report)
    rows = {line.split()[0]: line for line in text.splitlines() if line.split()[:1] in (["n1"], ["n2"], ["n3"])
            and len(line.split()) > 3}
    assert "3 " in rows["n1"] and "1 of 3" in rows["n2"] and "10 B of 3.0 KiB" in rows["n2"], text
    assert " ? " in rows["n3"], text  # not asked afterwards: nothing is claimed for it
