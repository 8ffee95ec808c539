"""The agent's disk side of sync: atomic verified writes, and nothing outside the workdir."""

from __future__ import annotations

import errno
import hashlib
import os
import sys

import pytest

from agent import sync as node_sync
from agent import sync_durable as durable
from shared.file_batch import pack_batch
from shared.rpc import RemoteError


def _put(root: str, rows: list) -> dict:
    """put_files with [[path, mode, sha256, data], ...], as the head packs them."""
    return node_sync.put_files(root, pack_batch(rows))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_files_land_with_their_modes_and_no_temporary_is_left(tmp_path):
    root = str(tmp_path / "work")
    _put(root, [["bin/run.sh", 0o755, _sha(b"#!/bin/sh\n"), b"#!/bin/sh\n"],
                ["a.txt", 0o4644, _sha(b"a"), b"a"]])
    assert oct(os.stat(tmp_path / "work/bin/run.sh").st_mode & 0o7777) == oct(0o755)
    assert oct(os.stat(tmp_path / "work/a.txt").st_mode & 0o7777) == oct(0o644)  # no setuid from the wire
    assert sorted(os.listdir(tmp_path / "work/bin")) == ["run.sh"]


def test_content_that_does_not_match_its_hash_is_not_written(tmp_path):
    root = str(tmp_path / "work")
    with pytest.raises(RemoteError, match="does not match"):
        _put(root, [["a.txt", 0o644, _sha(b"other"), b"a"]])
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
        _put(str(root), [[bad, 0o644, _sha(b"x"), b"x"]])
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
    real_fsync, real_syncfs = os.fsync, durable.syncfs

    def fsync(fd):
        calls["fsync"] += 1
        return real_fsync(fd)

    def syncfs(path):
        calls["syncfs"] += 1
        return real_syncfs(path)

    monkeypatch.setattr(durable.os, "fsync", fsync)
    monkeypatch.setattr(durable, "syncfs", syncfs)
    return calls


def _batch(start: int, count: int) -> list:
    return [[f"d{i % 7}/f{i}.py", 0o644, _sha(f"x = {i}\n".encode()), f"x = {i}\n".encode()]
            for i in range(start, start + count)]


def test_batches_are_not_flushed_one_by_one_and_sync_state_makes_them_durable_once(tmp_path, monkeypatch):
    root = str(tmp_path / "work")
    calls = _flush_calls(monkeypatch)
    for start in range(0, 600, 200):
        _put(root, _batch(start, 200))
    assert calls == {"fsync": 0, "syncfs": 0}  # three batches written, renamed, nothing flushed yet
    assert durable.cache_for(root).entries == {}  # not in the hash cache before they are durable
    state = node_sync.sync_state(root, [], known=None)
    expected = {"syncfs": 1, "fsync": 0} if sys.platform.startswith("linux") else None
    if expected is not None:
        assert calls == expected, calls  # one syncfs for the whole sync
    else:
        assert calls["fsync"] >= 600  # elsewhere an fsync per file (and per directory) at the end only
    assert state["flushed"] == 600 and "files" not in state
    assert state["count"] == 607 and state["stats"]["directories"] == 7  # its 600 files and their 7 directories
    assert state["stats"]["hashed_files"] == 0  # the files it wrote are known: the check is a stat per file
    again = node_sync.sync_state(root, [], known=[state["tree_hash"]])
    assert again["flushed"] == 0 and again["tree_hash"] == state["tree_hash"] and "files" not in again
    assert calls["syncfs"] == (1 if expected else 0)  # nothing pending: nothing flushed again


