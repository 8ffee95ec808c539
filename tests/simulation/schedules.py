"""Seeded fault schedules for the simulated cluster, the loop that runs one, and the invariants.

``run_schedule(seed)`` builds a schedule from the seed alone (so a failure is replayed from
its seed: ``python -m tests.simulation.replay SEED``), drives the real ``JobRunner`` over
``tests.simulation.world`` under trio's virtual clock, and checks after every effect the
supervisor calls, and at the end:

(a) a run succeeds only when one attempt's ranks all finished the total steps, or when the
    newest valid checkpoint of this run is at the total;
(b) a resume uses only a whole checkpoint of this run;
(c) one failure loses at most one checkpoint interval plus what the failed attempt did before
    its first checkpoint (one more interval when rank 0's own node was lost: its newest
    checkpoint may not have been copied off yet);
(d) at most one attempt's ranks run at a time, except on nodes the head cannot reach; those
    are stopped once their nodes are back;
(e) every run ends within a bound computed from its restarts, backoffs, node waits and hangs;
(f) a stop ends the run within STOP_BOUND_S of virtual time;
(g) each restart is counted once, across daemon restarts;
(h) no event or error says "internal error" (or shows an exception group).
"""

from __future__ import annotations

import contextlib
import logging
import random
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog
from trio.testing import MockClock

from coordinator.jobs import core
from coordinator.jobs.policy import MAX_BACKOFF_S
from coordinator.jobs.record import JobRecord
from coordinator.jobs.spec import JobSpec
from coordinator.jobs.supervisor import ACTIVE, FINISHED, NODE_WAIT_S, JobRunner
from tests.simulation.world import DaemonCrash, SimEffects, World

STOP_BOUND_S = 120.0  # a stop waits at most for calls in flight to nodes that hang (their timeouts)
REAP_GRACE_S = 5.0  # an old rank on a node that just came back is stopped at the next poll


class InvariantBroken(AssertionError):
    pass


@dataclass
class Schedule:
    seed: int
    nodes: list[str]
    spec: dict[str, Any]
    step_s: float
    startup_s: float
    copy_s: float
    faults: list[dict[str, Any]] = field(default_factory=list)
    crashes: list[tuple[int, float]] = field(default_factory=list)  # (effect number, restart delay)
    stop_at: float | None = None
    runs: int = 1  # the same name run this many times, one after the other
    head_machine: tuple[str, ...] = ()  # nodes that are the head's own machine (host "local")

    def describe(self) -> str:
        lines = [f"seed {self.seed}: nodes {', '.join(self.nodes)}; step {self.step_s:g} s, startup "
                 f"{self.startup_s:g} s, copy {self.copy_s:g} s; runs {self.runs}"
                 + (f"; head on {', '.join(self.head_machine)}'s machine" if self.head_machine else ""),
                 "  spec: " + ", ".join(f"{k}={v}" for k, v in self.spec.items() if k != "command")
                 + ("; an mlx_lm lora command" if "mlx_lm" in self.spec["command"] else "")]
        lines += [f"  fault: {fault}" for fault in self.faults]
        lines += [f"  daemon killed at its effect #{n}, back after {d:g} s" for n, d in self.crashes]
        if self.stop_at is not None:
            lines.append(f"  coord stop at t={self.stop_at:g} s")
        return "\n".join(lines)


