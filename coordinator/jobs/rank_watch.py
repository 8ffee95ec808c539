"""A run's ranks, for its supervisor: each rank polled through its node's agent and its report
classified (``core.classify_ranks``), progress and fingerprints read, each rank's output kept
on the head, stacks captured from a hung rank, known failures diagnosed.

``RankWatcher`` answers one question per poll: is the attempt over, and how. It works on the
attempt it is handed and the run's shared context; checkpoints are the keeper's, which it
asks only to invalidate what was saved after a divergence."""

from __future__ import annotations

import signal

import anyio
import anyio.abc

from coordinator.jobs import core, diagnosis, training_health
from coordinator.jobs.attempt import Attempt
from coordinator.jobs.checkpoints import CheckpointKeeper
from coordinator.jobs.diagnosis import Diagnosis
from coordinator.jobs.effects import RankPorts
from coordinator.jobs.fingerprints import Divergence, comparison_summary
from coordinator.jobs.hang_watch import HangWatch
from coordinator.jobs.metric_point import MetricPoint
from coordinator.jobs.node_health import NodeHealth
from coordinator.jobs.outage_watch import OutageWatch
from coordinator.jobs.policy import (
    DIVERGED,
    HUNG,
    LAUNCH_FAILED,
    LOSS_SPIKE,
    NODE_LOST,
    RANK_FAILED,
    RESIZED,
    Outcome,
    RankFailure,
    awaits_root_cause,
    clean_line,
    last_line,
    launcher_root_cause,
    peer_lost,
    root_cause,
)
from coordinator.jobs.progress import read_record
from coordinator.jobs.run_context import RunContext
from coordinator.jobs.straggler_watch import StragglerWatch
from coordinator.jobs.training_health import Unsound
from coordinator.nodes import versions as node_versions
from shared.agent_api.common import JsonObject
from shared.agent_api.progress import CheckpointRecord, FingerprintRecord, HeartbeatRecord, TrainRecord, ValRecord
from shared.agent_api.ranks import RankStatusReply
from shared.rpc import RemoteError

POLL_S = 0.5  # the least time between two polls of every rank
HOLD_S = 2.0  # a poll's status requests wait this long for their rank to end before they answer
MAX_REREADS = 20  # polls at once after every rank exited, each reading up to the agent's cap of records
LOG_DIAGNOSIS_BYTES = 256 << 10  # the end of a rank's log, where the error that stopped it is
FAILURES = (RANK_FAILED, NODE_LOST, HUNG, LAUNCH_FAILED)  # outcomes a recovery is timed from
RECOVERIES_KEPT = 100
READ_AGAIN = "read again"  # every rank has exited, and the last poll read something: poll again at once


