"""Seeded fault schedules for the simulated cluster, and the loop that runs one.

``run_schedule(seed)`` builds a schedule from the seed alone (so a failure is replayed from
its seed: ``python -m tests.simulation.replay SEED``), drives the real job manager
(``coordinator.jobs.manager.JobManager``, and through it each run's ``JobRunner``) over
``tests.simulation.world`` under trio's virtual clock, as ``tests.simulation.daemon`` does:
jobs submitted, stopped and cancelled at virtual times, the daemon killed and started again.
The invariants (``tests.simulation.invariants``) are checked after every effect the
supervisor calls, and at the end.

Most schedules run one job on every node (its name run again in some), under node losses,
rank kills, hangs, damaged checkpoints and daemon crashes. A share (MULTI_JOB_SHARE) run two
to four jobs at once, on overlapping and disjoint node sets, submitted at different times with
priorities, some cancelled while queued and some stopped while running, under the same faults.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog
import trio
from trio.testing import MockClock

from coordinator.jobs import core, manager
from tests.simulation.daemon import SimDaemon
from tests.simulation.invariants import STOP_BOUND_S, Checker, InvariantBroken, time_bound
from tests.simulation.world import World

__all__ = ["STOP_BOUND_S", "InvariantBroken", "JobPlan", "Schedule", "make_schedule", "run_schedule"]

MULTI_JOB_SHARE = 0.25  # of the schedules, those that run several jobs at once
TORCH_SHARE = 0.5  # of the schedules of a script of its own, those run by a launcher on the nodes


def command_for(trainer: str, total: int) -> list[str]:
    """A job's command for the simulated trainer: a script of one's own, mlx-lm's, or coord's
    (which names mlx_lm lora's options, its total as --iters)."""
    if trainer == "script":
        return ["python", "train.py"]
    module = ["mlx_lm", "lora"] if trainer == "mlx_lm" else ["agent.train"]
    return ["python", "-m", *module, "--model", "m", "--train", "--data", "d", "--iters", str(total),
            "--batch-size", "12"]


@dataclass
class JobPlan:
    """One job of a schedule: its spec, and what its user asks of it when (virtual seconds)."""

    spec: dict[str, Any]
    submit_at: float = 0.0
    stop_at: float | None = None  # coord stop of its first run
    cancel_at: float | None = None  # coord cancel of its first run (refused once it left the queue)
    runs: int = 1  # the same name run this many times, each submitted once the one before ended

    def describe(self) -> str:
        spec = self.spec
        return (f"  job {spec['name']}: submitted at t={self.submit_at:g} s on "
                f"{', '.join(spec.get('nodes') or ['every node'])}, priority {spec.get('priority', 0)}"
                + (f", runs {self.runs}" if self.runs > 1 else "")
                + (f"; coord cancel at t={self.cancel_at:g} s" if self.cancel_at is not None else "")
                + (f"; coord stop at t={self.stop_at:g} s" if self.stop_at is not None else "") + "\n    spec: "
                + ", ".join(f"{k}={v}" for k, v in spec.items() if k not in ("command", "name", "nodes", "priority")))


@dataclass
class Schedule:
    seed: int
    nodes: list[str]
    spec: dict[str, Any]  # the first job's
    step_s: float
    startup_s: float
    copy_s: float
    faults: list[dict[str, Any]] = field(default_factory=list)
    crashes: list[tuple[int, float]] = field(default_factory=list)  # (effect number, restart delay)
    stop_at: float | None = None  # coord stop of the first job's first run
    runs: int = 1  # the first job's name run this many times, one after the other
    head_machine: tuple[str, ...] = ()  # nodes that are the head's own machine (host "local")
    more_jobs: list[JobPlan] = field(default_factory=list)  # submitted beside the first
    hash_s: float = 0.0  # what a node's listing of its checkpoints takes (hashing a large new one)

    def jobs(self) -> list[JobPlan]:
        return [JobPlan(self.spec, 0.0, self.stop_at, None, self.runs), *self.more_jobs]

    def describe(self) -> str:
        lines = [f"seed {self.seed}: nodes {', '.join(self.nodes)}; step {self.step_s:g} s, startup "
                 f"{self.startup_s:g} s, copy {self.copy_s:g} s; runs {self.runs}"
                 + (f"; head on {', '.join(self.head_machine)}'s machine" if self.head_machine else ""),
                 "  spec: " + ", ".join(f"{k}={v}" for k, v in self.spec.items() if k != "command")
                 + ("; an mlx_lm lora command" if "mlx_lm" in self.spec["command"] else "")]
        lines += [job.describe() for job in self.more_jobs]
        lines += [f"  fault: {fault}" for fault in self.faults]
        lines += [f"  daemon killed at its effect #{n}, back after {d:g} s" for n, d in self.crashes]
        if self.stop_at is not None:
            lines.append(f"  coord stop at t={self.stop_at:g} s")
        return "\n".join(lines)


def make_schedule(seed: int, count: int | None = None) -> Schedule:
    """The schedule of ``seed``: a cluster of 2 to 4 nodes, or of ``count`` (the same draws otherwise)."""
    rng = random.Random(seed)
    drawn = rng.randint(2, 4)
    count = count or drawn
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
    # mlx_lm: rank 0 alone saves; its newest checkpoint is copied to every node. coord: every rank saves.
    spec["command"] = command_for(trainer, total)
    spec["trainer"] = "coord" if trainer == "coord" else "mlx_lm"
    if trainer == "script":
        _report_before_hanging(schedule)
        # Drawn apart too: a job whose ranks each node's agent starts (torchrun, Accelerate, any program).
        launchers = random.Random(f"launcher:{seed}")
        if launchers.random() < TORCH_SHARE:
            spec["launcher"] = launchers.choice(["torchrun", "accelerate", "command"])
    if more.random() < 0.4:
        schedule.head_machine = (nodes[0],)
    # Drawn apart too: a rank that aborts after its last step and final save (Gloo at interpreter exit).
    teardown = random.Random(f"teardown:{seed}")
    if teardown.random() < 0.1:
        schedule.faults.append({"kind": "teardown", "attempt": teardown.randint(0, 2),
                                "rank": teardown.randrange(count), "status": teardown.choice([134, 1])})
    # Drawn apart too: the head's own network down for a while (every node out of its reach at once, the
    # ranks training on), a node cut off from every machine (its peers wait in their next collective),
    # and a loss that turns NaN from a step (the job's divergence policy).
    health = random.Random(f"health:{seed}")
    if health.random() < 0.15:
        schedule.faults.append({"kind": "head", "at": health.uniform(0, horizon), "detect_s": health.uniform(1, 8),
                                "for": health.choice([health.uniform(2, 40), health.uniform(40, 120)])})
    if health.random() < 0.1:
        schedule.faults.append({"kind": "isolate", "node": health.choice(nodes), "at": health.uniform(0, horizon),
                                "detect_s": health.uniform(0.2, 8.0),
                                "back_after": health.choice([None, health.uniform(1, 60)])})
    if health.random() < 0.15:
        schedule.faults.append({"kind": "nan", "attempt": health.randint(0, 2),
                                "from_step": health.randint(1, total)})
        spec["on_divergence"] = health.choice(["rollback", "rollback", "stop"])
        spec["max_rollbacks"] = health.randint(0, 3)
    # Drawn apart too: a checkpoint store for the first job, which may stop answering for a while.
    store = random.Random(f"store:{seed}")
    if store.random() < 0.2:
        spec["checkpoint_store"] = "s3://bucket/coord"
        spec["store_keep"] = store.randint(1, 3)
        if store.random() < 0.5:
            schedule.faults.append({"kind": "store", "at": store.uniform(0, horizon),
                                    "for": store.choice([store.uniform(1, 30), store.uniform(30, 300)])})
    # Drawn apart too: whether this schedule runs several jobs at once.
    jobs = random.Random(f"jobs:{seed}")
    if jobs.random() < MULTI_JOB_SHARE:
        _more_jobs(schedule, jobs, trainer, horizon)
    return schedule


def _report_before_hanging(schedule: Schedule) -> None:
    """A script is watched for hangs once it has reported (rank 0's train records): a run whose
    rank 0 hangs, or exits cleanly, before its first report while another rank hangs is never
    called hung, by design, and would never end. Here rank 0 reports a step first."""
    for fault in schedule.faults:
        if fault["kind"] == "early" or (fault["kind"] == "hang" and fault["rank"] == 0):
            fault["after"] = max(1, fault["after"])


def _more_jobs(schedule: Schedule, rng: random.Random, trainer: str, horizon: float) -> None:
    """Two to four jobs at once: each on every node or on some (overlapping or disjoint), with
    priorities, submitted at different times; some cancelled soon after (while queued, when their
    nodes were busy), some stopped later; each rank or launch fault meant for one of them."""
    nodes = schedule.nodes

    def some_nodes(apart_from: list[str] | None = None) -> list[str] | None:
        if apart_from and rng.random() < 0.3:  # beside the first job, on none of its nodes
            return [n for n in nodes if n not in apart_from] or None
        if rng.random() < 0.3:
            return None  # every node
        chosen = [n for n in nodes if rng.random() < 0.5] or [rng.choice(nodes)]
        return chosen if len(chosen) < len(nodes) else None

    def fit(spec: dict[str, Any]) -> None:  # --min-nodes within the job's own nodes
        if spec["min_nodes"] is not None:
            spec["min_nodes"] = max(1, len(spec["nodes"] or nodes) - 1)

    first = schedule.spec
    first["nodes"], first["priority"] = some_nodes(), rng.choice([0, 0, 1])
    fit(first)
    for number in range(rng.choice([1, 1, 2, 3])):
        save_every = rng.choice([5, 10])
        total = save_every * rng.randint(1, 3) + rng.choice([0, 0, 3])
        spec = {"name": f"sim{number + 2}", "command": command_for(trainer, total),
                "trainer": first["trainer"], "save_every": save_every, "max_restarts": rng.randint(0, 3),
                "keep": rng.randint(1, 3), "total_steps": total,
                "replica": rng.choice(["head", "head", "none", nodes[-1]]),
                "min_nodes": rng.choice([None, None, 1]), "node_timeout": rng.choice([5.0, 20.0, 60.0]),
                "hang_timeout": rng.choice([None, 15.0, 30.0]), "nodes": some_nodes(first["nodes"]),
                "priority": rng.choice([-1, 0, 0, 1, 2])}
        if "launcher" in first:
            spec["launcher"] = first["launcher"]
        fit(spec)
        job = JobPlan(spec, submit_at=rng.uniform(0, horizon))
        if rng.random() < 0.3:
            job.cancel_at = job.submit_at + rng.uniform(0, 3)
        elif rng.random() < 0.25:
            job.stop_at = job.submit_at + rng.uniform(0, horizon)
        if rng.random() < 0.1:
            job.runs = 2
        schedule.more_jobs.append(job)
    names = [job.spec["name"] for job in schedule.jobs()]
    # A diverging rank only in a job of three or more nodes (two that disagree name no wrong one).
    wide = [job.spec["name"] for job in schedule.jobs() if len(job.spec["nodes"] or nodes) >= 3]
    for fault in list(schedule.faults):
        if fault["kind"] == "diverge" and not wide:
            schedule.faults.remove(fault)
        elif fault["kind"] in ("kill", "hang", "early", "launch", "diverge", "teardown", "nan"):
            fault["job"] = rng.choice(wide if fault["kind"] == "diverge" else names)


async def _apply_faults(schedule: Schedule, world: World) -> None:
    for fault in schedule.faults:
        kind = fault["kind"]
        job = fault.get("job")  # the job it is meant for (None: every job)
        if kind in ("kill", "hang", "early", "teardown"):
            world.rank_faults[(job, fault["attempt"], fault["rank"] if kind != "early" else 0)] = fault
            if kind == "early":
                for rank in range(len(schedule.nodes)):
                    world.rank_faults[(job, fault["attempt"], rank)] = fault
        elif kind == "diverge":  # every rank reports fingerprints; this one's differ from step "from_step" on
            world.fingerprint_every = fault["every"]
            world.diverging[(job, fault["attempt"], fault["rank"])] = fault["from_step"]
        elif kind == "launch":
            world.launch_faults[(job, fault["attempt"])] = fault["how"]
        elif kind == "checkpoint":
            world.bad_checkpoints[fault["step"]] = fault["how"]
        elif kind == "nan":
            world.nan_loss[(job, fault["attempt"])] = fault["from_step"]
    timed = sorted((f for f in schedule.faults if "at" in f), key=lambda f: f["at"])
    async with anyio.create_task_group() as tasks:
        for fault in timed:
            tasks.start_soon(_timed_fault, world, fault)


async def _timed_fault(world: World, fault: dict[str, Any]) -> None:
    await anyio.sleep(fault["at"])
    name, kind = fault.get("node", ""), fault["kind"]
    if kind == "head":
        await world.cut_head(fault["detect_s"], fault["for"], late=fault.get("late"))
    elif kind in ("power", "cut", "isolate"):
        cut = {"power": world.power_off, "cut": world.cut, "isolate": world.isolate}[kind]
        await cut(name, fault["detect_s"])
        if fault["back_after"] is not None:
            await anyio.sleep(max(0.0, fault["back_after"] - fault["detect_s"]))
            await world.restore(name)
    elif kind == "agent":
        await world.restart_agent(name)
    elif kind == "store":  # the checkpoint store stops answering
        world.store_up = False
        await anyio.sleep(fault["for"])
        world.store_up = True
    elif kind == "disk":
        world.nodes[name].disk_full = True
        if fault["for"] is not None:
            await anyio.sleep(fault["for"])
            world.nodes[name].disk_full = False


def deadline(schedule: Schedule) -> float:
    """(e): by when every job of the schedule has ended, however its runs queue behind each other."""
    runs = sum(time_bound(schedule, job.spec) * job.runs for job in schedule.jobs())
    return max(job.submit_at for job in schedule.jobs()) + runs + sum(d for _, d in schedule.crashes) + 120


async def _drive(schedule: Schedule, world: World, checker: Checker) -> dict[str, Any]:
    daemon = SimDaemon(schedule, world, checker)
    async with anyio.create_task_group() as outer:
        outer.start_soon(_apply_faults, schedule, world)
        outer.start_soon(daemon.serve)
        with anyio.move_on_after(deadline(schedule)):
            await daemon.until_all_ended()
        ended = daemon.all_ended()
        checker.recheck = True
        checker.observe()  # (m) too when nothing ran since: a run left queued with its nodes free
        if ended:
            # The daemon lives on: its reapers stop what runs on nodes once they are back.
            await anyio.sleep(max([f.get("back_after") or f.get("for") or 0 for f in schedule.faults] + [0]) + 30)
        outer.cancel_scope.cancel()
    unanswered = [r.describe() for r in daemon.pending()]
    if unanswered:
        checker.fail("e", f"requests never answered: {'; '.join(unanswered)}")
    checker.final()
    if ended:
        checker.final_leftovers()
    return {"runs": [{"run_id": run_id, "name": row["name"], "state": row["state"], "record": row["record"]}
                     for run_id, row in world.store.items()],
            "launches": world.launch_log, "copies": world.copies, "timeline": checker.timeline,
            "requests": daemon.requests, "incarnations": daemon.incarnations,
            "stopped": checker.stopped, "cancelled": checker.cancelled, "stored": world.stored,
            "exits": [(r.run, r.attempt, r.rank, r.exit, r.exited_at) for r in world.ranks.values()],
            "durable": {run_id: list(rows.values()) for run_id, rows in world.durable.items()},
            "events": world.events, "listings": world.listings,
            "catalog": {run_id: list(copies.values()) for run_id, copies in world.catalog.items()}}


@contextlib.contextmanager
def deterministic(seed: int) -> Iterator[None]:
    """The same schedule the same way every time, in any process (a replay is a fresh one):
    run ids drawn from the seed (they order jobs submitted at the same instant); trio's
    scheduler, which orders runnable tasks at random (its own Random, seeded here); and trio's
    timeouts that fall due at the same virtual instant (two ranks' polls, two pre-flights),
    which it orders by the id() of their cancel scopes, a memory address: here by when each
    was set. Everything is put back after."""
    run = trio._core._run  # type: ignore[attr-defined]
    draws = random.Random(f"run-ids:{seed}")
    saved_state = run._r.getstate()
    run._r.seed(seed)
    new_run_id, add_deadline = manager.new_run_id, run.Deadlines.add
    manager.new_run_id = lambda name, taken=frozenset(): core.new_run_id(  # type: ignore[assignment]
        name, taken, token=lambda n: f"{draws.getrandbits(8 * n):0{2 * n}x}")
    order = itertools.count()

    def add_in_order(self: Any, deadline: float, cancel_scope: Any) -> None:
        heapq.heappush(self._heap, (deadline, next(order), cancel_scope))
        self._active += 1

    run.Deadlines.add = add_in_order
    try:
        yield
    finally:
        manager.new_run_id, run.Deadlines.add = new_run_id, add_deadline
        run._r.setstate(saved_state)


def run_schedule(seed: int | Schedule) -> dict[str, Any]:
    """Run one schedule under a virtual clock; InvariantBroken (with the replay) when one breaks."""
    schedule = seed if isinstance(seed, Schedule) else make_schedule(seed)
    world = World(schedule.nodes, step_s=schedule.step_s, startup_s=schedule.startup_s, copy_s=schedule.copy_s,
                  hash_s=schedule.hash_s,
                  every_rank_saves=schedule.spec.get("trainer") == "coord", head_machine=schedule.head_machine,
                  heartbeats=schedule.spec["command"] != command_for("script", 0))
    checker = Checker(schedule, world)
    world.checkers.append(checker.continuous)
    try:
        with quiet_logs(), deterministic(schedule.seed):
            return anyio.run(_drive, schedule, world, checker, backend="trio",
                             backend_options={"clock": MockClock(autojump_threshold=0)})
    except BaseException as exc:
        broken = checker.broken or (exc if isinstance(exc, InvariantBroken) else None)
        if broken is not None:  # the first one broken, though a task that met it swallowed it
            raise InvariantBroken(f"{broken}\n{replay(schedule, world)}") from None
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
