"""A batch of small files as columns: what goes in comes out, and a batch whose fields disagree is refused."""

from __future__ import annotations

import hashlib

import pytest

from shared.file_batch import BadBatch, pack_batch, unpack_batch


def _row(path: str, data: bytes, mode: int = 0o644) -> tuple[str, int, str, bytes]:
    return path, mode, hashlib.sha256(data).hexdigest(), data


def test_files_come_back_as_they_went_in_with_empty_files_and_names_outside_ascii():
    rows = [_row("a.py", b"x = 1\n"), _row("bin/run.sh", b"#!/bin/sh\n", 0o755), _row("empty", b""),
            _row("données/é.txt", bytes(range(256)) * 3)]
    batch = pack_batch(rows)
    assert batch["count"] == 4 and len(batch["data"]) == sum(len(r[3]) for r in rows)
    back = unpack_batch(batch)
    assert [(path, mode, digest.hex(), bytes(data)) for path, mode, digest, data in back] == rows


def _batch(**changes: object) -> dict:
    batch = dict(pack_batch([_row("a", b"aa"), _row("b", b"bbb")]))
    batch.update(changes)
    return batch


@pytest.mark.parametrize(("changes", "said"), [
    ({"count": 3}, "a batch of 3 files has 2 paths"),
    ({"paths": "a\0b\0c"}, "has 3 paths"),
    ({"modes": b"\x01\xa4"}, "1 modes"),
    ({"sizes": b"\0\0\0\2"}, "1 sizes"),
    ({"sha256": b"\0" * 32}, "1 digests"),
    ({"data": b"aabbbb"}, "sizes add up to 5 bytes, its data is 6"),
    ({"data": "aabbb"}, "a batch is"),
    ({"count": True}, None),
    ({"count": 0, "paths": "", "modes": b"", "sizes": b"", "sha256": b"", "data": b""}, "at least one file"),
])
def test_a_batch_whose_fields_disagree_is_refused_saying_how(changes, said):
    with pytest.raises(BadBatch) as caught:
        unpack_batch(_batch(**changes))
    if said is not None:
        assert said in str(caught.value)


def test_a_missing_field_is_refused():
    batch = _batch()
    del batch["sha256"]
    with pytest.raises(BadBatch, match="a batch is"):
        unpack_batch(batch)
