"""A run's checkpoints, for its supervisor: found on rank 0's node and validated, catalogued,
kept or removed (retention), invalidated after a divergence, chosen and placed for a resume,
and their final copy awaited before success.

A mixin of ``JobRunner``: it works on the runner's record, effects and events."""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING, Any

import anyio

from coordinator.jobs import catalog, core
from coordinator.jobs.effects import HEAD, LaunchError, Placement
from coordinator.jobs.fingerprints import Divergence
from coordinator.jobs.policy import DIVERGED, Outcome
from coordinator.jobs.transfer import CheckpointDamaged
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from coordinator.jobs.supervisor import JobRunner as _Runner
else:
    _Runner = object

CHECKPOINT_POLL_S = 2.0
FINAL_COPY_TIMEOUT_S = 600.0


class CheckpointKeeping(_Runner):
    """The checkpoint half of a run's supervisor."""

    async def _await_final_copy(self) -> None:
        """Success means done: with replicas on, the newest valid checkpoint's copy has landed
        before the job is called succeeded; when it cannot land, the job says so."""
        if self.replicator is None:
            return
        newest = catalog.newest_valid(self.fx.checkpoints(self.run_id))
        if newest is None:
            return
        with anyio.move_on_after(FINAL_COPY_TIMEOUT_S):
            async with anyio.create_task_group() as copying:
                async def cut_short_by_a_stop() -> None:
                    await self._stop_asked.wait()
                    copying.cancel_scope.cancel()

                copying.start_soon(cut_short_by_a_stop)
                await self.replicator.replicate_pending()
                copying.cancel_scope.cancel()
        copies = [c for c in self.fx.checkpoints(self.run_id)
                  if c["valid"] and (c["step"], c["attempt"]) == (newest["step"], newest["attempt"])
                  and c.get("role") == catalog.REPLICA]
        if not copies:
            self.record["warning"] = (f"the final checkpoint (step {newest['step']}) has no replica: its copy to "
                                      f"{self.spec.replica} did not land; it is only on {newest['node']}")
            self.event("replica_missing", self.record["warning"], step=newest["step"])

    async def _choose_resume(self, order: list[str]) -> tuple[dict[str, Any] | None, dict[str, str]]:
        """The newest checkpoint of this run with a copy that still verifies, placed on every node
        of ``order``.

        Copies are tried primary first, then the replica (the primary's machine may be the one
        that was lost); a copy whose bytes no longer match its SHA256 is marked invalid and
        never used again, and the next copy or the checkpoint before is tried."""
        for copies in catalog.resume_candidates(self.fx.checkpoints(self.run_id)):
            for copy in copies:
                if copy["node"] != HEAD and (copy["node"] not in self.fx.node_names()
                                             or not self._node_up(copy["node"])):
                    continue
                try:
                    return copy, await self._place_resume_file(copy, order)
                except (RemoteError, CheckpointDamaged, OSError) as exc:
                    reason = exc.message if isinstance(exc, RemoteError) else str(exc)
                    if isinstance(exc, RemoteError) and core.unreachable_error(exc.code):
                        # The copy may be fine; the node holding it or receiving it is away.
                        raise LaunchError(f"the checkpoint of step {copy['step']} could not be placed: {reason}",
                                          node=copy["node"] if copy["node"] != HEAD else None) from None
                    self.fx.add_checkpoint(self.run_id, {**copy, "valid": False, "detail": reason})
                    kind = "replica_rejected" if copy.get("role") == catalog.REPLICA else "checkpoint_rejected"
                    self.event(kind, f"{copy.get('role', 'primary')} copy of the checkpoint of step {copy['step']} "
                               f"({copy['node']}) cannot be resumed from: {reason}", step=copy["step"])
        return None, {}

    async def _place_resume_file(self, checkpoint: dict[str, Any], order: list[str]) -> dict[str, str]:
        """Every rank's node needs the checkpoint to resume from: stream it from where it is to all
        of them at once, its SHA256 checked against the catalog's."""
        started = self.fx.monotonic()
        name = posixpath.basename(checkpoint["path"])
        placed = {checkpoint["node"]: checkpoint["path"]} if checkpoint["node"] in order else {}
        if not checkpoint.get("sha256"):
            raise CheckpointDamaged("no SHA256 was recorded for it")
        targets = [node for node in order if node not in placed]
        if targets:
            paths = await self.fx.copy_checkpoint(
                checkpoint, [Placement(node, f"checkpoints/{self.run_id}/resume/{name}") for node in targets])
            placed.update(zip(targets, paths))
            self.event("checkpoint_placed", f"checkpoint of step {checkpoint['step']} from {checkpoint['node']}:"
                       f"{checkpoint['path']} placed on {len(targets)} nodes", seconds=round(self.fx.monotonic() - started, 3))
        return placed

    async def _watch_checkpoints(self) -> None:
        while True:
            await anyio.sleep(CHECKPOINT_POLL_S)
            started = self.fx.monotonic()
            with anyio.CancelScope(shield=True):  # a poll half done would leave the catalog behind the disk
                await self._poll_checkpoints()
            if self.fx.monotonic() - started > 5 * CHECKPOINT_POLL_S:
                self.log.warning("slow checkpoint poll", seconds=round(self.fx.monotonic() - started, 1))

    async def _diverged(self, found: Divergence) -> Outcome:
        """Replicas that no longer agree: stop, and resume from a checkpoint taken before it happened."""
        order = self.record["order"]
        named = ", ".join(f"{r} on {order[r]}" for r in found.ranks if r < len(order))
        self.event("replica_diverged", f"{found.describe()} (rank {named})", step=found.step, ranks=found.ranks)
        outcome = self._outcome(DIVERGED, found.describe(), f"diverged:{found.step}")
        good_until = found.last_agreed if found.last_agreed is not None else self.record["start_step"]
        self._diverged_after = good_until  # and checkpoints still to be found, when the ranks are stopped
        async with self._checkpoint_poll:
            for copy in self.fx.checkpoints(self.run_id):
                if copy["valid"] and copy["attempt"] == self.record["attempt"] and copy["step"] > good_until:
                    self.fx.add_checkpoint(self.run_id, {**copy, "valid": False, "detail": self._diverged_detail()})
        return outcome

    def _diverged_detail(self) -> str:
        return f"taken after the replicas diverged (last agreed at step {self._diverged_after})"

    async def _poll_checkpoints(self, *, attempt_over: bool = False) -> None:
        """Find new checkpoints on rank 0's node, validate them, enter them in the catalog, apply retention.

        ``attempt_over``: the ranks are stopped, so a checkpoint that fails validation is damaged,
        not still being written."""
        async with self._checkpoint_poll:
            await self._poll_checkpoints_now(attempt_over)

    async def _poll_checkpoints_now(self, attempt_over: bool) -> None:
        if not self.record["order"] or self.record["attempt"] < 0:
            return
        name, attempt = self.record["order"][0], self.record["attempt"]
        listed = await self._catalogue(name, attempt, self.record["start_step"], self._known_checkpoints,
                                       attempt_over=attempt_over)
        if not listed and attempt_over:
            # Rank 0's node is away: what it wrote until the end is catalogued when it is back,
            # before the next resume is chosen (its ranks may even have finished meanwhile).
            left = self.record.setdefault("uncatalogued", [])
            if [name, attempt, self.record["start_step"]] not in left:
                left.append([name, attempt, self.record["start_step"]])
        await self._retain()
        self.save()

    async def _catalogue_left_behind(self) -> None:
        """Checkpoints of earlier attempts whose rank-0 node was away when they ended."""
        left = []
        for name, attempt, start_step in self.record.get("uncatalogued") or []:
            known = {posixpath.basename(c["path"]) for c in self.fx.checkpoints(self.run_id)
                     if c["attempt"] == attempt and c["node"] == name}
            if name not in self.fx.node_names() or not await self._catalogue(name, attempt, start_step, known,
                                                                              attempt_over=True):
                left.append([name, attempt, start_step])
        self.record["uncatalogued"] = left

    async def _catalogue(self, name: str, attempt: int, start_step: int, known: set[str], *,
                         attempt_over: bool) -> bool:
        """List one attempt's checkpoints on ``name``, validate and catalogue the new ones; False when
        the node could not be asked."""
        if not self.fx.node(name).up:
            return False
        try:
            found = await self.fx.call(name, "list_checkpoints", {"job": self.run_id, "attempt": attempt,
                                                                  "known": sorted(known)}, timeout=60)
        except RemoteError as exc:
            self.log.warning("checkpoints not listed", node=name, reason=exc.message)
            return False
        current = attempt == self.record["attempt"]
        for entry in catalog.settled(found["checkpoints"], attempt_over=attempt_over):
            known.add(entry["name"])
            step = start_step + entry["iteration"]
            if current and entry["valid"] and self._diverged_after is not None and step > self._diverged_after:
                entry = {**entry, "valid": False, "detail": self._diverged_detail()}
            self.fx.add_checkpoint(self.run_id, {
                "step": step, "attempt": attempt, "node": name, "path": entry["path"], "sha256": entry["sha256"],
                "size": entry["size"], "valid": entry["valid"], "detail": entry["detail"], "created": self.fx.now()})
            if entry["valid"]:
                last = self.record.get("last_checkpoint")
                if last is None or step >= last["step"]:
                    self.record["last_checkpoint"] = {"step": step, "time": self.fx.now(), "node": name}
                self.event("checkpoint", f"checkpoint of step {step} validated ({entry['detail']})"
                           + ("" if current else f", written by attempt {attempt} while {name} was away"),
                           step=step)
                if self.replicator is not None:
                    self.replicator.poke()
            else:
                self.event("checkpoint_invalid", f"checkpoint of step {step} is not valid: {entry['detail']}",
                           step=step)
        return True

    async def _retain(self) -> None:
        for old in catalog.to_remove(self.fx.checkpoints(self.run_id), self.spec.keep):
            if old["node"] == HEAD:
                self.fx.remove_head_file(old["path"])
                self.fx.remove_checkpoint(self.run_id, old["attempt"], old["node"], old["path"])
                continue
            if old["node"] not in self.fx.node_names() or not self.fx.node(old["node"]).up:
                continue
            try:
                await self.fx.call(old["node"], "remove_checkpoints", {
                    "job": self.run_id, "attempt": old["attempt"], "names": [posixpath.basename(old["path"])],
                    "replica": old.get("role") == catalog.REPLICA}, timeout=60)
                self.fx.remove_checkpoint(self.run_id, old["attempt"], old["node"], old["path"])
            except RemoteError:
                continue
