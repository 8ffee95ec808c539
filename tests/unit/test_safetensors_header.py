"""The one safetensors header reader (shared/safetensors_header.py), used by the plan's sizing
and by the trainer's checkpoint reader."""

from __future__ import annotations

import json
import struct

import pytest

from agent.trainer.safetensors_file import HostTensor, read_header, write_atomic
from coordinator.plan.model_shape import SizingError, read_safetensors_header
from shared import safetensors_header
from shared.safetensors_header import HeaderError, read_header_block, tensor_entries


def safetensors_bytes(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


ENTRY = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def test_the_header_comes_back_whole_with_where_the_data_starts(tmp_path):
    path = tmp_path / "a.safetensors"
    header = {"__metadata__": {"step": "3"}, "w": ENTRY}
    path.write_bytes(safetensors_bytes(header, b"\0" * 8))
    parsed, start = read_header_block(path)
    assert parsed == header
    assert start == path.stat().st_size - 8
    assert tensor_entries(parsed, path) == {"w": ENTRY}


def test_the_trainer_and_the_sizing_read_the_same_file(tmp_path):
    path = tmp_path / "adapters.safetensors"
    write_atomic(str(path), {"w": HostTensor("F32", (2,), bytes(8))}, {"step": "7"})
    assert read_header(str(path))["__metadata__"] == {"step": "7"}
    assert read_safetensors_header(path) == {"w": ENTRY}


@pytest.mark.parametrize("content, message", [
    (b"\x00" * 4, "too short for a safetensors file"),
    (struct.pack("<Q", 2**40), r"header length \d+ is over the format's 100 MB limit"),
    (struct.pack("<Q", 50) + b"{}", r"header cut short \(2 of 50 bytes\)"),
    (struct.pack("<Q", 2) + b"[]", "header is not a JSON object"),
    (struct.pack("<Q", 3) + b"{x}", "header is not JSON"),
    (struct.pack("<Q", 2) + b"\xff\xfe", "header is not JSON"),
])
def test_a_file_that_is_not_safetensors_is_refused_naming_the_file(tmp_path, content, message):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    for reader in (safetensors_header.read_header, lambda p: read_header(str(p))):
        with pytest.raises(HeaderError, match=f"bad.safetensors: {message}"):
            reader(path)
    with pytest.raises(SizingError, match=f"bad.safetensors: {message}"):
        read_safetensors_header(path)


def test_a_tensor_entry_without_its_fields_is_refused(tmp_path):
    path = tmp_path / "m.safetensors"
    path.write_bytes(safetensors_bytes({"w": {"dtype": "F32"}}))
    assert read_header(str(path)) == {"w": {"dtype": "F32"}}  # the trainer reads only the metadata
    with pytest.raises(SizingError, match="m.safetensors: tensor 'w' has no dtype, shape and data_offsets"):
        read_safetensors_header(path)


def test_a_missing_file_raises_the_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        safetensors_header.read_header(tmp_path / "none.safetensors")
