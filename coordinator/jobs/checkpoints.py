"""A run's checkpoints, for its supervisor: found where the ranks wrote them (rank 0's node, and
with coord's trainer every node's own copy) and validated there, catalogued,
kept or removed (retention), invalidated after a divergence, chosen and placed for a resume,
and their final copy awaited before success."""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING, TypedDict

import anyio

from coordinator.durable import policy
from coordinator.jobs import catalog, core
from coordinator.jobs.attempt import Attempt
from coordinator.jobs.checkpoint_dirs import DirKeeper
from coordinator.jobs.effects import HEAD, CatalogPorts, LaunchError, Placement
from coordinator.jobs.node_health import NodeHealth
from coordinator.jobs.record import JobRecord
from coordinator.jobs.replica import Replicator, node_replica_rel

if TYPE_CHECKING:
    from coordinator.jobs.durability import DurabilityWatch
from coordinator.jobs.run_context import RunContext
from coordinator.jobs.transfer import CheckpointDamaged
from coordinator.launch.registry import capabilities
from coordinator.launch.trainers import trainer_declared
from coordinator.store.state import CheckpointRow
from shared.agent_api.ranks import CheckpointInfo
from shared.rpc import RemoteError
from shared.sizes import size_text

CHECKPOINT_POLL_S = 2.0
CHECKPOINT_BACKSTOP_S = 30.0  # the nodes are listed at least this often, whatever their marks say
FINAL_COPY_TIMEOUT_S = 600.0


class Placed(TypedDict):
    """What placing a resume's checkpoint did: the nodes that used their own copy, and those sent one."""

    in_place: list[str]
    copied_to: list[str]
    bytes_copied: int


def _diverged_detail(record: JobRecord, good_until: int) -> str:
    """Why a checkpoint after a divergence is not valid."""
    if record.unsound is not None:
        return f"taken after step {good_until}, where the training is no longer trusted: {record.unsound['detail']}"
    return f"taken after the replicas diverged (last agreed at step {good_until})"


