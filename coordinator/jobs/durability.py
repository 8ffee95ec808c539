"""One run's checkpoints taken off the cluster: each validated checkpoint uploaded to the checkpoint
store in the background (``coordinator/durable``), the store's retention applied, and how far behind
the store is kept in the record (``coord status``: "durable up to step N"), with an alert when a
checkpoint has waited longer than ``--durability-lag-alert``.

The training never waits on the store: uploads run beside it, one at a time, newest first (the
policy in ``coordinator/durable/policy.py``). An upload that fails is said once per cause
(``store_failed``) and tried again after a backoff; the next checkpoint starts a new try at once."""

from __future__ import annotations

import anyio

from coordinator.config.store_url import checkpoint_dir, parse_store_url
from coordinator.durable import policy
from coordinator.durable.objects import StoreError
from coordinator.durable.transfer import SenderLost, UploadDamaged
from coordinator.jobs.effects import StorePorts, UploadMeta
from coordinator.jobs.record import Durability
from coordinator.jobs.run_context import RunContext
from shared.rpc import RemoteError

RETRY_FIRST_S, RETRY_MAX_S = 15.0, 300.0
FINAL_UPLOAD_TIMEOUT_S = 600.0  # the run's last checkpoint, before it is called succeeded
STOPPED_UPLOAD_TIMEOUT_S = 120.0  # before it is called stopped or failed: someone may be waiting on coord stop


