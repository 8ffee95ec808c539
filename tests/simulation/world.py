"""A simulated cluster behind the supervisor's effects (``coordinator.jobs.effects``).

Nodes, their agents and sessions, ranks that train at a given speed and write checkpoints
(rank 0 alone, as mlx-lm's trainer; or every rank its own copy on its own node, as coord's:
a node that was down when one was written lacks it),
disks, the launcher and the daemon's store, all under trio's virtual clock: a schedule that
spans hours runs in milliseconds. Faults are applied by ``tests.simulation.schedules``.

The world keeps the ground truth (which ranks really run, which checkpoint files are really
whole) so that the invariants can be checked against it, not against what the supervisor
believes.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import anyio
import trio

from coordinator.durable.objects import StoreError
from coordinator.durable.transfer import UploadDamaged
from coordinator.jobs.effects import HEAD, LaunchError, NodeView, Placement
from coordinator.jobs.transfer import CheckpointDamaged
from coordinator.launch.registry import capabilities, launcher_named
from coordinator.launch.seam import LaunchPlan, NodeReadings, no_links
from shared.rpc import RemoteError

EPOCH = 1_700_000_000.0
CALL_S = 0.005  # every agent call takes a little virtual time, as a real one does
PEER_LOST_S = 1.0  # a rank whose peer is gone notices this much later
HOLD_LOOK_S = 0.5  # how often a held status request looks at its node (faults come from outside the rank)
WRITE_S = 0.3  # a checkpoint is half-written this long


class DaemonCrash(BaseException):
    """The daemon process dies here (not an Exception: nothing in the daemon may catch it)."""


def attempt_dir(node: SimNode, job: str, attempt: int) -> str:
    """Where an attempt's ranks write their checkpoints on ``node`` (COORD_CHECKPOINT_DIR), with a slash."""
    return f"{node.workdir}/checkpoints/{job}/attempt-{attempt}/"


@dataclass
class SimFile:
    run: str
    step: int  # the global step it holds
    size: int
    sha256: str
    complete_at: float
    torn: bool = False  # its writer died before it was whole: it never will be
    corrupt: bool = False

    def whole(self, now: float) -> bool:
        return not self.torn and not self.corrupt and now >= self.complete_at


@dataclass
class SimRank:
    run: str
    attempt: int
    rank: int
    node: str
    start_step: int
    total: int
    save_every: int
    step_s: float
    startup_s: float
    resume_file: str | None
    launched_at: float | None = None
    exit: int | None = None
    exited_at: float | None = None
    vanished: bool = False  # its node lost power: no exit status will ever be written
    last_line: str = ""
    die_after: tuple[int, int] | None = None  # (steps after start, status)
    teardown_status: int = 0  # its exit status once done (Gloo's abort at interpreter exit: 134)
    hang_after: int | None = None
    exit_early_after: int | None = None
    lost_peer_at: float | None = None  # a peer went away: this rank exits with status 1 then
    written_to: int = 0  # the last step whose checkpoint was materialised
    fingerprint_every: int = 0  # steps between the SHA256 of its weights it reports (--fingerprint-every)
    diverge_at: int | None = None  # from this step on its weights differ from the other ranks'

    @property
    def begin(self) -> float:
        return (self.launched_at or 0.0) + self.startup_s

    def time_of(self, step: int) -> float:
        return self.begin + (step - self.start_step) * self.step_s

    def running(self) -> bool:
        return self.launched_at is not None and self.exit is None and not self.vanished

    def step_at(self, now: float) -> int:
        if self.launched_at is None:
            return self.start_step
        end = now if self.exited_at is None else min(now, self.exited_at)
        if self.hang_after is not None:
            end = min(end, self.time_of(self.start_step + self.hang_after))
        if end < self.begin:
            return self.start_step
        return min(self.total, self.start_step + int(math.floor((end - self.begin) / self.step_s + 1e-9)))

    def phase_at(self, now: float) -> tuple[str, float]:
        """Its heartbeat's phase and idle time (since its last step, or since the phase began), as
        coord's trainers write them: loading until it begins, compiling until its first step."""
        step = self.step_at(now)
        if now < self.begin:
            return "loading", now - (self.launched_at or 0.0)
        if step == self.start_step:
            return "compiling", now - self.begin
        return "training", now - self.time_of(step)

    def cpu_at(self, now: float) -> float:
        """The CPU seconds its processes used, as its agent reads them: a core's worth while it loads,
        compiles and trains, none more once it hangs (a hung rank of the simulator waits, idle)."""
        end = now if self.exited_at is None else min(now, self.exited_at)
        if self.hang_after is not None:
            end = min(end, self.time_of(self.start_step + self.hang_after))
        return max(0.0, end - (self.launched_at or end))

    def natural_end(self) -> tuple[float, int, str] | None:
        """When and how the rank ends on its own (finish, planned death, early exit)."""
        if self.launched_at is None:
            return None
        ends = []
        if self.hang_after is None or self.start_step + self.hang_after >= self.total:
            # the last checkpoint is written before the rank exits
            ends.append((self.time_of(self.total) + WRITE_S + 0.01, self.teardown_status,
                         "terminate called without an active exception" if self.teardown_status else "done"))
        if self.die_after is not None:
            steps, status = self.die_after
            ends.append((self.time_of(self.start_step + steps) + 0.005, status, f"killed with status {status}"))
        if self.exit_early_after is not None:
            ends.append((self.time_of(self.start_step + self.exit_early_after) + 0.01, 0, "exited early"))
        if self.lost_peer_at is not None:
            ends.append((self.lost_peer_at, 1, "connection to a peer was lost"))
        return min(ends) if ends else None


