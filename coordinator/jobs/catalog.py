"""The checkpoint catalog: which checkpoints exist, which are valid, which to keep, which to resume from.

A checkpoint (one step of one attempt) may have several copies: the primary, where rank 0
wrote it, and its replica (the head's state directory or another node). Retention and the
choice of a resume work on checkpoints; the copies of one are tried in order, primary first.
"""

from __future__ import annotations

from typing import Any

PRIMARY, REPLICA = "primary", "replica"


def _key(copy: dict[str, Any]) -> tuple[int, int]:
    return copy["step"], copy["attempt"]


def resume_candidates(copies: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Valid checkpoints, newest first, each as its valid copies with the primary first.

    A copy that failed validation is never resumed from; a checkpoint with no valid copy left
    gives way to the one before it."""
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for copy in copies:
        if copy["valid"]:
            groups.setdefault(_key(copy), []).append(copy)
    return [sorted(groups[key], key=lambda c: c.get("role", PRIMARY) != PRIMARY)
            for key in sorted(groups, reverse=True)]


def newest_valid(copies: list[dict[str, Any]]) -> dict[str, Any] | None:
    candidates = resume_candidates(copies)
    return candidates[0][0] if candidates else None


def to_remove(copies: list[dict[str, Any]], keep: int) -> list[dict[str, Any]]:
    """Retention: every copy of the newest ``keep`` valid checkpoints stays; the copies of older
    ones, and invalid ones older than the newest kept, go."""
    kept = {_key(group[0]) for group in resume_candidates(copies)[:keep]}
    if not kept:
        return []
    oldest_kept = min(kept)
    return [c for c in copies if _key(c) not in kept and _key(c) < oldest_kept]


def unreplicated(copies: list[dict[str, Any]], keep: int) -> list[dict[str, Any]]:
    """Valid primaries among the kept checkpoints that have no replica yet, newest first."""
    replicated = {_key(c) for c in copies if c.get("role") == REPLICA}
    return [group[0] for group in resume_candidates(copies)[:keep]
            if group[0].get("role", PRIMARY) == PRIMARY and _key(group[0]) not in replicated]


def settled(found: list[dict[str, Any]], *, attempt_over: bool) -> list[dict[str, Any]]:
    """The checkpoints of one listing whose verdict is final.

    mlx-lm writes ``NNNNNNN_adapters.safetensors`` straight to its final name, so a listing
    can catch one half-written: it fails validation now and passes a moment later. A failed
    one is judged only when nothing can still be writing it: the attempt's ranks are stopped,
    or a checkpoint of a later iteration exists (checkpoints are written one after another).
    Until then it is neither catalogued nor rejected, and it is listed again."""
    newest = max((entry["iteration"] for entry in found), default=-1)
    return [entry for entry in found
            if entry["valid"] or attempt_over or entry["iteration"] < newest]
