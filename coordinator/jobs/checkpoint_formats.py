"""When a checkpoint directory is complete, by its format, and how the nodes' parts of one join.

A PyTorch job's checkpoint directory (``0000040/``) may be spread over the nodes: with Accelerate
each process writes its own ``random_states_R.pkl`` on its own node, with torch.distributed.checkpoint
each rank its own shard. The head asks every node of the attempt what it holds of each directory and
joins the parts (:func:`join_parts`); the whole is valid only when its format's every part is there
(:func:`judge`), and a node's part is never taken for the whole.

The formats, each told by its own files:

- ``COMPLETE``: a file of that name, written last by the script: anything the script saves.
- DeepSpeed: ``latest`` names a tag whose model states exist, and, where ZeRO wrote optimizer
  states, one for each data-parallel rank of the world.
- Accelerate (``accelerator.save_state``): model weights (``model*.safetensors``, ``pytorch_model*.bin``
  or an FSDP ``pytorch_model_fsdp_*`` directory), optimizer state, and ``random_states_R.pkl`` for
  every rank R of the world.
- torch.distributed.checkpoint: ``.metadata``, and every file it names.

Where a ``.metadata`` is part of another format (Accelerate's FSDP directories), the files it names
must be there too. Pure: plain data in, a verdict out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.agent_api.ranks import CheckpointInfo
from shared.checkpoint_dirs import DirFile, NonFinite, describe_nonfinite, describe_values_read, digest, total_size

COMPLETE = "COMPLETE"
_RANDOM_STATES = re.compile(r"^random_states_(\d+)\.pkl$")
_ACCELERATE_MODEL = re.compile(r"^(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin|pytorch_model_fsdp_\d+/.+)$")
_ACCELERATE_OPTIMIZER = re.compile(r"^(optimizer(_\d+)?\.bin|optimizer_\d+/.+)$")
_DEEPSPEED_MODEL = re.compile(r"^mp_rank_\d+_model_states\.pt$|^zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt$")
_DEEPSPEED_ZERO = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


@dataclass(frozen=True)
class Verdict:
    valid: bool
    format: str  # complete, deepspeed, accelerate, dcp, or unknown
    detail: str
    nonfinite: NonFinite | None = None  # what made it invalid, when a tensor's value did


@dataclass
class Joined:
    """One checkpoint directory as the nodes hold it together."""

    files: dict[str, DirFile] = field(default_factory=dict)  # relative path -> the file
    holders: dict[str, list[str]] = field(default_factory=dict)  # relative path -> nodes that hold it
    notes: dict[str, str] = field(default_factory=dict)
    references: dict[str, list[str] | None] = field(default_factory=dict)
    conflict: str | None = None  # two nodes hold one path with different bytes
    unreadable: dict[str, str] = field(default_factory=dict)  # node -> why its part could not be read
    # relative path -> the first NaN or infinity in it, as any node that holds it read it (a copy received
    # through the relay is hashed on arrival, its values not read again: its holder's word counts)
    nonfinite: dict[str, NonFinite] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        return digest(self.files.values())

    @property
    def size(self) -> int:
        return total_size(self.files.values())

    @property
    def values_read(self) -> int:
        """Tensors whose every value was read (and found finite, when ``nonfinite`` is empty)."""
        return sum(entry.get("values_read", 0) for entry in self.files.values())

    def missing_on(self, node: str) -> list[str]:
        """The paths ``node`` does not hold yet, in order."""
        return sorted(path for path, nodes in self.holders.items() if node not in nodes)


def written_last(path: str) -> bool:
    """Whether a file is the one its format writes after all the others (the script's COMPLETE,
    DeepSpeed's ``latest``, a ``.metadata``): whoever copies a directory copies it last."""
    return path.rsplit("/", 1)[-1] in (COMPLETE, "latest", ".metadata")


def join_parts(parts: Mapping[str, CheckpointInfo]) -> Joined:
    """The nodes' parts of one directory (node -> what it listed) as one: every file any node holds."""
    joined = Joined()
    for node in sorted(parts):
        part = parts[node]
        if not part["valid"]:
            joined.unreadable[node] = part["detail"]
            continue
        for entry in part.get("files", []):
            known = joined.files.get(entry["path"])
            if known is not None and (known["size"], known["sha256"]) != (entry["size"], entry["sha256"]):
                joined.conflict = (f"{entry['path']} differs between {', '.join(joined.holders[entry['path']])} and "
                                   f"{node}")
                continue
            joined.files.setdefault(entry["path"], entry)
            joined.holders.setdefault(entry["path"], []).append(node)
            if "nonfinite" in entry:
                joined.nonfinite.setdefault(entry["path"], entry["nonfinite"])
        joined.notes.update(part.get("notes") or {})
        for name, named in (part.get("references") or {}).items():
            joined.references.setdefault(name, named)
    return joined


def judge(joined: Joined, world_size: int | None) -> Verdict:
    """Whether the joined directory is a complete checkpoint, by its format; ``world_size`` is the
    number of processes that wrote it (None: not known, and what depends on it is not checked)."""
    if joined.unreadable:
        node, why = sorted(joined.unreadable.items())[0]
        return Verdict(False, "unknown", f"{node}'s part cannot be read: {why}")
    if joined.conflict:
        return Verdict(False, "unknown", joined.conflict)
    if not joined.files:
        return Verdict(False, "unknown", "empty")
    if joined.nonfinite:
        bad = joined.nonfinite[min(joined.nonfinite)]
        return Verdict(False, "unknown", describe_nonfinite(bad), bad)
    names = set(joined.files)
    problem = _references_missing(joined, names)
    if COMPLETE in names:
        return _verdict("complete", problem, joined)
    if "latest" in names:
        return _verdict("deepspeed", problem or _deepspeed_problem(joined, names, world_size), joined)
    if any(_RANDOM_STATES.match(n) or _ACCELERATE_MODEL.match(n) for n in names):
        return _verdict("accelerate", problem or _accelerate_problem(names, world_size), joined)
    if ".metadata" in names:
        return _verdict("dcp", problem, joined)
    return Verdict(False, "unknown", f"no {COMPLETE} file and no format coord knows (Accelerate, DeepSpeed, "
                                     "torch.distributed.checkpoint): a script of its own writes COMPLETE last")


def _verdict(form: str, problem: str | None, joined: Joined) -> Verdict:
    if problem:
        return Verdict(False, form, problem)
    values = joined.values_read
    return Verdict(True, form, f"{form}: {len(joined.files)} files"
                   + (f", {describe_values_read(values)}" if values else ""))


def _references_missing(joined: Joined, names: set[str]) -> str | None:
    for metadata, named in sorted(joined.references.items()):
        if metadata not in names:
            continue
        if named is None:
            return f"{metadata} cannot be read as torch.distributed.checkpoint metadata"
        missing = [name for name in named if name not in names]
        if missing:
            return f"{metadata} names {len(missing)} files not written (yet): {', '.join(missing[:3])}"
    return None


def _accelerate_problem(names: set[str], world_size: int | None) -> str | None:
    if not any(_ACCELERATE_MODEL.match(n) for n in names):
        return "no model weights (model.safetensors, pytorch_model.bin or pytorch_model_fsdp_0/)"
    if not any(_ACCELERATE_OPTIMIZER.match(n) for n in names):
        return "no optimizer state (optimizer.bin or optimizer_0/)"
    ranks = {int(m.group(1)) for n in names if (m := _RANDOM_STATES.match(n))}
    if world_size is not None:
        missing = [r for r in range(world_size) if r not in ranks]
        if missing:
            return f"random_states of rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing[:8]))} " \
                   f"missing (one per rank of {world_size})"
    return None


def _deepspeed_problem(joined: Joined, names: set[str], world_size: int | None) -> str | None:
    tag = joined.notes.get("latest", "").strip()
    if not tag or "/" in tag or tag.startswith("."):
        return f"latest names no tag ({tag!r})"
    inside = [n[len(tag) + 1:] for n in names if n.startswith(tag + "/")]
    if not any(_DEEPSPEED_MODEL.match(n) for n in inside):
        return f"tag {tag} has no model states (mp_rank_00_model_states.pt)"
    ranks = {int(m.group(1)) for n in inside if (m := _DEEPSPEED_ZERO.match(n))}
    if ranks and world_size is not None:
        missing = [r for r in range(world_size) if r not in ranks]
        if missing:
            return f"tag {tag} lacks the ZeRO states of rank{'s' if len(missing) > 1 else ''} " \
                   f"{', '.join(map(str, missing[:8]))} (one per rank of {world_size})"
    return None