class RankWatcher:
    def __init__(self, ctx: RunContext, health: NodeHealth, checkpoints: CheckpointKeeper):
        self.ctx = ctx
        self.fx: RankPorts = ctx.fx
        self.health = health
        self.checkpoints = checkpoints
        self.hangs = HangWatch(ctx)
        self.outage = OutageWatch(ctx, health)
        self.stragglers = StragglerWatch(ctx)
        self._points: list[tuple[str, MetricPoint]] = []  # the train and val points of the poll under way

    async def poll(self, attempt: Attempt, *, may_read_again: bool, wait_s: float = 0.0) -> Outcome | str | None:
        """Ask every rank once, all at once: the attempt's outcome when it is over, READ_AGAIN when
        every rank has exited and what they wrote last still comes in (``may_read_again``), else
        None. With ``wait_s`` each node's agent answers once its rank has ended or after that many
        seconds, so a steady attempt costs one call per rank every ``wait_s`` and an end is still
        seen at once."""
        ctx, record = self.ctx, self.ctx.record
        # The nodes the head cannot reach are not asked: whether they are gone or only out of the
        # head's reach is judged below, once what the others said is read (OutageWatch).
        away = {rank: (name, self.fx.node(name).reason or "not up") for rank, name in enumerate(attempt.order)
                if not self.health.up(name)}
        replies, failed = await self._ask(attempt, wait_s, skip=set(away))
        reports: list[core.RankReport] = []
        read_any = False
        step_before, first_before = record.step, record.first_step_at
        # Each rank's memory as this poll found it goes with every train point the poll reads (a
        # poll reads the points of up to HOLD_S of training at once).
        attempt.rank_peaks.clear()
        for rank, reply in replies.items():
            attempt.checkpoint_marks[attempt.order[rank]] = reply.get("checkpoints_mark") or ""
            if rss := reply.get("rss_bytes"):
                record.rank_memory[str(rank)] = rss
                attempt.rank_peaks[str(rank)] = rss
        try:
            for rank, name in enumerate(attempt.order):
                status = replies.get(rank)
                if status is None:
                    continue  # its node did not answer: judged below, after what the others said is read
                read_any = bool(status["progress"]) or read_any
                reports.append(await self._read(attempt, rank, name, status))
        finally:
            if self._points:  # the poll's points, written together
                points, self._points = self._points, []
                self.fx.record_points(self.ctx.run_id, points)
        self.hangs.after_poll(progressed=record.step > step_before
                              or (first_before is None and record.first_step_at is not None))
        if read_any:
            ctx.save()  # the progress and the offsets it was read up to, together
        for rank, (name, reason) in failed.items():
            self.health.mark_unreachable(name)
            away[rank] = (name, f"it did not answer: {reason}")
        pid = record.launcher_pid
        verdict = core.classify_ranks(reports, ranks=len(attempt.order), step=record.step,
                                      total_steps=ctx.spec.total_steps,
                                      launcher_exit=self.fx.launcher_exit(pid) if pid else None,
                                      since_launch=self.fx.now() - (record.launched_at or 0))
        if away:
            return await self._while_away(attempt, away, verdict, reports)
        self.outage.back()
        if (dropped := await self._compare_ranks(attempt, verdict, read_any)) is not None:
            return dropped
        # Before the verdict: fingerprints that disagree, or a loss that went NaN, read in the same poll
        # that found every rank finished, make the run resume from before them, never a success.
        if attempt.unsound is not None:
            return await self._unsound(attempt, attempt.unsound)
        if attempt.divergence is not None:
            return await self._diverged(attempt, attempt.divergence)
        if verdict is not None:
            if read_any and may_read_again and all(r.state == "exited" for r in reports):
                return READ_AGAIN  # every rank is done: what they wrote last (a read is capped) is judged too
            return await self._ended(attempt, verdict, reports)
        hung = self.hangs.verdict(attempt)
        if hung:
            # Named before the stacks are asked for: a stopped rank is woken by nothing but SIGCONT.
            self.ctx.event("hang", hung.describe(), ranks=list(hung.ranks))
            await self._capture_stacks(attempt)
            return self.ended(attempt, HUNG, hung.describe(), "hang")
        return None

    async def _compare_ranks(self, attempt: Attempt, verdict: core.Verdict | None, read_any: bool) -> Outcome | None:
        """Every rank answered and goes on: their compute times compared (the watch of stragglers);
        the attempt ends when --straggler-policy drop shrinks a straggler's node out."""
        if verdict is not None or not read_any:
            return None
        drop = await self.stragglers.after_poll(attempt)
        return self.ended(attempt, RESIZED, drop, "straggler-dropped") if drop is not None else None

    async def _while_away(self, attempt: Attempt, away: dict[int, tuple[str, str]], verdict: core.Verdict | None,
                          reports: list[core.RankReport]) -> Outcome | None:
        """Some of the attempt's nodes cannot be reached. What the others' ranks said still counts (a
        NaN, replicas that disagree, a rank that failed: its peers' deaths are a recovery as ever);
        otherwise the attempt goes on while OutageWatch waits for the lost nodes, or ends as a node
        loss once it must not. Neither a success nor a hang is judged on part of the ranks."""
        if attempt.unsound is not None:
            return await self._unsound(attempt, attempt.unsound)
        if attempt.divergence is not None:
            return await self._diverged(attempt, attempt.divergence)
        if verdict is not None and verdict.kind == RANK_FAILED:
            # Not all of it was read (the away nodes' fingerprints, their last steps): never a success.
            attempt.ended_unread = True
            return await self._ended(attempt, verdict, reports)
        lost = await self.outage.judge(attempt, away)
        return self._verdict(attempt, lost) if lost is not None else None

    async def _read(self, attempt: Attempt, rank: int, name: str, status: RankStatusReply) -> core.RankReport:
        """One rank's reply taken in: its progress, its output on the head, and its report."""
        attempt.progress_offsets[rank] = status["progress_offset"]
        self.hangs.seen(attempt, rank, status)
        for progress in status["progress"]:
            self._on_progress(attempt, rank, progress)
        if "log" in status:
            self.fx.append_log(self.ctx.run_id, attempt.number, rank, status["log"])
            attempt.log_offsets[rank] = status["log_offset"]
        await self.pull_log(attempt, rank, name, status["log_size"])  # what did not fit in the reply
        detected = None
        if status["state"] == "exited" and (exited_at := status.get("exited_at")):  # both on the node's clock
            detected = max(0.0, status["time"] - exited_at)
        # The worker that failed on its own, before those that only lost it (its peers on this node).
        errors = sorted(status.get("worker_errors") or [],
                        key=lambda e: (peer_lost(e["message"]), e["time"] or 0.0, e["local_rank"]))
        said = f"worker {errors[0]['local_rank']} on {name}: {errors[0]['message']}" if errors else None
        return core.RankReport(rank, name, status["state"], status.get("exit"), detected, said)

    async def _ask(self, attempt: Attempt, wait_s: float, *,
                   skip: set[int] = frozenset()) -> tuple[dict[int, RankStatusReply], dict[int, tuple[str, str]]]:  # type: ignore[assignment]
        """Every rank's status but ``skip``'s, asked of all nodes at once: rank -> reply, and rank ->
        (node, why) for the nodes that did not answer. When a rank has ended, or a stop is asked
        for, the others' waits are cut short and they are asked again at once, so that what follows
        sees every rank as it is now."""
        replies: dict[int, RankStatusReply] = {}
        failed: dict[int, tuple[str, str]] = {}
        asked = [rank for rank in range(len(attempt.order)) if rank not in skip]

        async def ask(rank: int, wait: float, tasks: anyio.abc.TaskGroup, answered: anyio.Event) -> None:
            try:
                status = await self.fx.call(attempt.order[rank], "rank_status", {
                    "job": self.ctx.run_id, "attempt": attempt.number, "rank": rank,
                    "progress_offset": attempt.progress_offsets.get(rank, 0),
                    "log_offset": attempt.log_offsets.get(rank, 0), "wait_s": wait}, timeout=10 + wait)
            except RemoteError as exc:
                failed[rank] = (attempt.order[rank], exc.message)
                tasks.cancel_scope.cancel()
                return
            replies[rank] = status
            if wait and status["state"] in ("exited", "vanished"):
                tasks.cancel_scope.cancel()  # the others need not wait: the attempt is ending
            if len(replies) + len(failed) == len(asked):
                answered.set()

        if not asked:
            return replies, failed
        for wait in (wait_s, 0.0) if wait_s else (0.0,):
            answered = anyio.Event()
            async with anyio.create_task_group() as tasks:
                for rank in asked:
                    if rank not in replies:
                        tasks.start_soon(ask, rank, wait, tasks, answered)
                # Whichever comes first: every answer, or a stop (which need not wait for the holds).
                async with anyio.create_task_group() as first:
                    first.start_soon(_set_when, answered, first)
                    if wait:
                        first.start_soon(_set_when, self.ctx.stop_asked, first)
                tasks.cancel_scope.cancel()
            if failed or len(replies) == len(asked):
                break
        return replies, failed

    async def diverged_before_restart(self, attempt: Attempt) -> Outcome | None:
        """A divergence a previous daemon saw and saved: the attempt ends as it was then."""
        record = self.ctx.record
        if record.diverged_after is None:
            return None
        await self.checkpoints.invalidate_after_divergence(attempt)
        if record.unsound is not None:
            unsound = record.unsound
            return self.ended(attempt, unsound["kind"], f"{unsound['detail']} (found before the daemon restarted)",
                              f"{unsound['kind']}:{unsound['step']}")
        return self.ended(attempt, DIVERGED, f"the replicas diverged after step {record.diverged_after} "
                          "(found before the daemon restarted)", f"diverged:{record.diverged_after}")

    async def _ended(self, attempt: Attempt, verdict: core.Verdict, reports: list[core.RankReport]) -> Outcome | None:
        """The attempt's outcome from its verdict; None while the ranks that failed only lost a peer
        wait a moment for a rank still running to end with the cause."""
        if not verdict.failures:
            return self._verdict(attempt, verdict)
        cause = await self._root_cause(attempt, verdict)
        if attempt.peer_lost_seen_at is None and peer_lost(cause.last_line):
            attempt.peer_lost_seen_at = self.fx.monotonic()
        if awaits_root_cause(cause.last_line, any(r.state in ("running", "starting") for r in reports),
                             self.fx.monotonic() - (attempt.peer_lost_seen_at or 0.0)):
            return None
        return self._failed(attempt, cause, verdict)

    async def _root_cause(self, attempt: Attempt, verdict: core.Verdict) -> RankFailure:
        return root_cause([RankFailure(r.rank, r.node, r.exit if r.exit is not None else -1,
                                       clean_line(r.worker_error) if r.worker_error
                                       else await self._log_tail(attempt, r.rank)) for r in verdict.failures])

    def _failed(self, attempt: Attempt, cause: RankFailure, verdict: core.Verdict) -> Outcome:
        code, tail = cause.status, cause.last_line
        return self.ended(attempt, RANK_FAILED, f"rank {cause.rank} on {cause.node} exited with status {code}"
                          + (f" ({_signal_name(code)})" if _signal_name(code) else "")
                          + (f": {tail}" if tail else ""), f"exit:{code}:{tail}",
                          detected_after=verdict.detected_after)

    def _verdict(self, attempt: Attempt, verdict: core.Verdict) -> Outcome:
        return self.ended(attempt, verdict.kind, verdict.detail, verdict.signature, verdict.detected_after)

    def ended(self, attempt: Attempt | None, kind: str, detail: str, signature: str,
              detected_after: float | None = None) -> Outcome:
        """The attempt is over; ``detected_after`` is how long its end went unseen (a rank's exit
        to the poll that saw it), when known."""
        record = self.ctx.record
        extra = {"seconds": round(detected_after, 3)} if detected_after is not None else {}
        if kind in FAILURES and record.failed_at is None:
            record.failed_at = self.fx.now()
        self.ctx.event("attempt_ended", f"attempt {record.attempt}: {kind}: {detail}"
                       + (f" (seen {detected_after:.2f} s after)" if detected_after is not None else ""),
                       outcome=kind, attempt=record.attempt, step=record.step, **extra)
        if kind in (RANK_FAILED, HUNG) and attempt is not None:
            self._diagnose_logs(attempt)
        return Outcome(kind, detail, record.first_step_at is not None, signature[:300])

    async def _diverged(self, attempt: Attempt, found: Divergence) -> Outcome:
        """Replicas that no longer agree: stop, and resume from a checkpoint taken before it happened."""
        order = attempt.order
        named = ", ".join(f"{r} on {order[r]}" for r in found.ranks if r < len(order))
        # Saved first: a daemon restarted from here on still knows this attempt's checkpoints after
        # the last agreed step are not valid (the fingerprints that showed it are not read again).
        self.ctx.record.diverged_after = (found.last_agreed if found.last_agreed is not None
                                             else self.ctx.record.start_step)
        self.ctx.save()
        self.ctx.event("replica_diverged", f"{found.describe()} (rank {named})", step=found.step, ranks=found.ranks)
        outcome = self.ended(attempt, DIVERGED, found.describe(), f"diverged:{found.step}")
        await self.checkpoints.invalidate_after_divergence(attempt)
        return outcome

    async def _unsound(self, attempt: Attempt, found: Unsound) -> Outcome:
        """A NaN or infinite loss (or a spike the job rolls back from): stop, and resume from the newest
        checkpoint saved before that step. When the attempt never reported a finite loss, the checkpoint
        it resumed from is suspect too (its weights or optimizer state may hold what made the first step
        go wrong), and the resume goes further back."""
        record = self.ctx.record
        good_until = found.step - 1 if attempt.finite_loss_seen else attempt.start_step - 1
        # Saved first: a daemon restarted from here on still rolls back, and still knows which
        # checkpoints are not valid (the record that showed it is not read again).
        record.unsound = {"kind": found.kind, "step": found.step, "metric": found.metric, "value": found.value,
                          "detail": found.detail}
        record.diverged_after = max(-1, good_until)
        self.ctx.save()
        outcome = self.ended(attempt, found.kind, found.detail, f"{found.kind}:{found.step}")
        await self.checkpoints.invalidate_after_divergence(attempt)
        return outcome

    def _check_health(self, attempt: Attempt, step: int, values: dict[str, float]) -> None:
        """A value that says the training went wrong stops the attempt (at the end of this poll); a loss
        spike is said, and stops it only when the job asks (--on-spike rollback)."""
        if attempt.unsound is not None:
            return  # the first one is what the attempt is stopped for
        found = training_health.non_finite(step, values, (*training_health.HEALTH_VALUES, "val_loss"))
        if found is not None:
            attempt.unsound = found
            self.ctx.log.warning("non_finite", step=step, metric=found.metric, value=str(found.value))
            return
        loss = values.get("loss")
        if loss is None:
            return
        attempt.finite_loss_seen = True
        spike = attempt.losses.add(step, loss)
        if spike is None:
            return
        rollback = self.ctx.spec.on_spike == "rollback"
        self.ctx.event("loss_spike", spike.describe() + ("; rolling back (--on-spike rollback)" if rollback
                                                         else "; training goes on (--on-spike warn)"),
                       step=step, loss=loss, median=spike.median, threshold=spike.threshold)
        if rollback:
            attempt.unsound = Unsound(LOSS_SPIKE, step, "loss", loss, spike.describe())

    # --- known failures -----------------------------------------------------------------

    def _diagnose(self, found: list[Diagnosis], where: str) -> None:
        """Known failure modes, each named once per job with its fix (coord status shows them)."""
        known = self.ctx.record.diagnoses
        for item in found:
            if any(d["id"] == item["id"] for d in known):
                continue
            known.append({"id": item["id"], "title": item["title"], "detail": f"{where}: {item['detail']}",
                          "fix": item["fix"], "line": item.get("line")})
            self.ctx.event("diagnosis", f"{item['title']} ({where}); fix: {item['fix']}", id=item["id"])

    def diagnose_launch(self, order: list[str], envs: dict[str, str], command: list[str]) -> None:
        """Known failures the job's command, its launcher's environment and its nodes' facts show
        before a rank starts."""
        versions = [v for v in ((self.fx.node(n).facts or {}).get("mlx_lm_version") for n in order) if v]
        oldest = node_versions.oldest(versions)
        self._diagnose(diagnosis.diagnose_job(command, envs, oldest), "the job's command")
        facts = {n: self.fx.node(n).facts for n in order if self.fx.node(n).facts}
        self._diagnose(diagnosis.diagnose_cluster(facts), "the job's nodes")

    def _diagnose_logs(self, attempt: Attempt) -> None:
        for rank in range(len(attempt.order)):
            text = self.fx.log_tail(self.ctx.run_id, attempt.number, rank,
                                    LOG_DIAGNOSIS_BYTES).decode("utf-8", "replace")
            if text:
                self._diagnose(diagnosis.diagnose_log(text), f"rank {rank}'s log, attempt {attempt.number}")

    # --- progress -----------------------------------------------------------------------

    def _on_progress(self, attempt: Attempt, rank: int, line: JsonObject) -> None:
        progress = read_record(line)
        if progress is None:
            return  # another kind, or a record without what coord reads: skipped
        if not self.ctx.record.progress_seen:
            unwatched = not self.hangs.watched()
            self.ctx.record.progress_seen = True  # from now on the run is watched for hangs
            if unwatched:
                self.ctx.event("hang_watch", f"rank {rank} reports its progress: watched for hangs from now on")
        if progress["kind"] == "heartbeat":
            self._on_heartbeat(attempt, rank, progress)
        elif progress["kind"] == "fingerprint":
            self._on_fingerprint(attempt, progress)
        elif progress["kind"] == "checkpoint":
            self._on_checkpoint_written(progress)
        elif progress["kind"] == "val":
            self._on_val_loss(attempt, progress)
        elif progress["kind"] == "compute":
            self._advance(attempt, rank, progress["step"], float(progress.get("time") or self.fx.now()), first=False)
            self.stragglers.compute(attempt, rank, progress["compute_seconds"])
        else:
            self._on_train(attempt, rank, progress)

    def _on_fingerprint(self, attempt: Attempt, progress: FingerprintRecord) -> None:
        record = self.ctx.record
        check = attempt.replica_check
        compared = check.compared
        found = check.add(progress["step"], progress["rank"], progress["sha256"])
        record.replica_state = check.state()  # saved with the progress offsets it goes with
        first = found if attempt.divergence is None else None  # the one the attempt is stopped for
        attempt.divergence = attempt.divergence or found
        if check.compared != compared:  # every rank reported this step: kept for the plan
            record.replica_check = comparison_summary(record.replica_check, check, record.attempt,
                                                         attempt.order, first)

    def _advance(self, attempt: Attempt, rank: int, step: int, at: float, *, first: bool) -> None:
        """A step ``rank`` finished, by its record written at ``at`` (its clock); ``first``: it is the
        attempt's first step even if it is not past the start (a train record is one; a
        heartbeat's step is one once it is past the start)."""
        record = self.ctx.record
        self.hangs.stepped(attempt, rank, step, at)
        if record.first_step_at is None and (first or step > record.start_step):
            now = self.fx.now()
            # Until the first step, the last progress is the launch (both on the head's clock).
            seconds = now - (record.last_progress if record.last_progress is not None else now)
            record.first_step_at = now
            record.first_step_seconds = seconds
            self.ctx.event("first_step", f"attempt {record.attempt} reached step {step}", seconds=round(seconds, 3),
                           step=step, attempt=record.attempt)
            self._recovered()
        record.step = max(step, record.step)

    def _on_heartbeat(self, attempt: Attempt, rank: int, beat: HeartbeatRecord) -> None:
        self.hangs.heartbeat(attempt, rank, beat)
        if "compute_s" in beat:
            self.stragglers.compute(attempt, rank, beat["compute_s"])
        step = beat.get("step")
        if step is not None:
            self._advance(attempt, rank, step, beat["time"], first=False)

    def _on_train(self, attempt: Attempt, rank: int, progress: TrainRecord) -> None:
        record = self.ctx.record
        now = float(progress.get("time") or self.fx.now())  # the rank's own clock
        step = progress["step"]
        self._advance(attempt, rank, step, now, first=True)
        if "compute_seconds" in progress:
            self.stragglers.compute(attempt, rank, progress["compute_seconds"])
        last = attempt.last_train
        if last is not None and step > last[0] and now > last[1]:
            record.step_seconds = (now - last[1]) / (step - last[0])
        attempt.last_train = (step, now)
        # A value a record leaves out keeps the last one given: a script may report its loss only every
        # so many steps (Hugging Face Trainer's logging steps), and every step for the hang watch.
        if "loss" in progress:
            record.loss = progress["loss"]  # NaN too: shown as what it is, never as the last finite one
        values = {"loss": progress["loss"]} if "loss" in progress else {}
        if "grad_norm" in progress:
            values["grad_norm"] = progress["grad_norm"]
        self._check_health(attempt, step, values)
        if "tokens_per_second" in progress:
            record.tokens_per_second = progress["tokens_per_second"]
        if "peak_memory_gb" in progress:
            record.peak_memory_gb = progress["peak_memory_gb"]
        peak = progress.get("peak_memory_gb")
        self._points.append(("train", {
            "step": step, "attempt": record.attempt, "time": now, "loss": progress.get("loss"),
            "learning_rate": progress.get("learning_rate"), "tokens_per_second": progress.get("tokens_per_second"),
            "samples_per_second": progress.get("samples_per_second"), "comm_seconds": progress.get("comm_seconds"),
            # mlx-lm's peak memory is bytes / 1e9
            "peak_memory_bytes": int(peak * 1e9) if isinstance(peak, (int, float)) else None,
            "rank_memory_bytes": dict(attempt.rank_peaks)}))

    def _on_val_loss(self, attempt: Attempt, progress: ValRecord) -> None:
        step, loss = progress["step"], progress["val_loss"]
        self.ctx.record.val_loss = loss
        self._check_health(attempt, step, {"val_loss": loss})
        self._points.append(("val", {"step": step, "attempt": attempt.number,
                                     "time": float(progress.get("time") or self.fx.now()), "loss": loss}))

    def _recovered(self) -> None:
        """The first step after a failure ends a recovery: its seconds, from the failed attempt's end
        (the first, if several failed in a row) to now, feed coord_recovery_seconds."""
        failed_at, self.ctx.record.failed_at = self.ctx.record.failed_at, None
        if failed_at is None:
            return
        recoveries = self.ctx.record.recoveries
        recoveries.append(round(max(0.0, self.fx.now() - failed_at), 3))
        del recoveries[:-RECOVERIES_KEPT]

    def _on_checkpoint_written(self, progress: CheckpointRecord) -> None:
        """coord's trainer says how long a save held training and how long the write took
        off the training thread; kept with the step time so the plan can state the overhead."""
        held, wrote = progress["blocking_seconds"], progress["write_seconds"]
        step = progress["step"]  # the trainer counts global steps
        self.ctx.event("checkpoint_saved", f"checkpoint of step {step} saved: training held "
                       f"{held:.3f} s, written in {wrote:.2f} s off the training thread",
                       step=step, blocking_seconds=round(held, 6),
                       write_seconds=round(wrote, 4), step_seconds=self.ctx.record.step_seconds)

    # --- each rank's output -------------------------------------------------------------

    async def pull_log(self, attempt: Attempt, rank: int, name: str, size: int) -> None:
        """Keep each rank's output on the head, per run, attempt and rank."""
        offset = attempt.log_offsets.get(rank, 0)
        if size <= offset:
            return
        try:
            piece = await self.fx.call(name, "read_log", {"job": self.ctx.run_id, "attempt": attempt.number,
                                                          "rank": rank, "offset": offset}, timeout=30)
        except RemoteError:
            return
        self.fx.append_log(self.ctx.run_id, attempt.number, rank, piece["data"])
        attempt.log_offsets[rank] = piece["offset"]

    async def pull_all_logs(self, attempt: Attempt) -> None:
        for rank, name in enumerate(attempt.order):
            await self.pull_log(attempt, rank, name, 1 << 62)

    async def _log_tail(self, attempt: Attempt, rank: int) -> str:
        name = attempt.order[rank]
        if self.fx.node(name).up:
            await self.pull_log(attempt, rank, name, 1 << 62)
        tail = self.fx.log_tail(self.ctx.run_id, attempt.number, rank, 8000).decode("utf-8", "replace")
        return launcher_root_cause(tail) or last_line(tail[-2000:])

    async def _capture_stacks(self, attempt: Attempt) -> None:
        for rank, name in enumerate(attempt.order):
            if not self.fx.node(name).up:
                continue
            try:
                result = await self.fx.call(name, "dump_stacks", {"job": self.ctx.run_id, "attempt": attempt.number,
                                                                  "rank": rank}, timeout=10)
                self.ctx.event("stacks", f"rank {rank} on {name}: {result['detail']}")
            except RemoteError:
                pass
        await anyio.sleep(1.0)  # let the ranks print their stacks before the logs are pulled
        await self.pull_all_logs(attempt)


def _signal_name(status: int) -> str | None:
    if status > 128:
        try:
            return signal.Signals(status - 128).name
        except ValueError:
            return None
    return None


async def _set_when(event: anyio.Event, group: anyio.abc.TaskGroup) -> None:
    """Cancel ``group`` once ``event`` is set (the first of several events to come ends the wait)."""
    await event.wait()
    group.cancel_scope.cancel()
