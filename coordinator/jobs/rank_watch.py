"""A run's ranks, for its supervisor: each rank polled through its node's agent and its report
classified (``core.classify_ranks``), progress and fingerprints read, each rank's output kept
on the head, stacks captured from a hung rank, known failures diagnosed.

A mixin of ``JobRunner``: it works on the runner's record, effects and events."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

import anyio

from coordinator.jobs import core, diagnosis
from coordinator.jobs.fingerprints import comparison_summary
from coordinator.jobs.policy import (
    DIVERGED,
    HUNG,
    LAUNCH_FAILED,
    NODE_LOST,
    RANK_FAILED,
    RESIZED,
    STOPPED,
    Outcome,
    RankFailure,
    root_cause,
)
from coordinator.jobs.spec import attempt_command
from coordinator.nodes import versions as node_versions
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from coordinator.jobs.supervisor import JobRunner as _Runner
else:
    _Runner = object

POLL_S = 0.5
MAX_REREADS = 20  # polls at once after every rank exited, each reading up to the agent's cap of records
LOG_DIAGNOSIS_BYTES = 256 << 10  # the end of a rank's log, where the error that stopped it is
FAILURES = (RANK_FAILED, NODE_LOST, HUNG, LAUNCH_FAILED)  # outcomes a recovery is timed from
RECOVERIES_KEPT = 100


class RankWatching(_Runner):
    """The rank-watching half of a run's supervisor."""

    async def _watch_ranks(self) -> Outcome:
        """Poll every rank through its node's agent until the attempt ends one way or another."""
        attempt = self.record["attempt"]
        order = self.record["order"]
        rereads = 0
        if self.record.get("diverged_after") is not None:  # seen before a daemon restart: ended as it was then
            await self._invalidate_after_divergence()
            return self._outcome(DIVERGED, f"the replicas diverged after step {self.record['diverged_after']} "
                                 "(found before the daemon restarted)", f"diverged:{self.record['diverged_after']}")
        while True:
            if self.stop_requested:
                return self._outcome(STOPPED, "stop requested", "")
            reports: list[core.RankReport] = []
            read_any = False
            for rank, name in enumerate(order):
                view = self.fx.node(name)
                if not view.up:
                    return self._verdict(core.node_lost(rank, name, view.reason))
                try:
                    status = await self.fx.call(name, "rank_status", {
                        "job": self.run_id, "attempt": attempt, "rank": rank,
                        "progress_offset": self._progress_offsets.get(rank, 0)}, timeout=10)
                except RemoteError as exc:
                    self._mark_unreachable(name)
                    return self._verdict(core.node_lost(rank, name, f"it did not answer: {exc.message}"))
                self._progress_offsets[rank] = status["progress_offset"]
                if status.get("rss_bytes"):
                    self.record.setdefault("rank_memory", {})[str(rank)] = status["rss_bytes"]
                    # the largest since the last point: what the history keeps per rank
                    self._rank_peaks[str(rank)] = max(self._rank_peaks.get(str(rank), 0), status["rss_bytes"])
                read_any = read_any or bool(status["progress"])
                for record in status["progress"]:
                    self._on_progress(record)
                await self._pull_log(rank, name, status["log_size"])
                detected = None
                if status["state"] == "exited" and status.get("exited_at"):  # both times from the node's clock
                    detected = max(0.0, status["time"] - status["exited_at"])
                reports.append(core.RankReport(rank, name, status["state"], status.get("exit"), detected))
            pid = self.record.get("launcher_pid")
            verdict = core.classify_ranks(reports, ranks=len(order), step=self.record["step"],
                                          total_steps=self.spec.total_steps,
                                          launcher_exit=self.fx.launcher_exit(pid) if pid else None,
                                          since_launch=self.fx.now() - (self.record.get("launched_at") or 0))
            # Before the verdict: fingerprints that disagree, read in the same poll that found every
            # rank finished, make the run resume from before them, never a success.
            if self._divergence is not None:
                return await self._diverged(self._divergence)
            if verdict is not None:
                if read_any and rereads < MAX_REREADS and all(r.state == "exited" for r in reports):
                    rereads += 1  # every rank is done: what they wrote last (a read is capped) is judged too
                    continue
                return await self._ended(verdict)
            hung = core.hang_reason(now=self.fx.now(), last_progress=self.record.get("last_progress"),
                                    first_step_at=self.record["first_step_at"], configured=self.spec.hang_timeout,
                                    step_seconds=self.record.get("step_seconds"))
            if hung:
                await self._capture_stacks()
                return self._outcome(HUNG, hung, "hang")
            if self.record.get("unstopped"):
                await self._reap()
            resize = self._resize_due()
            if resize:
                return self._outcome(RESIZED, resize, "resize")
            await self._pause(POLL_S)

    async def _ended(self, verdict: core.Verdict) -> Outcome:
        if not verdict.failures:
            return self._verdict(verdict)
        cause = root_cause([RankFailure(r.rank, r.node, r.exit, await self._log_tail(r.rank))
                            for r in verdict.failures])
        code, tail = cause.status, cause.last_line
        return self._outcome(RANK_FAILED, f"rank {cause.rank} on {cause.node} exited with status {code}"
                             + (f" ({_signal_name(code)})" if _signal_name(code) else "")
                             + (f": {tail}" if tail else ""), f"exit:{code}:{tail}",
                             detected_after=verdict.detected_after)

    def _verdict(self, verdict: core.Verdict) -> Outcome:
        return self._outcome(verdict.kind, verdict.detail, verdict.signature, verdict.detected_after)

    def _outcome(self, kind: str, detail: str, signature: str, detected_after: float | None = None) -> Outcome:
        """The attempt is over; ``detected_after`` is how long its end went unseen (a rank's exit
        to the poll that saw it), when known."""
        extra = {"seconds": round(detected_after, 3)} if detected_after is not None else {}
        if kind in FAILURES:
            self.record.setdefault("failed_at", self.fx.now())
        self.event("attempt_ended", f"attempt {self.record['attempt']}: {kind}: {detail}"
                   + (f" (seen {detected_after:.2f} s after)" if detected_after is not None else ""),
                   outcome=kind, **extra)
        if kind in (RANK_FAILED, HUNG):
            self._diagnose_logs()
        return Outcome(kind, detail, self.record["first_step_at"] is not None, signature[:300])

    def _diagnose(self, found: list[dict[str, Any]], where: str) -> None:
        """Known failure modes, each named once per job with its fix (coord status shows them)."""
        known = self.record.setdefault("diagnoses", [])
        for item in found:
            if any(d["id"] == item["id"] for d in known):
                continue
            known.append({"id": item["id"], "title": item["title"], "detail": f"{where}: {item['detail']}",
                          "fix": item["fix"], "line": item.get("line")})
            self.event("diagnosis", f"{item['title']} ({where}); fix: {item['fix']}", id=item["id"])

    def _diagnose_launch(self, order: list[str], document: dict[str, Any], batch) -> None:
        versions = [v for v in ((self.fx.node(n).facts or {}).get("mlx_lm_version") for n in order) if v]
        oldest = node_versions.oldest(versions)
        command = attempt_command(self.spec, adapter_path="", resume_file=None, start_step=0, batch=batch)
        envs = dict(env.split("=", 1) for env in document.get("envs", []) if "=" in env)
        self._diagnose(diagnosis.diagnose_job(command, envs, oldest), "the job's command")
        facts = {n: self.fx.node(n).facts for n in order if self.fx.node(n).facts}
        self._diagnose(diagnosis.diagnose_cluster(facts), "the job's nodes")

    def _diagnose_logs(self) -> None:
        attempt = self.record["attempt"]
        for rank in range(len(self.record["order"])):
            text = self.fx.log_tail(self.run_id, attempt, rank, LOG_DIAGNOSIS_BYTES).decode("utf-8", "replace")
            if text:
                self._diagnose(diagnosis.diagnose_log(text), f"rank {rank}'s log, attempt {attempt}")

    def _on_progress(self, record: dict[str, Any]) -> None:
        if record.get("kind") == "fingerprint":
            check = self._replica_check
            compared = check.compared
            found = check.add(int(record["step"]), int(record["rank"]), str(record["sha256"]))
            self.record["replica_state"] = check.state()  # saved with the progress offsets it goes with
            first = found if self._divergence is None else None  # the one the attempt is stopped for
            self._divergence = self._divergence or found
            if check.compared != compared:  # every rank reported this step: kept for the plan
                self.record["replica_check"] = comparison_summary(self.record.get("replica_check"), check,
                                                                  self.record["attempt"], self.record["order"], first)
            return
        if record.get("kind") == "checkpoint":
            self._on_checkpoint_written(record)
            return
        if record.get("kind") == "val":
            self._on_val_loss(record)
            return
        if record.get("kind") != "train":
            return
        now = float(record.get("time") or self.fx.now())
        step = int(record["step"])
        if self.record["first_step_at"] is None:
            self.record["first_step_at"] = now
            self.event("first_step", f"attempt {self.record['attempt']} reached step {step}",
                       seconds=round(now - (self.record.get("last_progress") or now), 3), step=step)
            self._recovered()
        previous_step = self.record["step"]
        previous_time = self.record.get("last_progress")
        if step > previous_step and previous_time and self.record["first_step_at"] != now:
            per_step = (now - previous_time) / max(1, step - previous_step)
            self.record["step_seconds"] = per_step
        self.record["step"] = max(step, self.record["step"])
        self.record["loss"] = record.get("loss")
        self.record["tokens_per_second"] = record.get("tokens_per_second")
        self.record["peak_memory_gb"] = record.get("peak_memory_gb")
        self.record["last_progress"] = now
        self.save()
        peak = record.get("peak_memory_gb")
        self.fx.record_point(self.run_id, "train", {
            "step": step, "attempt": self.record["attempt"], "time": now, "loss": record.get("loss"),
            "learning_rate": record.get("learning_rate"), "tokens_per_second": record.get("tokens_per_second"),
            # mlx-lm's peak memory is bytes / 1e9
            "peak_memory_bytes": int(peak * 1e9) if isinstance(peak, (int, float)) else None,
            "rank_memory_bytes": dict(self._rank_peaks)})
        self._rank_peaks.clear()

    def _on_val_loss(self, record: dict[str, Any]) -> None:
        try:
            step, loss = int(record["step"]), float(record["val_loss"])
        except (KeyError, TypeError, ValueError):
            return
        self.record["val_loss"] = loss
        self.fx.record_point(self.run_id, "val", {"step": step, "attempt": self.record["attempt"],
                                                  "time": float(record.get("time") or self.fx.now()), "loss": loss})

    def _recovered(self) -> None:
        """The first step after a failure ends a recovery: its seconds, from the failed attempt's end
        (the first, if several failed in a row) to now, feed coord_recovery_seconds."""
        failed_at = self.record.pop("failed_at", None)
        if failed_at is None:
            return
        recoveries = self.record.setdefault("recoveries", [])
        recoveries.append(round(max(0.0, self.fx.now() - failed_at), 3))
        del recoveries[:-RECOVERIES_KEPT]

    def _on_checkpoint_written(self, record: dict[str, Any]) -> None:
        """coord's trainer says how long a save held training and how long the write took
        off the training thread; kept with the step time so the plan can state the overhead."""
        try:
            held, wrote = float(record["blocking_seconds"]), float(record["write_seconds"])
            step = int(record["step"])  # the trainer counts global steps
        except (KeyError, TypeError, ValueError):
            return
        self.event("checkpoint_saved", f"checkpoint of step {step} saved: training held "
                   f"{held:.3f} s, written in {wrote:.2f} s off the training thread",
                   step=step, blocking_seconds=round(held, 6),
                   write_seconds=round(wrote, 4), step_seconds=self.record.get("step_seconds"))

    async def _pull_log(self, rank: int, name: str, size: int) -> None:
        """Keep each rank's output on the head, per run, attempt and rank."""
        offset = self._log_offsets.get(rank, 0)
        if size <= offset:
            return
        try:
            piece = await self.fx.call(name, "read_log", {"job": self.run_id, "attempt": self.record["attempt"],
                                                          "rank": rank, "offset": offset}, timeout=30)
        except RemoteError:
            return
        self.fx.append_log(self.run_id, self.record["attempt"], rank, piece["data"])
        self._log_offsets[rank] = piece["offset"]

    async def _log_tail(self, rank: int) -> str:
        name = self.record["order"][rank]
        if self.fx.node(name).up:
            await self._pull_log(rank, name, 1 << 62)
        text = self.fx.log_tail(self.run_id, self.record["attempt"], rank, 2000).decode("utf-8", "replace")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return lines[-1][:300] if lines else ""

    async def _capture_stacks(self) -> None:
        for rank, name in enumerate(self.record["order"]):
            if not self.fx.node(name).up:
                continue
            try:
                result = await self.fx.call(name, "dump_stacks", {"job": self.run_id, "attempt": self.record["attempt"],
                                                                  "rank": rank}, timeout=10)
                self.event("stacks", f"rank {rank} on {name}: {result['detail']}")
            except RemoteError:
                pass
        await anyio.sleep(1.0)  # let the ranks print their stacks before the logs are pulled
        for rank, name in enumerate(self.record["order"]):
            await self._pull_log(rank, name, 1 << 62)

def _signal_name(status: int) -> str | None:
    if status > 128:
        try:
            return signal.Signals(status - 128).name
        except ValueError:
            return None
    return None