def test_the_hash_cache_on_disk_names_a_written_file_only_once_it_is_durable(tmp_path, monkeypatch):
    """sync_state walks the tree while the disk flushes: the cache file is written only after the flush
    succeeded, and a flush that fails leaves no entry for the files (they are flushed next time)."""
    import time

    root = str(tmp_path / "work")
    cache_file = os.path.join(root, durable.CACHE_NAME)
    _put(root, _batch(0, 100))

    def cached_on_disk() -> bool:
        if not os.path.exists(cache_file):
            return False
        with open(cache_file, encoding="utf-8") as handle:
            return "d0/f0.py" in handle.read()

    seen: list[bool] = []
    real_syncfs = durable.syncfs

    def slow_syncfs(path):
        time.sleep(0.3)  # long after the walk is done
        seen.append(cached_on_disk())
        return real_syncfs(path)

    def failing_fsync(path):
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as patch:  # the flush fails: syncfs unavailable, then an fsync fails
        patch.setattr(durable, "syncfs", lambda path: False)
        patch.setattr(durable, "fsync_path", failing_fsync)
        with pytest.raises(OSError):
            node_sync.sync_state(root, [])
    assert not cached_on_disk() and "d0/f0.py" not in durable.cache_for(root).entries
    if sys.platform.startswith("linux"):
        monkeypatch.setattr(durable, "syncfs", slow_syncfs)
    state = node_sync.sync_state(root, [])
    assert state["flushed"] == 100 and state["count"] == 107 and state["stats"]["hashed_files"] == 0  # 7 dirs
    assert seen in ([False], []) and cached_on_disk()  # not on disk while flushing; on disk after


def _held_flush(monkeypatch, fail: bool = False):
    """The agent's flush, held until the returned event is set (then done for real, or failed)."""
    import threading

    gate = threading.Event()
    real = durable.make_durable

    def held(root, *taken):
        assert gate.wait(30)
        if fail:  # no syncfs, and the first fsync fails
            real_fsync, real_syncfs = durable.fsync_path, durable.syncfs
            durable.fsync_path = lambda path: (_ for _ in ()).throw(OSError(5, "Input/output error"))
            durable.syncfs = lambda path: False
            try:
                return real(root, *taken)
            finally:
                durable.fsync_path, durable.syncfs = real_fsync, real_syncfs
        return real(root, *taken)

    monkeypatch.setattr(durable, "make_durable", held)
    return gate


def _cached_on_disk(root: str, rel: str) -> bool:
    path = os.path.join(root, durable.CACHE_NAME)
    if not os.path.exists(path):
        return False
    with open(path, encoding="utf-8") as handle:
        return f'"{rel}"' in handle.read()


def test_sync_state_answers_while_its_flush_goes_on_and_the_cache_names_the_files_only_once_durable(
        tmp_path, monkeypatch):
    """The tree's hash proves a sync; the flush goes on behind the answer, as rsync's writes do. Until it has
    succeeded no scan writes the hash cache to disk (its entries for those files stay in memory: the scans
    meanwhile read none of them), and the flush's end writes it."""
    root = str(tmp_path / "work")
    _put(root, _batch(0, 100))
    gate = _held_flush(monkeypatch)
    state = node_sync.sync_state(root, [], known=[])
    assert state["flush"] == "under way" and state["flushed"] == 100 and state["count"] == 107
    assert state["stats"]["hashed_files"] == 0 and len(state["files"]) == 107
    described = node_sync.describe(root, [])  # a scan while the flush is under way
    assert described["tree_hash"] != state["tree_hash"]  # (files only: no directories in a describe)
    assert described["stats"]["hashed_files"] == 0 and not _cached_on_disk(root, "d0/f0.py")
    again = node_sync.sync_state(root, [])  # nothing new to flush: answered at once, the flush still going
    assert again["flushed"] == 0 and again["tree_hash"] == state["tree_hash"]
    assert not _cached_on_disk(root, "d0/f0.py") and not durable.wait_flushed(root, 0.1)
    gate.set()
    assert durable.wait_flushed(root, 30)
    assert _cached_on_disk(root, "d0/f0.py") and _cached_on_disk(root, "d1/f99.py")


def test_a_flush_that_fails_behind_the_answer_is_done_again_by_the_next_sync_state_which_waits_for_it(
        tmp_path, monkeypatch):
    root = str(tmp_path / "work")
    _put(root, _batch(0, 100))
    gate = _held_flush(monkeypatch, fail=True)
    state = node_sync.sync_state(root, [])
    assert state["flush"] == "under way"
    gate.set()
    assert durable.wait_flushed(root, 30)
    assert "d0/f0.py" not in durable.cache_for(root).entries and not _cached_on_disk(root, "d0/f0.py")
    with pytest.raises(OSError, match="Input/output error"):  # the disk still fails: this call says so
        node_sync.sync_state(root, [])
    monkeypatch.undo()
    retried = node_sync.sync_state(root, [])  # waited for: its files were put back to be flushed
    assert retried["flushed"] == 100 and retried["flush"] != "under way" and retried["tree_hash"] == state["tree_hash"]
    assert _cached_on_disk(root, "d0/f0.py")