class DurabilityWatch:
    def __init__(self, ctx: RunContext, url: str):
        self.ctx = ctx
        self.fx: StorePorts = ctx.fx
        self.url = parse_store_url(url).url
        self.run_url = parse_store_url(url).below(ctx.run_id).url
        self._wake = anyio.Event()
        self._one_at_a_time = anyio.Lock()
        self._retry_s = RETRY_FIRST_S
        self._told: str | None = None  # the failure said last (each cause once)
        self._lag_alerted = False

    def poke(self) -> None:
        """A new checkpoint was validated."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            with anyio.move_on_after(self._retry_s if self.ctx.record.durability and
                                     self.ctx.record.durability["error"] else RETRY_MAX_S):
                await self._wake.wait()
            self._wake = anyio.Event()
            await self.upload_pending()

    def _meta(self) -> UploadMeta:
        return UploadMeta(run=self.ctx.run_id, job=self.ctx.spec.name,
                          world_size=len(self.ctx.record.order or self.ctx.job_nodes()),
                          bandwidth=self.ctx.spec.store_bandwidth, from_nodes=self.ctx.spec.store_from == "nodes")

    async def upload_pending(self) -> bool:
        """Upload the newest checkpoint not yet durable (if any), then apply the store's retention;
        whether the store is caught up."""
        async with self._one_at_a_time:
            run, fx = self.ctx, self.fx
            source = policy.to_upload(fx.checkpoints(run.run_id), fx.durable_checkpoints(run.run_id))
            error: str | None = None
            cause: str | None = None  # what is said once: a store's kind of failure, else the error itself
            speed: float | None = None
            if source is not None:
                where = f"{self.run_url}/{checkpoint_dir(source['step'], source['attempt'])}"
                started = fx.monotonic()
                try:
                    row = await fx.upload_checkpoint(where, source, self._meta())
                except (StoreError, UploadDamaged, SenderLost, RemoteError, OSError) as exc:
                    error = exc.message if isinstance(exc, RemoteError) else str(exc)
                    cause = f"store:{exc.kind}" if isinstance(exc, StoreError) else error
                else:
                    seconds = max(fx.monotonic() - started, 1e-6)
                    speed = row["bytes"] / seconds
                    fx.add_durable(run.run_id, row)
                    senders = row.get("senders") or []
                    run.event("durable", f"checkpoint of step {row['step']} committed to {row['url']} in "
                              f"{seconds:.2f} s ({speed / 1e6:.1f} MB/s"
                              + (f", put by {', '.join(senders)}" if senders else "")
                              + "), every part's SHA256 in its manifest",
                              step=row["step"], attempt=row["attempt"], url=row["url"], bytes=row["bytes"],
                              seconds=round(seconds, 3), senders=senders)
                    self._told, self._retry_s = None, RETRY_FIRST_S
            if error is not None:
                if cause != self._told:
                    run.event("store_failed", f"checkpoint of step {source['step'] if source else '?'} not uploaded "
                              f"to {self.url}: {error}; the job trains on, and coord tries again", error=error)
                    self._told = cause
                self._retry_s = min(self._retry_s * 2, RETRY_MAX_S)
            else:
                await self._retain()
            self._update(error, speed)
            return error is None and policy.to_upload(fx.checkpoints(run.run_id),
                                                      fx.durable_checkpoints(run.run_id)) is None

    async def _retain(self) -> None:
        run, fx = self.ctx, self.fx
        for old in policy.store_to_remove(fx.durable_checkpoints(run.run_id), run.spec.store_keep,
                                          run.spec.store_keep_every):
            try:
                await fx.remove_stored(old["url"])
            except StoreError as exc:
                run.log.warning("store_retention_failed", url=old["url"], error=str(exc))
                return
            fx.remove_durable(run.run_id, old["attempt"], old["step"])

    def _update(self, error: str | None, speed: float | None) -> None:
        run, fx = self.ctx, self.fx
        lag = policy.lag(fx.checkpoints(run.run_id), fx.durable_checkpoints(run.run_id), fx.now())
        before = run.record.durability
        run.record.durability = Durability(
            store=self.run_url, durable_step=lag.durable_step, lag_steps=lag.steps, lag_seconds=round(lag.seconds, 1),
            bytes_per_s=speed if speed is not None else (before["bytes_per_s"] if before else None), error=error)
        if lag.seconds > run.spec.durability_lag_alert and not self._lag_alerted:
            self._lag_alerted = True
            durable = f"step {lag.durable_step}" if lag.durable_step is not None else "no checkpoint yet"
            run.event("durability_lag", f"checkpoints have not reached {self.url} for {lag.seconds:.0f} s "
                      f"(--durability-lag-alert {run.spec.durability_lag_alert:g}): durable up to {durable}, "
                      f"{lag.steps} steps behind" + (f"; last error: {error}" if error else ""),
                      lag_seconds=round(lag.seconds, 1), lag_steps=lag.steps, durable_step=lag.durable_step)
        elif lag.seconds <= run.spec.durability_lag_alert:
            self._lag_alerted = False

    def held_locally(self) -> set[tuple[int, int]]:
        """(step, attempt) of the checkpoints local retention keeps until they are in the store."""
        return policy.held_locally(self.fx.checkpoints(self.ctx.run_id), self.fx.durable_checkpoints(self.ctx.run_id))

    async def final_upload(self, limit_s: float = FINAL_UPLOAD_TIMEOUT_S) -> None:
        """Before a run ends: its newest checkpoint into the store, within ``limit_s``; a warning with
        the run when it did not land."""
        if policy.to_upload(self.fx.checkpoints(self.ctx.run_id), self.fx.durable_checkpoints(self.ctx.run_id)):
            self.ctx.event("final_upload", f"uploading the newest checkpoint to {self.url} before the run ends "
                           f"(at most {limit_s:.0f} s)")
        with anyio.move_on_after(limit_s):
            for _ in range(3):
                if await self.upload_pending():
                    return
                await self.ctx.pause(RETRY_FIRST_S)
        state = self.ctx.record.durability
        if state and state["lag_steps"] > 0:
            durable = f"step {state['durable_step']}" if state["durable_step"] is not None else "no checkpoint yet"
            self.ctx.record.add_warning(f"the final checkpoint is not in the checkpoint store ({self.url}): durable "
                                        f"up to {durable}"
                                        + (f" ({state['error']})" if state["error"] else ""))
