"""The checkpoint catalog: which checkpoints exist, which are valid, which to keep, which to resume from.

A checkpoint (one step of one attempt) may have several copies, one catalog row each:

- ``primary``: where rank 0 wrote it;
- ``local``: another rank's own copy on its own node (coord's trainer: every rank of a data
  parallel job holds the same weights and writes the same file in its own checkpoint dir);
- ``replica``: a copy coord made (the head's state directory, ``--replica NODE``, or the
  background copy of mlx-lm's checkpoint to every other node of the attempt).

Every copy is validated where it lies (its own node hashes it) and is only ever used under
its own SHA256. Retention and the choice of a resume work on checkpoints; a resume uses each
node's own copy in place and copies the checkpoint only to the nodes that lack it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from coordinator.store.state import CheckpointRow
from shared.agent_api.ranks import CheckpointInfo

PRIMARY, LOCAL, REPLICA = "primary", "local", "replica"
_ROLE_ORDER = {PRIMARY: 0, LOCAL: 1, REPLICA: 2}
HEAD = "head"  # as coordinator.jobs.effects.HEAD (kept here so that this module stays pure)


def _key(copy: CheckpointRow) -> tuple[int, int]:
    return copy["step"], copy["attempt"]


def role(copy: CheckpointRow) -> str:
    return copy.get("role") or PRIMARY


def resume_candidates(copies: list[CheckpointRow]) -> list[list[CheckpointRow]]:
    """Valid checkpoints, newest first, each as its valid copies: the primary first, then the
    ranks' own copies, then coord's replicas.

    A copy that failed validation is never resumed from; a checkpoint with no valid copy left
    gives way to the one before it."""
    groups: dict[tuple[int, int], list[CheckpointRow]] = {}
    for copy in copies:
        if copy["valid"]:
            groups.setdefault(_key(copy), []).append(copy)
    return [sorted(groups[key], key=lambda c: _ROLE_ORDER.get(role(c), 3))
            for key in sorted(groups, reverse=True)]


def newest_valid(copies: list[CheckpointRow]) -> CheckpointRow | None:
    candidates = resume_candidates(copies)
    return candidates[0][0] if candidates else None


def holders(group: list[CheckpointRow], sha256: str | None) -> dict[str, CheckpointRow]:
    """node -> its valid copy of one checkpoint with exactly this SHA256 (a node holding two, its
    own copy before coord's replica). The head is a holder like any node."""
    out: dict[str, CheckpointRow] = {}
    if not sha256:
        return out
    for copy in sorted(group, key=lambda c: _ROLE_ORDER.get(role(c), 3)):
        if copy["valid"] and copy.get("sha256") == sha256:
            out.setdefault(copy["node"], copy)
    return out


@dataclass
class ResumePlan:
    """How one checkpoint reaches every node of the next attempt.

    ``source``: the copy the others are measured against (and copied from, for the nodes that
    lack it); ``in_place``: node -> that node's own copy with the source's SHA256, used where it
    lies; ``missing``: the nodes that must be sent it (through ``copy_checkpoint``)."""

    source: CheckpointRow
    in_place: dict[str, CheckpointRow] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)


def plan_resume(group: list[CheckpointRow], order: list[str], reachable: Callable[[str], bool]) -> ResumePlan | None:
    """For one checkpoint (its valid copies, as ``resume_candidates`` gives them): the first
    copy that can be reached, in role order, is the source; every node of ``order`` that holds a
    valid copy with the source's SHA256 resumes from it in place; the rest are missing. None
    when no copy can be reached (its nodes are away)."""
    source = next((c for c in group if c["valid"] and c.get("sha256") and reachable(c["node"])), None)
    if source is None:
        return None
    held = holders(group, source["sha256"])
    in_place = {node: held[node] for node in order if node in held}
    return ResumePlan(source, in_place, [node for node in order if node not in in_place])


def to_remove(copies: list[CheckpointRow], keep: int,
              same_machine: Callable[[str, str], bool] | None = None) -> list[CheckpointRow]:
    """Retention: every copy of the newest ``keep`` valid checkpoints stays; every copy (on every
    node) of older ones, and invalid ones older than the newest kept, go.

    With ``same_machine``: while none of those newest has a copy off its primary's machine yet
    (copies slower than the checkpoint interval), the newest checkpoint that has one stays too, and
    what is newer than it: losing the primary's machine then costs the steps since it, not the run."""
    candidates = resume_candidates(copies)
    kept = {_key(group[0]) for group in candidates[:keep]}
    if not kept:
        return []
    if same_machine is not None and not any(off_machine(group, same_machine) for group in candidates[:keep]):
        safe = next((group for group in candidates[keep:] if off_machine(group, same_machine)), None)
        if safe is not None:
            kept.add(_key(safe[0]))
    oldest_kept = min(kept)
    return [c for c in copies if _key(c) not in kept and _key(c) < oldest_kept]