class CheckpointKeeper:
    """One run's checkpoints: its catalog entries, the attempt's copies found and validated, the
    resume chosen and placed, retention, and the background replicator poked when one is new."""

    def __init__(self, ctx: RunContext, health: NodeHealth, replicator: Replicator | None):
        self.ctx = ctx
        self.fx: CatalogPorts = ctx.fx
        self.health = health
        self.replicator = replicator
        self._lock = anyio.Lock()  # the background watcher and the end of an attempt take turns
        self._validated_since_poke = False
        self.last_placement: Placed | None = None  # what the last resume's placing did (for its event)
        self.dirs = DirKeeper(ctx, health)  # checkpoint directories, joined from every node's part
        self.durability: DurabilityWatch | None = None  # with a checkpoint store: the uploads
        self.free_bytes: dict[str, int] = {}  # node -> what its checkpoints' disk had left, when last listed
        self._short_of_room: set[str] = set()  # nodes said to be short of room (said again once they were not)

    def ranks_write_own_copies(self) -> bool:
        """coord's trainer: every rank writes the checkpoint on its own node (data parallel ranks hold
        the same weights); mlx-lm's trainer and other scripts: rank 0 only (``Trainer.every_rank_saves``)."""
        return trainer_declared(self.ctx.spec.trainer).every_rank_saves

    def parts_on_every_node(self) -> bool:
        """A launcher whose nodes may each hold a part of a checkpoint directory (its processes' random
        states, their shards: ``Capabilities.checkpoint_parts``), so every node of the attempt is listed."""
        return capabilities(self.ctx.spec.launcher).checkpoint_parts

    async def await_final_copy(self) -> None:
        """Success means done: with replicas on, the newest valid checkpoint has a copy off its
        primary's machine (coord's replica, or another node's own copy) before the job is called
        succeeded; when none can land, the job says so."""
        if self.replicator is None:
            return
        newest = catalog.newest_valid(self.fx.checkpoints(self.ctx.run_id))
        if newest is None:
            return
        with anyio.move_on_after(FINAL_COPY_TIMEOUT_S):
            async with anyio.create_task_group() as copying:
                async def cut_short_by_a_stop() -> None:
                    await self.ctx.stop_asked.wait()
                    copying.cancel_scope.cancel()

                copying.start_soon(cut_short_by_a_stop)
                await self.replicator.replicate_pending(final=True)
                copying.cancel_scope.cancel()
        # Retention kept older checkpoints while the newer ones had no copy off their machine yet;
        # with the final copies landed they can go now (no later poll would remove them).
        # (Retention changes the catalog only: the record is saved with the job's end, and saving it
        # here, with the attempt's outcome counted but the job not yet ended, would count it again
        # after a daemon restart.)
        async with self._lock:
            await self._retain()
        group = [c for c in self.fx.checkpoints(self.ctx.run_id)
                 if c["valid"] and (c["step"], c["attempt"]) == (newest["step"], newest["attempt"])]
        if not catalog.off_machine(group, self.health.same_machine):
            missing = (f"the final checkpoint (step {newest['step']}) has no replica: its copy to "
                       f"{self.ctx.spec.replica} did not land; it is only on {newest['node']}")
            self.ctx.record.add_warning(missing)
            self.ctx.event("replica_missing", missing, step=newest["step"])

    async def choose_resume(self, order: list[str]) -> tuple[CheckpointRow | None, dict[str, str]]:
        """The newest valid checkpoint of this run that can be reached, and node -> the file each
        rank of ``order`` resumes from.

        The rule: the newest valid checkpoint with a reachable copy, never an older one to save a
        copy (redoing a checkpoint interval costs more than sending one file). Every node that
        holds a valid copy of it with the same SHA256 (its rank's own copy, or coord's replica)
        resumes from that copy where it lies; only the nodes that lack it (new, back from an
        outage, or whose copy failed) are sent it, from its first reachable copy in role order
        (primary, a rank's own copy, a replica). A copy whose bytes no longer match its SHA256 is
        marked invalid and never used again, and the next copy or the checkpoint before is tried."""
        for group in catalog.resume_candidates(self.fx.checkpoints(self.ctx.run_id)):
            key = (group[0]["step"], group[0]["attempt"])
            while True:
                group = [c for c in self.fx.checkpoints(self.ctx.run_id)
                         if c["valid"] and (c["step"], c["attempt"]) == key]
                group = catalog.resume_candidates(group)[0] if group else []
                plan = catalog.plan_resume(group, order, self.health.reachable)
                if plan is None:
                    break
                if await self._gone_in_place(plan):
                    continue  # marked invalid: plan again without them
                copy = plan.source
                try:
                    return copy, await self._place_resume_file(plan, order)
                except (RemoteError, CheckpointDamaged, OSError) as exc:
                    reason = exc.message if isinstance(exc, RemoteError) else str(exc)
                    if isinstance(exc, RemoteError) and core.unreachable_error(exc.code):
                        # The copy may be fine; the node holding it or receiving it is away.
                        raise LaunchError(f"the checkpoint of step {copy['step']} could not be placed: {reason}",
                                          node=copy["node"] if copy["node"] != HEAD else None) from None
                    self.fx.add_checkpoint(self.ctx.run_id, {**copy, "valid": False, "detail": reason})
                    kind = "replica_rejected" if copy.get("role") == catalog.REPLICA else "checkpoint_rejected"
                    self.ctx.event(kind, f"{catalog.role(copy)} copy of the checkpoint of step {copy['step']} "
                               f"({copy['node']}) cannot be resumed from: {reason}", step=copy["step"])
        return None, {}

    async def _gone_in_place(self, plan: catalog.ResumePlan) -> bool:
        """Each node's own copy still has the SHA256 it was validated with: every node hashes its
        copy where it lies, all at once (a copy is trusted only as far as its bytes, however long
        ago it was catalogued). A copy that is gone or changed is marked invalid; True when one was."""
        gone: list[tuple[CheckpointRow, str]] = []
        away: list[tuple[str, str]] = []
        timeout = max(60.0, (plan.source.get("size") or 0) / 50e6)

        async def look(node: str, copy: CheckpointRow) -> None:
            try:
                answer = await self.fx.call(node, "hash_file", {"path": copy["path"]}, timeout=timeout)
            except RemoteError as exc:
                if core.unreachable_error(exc.code):
                    away.append((node, exc.message))
                else:
                    gone.append((copy, exc.message))
                return
            if answer.get("size") != copy["size"] or answer.get("sha256") != copy.get("sha256"):
                gone.append((copy, "its bytes no longer match the SHA256 recorded when it was validated"))

        async with anyio.create_task_group() as tasks:
            for node, copy in plan.in_place.items():
                tasks.start_soon(look, node, copy)
        if away:
            node, reason = sorted(away)[0]
            raise LaunchError(f"the checkpoint of step {plan.source['step']} could not be looked at on {node}: "
                              f"{reason}", node=node)
        for copy, reason in gone:
            self.fx.add_checkpoint(self.ctx.run_id, {**copy, "valid": False, "detail": reason})
            self.ctx.event("checkpoint_rejected", f"{catalog.role(copy)} copy of the checkpoint of step {copy['step']} "
                       f"({copy['node']}) cannot be resumed from: {reason}", step=copy["step"])
        return bool(gone)

    async def _place_resume_file(self, plan: catalog.ResumePlan, order: list[str]) -> dict[str, str]:
        """Each rank resumes from its own node's copy where it has one; the nodes that lack it are
        sent it, all at once, its SHA256 checked against the catalog's. Says what was copied
        (nothing, when every node held it)."""
        started = self.fx.monotonic()
        checkpoint = plan.source
        name = posixpath.basename(checkpoint["path"])
        placed = {node: copy["path"] for node, copy in plan.in_place.items()}
        if not checkpoint.get("sha256"):
            raise CheckpointDamaged("no SHA256 was recorded for it")
        targets = [node for node in order if node in plan.missing]
        if targets:
            paths = await self.fx.copy_checkpoint(
                checkpoint, [Placement(node, node_replica_rel(self.ctx.run_id, checkpoint["attempt"], name))
                             for node in targets])
            placed.update(zip(targets, paths, strict=True))
            for node, path in zip(targets, paths, strict=True):
                # Catalogued like any replica: a later resume finds it there, retention removes it.
                self.fx.add_checkpoint(self.ctx.run_id, {
                    **checkpoint, "node": node, "path": path, "role": catalog.REPLICA, "created": self.fx.now(),
                    "detail": f"placed for a resume, from {checkpoint['node']}:{checkpoint['path']}"})
        self.last_placement = {"in_place": sorted(plan.in_place), "copied_to": targets,
                                "bytes_copied": (checkpoint.get("size") or 0) * len(targets)}
        self.ctx.event("checkpoint_placed",
                   f"checkpoint of step {checkpoint['step']}: "
                   + (f"{len(plan.in_place)} nodes resume from their own copy ({', '.join(plan.in_place)})"
                      if plan.in_place else "no node holds it")
                   + (f"; copied from {checkpoint['node']}:{checkpoint['path']} to {', '.join(targets)}"
                      if targets else "; nothing copied"),
                   step=checkpoint["step"], in_place=sorted(plan.in_place), copied_to=targets,
                   bytes_copied=(checkpoint.get("size") or 0) * len(targets),
                   seconds=round(self.fx.monotonic() - started, 3))
        return placed

    async def watch(self, attempt: Attempt) -> None:
        """Find the attempt's new checkpoints while it runs (hashing a large one takes seconds: a
        rank's exit must not wait for it)."""
        while True:
            await anyio.sleep(CHECKPOINT_POLL_S)
            started = self.fx.monotonic()
            if not catalog.listing_due(self._listed_nodes(attempt), attempt.checkpoint_marks, attempt.listed_marks,
                                       pending=attempt.listing_pending, since_listed=started - attempt.listed_at,
                                       backstop_s=CHECKPOINT_BACKSTOP_S):
                continue
            with anyio.CancelScope(shield=True):  # a poll half done would leave the catalog behind the disk
                await self.poll(attempt)
            if self.fx.monotonic() - started > 5 * CHECKPOINT_POLL_S:
                self.ctx.log.warning("slow checkpoint poll", seconds=round(self.fx.monotonic() - started, 1))

    async def invalidate_after_divergence(self, attempt: Attempt) -> None:
        """The attempt's checkpoints after its last agreed step, catalogued or still to be found, are not
        valid. After a NaN or a spike, those of earlier attempts after that step are not either: the
        checkpoint the attempt resumed from, when its very first loss went wrong."""
        record = self.ctx.record
        good_until = attempt.diverged_after = record.diverged_after
        if good_until is None:
            return
        detail = _diverged_detail(record, good_until)
        async with self._lock:
            for copy in self.fx.checkpoints(self.ctx.run_id):
                ours = copy["attempt"] == attempt.number or record.unsound is not None
                if copy["valid"] and ours and copy["step"] > good_until:
                    self.fx.add_checkpoint(self.ctx.run_id, {**copy, "valid": False, "detail": detail})
                    if record.unsound is not None and copy["attempt"] != attempt.number:
                        self.ctx.event("checkpoint_invalid", f"checkpoint of step {copy['step']} ({copy['node']}) "
                                       f"is not resumed from again: {record.unsound['detail']} in the first steps "
                                       "after resuming from it", step=copy["step"], node=copy["node"])
            newest = catalog.newest_valid(self.fx.checkpoints(self.ctx.run_id))
            last = record.last_checkpoint
            if last is not None and (newest is None or newest["step"] < last["step"]):
                # coord status shows the newest checkpoint a resume can use, not one just found unfit.
                record.last_checkpoint = ({"step": newest["step"], "time": newest["created"], "node": newest["node"]}
                                          if newest else None)

    async def poll(self, attempt: Attempt | None, *, attempt_over: bool = False) -> None:
        """Find new checkpoints on the attempt's nodes (rank 0's, and with coord's trainer every
        rank's own), validate them where they lie, enter them in the catalog, apply retention.

        ``attempt_over``: the ranks are stopped, so a checkpoint that fails validation is damaged,
        not still being written."""
        async with self._lock:
            await self._poll_now(attempt, attempt_over)

    def _listed_nodes(self, attempt: Attempt) -> list[str]:
        every = self.ranks_write_own_copies() or self.parts_on_every_node()
        return attempt.order if every else attempt.order[:1]

    async def _poll_now(self, attempt: Attempt | None, attempt_over: bool) -> None:
        if attempt is None or not attempt.order:
            return
        nodes = self._listed_nodes(attempt)
        marks, started = dict(attempt.checkpoint_marks), self.fx.monotonic()  # what this listing is made at
        listed: dict[str, list[CheckpointInfo] | None] = {}

        async def one(rank: int, name: str) -> None:
            role = catalog.PRIMARY if rank == 0 else catalog.LOCAL
            known = attempt.known_checkpoints.setdefault(name, set())
            listed[name] = await self._catalogue(name, attempt.number, attempt.start_step, known,
                                                 attempt_over=attempt_over, role=role, current=attempt)

        async with anyio.create_task_group() as tasks:
            for rank, name in enumerate(nodes):
                tasks.start_soon(one, rank, name)
        listings = {name: found for name, found in listed.items() if found is not None}
        if any(entry.get("kind") == "dir" for found in listings.values() for entry in found):
            # A directory's verdict needs every node's part: a node that could not be asked may hold one.
            complete = attempt_over or len(listings) == len(nodes)
            if complete and await self.dirs.settle(
                    attempt.number, attempt.start_step, attempt.order, listings, attempt.known_checkpoints,
                    attempt.dirs_seen, attempt_over=attempt_over, world_size=self.ctx.record.world_size,
                    current=True):
                self._validated_since_poke = True
        if attempt_over:
            # A node that is away: what it wrote until the end is catalogued when it is back,
            # before the next resume is chosen (its ranks may even have finished meanwhile).
            left = self.ctx.record.uncatalogued
            for rank, name in enumerate(nodes):
                entry = [name, attempt.number, attempt.start_step] + ([] if rank == 0 else [catalog.LOCAL])
                if listed.get(name) is None and entry not in left:
                    left.append(entry)
        attempt.listed_marks, attempt.listed_at = marks, started
        known = attempt.known_checkpoints
        attempt.listing_pending = len(listings) < len(set(nodes)) or any(
            entry["name"] not in known.get(name, ()) for name, found in listings.items() for entry in found)
        await self._retain()
        self.ctx.save()
        self._poke_replicator()

    def _poke_replicator(self) -> None:
        """After a whole poll (every node's copies catalogued): which copies are still wanted
        depends on all of them."""
        if self._validated_since_poke and self.replicator is not None:
            self.replicator.poke()
        if self._validated_since_poke and self.durability is not None:
            self.durability.poke()
        self._validated_since_poke = False

    async def catalogue_left_behind(self) -> None:
        """Checkpoints of earlier attempts whose nodes were away when they ended."""
        async with self._lock:
            await self._catalogue_left_behind_now()

    async def _catalogue_left_behind_now(self) -> None:
        left = []
        for entry in self.ctx.record.uncatalogued or []:
            name, attempt, start_step = entry[:3]
            role = entry[3] if len(entry) > 3 else catalog.PRIMARY
            known = {posixpath.basename(c["path"]) for c in self.fx.checkpoints(self.ctx.run_id)
                     if c["attempt"] == attempt and c["node"] == name and catalog.role(c) != catalog.REPLICA}
            found = await self._catalogue(name, attempt, start_step, known, attempt_over=True, role=role,
                                          current=None) if name in self.fx.node_names() else None
            if found is None:
                left.append(entry)
            elif any(e.get("kind") == "dir" for e in found):
                # What a node that was away holds of the attempt's directories, judged by itself: the
                # nodes that were here catalogued theirs already.
                await self.dirs.settle(attempt, start_step, [name], {name: found}, {name: known}, {},
                                       attempt_over=True, world_size=None, current=False)
        self.ctx.record.uncatalogued = left
        self._poke_replicator()

    async def _catalogue(self, name: str, attempt: int, start_step: int, known: set[str], *,
                         attempt_over: bool, role: str = catalog.PRIMARY,
                         current: Attempt | None) -> list[CheckpointInfo] | None:
        """List one attempt's checkpoints on ``name``, validate and catalogue the new files (as that
        node's ``role`` copy); what it listed (its directories are judged with the other nodes'
        parts), or None when the node could not be asked."""
        if not self.fx.node(name).up:
            return None
        try:
            found = await self.fx.call(name, "list_checkpoints", {"job": self.ctx.run_id, "attempt": attempt,
                                                                  "known": sorted(known)}, timeout=60)
        except RemoteError as exc:
            self.ctx.log.warning("checkpoints not listed", node=name, reason=exc.message)
            return None
        if "free_bytes" in found:
            self.free_bytes[name] = found["free_bytes"]
        diverged_after = current.diverged_after if current is not None and current.number == attempt else None
        current_attempt = current is not None and current.number == attempt
        files = [entry for entry in found["checkpoints"] if entry.get("kind") != "dir"]
        for entry in catalog.settled(files, attempt_over=attempt_over):
            known.add(entry["name"])
            step = start_step + entry["iteration"]
            if entry["valid"] and diverged_after is not None and step > diverged_after:
                entry = {**entry, "valid": False, "detail": _diverged_detail(self.ctx.record, diverged_after)}
            self.fx.add_checkpoint(self.ctx.run_id, {
                "step": step, "attempt": attempt, "node": name, "path": entry["path"], "sha256": entry["sha256"],
                "size": entry["size"], "valid": entry["valid"], "detail": entry["detail"], "created": self.fx.now(),
                "role": role})
            whose = "" if role == catalog.PRIMARY else f" on {name} (its rank's own copy)"
            if entry["valid"]:
                last = self.ctx.record.last_checkpoint
                if last is None or step > last["step"] or (step == last["step"] and role == catalog.PRIMARY):
                    self.ctx.record.last_checkpoint = {"step": step, "time": self.fx.now(), "node": name}
                if role == catalog.PRIMARY:
                    self.ctx.event("checkpoint", f"checkpoint of step {step} validated ({entry['detail']})"
                               + ("" if current_attempt else f", written by attempt {attempt} while {name} was away"),
                               step=step)
                else:
                    self.ctx.log.info("checkpoint_copy", step=step, node=name, sha256=entry["sha256"])
                self._validated_since_poke = True
            else:
                self.ctx.event("checkpoint_invalid",
                               f"checkpoint of step {step}{whose} is not valid: {entry['detail']}",
                               step=step, node=name, **({"nonfinite": entry["nonfinite"]} if "nonfinite" in entry
                                                        else {}))
        return found["checkpoints"]

    async def _retain(self) -> None:
        # With a checkpoint store, nothing newer than its newest durable checkpoint goes: until it is
        # in the store, a node's copy is the run's only protection against losing the cluster.
        held = self.durability.held_locally() if self.durability is not None else set()
        for old in catalog.to_remove(self.fx.checkpoints(self.ctx.run_id), self.ctx.spec.keep,
                                     self.health.same_machine):
            if (old["step"], old["attempt"]) in held:
                continue
            if old["node"] == HEAD:
                self.fx.remove_head_file(old["path"])
                self.fx.remove_checkpoint(self.ctx.run_id, old["attempt"], old["node"], old["path"])
                continue
            if old["node"] not in self.fx.node_names() or not self.fx.node(old["node"]).up:
                continue
            try:
                await self.fx.call(old["node"], "remove_checkpoints", {
                    "job": self.ctx.run_id, "attempt": old["attempt"], "names": [posixpath.basename(old["path"])],
                    "replica": old.get("role") == catalog.REPLICA}, timeout=60)
                self.fx.remove_checkpoint(self.ctx.run_id, old["attempt"], old["node"], old["path"])
            except RemoteError:
                continue
        if self.durability is not None:
            self._say_short_of_room(held)

    def _say_short_of_room(self, held: set[tuple[int, int]]) -> None:
        """Said once per node, before its disk fills: the checkpoints it holds for the store stay."""
        short = policy.short_of_room(self.fx.checkpoints(self.ctx.run_id), held, self.free_bytes)
        for room in short:
            if room.node in self._short_of_room:
                continue
            state = self.ctx.record.durability
            durable = state["durable_step"] if state else None
            self.ctx.event("store_disk", f"{room.node} has room for {room.room_for} more checkpoint"
                           f"{'' if room.room_for == 1 else 's'} "
                           f"({size_text(room.free_bytes)} free): {room.held} checkpoints "
                           f"({size_text(room.held_bytes)}) are kept there until they reach the checkpoint store "
                           "(durable up to "
                           + (f"step {durable}" if durable is not None else "no checkpoint yet")
                           + "); when the disk fills, a rank's next save fails", node=room.node,
                           free_bytes=room.free_bytes, room_for=room.room_for, held=room.held,
                           held_bytes=room.held_bytes)
        self._short_of_room = {room.node for room in short}
