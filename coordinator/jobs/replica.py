"""Checkpoints off the failing machine: each validated checkpoint is copied, in the background,
to a second place (the head's state directory, or another node) and entered in the catalog
as a replica once its SHA256 matched on arrival.

Copies run one at a time, newest first, and never in the training path: the ranks keep
training while the daemon streams the file from rank 0's agent. A copy that fails is tried
again at the next checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from coordinator.jobs import catalog
from coordinator.jobs.spec import REPLICA_HEAD
from coordinator.jobs.transfer import CheckpointDamaged, HeadSink, NodeSink, NodeSource, copy_verified
from coordinator.node_session import UP
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from coordinator.jobs.supervisor import JobRunner

HEAD = "head"  # the catalog's node name for a copy in the head's state directory


def head_replica_path(state_dir: Path, job: str, attempt: int, name: str) -> Path:
    return state_dir / "replicas" / job / f"attempt-{attempt}" / name


def node_replica_rel(job: str, attempt: int, name: str) -> str:
    return f"checkpoints/{job}/replica/attempt-{attempt}/{name}"


class Replicator:
    def __init__(self, runner: "JobRunner"):
        self.runner = runner
        self._wake = anyio.Event()

    def poke(self) -> None:
        """A new checkpoint was validated."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            await self.replicate_pending()

    async def replicate_pending(self) -> None:
        runner = self.runner
        for primary in catalog.unreplicated(runner.daemon.state.checkpoints(runner.spec.name), runner.spec.keep):
            await self.replicate(primary)

    async def replicate(self, primary: dict[str, Any]) -> None:
        runner = self.runner
        sessions = runner.daemon.cluster.sessions
        source = sessions.get(primary["node"])
        if source is None or source.state != UP:
            return  # its node is away; the resume will use an older replica or this primary when it is back
        name = primary["path"].rsplit("/", 1)[-1]
        target = runner.spec.replica
        if target != REPLICA_HEAD and (target == primary["node"] or sessions[target].state != UP):
            target = REPLICA_HEAD  # a copy on the same machine protects nothing; a node away cannot take it
        if target == REPLICA_HEAD:
            sink = HeadSink(head_replica_path(runner.daemon.config.state_dir, runner.spec.name, primary["attempt"],
                                              name))
        else:
            sink = NodeSink(sessions[target], node_replica_rel(runner.spec.name, primary["attempt"], name))
        started = time.monotonic()
        try:
            (path,) = await copy_verified(NodeSource(source, primary["path"]), [sink], size=primary["size"],
                                          sha256=primary["sha256"])
        except (RemoteError, CheckpointDamaged, OSError) as exc:
            reason = exc.message if isinstance(exc, RemoteError) else str(exc)
            runner.event("replica_failed", f"checkpoint of step {primary['step']} not copied to {sink.where}: "
                         f"{reason}", step=primary["step"])
            return
        seconds = time.monotonic() - started
        # The primary may have been found bad meanwhile (replicas that diverged invalidate
        # what was saved after it): the copy is no better than its original.
        now = next((c for c in runner.daemon.state.checkpoints(runner.spec.name)
                    if c.get("role", catalog.PRIMARY) == catalog.PRIMARY and c["attempt"] == primary["attempt"]
                    and c["node"] == primary["node"] and c["path"] == primary["path"]), None)
        valid = now is not None and now["valid"]
        detail = (f"replica of {primary['node']}:{primary['path']}" if valid else
                  f"replica of an invalid checkpoint: {now['detail'] if now else 'its primary was removed'}")
        runner.daemon.state.add_checkpoint(runner.spec.name, {
            **primary, "node": HEAD if target == REPLICA_HEAD else target, "path": path, "role": catalog.REPLICA,
            "valid": valid, "detail": detail, "created": time.time()})
        runner.event("replicated", f"checkpoint of step {primary['step']} copied to {sink.where} in {seconds:.2f} s "
                     f"({primary['size'] / max(seconds, 1e-6) / 1e6:.0f} MB/s), SHA256 checked on arrival",
                     step=primary["step"], seconds=round(seconds, 3), bytes=primary["size"])