@dataclass
class SimNode:
    name: str
    # Why the head cannot reach it now: "link" (its own link cut, or powered off), "head" (the head's own
    # network is down). Reachable from the head when there is no reason left.
    blocked: set[str] = field(default_factory=set)
    powered: bool = True
    session_up: bool = True
    generation: int = 1
    disk_full: bool = False
    files: dict[str, SimFile] = field(default_factory=dict)
    came_back_at: float = 0.0
    needs_reboot: str | None = None  # marked by a supervisor; a power cycle (a reboot) clears it
    down_since: float | None = None  # virtual time its session noticed it was gone

    @property
    def workdir(self) -> str:
        return f"/w/{self.name}"

    @property
    def reachable(self) -> bool:
        return not self.blocked

    @reachable.setter
    def reachable(self, value: bool) -> None:  # its own link, cut or restored
        if value:
            self.blocked.discard("link")
        else:
            self.blocked.add("link")


class World:
    """The ground truth, shared by every daemon incarnation."""

    def __init__(self, nodes: list[str], *, step_s: float = 0.5, startup_s: float = 2.0, copy_s: float = 0.5,
                 hash_s: float = 0.0,
                 every_rank_saves: bool = False, head_machine: tuple[str, ...] = (), heartbeats: bool = False):
        self.nodes = {name: SimNode(name) for name in nodes}
        # coord's trainer: every rank writes its own copy of each checkpoint on its own node
        self.every_rank_saves = every_rank_saves
        self.heartbeats = heartbeats  # coord's trainers: every rank says its phase and step at each status
        self.head_machine = set(head_machine)  # nodes that are the head's own machine
        self.copies: list[dict[str, Any]] = []  # every copy_checkpoint that landed: time, source, targets
        self.order = list(nodes)
        self.step_s = step_s
        self.startup_s = startup_s
        self.copy_s = copy_s
        self.hash_s = hash_s  # a listing of a node's checkpoints, hashing what is new
        self.listings: list[tuple[float, str]] = []  # (time, node) of each listing of a node's checkpoints
        self.ranks: dict[tuple[str, int, int], SimRank] = {}  # (run, attempt, rank)
        self.prepared: dict[tuple[str, int], dict[int, SimRank]] = {}
        self.launchers: dict[int, tuple[str, int, bool]] = {}  # pid -> (run, attempt, starts ranks)
        self.next_pid = 1000
        self.head_files: dict[str, SimFile] = {}
        self.store: dict[str, dict[str, Any]] = {}  # run id -> row (JSON round-tripped)
        self.catalog: dict[str, dict[tuple, dict[str, Any]]] = {}
        self.events: list[tuple[float, str, str]] = []
        self.metric_attempts: list[tuple[str, int, int]] = []  # (run id, attempt, start step) as recorded
        self.checkers: list[Callable[[], None]] = []
        # Faults are keyed by the job's name (None: every job's) and the attempt (and rank).
        self.launch_faults: dict[tuple[str | None, int], str] = {}  # -> "missing" | "dies"
        self.rank_faults: dict[tuple[str | None, int, int], dict[str, Any]] = {}
        self.fingerprint_every = 0  # ranks report fingerprints every this many steps (0: none)
        self.diverging: dict[tuple[str | None, int, int], int] = {}  # -> step its weights differ from
        self.bad_checkpoints: dict[int, str] = {}  # global step -> "corrupt" | "torn"
        self.nan_loss: dict[tuple[str | None, int], int] = {}  # (job, attempt) -> step rank 0's loss is NaN from
        self.head_cut = False  # the head's own network is down: it reaches no node on another machine
        self.detect_s = 3.0
        self.launch_log: list[dict[str, Any]] = []  # each launch as the invariants need it
        # The checkpoint store (None: none set): its committed checkpoints (url -> the source's SHA256 and
        # size), whether it answers, and how long an upload takes.
        self.store_url: str | None = None
        self.stored: dict[str, dict[str, Any]] = {}
        self.store_up = True
        self.upload_s = 1.0
        self.durable: dict[str, dict[tuple[int, int], dict[str, Any]]] = {}  # run id -> (step, attempt) -> row
        self.catalogued: dict[str, list[dict[str, Any]]] = {}  # run id -> every catalog row ever added
        self._settled_at, self._settled_ranks = -1.0, 0

    # --- time ---
    @staticmethod
    def now() -> float:
        return trio.current_time()  # the simulation runs on trio's MockClock (anyio's costs more, called this often)

    # --- ground truth upkeep ---
    def settle(self) -> None:
        """Bring every rank and checkpoint file up to now."""
        now = self.now()
        if now == self._settled_at and self._settled_ranks == len(self.ranks):
            return
        self._settled_at, self._settled_ranks = now, len(self.ranks)
        changed = True
        while changed:
            changed = False
            for rank in self.ranks.values():
                if not rank.running():
                    continue
                end = rank.natural_end()
                if end is not None and end[0] <= now:
                    self._write_checkpoints(rank, end[0])
                    self._exit(rank, end[0], end[1], end[2])
                    changed = True
        for rank in self.ranks.values():
            if rank.running():
                self._write_checkpoints(rank, now)

    def _exit(self, rank: SimRank, when: float, status: int, line: str) -> None:
        if not rank.running():
            return
        rank.exit, rank.exited_at, rank.last_line = status, when, line
        self._write_checkpoints(rank, when)
        for file in self.nodes[rank.node].files.values():
            if file.run == rank.run and file.complete_at > when:
                file.torn = True  # its writer is gone
        if status != 0:
            for peer in self.ranks.values():
                if peer.run == rank.run and peer.attempt == rank.attempt and peer.running():
                    self._exit_later(peer, when + PEER_LOST_S)

    def _exit_later(self, rank: SimRank, when: float) -> None:
        """A rank whose peer is gone exits with status 1 at ``when``."""
        if rank.lost_peer_at is None or when < rank.lost_peer_at:
            rank.lost_peer_at = when

    def _write_checkpoints(self, rank: SimRank, upto: float) -> None:
        if (rank.rank != 0 and not self.every_rank_saves) or rank.launched_at is None:
            return
        node = self.nodes[rank.node]
        reached = rank.step_at(upto)
        first = max(rank.written_to, rank.start_step) + 1
        for step in range(first, reached + 1):
            if step % rank.save_every and step != rank.total:
                continue
            iteration = step - rank.start_step
            path = f"{attempt_dir(node, rank.run, rank.attempt)}{iteration:07d}_adapters.safetensors"
            written = rank.time_of(step)
            if node.disk_full or not node.powered:
                # The save fails: the rank dies with the disk's error.
                if rank.die_after is None or rank.die_after[0] > iteration:
                    rank.die_after = (iteration, 1)
                    rank.last_line = "OSError: [Errno 28] No space left on device"
                break
            bad = self.bad_checkpoints.get(step) if rank.rank == 0 else None  # one disk's fault: rank 0's copy
            digest = hashlib.sha256(f"{rank.run}:{step}:{rank.attempt}".encode()).hexdigest()
            node.files[path] = SimFile(rank.run, step, 4096, digest, written + WRITE_S, torn=bad == "torn",
                                       corrupt=bad == "corrupt")
        rank.written_to = max(rank.written_to, reached)

    def running_attempts(self, *, reachable_only: bool, grace: float = 0.0) -> set[tuple[str, int]]:
        now = self.now()
        out = set()
        for rank in self.ranks.values():
            if not rank.running():
                continue
            node = self.nodes[rank.node]
            if reachable_only and (not node.reachable or now - node.came_back_at < grace):
                continue
            out.add((rank.run, rank.attempt))
        return out

    def ranks_by_node(self, *, grace: float) -> dict[str, set[str]]:
        """The runs whose ranks really run on each reachable node (one back for less than ``grace``
        is left out: its leftovers are stopped at the next poll)."""
        now = self.now()
        out: dict[str, set[str]] = {}
        for rank in self.ranks.values():
            node = self.nodes[rank.node]
            if rank.running() and node.reachable and now - node.came_back_at >= grace:
                out.setdefault(rank.node, set()).add(rank.run)
        return out

    def job_of(self, run_id: str) -> str | None:
        """The job a run is of, as the store has it."""
        row = self.store.get(run_id)
        return row["name"] if row else None

    @staticmethod
    def fault_for(faults: dict[tuple, Any], job: str | None, *key: int) -> Any:
        """The fault meant for this job's ``key`` (attempt, rank), else the one for every job's."""
        found = faults.get((job, *key))
        return found if found is not None else faults.get((None, *key))

    def check(self) -> None:
        for checker in self.checkers:
            checker()

    # --- faults the schedule applies ---
    async def power_off(self, name: str, detect_s: float) -> None:
        node = self.nodes[name]
        node.powered = node.reachable = False
        self.settle()
        for rank in self.ranks.values():
            if rank.node == name and rank.running():
                rank.vanished = True
                rank.exited_at = self.now()
                for peer in self.ranks.values():
                    if peer.run == rank.run and peer.attempt == rank.attempt and peer.running():
                        self._exit_later(peer, self.now() + PEER_LOST_S)
        await self._session_notices(node, detect_s)

    async def cut(self, name: str, detect_s: float) -> None:
        node = self.nodes[name]
        node.reachable = False
        await self._session_notices(node, detect_s)

    async def _session_notices(self, node: SimNode, detect_s: float) -> None:
        generation = node.generation
        await anyio.sleep(detect_s)
        if node.generation == generation and not node.reachable and node.session_up:
            node.session_up = False
            node.down_since = self.now()

    async def isolate(self, name: str, detect_s: float) -> None:
        """The node is cut from every other machine: its ranks and their peers in every attempt it
        takes part in stop stepping (they wait in their next collective), and the head loses it."""
        self.settle()
        runs = {(r.run, r.attempt) for r in self.ranks.values() if r.node == name and r.running()}
        for rank in self.ranks.values():
            if (rank.run, rank.attempt) in runs and rank.running():
                done = rank.step_at(self.now()) - rank.start_step
                rank.hang_after = done if rank.hang_after is None else min(rank.hang_after, done)
        await self.cut(name, detect_s)

    async def cut_head(self, detect_s: float, back_after: float, late: dict[str, float] | None = None) -> None:
        """The head's own network goes down for ``back_after`` s: every node on another machine is out
        of its reach at once while every rank trains on; then it reconnects to each (``late``: node ->
        seconds its session takes to come back, for one that reconnects after the others; else 1 s)."""
        self.head_cut = True
        away = [node for name, node in self.nodes.items() if name not in self.head_machine]
        for node in away:
            node.blocked.add("head")
        async with anyio.create_task_group() as noticing:
            for node in away:
                noticing.start_soon(self._session_notices, node, detect_s)
            await anyio.sleep(back_after)
            self.head_cut = False
            for node in away:
                node.blocked.discard("head")
                if node.reachable and node.powered:  # a node cut on its own stays away until it is restored
                    noticing.start_soon(self._reconnect, node, (late or {}).get(node.name, 1.0))

    async def restore(self, name: str, reconnect_s: float = 1.0) -> None:
        node = self.nodes[name]
        if not node.powered:
            # Back from a power loss: no rank of before runs; the files stay; it was rebooted.
            for rank in self.ranks.values():
                if rank.node == name and rank.running():
                    rank.vanished = True
            node.needs_reboot = None
        node.powered = node.reachable = True
        await self._reconnect(node, reconnect_s)

    async def _reconnect(self, node: SimNode, reconnect_s: float) -> None:
        await anyio.sleep(reconnect_s)
        if node.reachable and not node.session_up:
            node.generation += 1
            node.session_up = True
            node.down_since = None
            node.came_back_at = self.now()

    async def restart_agent(self, name: str) -> None:
        node = self.nodes[name]
        node.session_up, node.down_since = False, self.now()
        await anyio.sleep(1.0)
        node.generation += 1
        node.session_up = node.reachable
        node.down_since = None if node.session_up else node.down_since
        node.came_back_at = self.now()


