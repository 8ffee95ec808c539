"""The agent's part of a checkpoint's upload to the store: parts of one file, each put to a URL the
head signed for it (agent/store_put.py)."""

from __future__ import annotations

from typing import TypedDict


class StorePart(TypedDict):
    offset: int
    size: int
    url: str  # signed by the head for this one object, with a short expiry
    headers: dict[str, str]  # what the store needs beside the signature (Azure's blob type)


class _StorePutRequired(TypedDict):
    workdir: str
    path: str
    sha256: str  # the file's, as catalogued: checked before a byte goes
    parts: list[StorePart]


class StorePutRequest(_StorePutRequired, total=False):
    bandwidth: float | None  # bytes per second for this node's uploads (--store-bandwidth)


class _StorePutDone(TypedDict):
    size: int  # the part's bytes as the file holds them, and their SHA256
    sha256: str


class StorePutDone(_StorePutDone, total=False):
    encoding: str  # "zstd": the part went compressed (agent/store_put.py says when)
    stored: int  # its bytes in the store


class StorePutReply(TypedDict):
    parts: list[StorePutDone]  # in the order asked
    seconds: float
