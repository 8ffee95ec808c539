"""A checkpoint copy re-checked at a resume is read again only when it changed since the agent hashed it."""

from __future__ import annotations

import hashlib
import os

from agent import ranks


def test_an_unchanged_copy_is_not_read_again_and_a_changed_one_is(tmp_path, monkeypatch):
    path = tmp_path / "0000010_adapters.safetensors"
    path.write_bytes(b"a" * 4096)
    reads: list[str] = []
    real = ranks.sha256_file
    monkeypatch.setattr(ranks, "sha256_file", lambda p, size=None: reads.append(p) or real(p, size))
    assert ranks.sha256_remembered(str(path)) == hashlib.sha256(b"a" * 4096).hexdigest()
    assert ranks.hash_file(str(tmp_path), path.name)["sha256"] == hashlib.sha256(b"a" * 4096).hexdigest()
    assert len(reads) == 1
    with open(path, "r+b") as handle:  # same size, other bytes: its mtime moves
        handle.seek(100)
        handle.write(b"b")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert ranks.hash_file(str(tmp_path), path.name)["sha256"] != hashlib.sha256(b"a" * 4096).hexdigest()
    assert len(reads) == 2