class SimStore:
    """The daemon's store of runs (``coordinator.jobs.manager.RunStore``) over the rows
    ``SimEffects.save_run`` wrote to the world: a daemon crash loses none of them. Each read is
    a copy, as SQLite's is: a record read back shares nothing with the row."""

    def __init__(self, world: World):
        self.world = world

    def runs(self) -> list[dict[str, Any]]:
        """Every stored run, oldest first (in the order each was first saved)."""
        return json.loads(json.dumps(list(self.world.store.values())))

    def run_ids(self) -> set[str]:
        return set(self.world.store)


class SimEffects:
    """One daemon incarnation's effects over the world. Dies (``DaemonCrash``) at its
    ``crash_at``-th effect, and so does everything it is still running: ``spawn`` puts tasks
    in the incarnation's own task group, and ``died`` is set for whoever must end it."""

    def __init__(self, world: World, *, crash_at: int | None, spawn_into=None):
        self.world = world
        self.crash_at = crash_at
        self.calls = 0
        self.dead = False
        self.died = anyio.Event()
        self.spawn_into = spawn_into

    def _effect(self) -> None:
        if self.dead:
            raise DaemonCrash()
        self.calls += 1
        if self.crash_at is not None and self.calls >= self.crash_at:
            self.dead = True
            self.died.set()
            raise DaemonCrash()
        self.world.settle()
        self.world.check()

    # --- clock ---
    def now(self) -> float:
        return EPOCH + trio.current_time()

    def monotonic(self) -> float:
        return trio.current_time()

    # --- nodes ---
    def node_names(self) -> list[str]:
        return list(self.world.order)

    def slow_links(self, node: str) -> list[str]:
        return []  # the simulated cluster's links are never measured by coord doctor

    def node(self, name: str) -> NodeView:
        if self.dead:
            raise DaemonCrash()
        node = self.world.nodes[name]
        return NodeView(name, node.session_up, node.workdir, "/usr/bin/python3",
                        None if node.session_up else "keepalive timeout", {"mlx_lm_version": "0.30.2"},
                        node.generation, node.needs_reboot,
                        down_since=None if node.session_up else EPOCH + (node.down_since or self.world.now()))

    async def head_route_down(self, nodes: list[str]) -> str | None:
        self._effect()
        await anyio.sleep(CALL_S)
        remote = [name for name in nodes if name not in self.world.head_machine]
        return "the head's interface eth0 is down (simulated)" if self.world.head_cut and remote else None

    def mark_needs_reboot(self, name: str, reason: str) -> None:
        self._effect()
        self.world.nodes[name].needs_reboot = reason

    def on_head_machine(self, node: str) -> bool:
        if self.dead:
            raise DaemonCrash()
        return node in self.world.head_machine

    async def call(self, name: str, method: str, params: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        self._effect()
        node = self.world.nodes[name]
        if not node.session_up:
            raise RemoteError("connection_lost", f"node {name} is not up")
        await anyio.sleep(CALL_S)
        if not node.reachable:
            # The call hangs until the session notices, or times out.
            with anyio.move_on_after(timeout - CALL_S):
                while node.session_up and not node.reachable:
                    await anyio.sleep(0.25)
            if node.reachable and node.session_up:
                pass  # it came back in time: the call goes through
            elif not node.session_up:
                raise RemoteError("connection_lost", f"connection to {name} lost")
            else:
                raise RemoteError("timeout", f"{method} got no answer within {timeout:g} s")
        if method == "rank_status" and params.get("wait_s"):
            await self._hold_status(node, params)
        if method == "list_checkpoints":
            self.world.listings.append((self.world.now(), name))
            if self.world.hash_s:
                await anyio.sleep(self.world.hash_s)
        self._effect()
        return getattr(self, f"_agent_{method}")(node, **params)

    async def _hold_status(self, node: SimNode, params: dict[str, Any]) -> None:
        """A waiting status request, as the agent holds it: until its rank has ended or the wait is
        over. The agent looks ten times a second; here the sleep reaches to the rank's own end when
        that comes first, and a node that goes away meanwhile fails the call as it would."""
        deadline = self.world.now() + min(float(params["wait_s"]), 10.0)
        while self.world.now() < deadline:
            self.world.settle()  # the ranks' ends up to now
            sim = self._rank(params["job"], params["attempt"], params["rank"])
            if sim is not None and sim.node == node.name and (sim.vanished or sim.exit is not None):
                return
            end = sim.natural_end() if sim is not None else None
            until = min(deadline, self.world.now() + HOLD_LOOK_S, end[0] if end else deadline)
            await anyio.sleep(max(until - self.world.now(), 0.01))
            if not node.session_up:
                raise RemoteError("connection_lost", f"connection to {node.name} lost")
            if not node.reachable:
                raise RemoteError("timeout", f"rank_status got no answer from {node.name}")

    # --- the agent's methods ---
    def _agent_prepare_rank(self, node: SimNode, *, job: str, rank: int, attempt: int, python: str, argv: list,
                            env: dict, pass_output: bool = True, files: dict | None = None,
                            free_ports: list | None = None) -> dict[str, Any]:
        if node.disk_full:
            raise RemoteError("internal", "OSError: [Errno 28] No space left on device")
        world = self.world
        sim = SimRank(job, attempt, rank, node.name, int(env["COORD_STEP_OFFSET"]), int(env["COORD_TOTAL_STEPS"]),
                      int(env["COORD_SAVE_EVERY"]), world.step_s, world.startup_s, env.get("COORD_RESUME_FILE"))
        name = env["COORD_JOB"]
        fault = world.fault_for(world.rank_faults, name, attempt, rank) or {}
        if fault.get("kind") == "kill":
            sim.die_after = (fault["after"], fault["status"])
            sim.last_line = f"killed with status {fault['status']}"
        elif fault.get("kind") == "hang":
            sim.hang_after = fault["after"]
        elif fault.get("kind") == "early":
            sim.exit_early_after = fault["after"]
        elif fault.get("kind") == "teardown":
            sim.teardown_status = fault["status"]
        sim.diverge_at = world.fault_for(world.diverging, name, attempt, rank)
        sim.fingerprint_every = world.fingerprint_every
        world.prepared.setdefault((job, attempt), {})[rank] = sim
        return {"script": f"/home/{node.name}/.coord/jobs/{job}/rank-{rank}.sh"}

    def _agent_retire_standbys(self, node: SimNode, *, job: str) -> dict[str, Any]:
        return {"retired": 0}

    def _agent_start_rank(self, node: SimNode, *, job: str, rank: int, attempt: int,
                          standby: bool = False) -> dict[str, Any]:
        """A torch launcher's rank, started by its node's agent: the launcher runs there, or (a launch
        fault) is missing from the node's Python and exits at once, or dies before its workers start."""
        world = self.world
        prepared = world.prepared.get((job, attempt), {})
        sim = prepared.get(rank)
        if sim is None or sim.node != node.name:
            raise RemoteError("refused", f"rank {rank} of attempt {attempt} of {job} was not prepared here")
        if (job, attempt, rank) in world.ranks:
            raise RemoteError("refused", f"rank {rank} of attempt {attempt} of {job} was started already")
        if not any((run, number) == (job, attempt) for run, number, _ in world.ranks):
            world.launch_log.append({"run": job, "attempt": attempt, "time": world.now(),
                                     "ranks": {r: (s.node, s.start_step, s.resume_file) for r, s in prepared.items()}})
        world.ranks[(job, attempt, rank)] = sim
        sim.launched_at = world.now()
        fault = world.fault_for(world.launch_faults, world.job_of(job), attempt)
        if fault == "missing":
            sim.exit, sim.exited_at, sim.last_line = 1, world.now(), "No module named torch.distributed.run"
        elif fault == "dies":
            world._exit_later(sim, world.now() + sim.startup_s / 2)
        world.check()
        return {"pid": world.next_pid}

    def _rank(self, job: str, attempt: int, rank: int) -> SimRank | None:
        return self.world.ranks.get((job, attempt, rank))

    def _agent_rank_status(self, node: SimNode, *, job: str, attempt: int, rank: int, progress_offset: int = 0,
                           log_offset: int = -1, wait_s: float = 0.0) -> dict[str, Any]:
        answer = self._rank_status(node, job=job, attempt=attempt, rank=rank, progress_offset=progress_offset)
        answer["checkpoints_mark"] = self._checkpoints_mark(node, job, attempt)
        if log_offset >= 0:
            piece = self._agent_read_log(node, job=job, attempt=attempt, rank=rank, offset=log_offset)
            answer["log"], answer["log_offset"] = piece["data"], piece["offset"]
        return answer

    def _checkpoints_mark(self, node: SimNode, job: str, attempt: int) -> str:
        """As the agent's: it changes whenever a checkpoint of the attempt is written, completes or goes."""
        prefix = attempt_dir(node, job, attempt)
        now = self.world.now()
        seen = [(path, file.size, file.whole(now), file.torn, file.corrupt)
                for path, file in sorted(node.files.items()) if path.startswith(prefix)]
        return hashlib.sha256(repr(seen).encode()).hexdigest()[:24] if seen else "none"

    def _rank_status(self, node: SimNode, *, job: str, attempt: int, rank: int,
                     progress_offset: int) -> dict[str, Any]:
        sim = self._rank(job, attempt, rank)
        now = self.world.now()
        answer = {"pid": None, "exit": None, "rss_bytes": None, "progress": [], "progress_offset": progress_offset,
                  "log_size": 0, "time": EPOCH + now, "exited_at": None}
        if sim is None or sim.node != node.name:
            return {**answer, "state": "starting"}
        step = sim.step_at(now)
        if sim.fingerprint_every and step > progress_offset:
            answer["progress"] = [{"kind": "fingerprint", "step": s, "rank": rank,
                                   "sha256": ("d" if sim.diverge_at is not None and s >= sim.diverge_at else "a") * 64}
                                  for s in range(max(progress_offset, sim.start_step) + 1, step + 1)
                                  if s % sim.fingerprint_every == 0]
            answer["progress_offset"] = step
        if rank == 0 and step > progress_offset and step > sim.start_step:
            # A record per step, as a trainer writes them (a NaN is seen at the step it began).
            nan_from = self.world.fault_for(self.world.nan_loss, self.world.job_of(job), attempt)
            answer["progress"] += [{"kind": "train", "step": s, "time": EPOCH + sim.time_of(s),
                                    "loss": math.nan if nan_from is not None and s >= nan_from else 1.0 / s}
                                   for s in range(max(progress_offset, sim.start_step) + 1, step + 1)]
            answer["progress_offset"] = step
        if self.world.heartbeats and sim.running():
            phase, idle = sim.phase_at(now)
            answer["progress"].append({"kind": "heartbeat", "phase": phase, "step": step, "idle_s": idle,
                                       "time": EPOCH + now})
        answer["pid"] = 4000 + rank
        answer["log_size"] = 1 if sim.last_line and not sim.running() else 0
        if sim.vanished:
            return {**answer, "state": "vanished"}
        if sim.exit is not None:
            return {**answer, "state": "exited", "exit": sim.exit, "exited_at": EPOCH + sim.exited_at}
        return {**answer, "state": "running", "rss_bytes": 100 << 20, "cpu_s": sim.cpu_at(now)}

    def _agent_read_log(self, node: SimNode, *, job: str, attempt: int, rank: int, offset: int = 0) -> dict[str, Any]:
        sim = self._rank(job, attempt, rank)
        data = (sim.last_line + "\n").encode() if sim is not None and sim.last_line and offset == 0 else b""
        return {"data": data, "offset": offset + len(data)}

    def _agent_stop_rank(self, node: SimNode, *, job: str, attempt: int, rank: int) -> dict[str, Any]:
        sim = self._rank(job, attempt, rank)
        if sim is None or sim.node != node.name:
            return {"stopped": True, "left": [], "detail": "rank never started"}
        if sim.running():
            self.world._exit(sim, self.world.now(), 143, "Terminated")
        return {"stopped": True, "left": [], "detail": "stopped"}

    def _agent_dump_stacks(self, node: SimNode, *, job: str, attempt: int, rank: int) -> dict[str, Any]:
        return {"sent": True, "detail": "SIGUSR1 sent"}

    def _agent_list_checkpoints(self, node: SimNode, *, job: str, attempt: int, known: list) -> dict[str, Any]:
        prefix = attempt_dir(node, job, attempt)
        now = self.world.now()
        found = []
        for path, file in sorted(node.files.items()):
            name = path.rsplit("/", 1)[-1]
            if not path.startswith(prefix) or "/" in path[len(prefix):] or name in known:
                continue
            whole = file.whole(now)
            found.append({"name": name, "iteration": int(name[:7]), "path": path, "size": file.size,
                          "sha256": file.sha256 if whole else None, "valid": whole,
                          "detail": "1 tensors" if whole else "truncated safetensors header"})
        return {"dir": prefix, "checkpoints": found}

    def _agent_read_file(self, node: SimNode, *, path: str, offset: int = 0) -> dict[str, Any]:
        file = node.files.get(path)
        if file is None:
            raise RemoteError("refused", f"{path} does not exist")
        return {"data": b"", "offset": offset, "size": file.size}

    def _agent_hash_file(self, node: SimNode, *, path: str) -> dict[str, Any]:
        file = node.files.get(path)
        if file is None:
            raise RemoteError("refused", f"{path} does not exist")
        return {"size": file.size, "sha256": "0" * 64 if file.corrupt else file.sha256}

    def _agent_remove_checkpoints(self, node: SimNode, *, job: str, attempt: int, names: list,
                                  replica: bool = False) -> dict[str, Any]:
        directory = f"{node.workdir}/checkpoints/{job}/" + (f"replica/attempt-{attempt}/" if replica
                                                            else f"attempt-{attempt}/")
        for name in names:
            node.files.pop(directory + name, None)
        return {"removed": names}

    # --- before the first attempt ---
    async def sync(self, source: str, nodes: list[str] | None = None, *,
                   follow_outside_links: bool = False) -> dict[str, Any]:
        self._effect()
        return {"status": "ok", "detail": "every node matches"}

    async def preflight(self, *, backend: str | None, source: str | None, nodes: list[str] | None = None,
                        launcher: str | None = None, checkpoint_store: str | None = None) -> dict[str, Any]:
        self._effect()
        await anyio.sleep(1.0)
        return {"status": "pass", "checks": [], "seconds": 1.0, "hostfile": None, "backend": None}

    # --- launching ---
    async def plan_launch(self, nodes: list[str], job: Any) -> LaunchPlan:
        self._effect()
        await anyio.sleep(0.2)
        for name in nodes:
            node = self.world.nodes[name]
            if not node.reachable or not node.session_up:
                raise LaunchError(f"no link information from {name} (is it up?)", node=name)
        declared = capabilities(job.launcher)
        if declared.runs_on == "nodes" and declared.node_facts is None:  # the launcher's own plan, from the links
            cluster = SimpleNamespace(config=SimpleNamespace(nodes=[
                SimpleNamespace(name=n, is_local=False, ips=[f"10.0.0.{i + 1}"], host=n) for i, n in enumerate(nodes)]))
            return launcher_named(job.launcher).plan(cluster, NodeReadings({}), list(nodes), None, job)
        if declared.runs_on == "nodes":  # one per node, started by each node's agent
            return LaunchPlan(job.launcher, "gloo", tuple(nodes), no_links("gloo"),
                              node_envs={name: {"COORD_TORCH_BACKEND": "gloo"} for name in nodes},
                              rendezvous_address="10.0.0.1", procs_per_node=1)
        return LaunchPlan(job.launcher, "ring", tuple(nodes), no_links("ring"))

    def start_launcher(self, run_id: str, attempt: int, plan: LaunchPlan) -> int:
        self._effect()
        world = self.world
        fault = world.fault_for(world.launch_faults, world.job_of(run_id), attempt)
        if fault == "missing":
            raise LaunchError("mlx.launch could not be started (mlx.launch: No such file or directory); install mlx "
                              "into the head's Python (pip install mlx) or put mlx.launch on the daemon's PATH")
        pid = world.next_pid
        world.next_pid += 1
        prepared = world.prepared.get((run_id, attempt), {})
        starts = fault != "dies"
        world.launchers[pid] = (run_id, attempt, starts)
        world.launch_log.append({"run": run_id, "attempt": attempt, "time": world.now(),
                                 "ranks": {r: (s.node, s.start_step, s.resume_file) for r, s in prepared.items()}})
        if starts:
            for rank, sim in prepared.items():
                world.ranks[(run_id, attempt, rank)] = sim
                if world.nodes[sim.node].reachable:  # mlx.launch reaches it over SSH from the head
                    sim.launched_at = world.now()
                else:
                    sim.launched_at = world.now()
                    sim.exit, sim.exited_at, sim.last_line = 255, world.now(), "ssh: connect to host: timed out"
                    for peer in prepared.values():
                        if peer is not sim:
                            world._exit_later(peer, world.now() + PEER_LOST_S)
        world.check()
        return pid

    def launcher_exit(self, pid: int) -> int | None:
        run, attempt, starts = self.world.launchers.get(pid, ("", -1, True))
        if not starts:
            return 1
        ranks = [r for (r_run, r_attempt, _), r in self.world.ranks.items() if (r_run, r_attempt) == (run, attempt)]
        return 0 if ranks and not any(r.running() for r in ranks) else None

    async def stop_launcher(self, pid: int, *, final: bool) -> None:
        self._effect()

    # --- checkpoint bytes ---
    def _source_file(self, source: dict[str, Any]) -> SimFile | None:
        """The file a catalog copy names, on the head or on its node (which must be up)."""
        if source["node"] == HEAD:
            return self.world.head_files.get(source["path"])
        node = self.world.nodes[source["node"]]
        if not node.session_up or not node.reachable:
            raise RemoteError("connection_lost", f"node {node.name} is not up")
        return node.files.get(source["path"])

    async def copy_checkpoint(self, source: dict[str, Any], placements: list[Placement]) -> list[str]:
        self._effect()
        world = self.world
        file = self._source_file(source)
        await anyio.sleep(world.copy_s)
        self._effect()
        if file is None:
            raise RemoteError("not_found", f"{source['path']} does not exist")
        if source["node"] != HEAD and not world.nodes[source["node"]].reachable:
            raise RemoteError("connection_lost", f"node {source['node']} went away during the copy")
        if not file.whole(world.now()) or file.sha256 != source["sha256"]:
            raise CheckpointDamaged(f"{source['node']}:{source['path']} no longer matches the size and SHA256 "
                                    "recorded when it was validated")
        paths = []
        for placement in placements:
            if placement.node == HEAD:
                world.head_files[placement.path] = copy.copy(file)
                paths.append(placement.path)
                continue
            target = world.nodes[placement.node]
            if not target.reachable or not target.session_up:
                raise RemoteError("connection_lost", f"node {target.name} is not up")
            if target.disk_full:
                raise RemoteError("internal", "OSError: [Errno 28] No space left on device")
            path = f"{target.workdir}/{placement.path}"
            target.files[path] = copy.copy(file)
            paths.append(path)
        world.copies.append({"time": world.now(), "source": (source["node"], source["path"]),
                             "targets": [p.node for p in placements]})
        return paths

    def head_path(self, *parts: str) -> str:
        return "/head/" + "/".join(parts)

    def remove_head_file(self, path: str) -> None:
        self._effect()
        self.world.head_files.pop(path, None)

    # --- logs (kept short: the last line is what the supervisor reads) ---
    def append_log(self, run_id: str, attempt: int, rank: int, data: bytes) -> None:
        self._effect()
        key = f"{run_id}/{attempt}/{rank}"
        self.world.head_files.setdefault(key, b"")  # type: ignore[arg-type]
        self.world.head_files[key] += data  # type: ignore[operator]

    def log_size(self, run_id: str, attempt: int, rank: int) -> int:
        return len(self.world.head_files.get(f"{run_id}/{attempt}/{rank}", b""))  # type: ignore[arg-type]

    def log_tail(self, run_id: str, attempt: int, rank: int, size: int) -> bytes:
        return self.world.head_files.get(f"{run_id}/{attempt}/{rank}", b"")[-size:]  # type: ignore[index]

    # --- store and events ---
    def save_run(self, run_id: str, name: str, spec: dict[str, Any], state: str, record: dict[str, Any]) -> None:
        self._effect()
        # JSON round trip, as SQLite keeps it: nothing shared with the live record.
        self.world.store[run_id] = json.loads(json.dumps({"run_id": run_id, "name": name, "spec": spec,
                                                          "state": state, "record": record}))

    def checkpoints(self, run_id: str) -> list[dict[str, Any]]:
        self._effect()
        rows = self.world.catalog.get(run_id, {})
        return sorted((dict(r) for r in rows.values()), key=lambda c: (c["step"], c["attempt"], c.get("role", "")))

    def add_checkpoint(self, run_id: str, entry: dict[str, Any]) -> None:
        self._effect()
        row = {"role": "primary", **entry}
        self.world.catalog.setdefault(run_id, {})[(row["attempt"], row["node"], row["path"])] = row
        self.world.catalogued.setdefault(run_id, []).append(dict(row))

    def remove_checkpoint(self, run_id: str, attempt: int, node: str, path: str) -> None:
        self._effect()
        self.world.catalog.get(run_id, {}).pop((attempt, node, path), None)

    # --- the checkpoint store: not counted as effects (the fixed schedules' crash points stay) ---
    def store_url(self, job_store: str | None) -> str | None:
        return job_store or self.world.store_url

    async def upload_checkpoint(self, url: str, source: dict[str, Any], meta: Any) -> dict[str, Any]:
        if self.dead:
            raise DaemonCrash()
        world = self.world
        file = self._source_file(source)
        await anyio.sleep(world.upload_s)
        if self.dead:
            raise DaemonCrash()
        if not world.store_up:
            raise StoreError("timeout", f"writing to {url} took over 180 s", "the store stopped answering")
        if file is None or not file.whole(world.now()) or file.sha256 != source["sha256"]:
            raise UploadDamaged(f"{source['node']}:{source['path']} no longer matches what was validated")
        world.stored[url] = {"sha256": source["sha256"], "size": source["size"], "step": source["step"]}
        return {"attempt": source["attempt"], "step": source["step"], "url": url, "bytes": source["size"] or 0,
                "seconds": world.upload_s, "committed": self.now()}

    async def remove_stored(self, url: str) -> None:
        if not self.world.store_up:
            raise StoreError("timeout", f"removing {url} took over 180 s")
        self.world.stored.pop(url, None)

    def durable_checkpoints(self, run_id: str) -> list[dict[str, Any]]:
        if self.dead:
            raise DaemonCrash()
        return sorted((dict(r) for r in self.world.durable.get(run_id, {}).values()),
                      key=lambda r: (r["step"], r["attempt"]))

    def add_durable(self, run_id: str, row: dict[str, Any]) -> None:
        if self.dead:
            raise DaemonCrash()
        self.world.durable.setdefault(run_id, {})[(row["step"], row["attempt"])] = dict(row)

    def remove_durable(self, run_id: str, attempt: int, step: int) -> None:
        if self.dead:
            raise DaemonCrash()
        self.world.durable.get(run_id, {}).pop((step, attempt), None)

    def event(self, kind: str, message: str, data: dict[str, Any] | None) -> None:
        self._effect()
        self.world.events.append((trio.current_time(), kind, message))

    def record_attempt(self, run_id: str, attempt: int, start_step: int, nodes: list[str],
                       detail: str | None) -> None:
        # Not counted as an effect: the fixed schedules' crash points stay where they were.
        if self.dead:
            raise DaemonCrash()
        self.world.metric_attempts.append((run_id, attempt, start_step))

    def record_points(self, run_id: str, points: list[tuple[str, dict[str, Any]]]) -> None:
        if self.dead:
            raise DaemonCrash()

    def spawn(self, func: Callable[[], Awaitable[None]], *, name: str) -> None:
        if self.dead:
            raise DaemonCrash()
        if self.spawn_into is not None:
            self.spawn_into.start_soon(func, name=name)