def test_a_few_files_are_flushed_file_by_file_not_with_the_whole_filesystem(tmp_path, monkeypatch):
    root = str(tmp_path / "work")
    calls = _flush_calls(monkeypatch)
    _put(root, _batch(0, 3))
    node_sync.sync_state(root, [])
    assert calls["syncfs"] == 0 and calls["fsync"] == 3 + 3  # three files, their three directories


def test_sync_state_sends_the_listing_only_for_a_tree_the_head_does_not_know(tmp_path):
    root = tmp_path / "work"
    _put(str(root), _batch(0, 5))
    first = node_sync.sync_state(str(root), [], known=[])
    assert [f[0] for f in first["files"]] == sorted([f"d{i % 7}/f{i}.py" for i in range(5)] +
                                                    [f"d{i}" for i in range(5)])  # its directories too
    assert "files" not in node_sync.sync_state(str(root), [], known=[first["tree_hash"]])
    (root / "d1" / "f1.py").write_text("changed by hand\n")
    changed = node_sync.sync_state(str(root), [], known=[first["tree_hash"]])
    assert changed["tree_hash"] != first["tree_hash"] and len(changed["files"]) == 10


def test_a_batch_with_one_bad_hash_writes_nothing_and_a_failed_write_leaves_no_temporary(tmp_path):
    root = tmp_path / "work"
    batch = _batch(0, 4)
    batch[2] = [batch[2][0], 0o644, _sha(b"what the head hashed"), b"what arrived"]
    with pytest.raises(RemoteError, match="does not match its SHA256"):
        _put(str(root), batch)
    assert not root.exists() or list(root.rglob("*")) == []
    (root / "d3" / "f3.py").mkdir(parents=True)  # a directory where a file must go: its rename fails
    with pytest.raises(OSError):
        _put(str(root), _batch(0, 4))
    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))
    assert not [n for n in names if ".coord-" in n], names  # no temporary left behind
    assert node_sync.sync_state(str(root), [])["flushed"] == 3  # what landed before the failure is kept


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _temporaries(root) -> list[str]:
    return [p.name for p in root.rglob("*") if ".coord-" in p.name]


def _disk_fills_after(monkeypatch, room: int, code: int = errno.ENOSPC) -> None:
    """os.write takes what fits in ``room`` bytes more, then fails as a full disk does (a short write first)."""
    real_write = os.write
    left = [room]

    def write(fd, data):
        if left[0] <= 0:
            raise OSError(code, os.strerror(code))
        done = real_write(fd, bytes(memoryview(data)[:left[0]]))
        left[0] -= done
        return done

    monkeypatch.setattr(node_sync.os, "write", write)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd (Linux)")
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
def test_a_chunk_that_does_not_fit_ends_its_upload_and_says_where_and_how_much(tmp_path, monkeypatch, code):
    """A failed write ends the upload on the node there and then: no descriptor held, no temporary left,
    and the message names the directory, the bytes still to write and the bytes free."""
    from shared import protocol as p

    root = tmp_path / "work"
    data = os.urandom(3000)
    uploads = node_sync.Uploads()
    before = _open_fds()
    upload = uploads.begin(str(root), "models/big.bin", len(data), 0o644, _sha(data))["upload"]
    uploads.chunk(upload, 0, data[:1000])
    _disk_fills_after(monkeypatch, 400, code)
    with pytest.raises(RemoteError) as caught:
        uploads.chunk(upload, 1000, data[1000:])
    assert caught.value.code == p.NO_SPACE
    message = caught.value.message
    assert f"no space left in {root}/models" in message, message
    assert "(2000 bytes) still to write" in message and " free" in message, message
    assert os.strerror(code) in message
    assert _open_fds() == before and uploads.open_count() == 0
    assert _temporaries(root) == [] and not (root / "models" / "big.bin").exists()
    with pytest.raises(RemoteError, match="no upload"):  # a retry of the chunk finds nothing open
        uploads.chunk(upload, 1000, data[1000:])


