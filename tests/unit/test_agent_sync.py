"""The agent's disk side of sync: atomic verified writes, and nothing outside the workdir."""

from __future__ import annotations

import hashlib
import os
import sys

import pytest

from agent import sync as node_sync
from shared.rpc import RemoteError


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_files_land_with_their_modes_and_no_temporary_is_left(tmp_path):
    root = str(tmp_path / "work")
    node_sync.put_files(root, [["bin/run.sh", 0o755, _sha(b"#!/bin/sh\n"), b"#!/bin/sh\n"],
                               ["a.txt", 0o4644, _sha(b"a"), b"a"]])
    assert oct(os.stat(tmp_path / "work/bin/run.sh").st_mode & 0o7777) == oct(0o755)
    assert oct(os.stat(tmp_path / "work/a.txt").st_mode & 0o7777) == oct(0o644)  # no setuid from the wire
    assert sorted(os.listdir(tmp_path / "work/bin")) == ["run.sh"]


def test_content_that_does_not_match_its_hash_is_not_written(tmp_path):
    root = str(tmp_path / "work")
    with pytest.raises(RemoteError, match="does not match"):
        node_sync.put_files(root, [["a.txt", 0o644, _sha(b"other"), b"a"]])
    assert os.listdir(root) == []


@pytest.mark.parametrize("bad", ["../escape.txt", "/tmp/abs.txt", "sub/../../escape.txt", "link/x.txt"])
def test_traversal_attempts_are_refused_and_nothing_is_written_outside(tmp_path, bad):
    root = tmp_path / "work"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, root / "link")
    before = sorted(p for p in tmp_path.rglob("*"))
    with pytest.raises(RemoteError) as caught:
        node_sync.put_files(str(root), [[bad, 0o644, _sha(b"x"), b"x"]])
    assert bad.split("/")[0] in caught.value.message or "refused" in caught.value.message
    with pytest.raises(RemoteError):
        node_sync.Uploads().begin(str(root), bad, 1, 0o644, _sha(b"x"))
    with pytest.raises(RemoteError):
        node_sync.delete_files(str(root), [bad])
    assert sorted(p for p in tmp_path.rglob("*")) == before
    assert list(outside.iterdir()) == []


def test_a_chunked_upload_is_renamed_only_when_complete_and_verified(tmp_path):
    root = str(tmp_path / "work")
    data = os.urandom(3000)
    uploads = node_sync.Uploads()
    upload = uploads.begin(root, "big.bin", len(data), 0o644, _sha(data))["upload"]
    uploads.chunk(upload, 0, data[:1000])
    assert not os.path.exists(os.path.join(root, "big.bin"))
    with pytest.raises(RemoteError, match="expected 1000"):
        uploads.chunk(upload, 5, data[1000:])
    upload = uploads.begin(root, "big.bin", len(data), 0o644, _sha(data))["upload"]
    uploads.chunk(upload, 0, data[:1000])
    uploads.chunk(upload, 1000, data[1000:])
    uploads.finish(upload)
    assert open(os.path.join(root, "big.bin"), "rb").read() == data
    assert os.listdir(root) == ["big.bin"]


def test_an_upload_whose_bytes_do_not_match_its_sha256_is_refused_and_leaves_nothing(tmp_path):
    """What a replica copy lands on: bytes changed on the way are never renamed into place."""
    root = str(tmp_path / "work")
    data = os.urandom(3000)
    uploads = node_sync.Uploads()
    upload = uploads.begin(root, "ckpt/0000010_adapters.safetensors", len(data), 0o644, _sha(data))["upload"]
    uploads.chunk(upload, 0, data[:1000])
    uploads.chunk(upload, 1000, b"\xff" + data[1001:])  # one byte flipped, the size still right
    with pytest.raises(RemoteError, match="does not match its size and SHA256"):
        uploads.finish(upload)
    assert os.listdir(os.path.join(root, "ckpt")) == []  # neither the file nor its temporary


