"""The simulated daemon: the real job manager (``coordinator.jobs.manager.JobManager``) over the
simulated world, killed and started again as a schedule says, and the requests users send it.

Each incarnation is what ``coordinator.daemon.Daemon.run`` does with the jobs: a fresh job
manager and effects over the store's rows, ``reattach()`` then ``schedule()``, every task the
manager spawns in the incarnation's own task group (a crash cancels them all), and the control
requests (submit, stop, cancel) answered in that same group. A request the daemon died on
before answering is sent again to the next daemon, as a user would: a submission the dead
daemon had saved is found in the store (coord status) rather than sent twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from coordinator.jobs.manager import JobError, JobManager
from coordinator.jobs.states import ACTIVE, FINISHED
from tests.simulation.invariants import Checker
from tests.simulation.world import EPOCH, DaemonCrash, SimEffects, SimStore, World

STATE_DIR = Path("/sim/state")  # the job manager reads rank logs under it: the simulation never asks


@dataclass
class Request:
    kind: str  # "submit" | "stop" | "cancel"
    name: str  # the job's
    job: int  # which job of the schedule
    run: int  # which run of that job (0: its first; a name run again is submitted once the run before ended)
    at: float  # virtual time it is sent
    sent_at: float | None = None  # first sent (the daemon died before it answered: sent again)
    answered_at: float | None = None
    answer: str | None = None

    def describe(self) -> str:
        return f"{self.kind} {self.name}" + (f" (run {self.run + 1})" if self.run else "") + f" at t={self.at:g}"


def requests_of(schedule: Any) -> list[Request]:
    """Every request of the schedule, in the order they are sent."""
    out = []
    for number, job in enumerate(schedule.jobs()):
        name = job.spec["name"]
        for run in range(job.runs):
            out.append(Request("submit", name, number, run, job.submit_at))
        if job.cancel_at is not None:
            out.append(Request("cancel", name, number, 0, job.cancel_at))
        if job.stop_at is not None:
            out.append(Request("stop", name, number, 0, job.stop_at))
    return sorted(out, key=lambda r: r.at)  # stable: equal times keep the schedule's order


def is_crash(exc: BaseException) -> bool:
    if isinstance(exc, DaemonCrash):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return all(is_crash(e) or isinstance(e, anyio.get_cancelled_exc_class()) for e in exc.exceptions) and \
            any(is_crash(e) for e in exc.exceptions)
    return False


class SimDaemon:
    def __init__(self, schedule: Any, world: World, checker: Checker):
        self.schedule, self.world, self.checker = schedule, world, checker
        self.jobs = schedule.jobs()
        self.requests = requests_of(schedule)
        self.run_ids: dict[tuple[int, int], str] = {}  # (job, run) -> run id, once submitted
        self.manager: JobManager | None = None
        self.incarnations = 0

    # --- the daemon's lives -----------------------------------------------------------------

    async def serve(self) -> None:
        """Incarnation after incarnation, each killed at its effect the schedule says, until cancelled."""
        crashes = list(self.schedule.crashes)
        while True:
            try:
                await self._incarnation(crashes[0][0] if crashes else None)
            except BaseException as exc:  # noqa: BLE001 (a simulated daemon death is the point)
                if not is_crash(exc):
                    raise
            self.manager = None
            _, delay = crashes.pop(0)
            self.checker.detach(delay)
            await anyio.sleep(delay)

    async def _incarnation(self, crash_at: int | None) -> None:
        self.incarnations += 1
        async with anyio.create_task_group() as tasks:
            fx = SimEffects(self.world, crash_at=crash_at, spawn_into=tasks)
            manager = JobManager(fx, SimStore(self.world), STATE_DIR)
            self.manager = manager
            self.checker.attach(manager)
            tasks.start_soon(self._dies_with, fx)
            # As coordinator/daemon.py's Daemon.run: the runs of before, then the queue.
            manager.reattach()
            manager.schedule()
            tasks.start_soon(self._answer_requests, manager)
            await anyio.sleep_forever()

    @staticmethod
    async def _dies_with(fx: SimEffects) -> None:
        """A crash some task swallowed still ends the whole daemon."""
        await fx.died.wait()
        raise DaemonCrash()

    # --- the requests -----------------------------------------------------------------------

    def pending(self) -> list[Request]:
        return [r for r in self.requests if r.answered_at is None]

    def _ready(self, request: Request) -> bool:
        if request.kind == "submit":
            if request.run == 0:
                return True
            before = self.run_ids.get((request.job, request.run - 1))
            return before is not None and self.world.store[before]["state"] in FINISHED
        return (request.job, request.run) in self.run_ids

    async def _answer_requests(self, manager: JobManager) -> None:
        while True:
            now = anyio.current_time()
            pending = self.pending()
            if not pending:
                return
            due = next((r for r in pending if r.at <= now and self._ready(r)), None)
            if due is not None:
                self._answer(due, manager)
                self.checker.notify()
                continue
            later = [r.at - now for r in pending if r.at > now]
            changed = self.checker.changed
            with anyio.move_on_after(min(later) if later else math.inf):
                await changed.wait()

    def _answer(self, request: Request, manager: JobManager) -> None:
        now = anyio.current_time()
        retry = request.sent_at is not None
        request.sent_at = request.sent_at if retry else now
        spec = self.jobs[request.job].spec
        if request.kind == "submit":
            run_id = self._submitted_before(spec["name"], request) if retry else None
            if run_id is None:
                run_id = manager.submit(dict(spec)).run_id
            self.run_ids[(request.job, request.run)] = run_id
            request.answer = run_id
        else:
            run_id = self.run_ids[(request.job, request.run)]
            runner = manager.find(run_id)
            was, attempt = runner.state, runner.record.attempt
            try:
                (manager.cancel if request.kind == "cancel" else manager.stop)(run_id)
            except JobError as exc:  # cancel: it left the queue already
                request.answer = f"refused: {exc.message}"
            else:
                request.answer = f"answered ({was} then)"
                if was == "queued":  # coord stop of a queued job cancels it too
                    self.checker.cancelled.setdefault(run_id, now)
                elif was in ACTIVE:
                    self.checker.stopped.setdefault(run_id, (now, attempt))
        request.answered_at = now

    def _submitted_before(self, name: str, request: Request) -> str | None:
        """The run a daemon that died before answering had already saved, as coord status shows it."""
        known = set(self.run_ids.values())
        for run_id, row in self.world.store.items():
            if row["name"] == name and run_id not in known and \
                    (row["record"].get("submitted") or 0.0) >= EPOCH + (request.sent_at or 0.0):
                return run_id
        return None

    # --- the end ----------------------------------------------------------------------------

    def all_ended(self) -> bool:
        """Every request answered and every run the live daemon knows finished."""
        manager = self.manager
        if manager is None or self.pending():
            return False
        return all(runner.state in FINISHED for runner in manager.runs.values())

    async def until_all_ended(self) -> None:
        while not self.all_ended():
            changed = self.checker.changed
            await changed.wait()
