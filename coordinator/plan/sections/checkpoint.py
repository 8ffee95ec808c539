"""The plan's checkpoint section: where checkpoints are written and copied, how many are kept, what a
resume costs."""

from __future__ import annotations

from typing import TypedDict

from coordinator.jobs.policy import MAX_BACKOFF_S, backoff
from coordinator.jobs.spec import REPLICA_HEAD, REPLICA_NONE
from coordinator.launch.trainers import Trainer, trainer_declared
from coordinator.plan.inputs import PlanInputs, expected_recovery, rank_order, trainer_of
from coordinator.plan.options import ResolvedOptions, positive_int
from coordinator.plan.provenance import Section, SectionFields

# "async" is a keyword: the one field the class form cannot name.
_AsyncField = TypedDict("_AsyncField", {"async": bool}, total=False)


class CheckpointSection(SectionFields, _AsyncField, total=False):
    approach: str
    contents: str
    compression: str
    storage: str
    replica: str
    frequency: str
    retention: str
    copies: str
    checkpoint_bytes: int
    disk_bytes_per_node: int
    host_memory_bytes_per_rank: int
    expected_recovery_time: str
    expected_recovery_seconds: float


def checkpoint_section(inputs: PlanInputs, options: ResolvedOptions) -> CheckpointSection:
    section: Section[CheckpointSection] = Section()
    if not inputs.nodes:
        return section.disabled("no nodes in the cluster file")
    order, _ = rank_order(inputs)
    rank0 = next(node for node in inputs.nodes if node.name == order[0])
    save_every, save_source = options["save_every"]
    keep, keep_source = options["keep"]
    restarts, restarts_source = options["max_restarts"]
    job = inputs.job_name or "JOB"
    trainer_facts, trainer_source = trainer_of(inputs, options)
    declared = trainer_declared(options["trainer"][0])
    section.put("approach", f"resume from the newest valid checkpoint: a failed rank, lost node or hang stops every "
                f"rank on every node; the newest checkpoint whose SHA256 and safetensors header check out is used "
                f"from each node's own copy where the node holds one, copied only to the nodes that lack it, and "
                f"the job relaunches from its step (at most {restarts} restarts: the first at once, later ones "
                f"after {backoff(0):g} s doubling to {MAX_BACKOFF_S:g} s)", f"coord's supervisor; {restarts_source}")
    if trainer_facts is None:
        section.lack("async", f"the training script writes its own checkpoints into COORD_CHECKPOINT_DIR "
                     f"({trainer_source})")
    else:
        section.put("async", trainer_facts["async"], f"{trainer_facts['saving']}: {trainer_source}")
        section.put("contents", trainer_facts["contents"], trainer_source)
    section.put("compression", options["compression"][0], options["compression"][1])
    every_rank = declared.every_rank_saves and trainer_facts is not None
    if every_rank:
        section.put("storage", f"every node: <workdir>/checkpoints/{job}/attempt-N/NNNNNNN_adapters.safetensors "
                    f"(rank 0's on {rank0.name}:{rank0.workdir})",
                    "coord's trainer: every rank writes the same file in its own node's workdir, one directory per "
                    "attempt; each copy is validated by its own SHA256 on its node")
    else:
        section.put("storage", f"{rank0.name}:{rank0.workdir}/checkpoints/{job}/attempt-N/NNNNNNN_adapters.safetensors",
                    "coord: rank 0 writes them in its node's workdir, one directory per attempt")
    replica, replica_source = options["replica"]
    section.put("replica", replica_text(replica, job), f"{replica_source}; coord's replicator "
                "(coordinator/jobs/replica.py)")
    section.put("frequency", f"every {save_every} steps", save_source)
    section.put("retention", f"last {keep} valid checkpoints", keep_source)
    with_optimizer = declared.exact_resume and trainer_facts is not None
    sizing = inputs.sizing
    size = None
    if sizing is not None:
        size = sizing.get("checkpoint_bytes_with_optimizer") if with_optimizer else sizing.get("checkpoint_bytes")
    section.put("copies", copies_text(every_rank, declared, trainer_facts is not None, replica, keep),
                "coord's catalog (coordinator/jobs/catalog.py)")
    if sizing is not None and positive_int(size):
        section.put("checkpoint_bytes", size, f"sizing: {sizing.get('source') or 'trainable parameters'}"
                    + ("; plus the optimizer state coord's trainer saves" if with_optimizer else ""))
        on_every_node = every_rank or (replica != REPLICA_NONE and not declared.every_rank_saves
                                       and trainer_facts is not None)
        if on_every_node:
            section.put("disk_bytes_per_node", keep * size,
                        f"{keep} kept checkpoints x {size} bytes, on every node (retention removes every node's copy "
                        "of a checkpoint it removes)")
        if every_rank:
            section.put("host_memory_bytes_per_rank", size,
                        "coord's trainer: each rank copies the step's arrays (weights and optimizer state) to host "
                        "memory while its file is written, one save at a time")
    seconds, how = expected_recovery(inputs)
    if seconds is None:
        section.lack("expected_recovery_time", how)
    else:
        section.put("expected_recovery_time", f"{seconds:g} s", how)
        section.put("expected_recovery_seconds", seconds, how)
    return section.done()


def copies_text(every_rank: bool, declared: Trainer, runs_trainer: bool, replica: str, keep: int) -> str:
    """Where a checkpoint has copies, and what a resume copies: ``declared`` is the trainer chosen, which
    ``runs_trainer`` says the command runs (else a script of its own, which saves as it likes)."""
    if every_rank:
        return (f"every node holds its own copy of each of the last {keep} checkpoints (the ranks of a data parallel "
                "job hold the same weights, so their files are byte-identical): a resume copies nothing, except to "
                "a node that lacks the checkpoint (new, or down when it was written); "
                f"{keep} x the checkpoint size of disk on every node")
    if runs_trainer and not declared.every_rank_saves and replica != REPLICA_NONE:
        return ("rank 0 writes each checkpoint; the newest is copied in the background to every other node of the "
                "attempt (one verified stream), so a resume usually copies nothing; "
                f"at most {keep} x the checkpoint size of disk on every node")
    return "rank 0 writes each checkpoint; a resume copies it to every other node before the relaunch"


def replica_text(replica: str, job: str) -> str:
    if replica == REPLICA_NONE:
        return ("none: a checkpoint lives only on rank 0's node (with coord's trainer: on every node, each rank's "
                f"own copy) until a resume copies it to the nodes that lack it (<workdir>/checkpoints/{job}/replica/)")
    where = (f"the head's state directory (replicas/{job}/)" if replica == REPLICA_HEAD
             else f"{replica}'s workdir (checkpoints/{job}/replica/)")
    return (f"{replica}: each validated checkpoint is copied in the background to {where}, its SHA256 checked on "
            "arrival; a resume falls back to it when rank 0's copy is lost (when the head is a node's own machine "
            "and another node holds its own copy, that copy protects it and the head's is not made)")
