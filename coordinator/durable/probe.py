"""Pre-flight's look at the checkpoint store: write a small object, list it, read it back, remove it.

Each step needs its own permission, so a store that lets coord write but not list (or read, or
remove) is told exactly which one is missing, before a run depends on it; a store that does not answer
is told apart from one that refuses (the first may be back by the first checkpoint, the second never)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from coordinator.durable.objects import ObjectStore, StoreError

PROBE_PREFIX = ".coord-probe"
#: What each step needs on S3 (and what the others call the same right).
_PERMISSION = {"write": "s3:PutObject", "list": "s3:ListBucket", "read": "s3:GetObject", "remove": "s3:DeleteObject"}


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    kind: str  # "" when ok; else the StoreError's kind, or "mismatch"
    detail: str


async def probe(store: ObjectStore) -> ProbeResult:
    key = f"{PROBE_PREFIX}/{secrets.token_hex(8)}"
    data = secrets.token_bytes(64)
    step = "write"
    try:
        await store.put(key, data)
        step = "list"
        listed = await store.list_objects(PROBE_PREFIX + "/")
        if not any(o.key == key for o in listed):
            return ProbeResult(False, "mismatch", f"{store.location.url}: an object just written is not listed; "
                               "the store may not be consistent, or the prefix is not what coord lists")
        step = "read"
        if await store.get(key) != data:
            return ProbeResult(False, "mismatch", f"{store.location.url}: an object read back is not what was "
                               "written")
        step = "remove"
        await store.delete([key])
    except StoreError as exc:
        hint = exc.hint
        if exc.kind == "denied" and store.location.scheme == "s3":
            hint = (f"the credentials may not {step} objects under {store.location.url} "
                    f"({_PERMISSION[step]} is needed, with the other three of s3:PutObject, s3:ListBucket, "
                    "s3:GetObject and s3:DeleteObject)")
        return ProbeResult(False, exc.kind, f"{step} failed: {exc.message}" + (f": {hint}" if hint else ""))
    return ProbeResult(True, "", f"{store.location.url}: wrote, listed, read back and removed a test object")
