"""The checkpoint catalog: which checkpoints exist, which are valid, which to keep, which to resume from."""

from __future__ import annotations

from typing import Any


def newest_valid(checkpoints: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A checkpoint that failed validation is never resumed from; the one before it is."""
    valid = [c for c in checkpoints if c["valid"]]
    return max(valid, key=lambda c: (c["step"], c["attempt"])) if valid else None


def to_remove(checkpoints: list[dict[str, Any]], keep: int) -> list[dict[str, Any]]:
    """Retention: the newest ``keep`` valid checkpoints stay; older ones, and invalid ones
    older than the newest valid one, go."""
    valid = sorted((c for c in checkpoints if c["valid"]), key=lambda c: (c["step"], c["attempt"]), reverse=True)
    kept = valid[:keep]
    if not kept:
        return []
    oldest_kept = min((c["step"], c["attempt"]) for c in kept)
    return [c for c in checkpoints if c not in kept and (c["step"], c["attempt"]) < oldest_kept]