@dataclass
class Wanted:
    """One background copy to make: ``source`` to each of ``targets`` (node names, or ``HEAD``)."""

    source: CheckpointRow
    targets: list[str]


def copies_wanted(copies: list[CheckpointRow], keep: int, *, target: str | None, spread_to: list[str],
                  same_machine: Callable[[str, str], bool], head_is_a_node: bool = False) -> list[Wanted]:
    """The background copies still to make for the kept checkpoints, newest first.

    ``target``: where the off-machine replica goes (``HEAD`` or a node; None: no replica). Each
    kept checkpoint gets one there unless it already has one there, or the target is the head,
    the head is one of the job's nodes' machine (``head_is_a_node``: a node on host "local") and
    a machine other than the head's already holds a valid copy: the ranks' own copies, or the
    copies to every node, protect it then, and a head copy would sit on a node's own machine.
    ``spread_to``: nodes that should each hold the newest checkpoint before any failure (the
    nodes of an attempt whose ranks do not write their own copies): those that lack it.
    The source is the checkpoint's first valid copy in role order (the primary when there is one).
    """
    out = []
    for index, group in enumerate(resume_candidates(copies)[:keep]):
        source = group[0]
        if not source.get("sha256"):
            continue
        held = holders(group, source["sha256"])
        spread = [node for node in spread_to if node not in held] if index == 0 else []
        targets: list[str] = []
        if target is not None:
            has_replica = any(role(c) == REPLICA and c["node"] in (target, HEAD) for c in group)
            elsewhere = any(not same_machine(node, HEAD) for node in [*held, *spread])
            if not has_replica and not (target == HEAD and head_is_a_node and elsewhere):
                targets.append(target)
        targets += [node for node in spread if node not in targets]
        if targets:
            out.append(Wanted(source, targets))
    return out


def off_machine(group: list[CheckpointRow], same_machine: Callable[[str, str], bool]) -> list[CheckpointRow]:
    """The valid copies of one checkpoint that survive the loss of its primary's machine: coord's
    replicas, and any copy on another machine than the primary's (a rank's own copy on its node)."""
    primary = next((c for c in group if role(c) == PRIMARY), None)
    if primary is None:
        return [c for c in group if c["valid"]]
    return [c for c in group if c["valid"] and c is not primary
            and (role(c) == REPLICA or not same_machine(c["node"], primary["node"]))]


def settled(found: list[CheckpointInfo], *, attempt_over: bool) -> list[CheckpointInfo]:
    """The checkpoints of one listing whose verdict is final.

    mlx-lm writes ``NNNNNNN_adapters.safetensors`` straight to its final name, so a listing
    can catch one half-written: it fails validation now and passes a moment later. A failed
    one is judged only when nothing can still be writing it: the attempt's ranks are stopped,
    or a checkpoint of a later iteration exists (checkpoints are written one after another).
    Until then it is neither catalogued nor rejected, and it is listed again."""
    newest = max((entry["iteration"] for entry in found), default=-1)
    return [entry for entry in found
            if entry["valid"] or attempt_over or entry["iteration"] < newest]


def listing_due(nodes: list[str], marks: Mapping[str, str], listed: Mapping[str, str] | None, *,
                pending: bool, since_listed: float, backstop_s: float) -> bool:
    """Whether the attempt's nodes are listed at this checkpoint poll. Listing a node asks its agent to walk
    (and hash what is new in) the attempt's checkpoints: at a hundred nodes, a poll of every node every 2 s
    was a third of the head's work while nothing was written. Each rank's status carries a mark of its
    node's checkpoints (a digest of their stats); the nodes are listed when a mark is not the one the last
    listing was made at, or not told (an older agent, an error: as before, every poll), when the last
    listing left something unsettled (a file or directory still being written, a node not reached), and
    at least every ``backstop_s`` whatever the marks say."""
    if listed is None or pending or since_listed >= backstop_s:
        return True
    return any(not marks.get(node) or marks.get(node) != listed.get(node) for node in nodes)