def test_inspect_reports_hashes_line_counts_and_missing_files(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
    found = node_sync.inspect_files(str(tmp_path), ["d.jsonl", "nope.txt"], count_lines=True)["files"]
    assert found["d.jsonl"]["lines"] == 2 and found["nope.txt"] is None


@pytest.mark.parametrize("patterns", [[], ["!.coord/"], ["*.tmp", "!.coord/hashcache.json"]],
                         ids=["no-patterns", "negated", "negated-file"])
def test_nothing_under_a_coord_directory_is_ever_in_a_manifest(tmp_path, patterns):
    """The model check asks for a manifest with no patterns, and the agent keeps its hash cache in
    <tree>/.coord/: a second run on the same model must not see its own cache as a model file."""
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (model / "weights.safetensors").write_bytes(b"w" * 100)
    (model / "sub" / "config.json").write_text("{}")
    before = node_sync.describe(str(model), patterns)["files"]
    assert (model / ".coord" / "hashcache.json").exists()  # the agent wrote its cache there
    (model / "sub" / ".coord").mkdir()
    (model / "sub" / ".coord" / "progress.jsonl").write_text("{}\n")
    (model / ".coord" / "hashcache.json").write_text('{"other": "node"}')
    after = node_sync.describe(str(model), patterns)["files"]
    assert sorted(f[0] for f in after) == ["sub/config.json", "weights.safetensors"]
    assert after == before


def _flush_calls(monkeypatch) -> dict[str, int]:
    """Count the agent's flushes (fsync of any fd, syncfs of a filesystem)."""
    calls = {"fsync": 0, "syncfs": 0}
    real_fsync, real_syncfs = os.fsync, node_sync._syncfs

    def fsync(fd):
        calls["fsync"] += 1
        return real_fsync(fd)

    def syncfs(path):
        calls["syncfs"] += 1
        return real_syncfs(path)

    monkeypatch.setattr(node_sync.os, "fsync", fsync)
    monkeypatch.setattr(node_sync, "_syncfs", syncfs)
    return calls


def _batch(start: int, count: int) -> list:
    return [[f"d{i % 7}/f{i}.py", 0o644, _sha(f"x = {i}\n".encode()), f"x = {i}\n".encode()]
            for i in range(start, start + count)]


def test_batches_are_not_flushed_one_by_one_and_sync_state_makes_them_durable_once(tmp_path, monkeypatch):
    root = str(tmp_path / "work")
    calls = _flush_calls(monkeypatch)
    for start in range(0, 600, 200):
        node_sync.put_files(root, _batch(start, 200))
    assert calls == {"fsync": 0, "syncfs": 0}  # three batches written, renamed, nothing flushed yet
    assert node_sync.cache_for(root).entries == {}  # not in the hash cache before they are durable
    state = node_sync.sync_state(root, [], known=None)
    expected = {"syncfs": 1, "fsync": 0} if sys.platform.startswith("linux") else None
    if expected is not None:
        assert calls == expected, calls  # one syncfs for the whole sync
    else:
        assert calls["fsync"] >= 600  # elsewhere an fsync per file (and per directory) at the end only
    assert state["flushed"] == 600 and state["count"] == 600 and "files" not in state
    assert state["stats"]["hashed_files"] == 0  # the files it wrote are known: the check is a stat per file
    again = node_sync.sync_state(root, [], known=[state["tree_hash"]])
    assert again["flushed"] == 0 and again["tree_hash"] == state["tree_hash"] and "files" not in again
    assert calls["syncfs"] == (1 if expected else 0)  # nothing pending: nothing flushed again


def test_the_hash_cache_on_disk_names_a_written_file_only_once_it_is_durable(tmp_path, monkeypatch):
    """sync_state walks the tree while the disk flushes: the cache file is written only after the flush
    succeeded, and a flush that fails leaves no entry for the files (they are flushed next time)."""
    import time

    root = str(tmp_path / "work")
    cache_file = os.path.join(root, node_sync.CACHE_NAME)
    node_sync.put_files(root, _batch(0, 100))

    def cached_on_disk() -> bool:
        if not os.path.exists(cache_file):
            return False
        with open(cache_file, encoding="utf-8") as handle:
            return "d0/f0.py" in handle.read()

    seen: list[bool] = []
    real_syncfs = node_sync._syncfs

    def slow_syncfs(path):
        time.sleep(0.3)  # long after the walk is done
        seen.append(cached_on_disk())
        return real_syncfs(path)

    def failing_fsync(path):
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as patch:  # the flush fails: syncfs unavailable, then an fsync fails
        patch.setattr(node_sync, "_syncfs", lambda path: False)
        patch.setattr(node_sync, "_fsync_path", failing_fsync)
        with pytest.raises(OSError):
            node_sync.sync_state(root, [])
    assert not cached_on_disk() and "d0/f0.py" not in node_sync.cache_for(root).entries
    if sys.platform.startswith("linux"):
        monkeypatch.setattr(node_sync, "_syncfs", slow_syncfs)
    state = node_sync.sync_state(root, [])
    assert state["flushed"] == 100 and state["count"] == 100 and state["stats"]["hashed_files"] == 0
    assert seen in ([False], []) and cached_on_disk()  # not on disk while flushing; on disk after


def test_a_few_files_are_flushed_file_by_file_not_with_the_whole_filesystem(tmp_path, monkeypatch):
    root = str(tmp_path / "work")
    calls = _flush_calls(monkeypatch)
    node_sync.put_files(root, _batch(0, 3))
    node_sync.sync_state(root, [])
    assert calls["syncfs"] == 0 and calls["fsync"] == 3 + 3  # three files, their three directories


def test_sync_state_sends_the_listing_only_for_a_tree_the_head_does_not_know(tmp_path):
    root = tmp_path / "work"
    node_sync.put_files(str(root), _batch(0, 5))
    first = node_sync.sync_state(str(root), [], known=[])
    assert [f[0] for f in first["files"]] == sorted(f"d{i % 7}/f{i}.py" for i in range(5))
    assert "files" not in node_sync.sync_state(str(root), [], known=[first["tree_hash"]])
    (root / "d1" / "f1.py").write_text("changed by hand\n")
    changed = node_sync.sync_state(str(root), [], known=[first["tree_hash"]])
    assert changed["tree_hash"] != first["tree_hash"] and len(changed["files"]) == 5


def test_a_batch_with_one_bad_hash_writes_nothing_and_a_failed_write_leaves_no_temporary(tmp_path):
    root = tmp_path / "work"
    batch = _batch(0, 4)
    batch[2] = [batch[2][0], 0o644, _sha(b"what the head hashed"), b"what arrived"]
    with pytest.raises(RemoteError, match="does not match its SHA256"):
        node_sync.put_files(str(root), batch)
    assert not root.exists() or list(root.rglob("*")) == []
    (root / "d3" / "f3.py").mkdir(parents=True)  # a directory where a file must go: its rename fails
    with pytest.raises(OSError):
        node_sync.put_files(str(root), _batch(0, 4))
    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))
    assert not [n for n in names if ".coord-" in n], names  # no temporary left behind
    assert node_sync.sync_state(str(root), [])["flushed"] == 3  # what landed before the failure is kept