def make_schedule(seed: int) -> Schedule:
    rng = random.Random(seed)
    count = rng.randint(2, 4)
    nodes = [f"n{i + 1}" for i in range(count)]
    save_every = rng.choice([5, 10])
    total = save_every * rng.randint(2, 4) + rng.choice([0, 0, 3])
    spec = {"name": "sim", "command": ["python", "train.py"], "save_every": save_every,
            "max_restarts": rng.randint(0, 4), "keep": rng.randint(1, 3), "total_steps": total,
            "replica": rng.choice(["head", "head", "none", nodes[-1]]),
            "min_nodes": rng.choice([None, None, max(1, count - 1)]),
            "node_timeout": rng.choice([5.0, 20.0, 60.0]),
            "hang_timeout": rng.choice([None, 15.0, 30.0])}
    schedule = Schedule(seed, nodes, spec, step_s=rng.choice([0.1, 0.2, 0.5]), startup_s=rng.uniform(0.5, 5),
                        copy_s=rng.choice([0.1, 0.5, 3.0]))
    horizon = schedule.startup_s + total * schedule.step_s
    for _ in range(rng.choice([0, 1, 1, 2, 2, 3, 4])):
        kind = rng.choice(["kill", "kill", "hang", "early", "power", "cut", "agent", "launch", "checkpoint",
                           "disk"])
        node = rng.choice(nodes)
        at = rng.uniform(0, horizon * 1.5)
        if kind in ("kill", "hang", "early"):
            fault = {"kind": kind, "attempt": rng.randint(0, 2), "rank": rng.randrange(count),
                     "after": rng.randint(0, total)}
            if kind == "kill":
                fault["status"] = rng.choice([1, 137, 139, 134])
        elif kind in ("power", "cut"):
            fault = {"kind": kind, "node": node, "at": at, "detect_s": rng.uniform(0.2, 8.0),
                     "back_after": rng.choice([None, rng.uniform(1, 30), rng.uniform(30, 200)])}
        elif kind == "agent":
            fault = {"kind": kind, "node": node, "at": at}
        elif kind == "launch":
            fault = {"kind": kind, "attempt": rng.randint(0, 2), "how": rng.choice(["missing", "dies"])}
        elif kind == "checkpoint":
            fault = {"kind": kind, "step": save_every * rng.randint(1, max(1, total // save_every)),
                     "how": rng.choice(["corrupt", "torn"])}
        else:
            fault = {"kind": kind, "node": node, "at": at, "for": rng.choice([None, rng.uniform(5, 60)])}
        schedule.faults.append(fault)
    for _ in range(rng.choice([0, 0, 1, 1, 2])):
        schedule.crashes.append((rng.randint(1, 400), rng.uniform(0.5, 10)))
    if rng.random() < 0.15:
        schedule.stop_at = rng.uniform(0, horizon)
    if rng.random() < 0.1:
        schedule.runs = 2
    # Drawn apart, as below: a rank whose weights diverge, on clusters of three or more (two ranks
    # that disagree have no majority to name the wrong one).
    diverging = random.Random(f"diverge:{seed}")
    if count >= 3 and diverging.random() < 0.1:
        schedule.faults.append({"kind": "diverge", "attempt": diverging.randint(0, 1), "rank": diverging.randrange(count),
                                "from_step": diverging.randint(1, total), "every": diverging.randint(1, 3)})
    # Drawn apart, so that the schedules above stay what they were for each seed: the trainer
    # (coord's: every rank writes its own copy on its node) and whether the head is rank 0's machine.
    more = random.Random(f"copies:{seed}")
    trainer = more.choice(["script", "mlx_lm", "coord"])
    if trainer == "mlx_lm":  # rank 0 alone saves; its newest checkpoint is copied to every node
        spec["command"] = ["python", "-m", "mlx_lm", "lora", "--model", "m", "--train", "--data", "d",
                           "--iters", str(total), "--batch-size", "12"]
    spec["trainer"] = "coord" if trainer == "coord" else "mlx_lm"
    if more.random() < 0.4:
        schedule.head_machine = (nodes[0],)
    return schedule


def time_bound(schedule: Schedule) -> float:
    """(e): the longest a run may take, from its restarts, backoffs, node waits and hangs."""
    spec = schedule.spec
    attempts = spec["max_restarts"] + 1 + len(schedule.crashes) + 1
    per_attempt = (schedule.startup_s + spec["total_steps"] * schedule.step_s + core.hang_bound(spec["hang_timeout"])
                   + STOP_BOUND_S + 60 + 10 * schedule.copy_s)
    outages = sum(f.get("back_after") or 0 for f in schedule.faults)
    return (attempts * (per_attempt + MAX_BACKOFF_S + NODE_WAIT_S + 10) + outages
            + sum(delay for _, delay in schedule.crashes) + 60)


class Checker:
    """The invariants, against the world's ground truth."""

    def __init__(self, schedule: Schedule, world: World):
        self.schedule, self.world = schedule, world
        self.run_ids: list[str] = []
        self.launches_checked = 0

    def fail(self, letter: str, message: str) -> None:
        raise InvariantBroken(f"({letter}) {message}")

    def continuous(self) -> None:
        world = self.world
        running = world.running_attempts(reachable_only=True, grace=REAP_GRACE_S)
        if len(running) > 1:
            self.fail("d", f"ranks of {len(running)} attempts run at once on reachable nodes: {sorted(running)}")
        for _, kind, message in world.events[-3:]:
            if "internal error" in message or "ExceptionGroup" in message:
                self.fail("h", f"{kind}: {message}")
        while self.launches_checked < len(world.launch_log):
            self.check_launch(world.launch_log[self.launches_checked])
            self.launches_checked += 1

    def check_launch(self, launch: dict[str, Any]) -> None:
        """(b) and (c) for one launch."""
        world, run = self.world, launch["run"]
        steps = {start for _, start, _ in launch["ranks"].values()}
        if len(steps) != 1:
            self.fail("b", f"ranks of attempt {launch['attempt']} start from different steps {steps}")
        start = steps.pop()
        for rank, (node, _, resume) in launch["ranks"].items():
            if start == 0:
                if resume:
                    self.fail("b", f"rank {rank} resumes from {resume} at step 0")
                continue
            file = world.nodes[node].files.get(resume or "")
            if file is None:
                self.fail("b", f"rank {rank} on {node} resumes from {resume}, which is not there")
            if file.run != run:
                self.fail("b", f"rank {rank} resumes from a checkpoint of run {file.run}, not {run}")
            if not file.whole(world.now()) or file.step != start:
                self.fail("b", f"rank {rank} resumes from {resume} (step {file.step}, whole "
                               f"{file.whole(world.now())}) as step {start}")
        earlier = [r for (r_run, attempt, _), r in world.ranks.items() if r_run == run and attempt < launch["attempt"]]
        if not earlier:
            return
        last_attempt = max(r.attempt for r in earlier)
        previous = [r for r in earlier if r.attempt == last_attempt]
        rank0 = next((r for r in previous if r.rank == 0), None)
        if rank0 is None or rank0.launched_at is None:
            return
        diverged = [max(r.diverge_at, r.start_step + 1) for r in previous if r.diverge_at is not None]
        seen = any(kind == "job.attempt_ended" and f"attempt {last_attempt}: diverged" in message
                   for t, kind, message in world.events if t >= rank0.launched_at)
        if diverged and seen:  # a divergence coord saw is never resumed from: the resume is from before it
            if start >= min(diverged):
                self.fail("c", f"attempt {launch['attempt']} resumes from step {start}, at or after rank weights "
                               f"diverged at step {min(diverged)}")
            return
        failed_at = min((r.exited_at for r in previous if r.exited_at is not None and r.exit != 0),
                        default=world.now())
        reached = rank0.step_at(failed_at)
        interval = self.schedule.spec["save_every"]
        first_checkpoint = min(rank0.total, (rank0.start_step // interval + 1) * interval)
        before_first = first_checkpoint - rank0.start_step
        allowed = interval + before_first
        if not world.nodes[rank0.node].reachable or not world.nodes[rank0.node].powered:
            allowed += interval + int(self.schedule.copy_s / self.schedule.step_s) + 1
        if any(f["kind"] in ("checkpoint", "disk") for f in self.schedule.faults) or \
                self.schedule.spec["replica"] == "none" or self.schedule.crashes:
            # a damaged checkpoint's work is lost with it; so is a lost node's without a copy
            return
        if reached - start > allowed:
            self.fail("c", f"attempt {launch['attempt']} resumes from step {start}; attempt {last_attempt} had "
                           f"reached {reached} (allowed loss {allowed})")

    def final(self, runner_state: str, record: dict[str, Any], run_id: str, stop_seen_at: float | None,
              ended_at: float, started_at: float) -> None:
        world, spec = self.world, self.schedule.spec
        total = spec["total_steps"]
        if runner_state not in FINISHED:
            self.fail("e", f"run {run_id} did not end within {time_bound(self.schedule):.0f} s; it is {runner_state}")
        if ended_at - started_at > time_bound(self.schedule):
            self.fail("e", f"run {run_id} took {ended_at - started_at:.0f} s (bound {time_bound(self.schedule):.0f})")
        if runner_state == "succeeded":
            finished = {}
            for (r_run, attempt, _), rank in world.ranks.items():
                if r_run == run_id:
                    finished.setdefault(attempt, []).append(rank.exit == 0 and rank.step_at(rank.exited_at or 0)
                                                             >= total)
            all_ranks = any(all(flags) for flags in finished.values())
            at_total = any(f.run == run_id and f.step >= total and f.whole(world.now())
                           for node in world.nodes.values() for f in node.files.values())
            at_total = at_total or any(f.run == run_id and f.step >= total and f.whole(world.now())
                                       for f in world.head_files.values() if hasattr(f, "run"))
            if not (all_ranks or at_total):
                self.fail("a", f"run {run_id} succeeded without an attempt that finished and without a checkpoint "
                               f"at step {total}")
            last = record.get("attempt")  # the attempt the success is of
            peers = [r for (r_run, attempt, _), r in world.ranks.items() if r_run == run_id and attempt == last]
            for rank in peers:
                every, start, rank_no, attempt = rank.fingerprint_every, rank.diverge_at, rank.rank, last
                # a step whose fingerprint every rank of the attempt reported, the diverged one's differing
                if start is not None and every and any(
                        step % every == 0 and all(p.step_at(p.exited_at or world.now()) >= step for p in peers)
                        for step in range(max(start, rank.start_step + 1), total + 1)):
                    self.fail("a", f"run {run_id} succeeded with attempt {attempt}, whose rank {rank_no} reported "
                                   f"weights that diverged from step {start}")
            copies = list(world.catalog.get(run_id, {}).values())
            valid = [c for c in copies if c["valid"]]
            if valid and spec["replica"] != "none" and not record.get("warning"):
                newest = max((c["step"], c["attempt"]) for c in valid)
                group = [c for c in valid if (c["step"], c["attempt"]) == newest]
                primary = next((c["node"] for c in group if c.get("role", "primary") == "primary"), None)
                on_head = world.head_machine | {"head"}
                if not any(c.get("role") == "replica" or (c.get("role") == "local" and c["node"] != primary and not
                                                          (c["node"] in on_head and primary in on_head))
                           for c in group):
                    self.fail("a", f"run {run_id} succeeded before a copy of its final checkpoint {newest} landed "
                                   "off its primary's machine, and says nothing of it")
        if stop_seen_at is not None and runner_state != "succeeded" and ended_at - stop_seen_at > STOP_BOUND_S:
            self.fail("f", f"a stop took {ended_at - stop_seen_at:.0f} s")
        if stop_seen_at is not None and runner_state not in FINISHED:
            self.fail("f", "a stop did not end the run")
        history = record.get("history", [])
        attempts = [h.get("attempt") for h in history]
        if len(attempts) != len(set(attempts)):
            self.fail("g", f"an attempt's outcome was counted twice: {attempts}")
        counted = sum(1 for h in history if h.get("counted"))
        if record.get("restarts") != counted:
            self.fail("g", f"restarts {record.get('restarts')} but {counted} counted outcomes in the history")
        if record.get("restarts", 0) > spec["max_restarts"]:
            self.fail("g", f"restarts {record['restarts']} over --max-restarts {spec['max_restarts']}")
        text = str(record.get("error") or "")
        if "internal error" in text or "ExceptionGroup" in text:
            self.fail("h", text)


async def _drive(schedule: Schedule, world: World, checker: Checker) -> dict[str, Any]:
    spec = JobSpec(**schedule.spec)
    crashes = list(schedule.crashes)
    result: dict[str, Any] = {"runs": []}
    async with anyio.create_task_group() as faults:
        faults.start_soon(_apply_faults, schedule, world)
        for number in range(schedule.runs):
            run_id = core.new_run_id(spec.name, set(world.store))
            checker.run_ids.append(run_id)
            started = anyio.current_time()
            stop_seen: list[float] = []
            ended_at: list[float] = []
            state, record = await _one_run(schedule, world, spec, run_id, crashes, stop_seen, started, ended_at,
                                           stop_at=schedule.stop_at if number == 0 else None)
            ended = ended_at[0] if ended_at else anyio.current_time()
            checker.final(state, record, run_id, stop_seen[0] if stop_seen else None, ended, started)
            if number > 0 and world.launch_log:
                first = next(launch for launch in world.launch_log if launch["run"] == run_id) \
                    if any(launch["run"] == run_id for launch in world.launch_log) else None
                if first is not None and any(start for _, start, _ in first["ranks"].values()):
                    checker.fail("b", f"run {run_id} of a name run again did not start from step 0")
            result["runs"].append({"run_id": run_id, "state": state, "record": record})
        # Every node that comes back has its leftovers stopped.
        await anyio.sleep(max([f.get("back_after") or 0 for f in schedule.faults] + [0]) + 30)
        world.settle()
        for rank in world.ranks.values():
            node = world.nodes[rank.node]
            if rank.running() and node.reachable and result["runs"][-1]["state"] in FINISHED:
                checker.fail("d", f"rank {rank.rank} of attempt {rank.attempt} still runs on {rank.node} after "
                                  "the run ended and its node is back")
        faults.cancel_scope.cancel()
    result["launches"] = world.launch_log
    result["copies"] = world.copies
    return result


async def _one_run(schedule, world, spec, run_id, crashes, stop_seen, started, ended_at, *, stop_at):
    bound = time_bound(schedule)
    fresh = True
    while True:
        crash_at = crashes[0][0] if crashes else None
        try:
            async with anyio.create_task_group() as daemon:
                fx = SimEffects(world, crash_at=crash_at, spawn_into=daemon)
                row = world.store.get(run_id)
                if fresh:
                    runner = JobRunner(fx, spec, run_id=run_id)
                    runner.save()
                    daemon.start_soon(runner.run)
                elif row["state"] in ACTIVE:
                    runner = JobRunner(fx, spec, run_id=run_id, record=JobRecord.from_json(row["record"]),
                                       state=row["state"])
                    daemon.start_soon(lambda: runner.run(reattach=row["record"].get("attempt", -1) >= 0))
                else:
                    runner = JobRunner(fx, spec, run_id=run_id, record=JobRecord.from_json(row["record"]),
                                       state=row["state"])
                    if row["record"].get("unstopped"):  # as the daemon does for a finished run
                        await runner.reap_when_back()
                    return row["state"], row["record"]
                fresh = False
                if stop_at is not None and not stop_seen:
                    async def stop_later(runner=runner) -> None:
                        await anyio.sleep(max(0.0, started + stop_at - anyio.current_time()))
                        if runner.state not in FINISHED:
                            stop_seen.append(anyio.current_time())
                            runner.request_stop()
                    daemon.start_soon(stop_later)
                with anyio.move_on_after(max(1.0, started + bound + 60 - anyio.current_time())):
                    await runner.done.wait()
                    ended_at.append(anyio.current_time())
                if runner.record.unstopped and runner.state in FINISHED:
                    # The daemon lives on: its reaper stops what runs on nodes once they are back.
                    await anyio.sleep(max([f.get("back_after") or 0 for f in schedule.faults] + [0]) + 20)
                daemon.cancel_scope.cancel()
            return runner.state, runner.record.to_json()
        except BaseException as exc:  # noqa: BLE001 (a simulated daemon death is the point)
            if not _is_crash(exc):
                raise
            _, delay = crashes.pop(0)
            fresh = False
            await anyio.sleep(delay)
            if run_id not in world.store:  # killed before the run was first saved: submitted again
                fresh = True


def _is_crash(exc: BaseException) -> bool:
    if isinstance(exc, DaemonCrash):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_crash(e) or isinstance(e, anyio.get_cancelled_exc_class()) for e in exc.exceptions) and \
            any(_is_crash(e) for e in exc.exceptions)
    return False


async def _apply_faults(schedule: Schedule, world: World) -> None:
    for fault in schedule.faults:
        kind = fault["kind"]
        if kind in ("kill", "hang", "early"):
            world.rank_faults[(fault["attempt"], fault["rank"] if kind != "early" else 0)] = fault
            if kind == "early":
                for rank in range(len(schedule.nodes)):
                    world.rank_faults[(fault["attempt"], rank)] = fault
        elif kind == "diverge":  # every rank reports fingerprints; this one's differ from step "from_step" on
            world.fingerprint_every = fault["every"]
            world.diverging[(fault["attempt"], fault["rank"])] = fault["from_step"]
        elif kind == "launch":
            world.launch_faults[fault["attempt"]] = fault["how"]
        elif kind == "checkpoint":
            world.bad_checkpoints[fault["step"]] = fault["how"]
    timed = sorted((f for f in schedule.faults if "at" in f), key=lambda f: f["at"])
    async with anyio.create_task_group() as tasks:
        for fault in timed:
            tasks.start_soon(_timed_fault, world, fault)


async def _timed_fault(world: World, fault: dict[str, Any]) -> None:
    await anyio.sleep(fault["at"])
    name, kind = fault["node"], fault["kind"]
    if kind in ("power", "cut"):
        await (world.power_off if kind == "power" else world.cut)(name, fault["detect_s"])
        if fault["back_after"] is not None:
            await anyio.sleep(max(0.0, fault["back_after"] - fault["detect_s"]))
            await world.restore(name)
    elif kind == "agent":
        await world.restart_agent(name)
    elif kind == "disk":
        world.nodes[name].disk_full = True
        if fault["for"] is not None:
            await anyio.sleep(fault["for"])
            world.nodes[name].disk_full = False


def run_schedule(seed: int | Schedule) -> dict[str, Any]:
    """Run one schedule under a virtual clock; InvariantBroken (with the replay) when one breaks."""
    schedule = seed if isinstance(seed, Schedule) else make_schedule(seed)
    world = World(schedule.nodes, step_s=schedule.step_s, startup_s=schedule.startup_s, copy_s=schedule.copy_s,
                  every_rank_saves=schedule.spec.get("trainer") == "coord", head_machine=schedule.head_machine)
    checker = Checker(schedule, world)
    world.checkers.append(checker.continuous)
    try:
        with quiet_logs():
            return anyio.run(_drive, schedule, world, checker, backend="trio",
                             backend_options={"clock": MockClock(autojump_threshold=0)})
    except InvariantBroken as exc:
        raise InvariantBroken(f"{exc}\n{replay(schedule, world)}") from None
    except BaseException as exc:
        raise InvariantBroken(f"the simulation itself failed: {exc!r}\n{replay(schedule, world)}") from exc


@contextlib.contextmanager
def quiet_logs():
    """The supervisor's log lines cost more than the simulation itself: dropped while it runs."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL),
                        cache_logger_on_first_use=False)
    try:
        yield
    finally:
        structlog.configure(**saved)


def replay(schedule: Schedule, world: World, events: int = 60) -> str:
    lines = [schedule.describe(), "  events (virtual seconds):"]
    lines += [f"    {t:8.2f} {kind}: {message}" for t, kind, message in world.events[-events:]]
    lines.append(f"  replay: python -m tests.simulation.replay {schedule.seed}")
    return "\n".join(lines)
