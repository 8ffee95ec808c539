"""A checkpoint copy to the head: written under its name only when its bytes match the SHA256
recorded at validation; otherwise refused, with nothing left behind."""

from __future__ import annotations

import hashlib

import anyio
import pytest

from coordinator.jobs.transfer import CHUNK, CheckpointDamaged, HeadSink, HeadSource, copy_verified


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "node" / "0000020_adapters.safetensors"
    path.parent.mkdir()
    path.write_bytes(bytes(range(256)) * (CHUNK // 256 + 1000))  # more than one chunk
    return path


def test_a_copy_whose_bytes_match_is_renamed_into_place(checkpoint, tmp_path):
    data = checkpoint.read_bytes()
    target = tmp_path / "replicas" / checkpoint.name
    written = anyio.run(lambda: copy_verified(HeadSource(checkpoint), [HeadSink(target)], size=len(data),
                                              sha256=hashlib.sha256(data).hexdigest()))
    assert written == [str(target)] and target.read_bytes() == data
    assert [p.name for p in target.parent.iterdir()] == [checkpoint.name]


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_copy_that_no_longer_matches_its_recorded_hash_is_refused_and_leaves_nothing(checkpoint, tmp_path, damage):
    recorded = checkpoint.read_bytes()
    size, sha256 = len(recorded), hashlib.sha256(recorded).hexdigest()
    with open(checkpoint, "r+b") as handle:  # changed on the node after it was validated
        if damage == "flipped":
            handle.seek(CHUNK + 10)
            handle.write(b"\x00\xff")
        else:
            handle.truncate(size - 1)
    target = tmp_path / "replicas" / checkpoint.name
    with pytest.raises(CheckpointDamaged, match="no longer matches"):
        anyio.run(lambda: copy_verified(HeadSource(checkpoint), [HeadSink(target)], size=size, sha256=sha256))
    assert not target.exists()
    assert list(target.parent.iterdir()) == []  # no partial file either
