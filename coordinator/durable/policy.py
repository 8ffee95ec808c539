"""What goes to the checkpoint store, what it keeps, and how far behind it is. Pure.

- **What to upload**: the newest valid checkpoint newer than the newest durable one (committed in
  the store). Newest first: when uploads fall behind the checkpoints, the ones in between are
  skipped, so the store is never more than one upload behind the newest checkpoint once it catches up.
- **What the store keeps** (``--store-keep N``, ``--store-keep-every K``): the newest N committed
  checkpoints, and every one whose step is a multiple of K; never the newest committed one.
- **What the nodes keep**: while a store is set, no copy of a checkpoint newer than the newest
  durable one is removed by local retention: until it is in the store, it is the run's only
  protection against losing the cluster.
- **Room on the nodes**: while checkpoints are held for the store, a node whose disk has room for
  fewer than ``ROOM_AT_LEAST`` more of them (the newest's size) is said, before the disk fills and a
  rank's save fails.
- **The lag**: in steps, the newest valid checkpoint's step over the newest durable one's; in
  seconds, how long the oldest checkpoint not yet durable (newer than the newest durable) has waited."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from coordinator.store.state import CheckpointRow, DurableRow


@dataclass(frozen=True)
class Lag:
    durable_step: int | None
    steps: int
    seconds: float


def _key(row: CheckpointRow | DurableRow) -> tuple[int, int]:
    return row["step"], row["attempt"]


def newest_durable(durable: list[DurableRow]) -> DurableRow | None:
    return max(durable, key=_key, default=None)


def to_upload(copies: list[CheckpointRow], durable: list[DurableRow]) -> CheckpointRow | None:
    """The checkpoint to upload next: the newest valid one newer than the newest durable (its first
    valid copy with a SHA256, the primary before the others), or None."""
    newest = newest_durable(durable)
    floor = _key(newest) if newest else (-1, -1)
    valid = [c for c in copies if c["valid"] and c.get("sha256") and _key(c) > floor]
    if not valid:
        return None
    top = max(_key(c) for c in valid)
    order = {"primary": 0, "local": 1, "replica": 2}
    return min((c for c in valid if _key(c) == top), key=lambda c: order.get(c.get("role") or "primary", 3))


def store_to_remove(durable: list[DurableRow], keep: int, keep_every: int | None) -> list[DurableRow]:
    """The committed checkpoints the store no longer keeps."""
    ordered = sorted(durable, key=_key, reverse=True)
    kept = ordered[:max(1, keep)]
    return [d for d in ordered[len(kept):] if not (keep_every and d["step"] % keep_every == 0)]


def held_locally(copies: list[CheckpointRow], durable: list[DurableRow]) -> set[tuple[int, int]]:
    """(step, attempt) of the checkpoints local retention must not remove: those newer than the newest
    durable one."""
    newest = newest_durable(durable)
    floor = _key(newest) if newest else (-1, -1)
    return {_key(c) for c in copies if c["valid"] and _key(c) > floor}


def lag(copies: list[CheckpointRow], durable: list[DurableRow], now: float) -> Lag:
    newest = newest_durable(durable)
    floor = _key(newest) if newest else (-1, -1)
    waiting = [c for c in copies if c["valid"] and _key(c) > floor]
    if not waiting:
        return Lag(newest["step"] if newest else None, 0, 0.0)
    top_step = max(c["step"] for c in waiting)
    since = min(c["created"] for c in waiting)
    return Lag(newest["step"] if newest else None, top_step - (newest["step"] if newest else 0),
               max(0.0, now - since))


ROOM_AT_LEAST = 3  # checkpoints of the newest's size


@dataclass(frozen=True)
class Room:
    """A node short of room while checkpoints are held on it for the store."""

    node: str
    free_bytes: int
    room_for: int  # more checkpoints of the newest one's size
    held: int  # checkpoints kept on it until they are durable
    held_bytes: int


def short_of_room(copies: list[CheckpointRow], held: set[tuple[int, int]], free: Mapping[str, int],
                  at_least: int = ROOM_AT_LEAST) -> list[Room]:
    """The nodes (with ``free`` bytes each) that hold checkpoints for the store and have room for fewer
    than ``at_least`` more."""
    short = []
    for node, free_bytes in sorted(free.items()):
        mine = [c for c in copies if c["node"] == node and c["valid"] and _key(c) in held]
        newest = max(mine, key=_key, default=None)
        if newest is None or not newest["size"]:
            continue
        room_for = free_bytes // newest["size"]
        if room_for < at_least:
            short.append(Room(node, free_bytes, room_for, len(mine), sum(c["size"] or 0 for c in mine)))
    return short