def test_a_short_write_is_completed_not_taken_for_the_whole_chunk(tmp_path, monkeypatch):
    """os.write may write part of a chunk: the rest is written too, so the file has every byte it was hashed with."""
    real_write = os.write
    monkeypatch.setattr(node_sync.os, "write", lambda fd, data: real_write(fd, bytes(memoryview(data)[:100])))
    root = tmp_path / "work"
    data = os.urandom(3000)
    uploads = node_sync.Uploads()
    upload = uploads.begin(str(root), "big.bin", len(data), 0o644, _sha(data))["upload"]
    uploads.chunk(upload, 0, data[:1500])
    uploads.chunk(upload, 1500, data[1500:])
    monkeypatch.undo()
    uploads.finish(upload)
    assert (root / "big.bin").read_bytes() == data


def test_a_file_too_large_for_the_node_says_so(tmp_path, monkeypatch):
    root = tmp_path / "work"
    data = os.urandom(2000)
    uploads = node_sync.Uploads()
    upload = uploads.begin(str(root), "big.bin", len(data), 0o644, _sha(data))["upload"]
    _disk_fills_after(monkeypatch, 0, errno.EFBIG)
    with pytest.raises(RemoteError, match="file size limit") as caught:
        uploads.chunk(upload, 0, data)
    assert str(root / "big.bin") in caught.value.message and uploads.open_count() == 0
    assert _temporaries(root) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd (Linux)")
def test_a_batch_that_fills_the_disk_says_so_and_keeps_what_landed_before(tmp_path, monkeypatch):
    from shared import protocol as p

    root = tmp_path / "work"
    batch = [[f"pkg/f{i}.py", 0o644, _sha(bytes([i]) * 100), bytes([i]) * 100] for i in range(10)]
    before = _open_fds()
    _disk_fills_after(monkeypatch, 450)  # four files and half of the fifth
    with pytest.raises(RemoteError) as caught:
        _put(str(root), batch)
    monkeypatch.undo()
    assert caught.value.code == p.NO_SPACE
    assert f"no space left in {root}/pkg" in caught.value.message
    assert "600 B still to write" in caught.value.message  # from the fifth file on, of this batch
    assert _open_fds() == before and _temporaries(root) == []
    assert sorted(p.name for p in (root / "pkg").iterdir()) == [f"f{i}.py" for i in range(4)]


def test_uploads_left_open_are_ended_with_the_session(tmp_path):
    """The agent's serve ends every upload its session left open (the head went away mid-file)."""
    import asyncio

    from agent import server

    data = os.urandom(3000)
    root = tmp_path / "work"
    uploads = node_sync.Uploads()
    uploads.begin(str(root), "a.bin", len(data), 0o644, _sha(data))
    uploads.begin(str(root), "b.bin", len(data), 0o644, _sha(data))
    assert len(_temporaries(root)) == 2

    class Closed:
        async def readexactly(self, n):
            raise asyncio.IncompleteReadError(b"", n)

    class Sink:
        def write(self, data):
            pass

        async def drain(self):
            pass

        def close(self):
            pass

    real = node_sync.Uploads
    node_sync.Uploads = lambda: uploads  # the session's own uploads: these two
    try:
        asyncio.run(server.serve(Closed(), Sink()))
    finally:
        node_sync.Uploads = real
    assert uploads.open_count() == 0 and _temporaries(root) == []


def test_a_file_replaces_a_link_or_fifo_at_its_name_and_never_writes_through_it(tmp_path):
    """A file is renamed into place: what stood at its name (a link out of the workdir, a FIFO) is replaced,
    not followed, so the write reaches nothing outside and no per-file check is needed to keep it so."""
    root = tmp_path / "work"
    root.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("not the node's to change\n")
    os.symlink(outside, root / "data.txt")
    os.mkfifo(root / "pipe")
    _put(str(root), [["data.txt", 0o644, _sha(b"synced\n"), b"synced\n"],
                     ["pipe", 0o644, _sha(b"p"), b"p"]])
    assert not os.path.islink(root / "data.txt") and (root / "data.txt").read_bytes() == b"synced\n"
    assert outside.read_text() == "not the node's to change\n"
    assert (root / "pipe").read_bytes() == b"p"
