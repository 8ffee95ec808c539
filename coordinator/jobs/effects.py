"""What a job's supervisor may do to the world, as narrow ports, one per role.

The supervisor decides; these effects act: the clock (``Clock``), calls to a node's agent and
what is known of the nodes (``AgentCalls``), sync, pre-flight and the launcher (``Launching``),
checkpoint bytes on the head and in the store (``CheckpointBytes``), the run's rows, logs and
events (``RunStore``), the metrics history (``Metrics``) and work that outlives the job's loop
(``Tasks``). ``JobEffects`` is all of them: the daemon fills it with the real parts
(``coordinator.jobs.daemon_effects``); the fault simulator (``tests/simulation``) fills it with
simulated nodes and ranks under a virtual clock, so the same supervisor loop runs under thousands
of fault schedules without a process. Each part of a job is handed the whole, but holds it as the
ports it uses (``self.fx: NodePorts = ctx.fx``), so that what a part may do shows in its type.

Sleeping is not an effect: the supervisor sleeps with anyio, which a virtual clock
(trio's ``MockClock``) makes free.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, overload

from coordinator.launch.seam import LaunchPlan
from coordinator.store.state import CheckpointEntry, CheckpointRow, DurableRow
from shared.agent_api.facts import UsageReply
from shared.agent_api.ranks import (
    DataReply,
    DumpStacksReply,
    HashFileReply,
    ListCheckpointsReply,
    PrepareRankReply,
    RankSignalsReply,
    RankStatusReply,
    RemoveCheckpointsReply,
    RetireStandbysReply,
    StartRankReply,
    StopRankReply,
)

if TYPE_CHECKING:
    from coordinator.jobs.metric_point import MetricPoint
    from coordinator.jobs.spec import JobSpec, JobSpecFields
    from coordinator.readiness.preflight import PreflightReport
    from coordinator.readiness.sync import SyncReport

HEAD = "head"  # the catalog's node name for a copy in the head's state directory

#: Work that outlives the job's own loop (a run, the reaping of ranks left behind), as a task.
Task = Callable[[], Coroutine[Any, Any, None]]


class LaunchError(Exception):
    """An attempt could not be started. ``node`` names the node it failed on, when one did:
    such a node is waited for like a lost one before the next launch."""

    def __init__(self, message: str, *, node: str | None = None):
        super().__init__(message)
        self.message = message
        self.node = node


@dataclass(frozen=True)
class NodeView:
    """A node as the supervisor sees it."""

    name: str
    up: bool
    workdir: str
    python: str
    reason: str | None = None
    facts: Mapping[str, Any] | None = None  # as the node's agent reported them: read key by key
    # Counts the node's sessions: a node that failed a call is trusted again only once it has
    # reconnected, not merely because its old session has not noticed the failure yet.
    generation: int = 0
    needs_reboot: str | None = None  # why it takes no part in a job until it comes back from a reboot
    # Set when the node has not been up once since the daemon started and its last try to connect
    # failed: why. A job naming it is refused at submit instead of waiting for it in silence.
    unreachable: str | None = None
    down_since: float | None = None  # while not up: since when (wall clock), as its session saw it go


@dataclass(frozen=True)
class UploadMeta:
    """What a checkpoint's manifest in the store says besides its files."""

    run: str
    job: str
    world_size: int
    bandwidth: float | None = None  # bytes per second for each sender (--store-bandwidth)
    from_nodes: bool = True  # the nodes put the parts where they can (--store-from)


@dataclass(frozen=True)
class Placement:
    """Where a checkpoint copy should land: a node (``path`` relative to its workdir) or the head."""

    node: str
    path: str


class Clock(Protocol):
    """Wall and monotonic time (sleeps are anyio's)."""

    def now(self) -> float: ...
    def monotonic(self) -> float: ...


class AgentCalls(Protocol):
    """The nodes as the head knows them, and calls to their agents."""

    def node_names(self) -> list[str]: ...
    def node(self, name: str) -> NodeView: ...

    # Call the node's agent (its workdir is added to ``params``); RemoteError on any failure. Each
    # method the supervisor calls answers its reply in shared.agent_api.
    @overload
    async def call(self, node: str, method: Literal["prepare_rank"], params: Mapping[str, object], *,
                   timeout: float) -> PrepareRankReply: ...
    @overload
    async def call(self, node: str, method: Literal["start_rank"], params: Mapping[str, object], *,
                   timeout: float) -> StartRankReply: ...
    @overload
    async def call(self, node: str, method: Literal["retire_standbys"], params: Mapping[str, object], *,
                   timeout: float) -> RetireStandbysReply: ...
    @overload
    async def call(self, node: str, method: Literal["rank_status"], params: Mapping[str, object], *,
                   timeout: float) -> RankStatusReply: ...
    @overload
    async def call(self, node: str, method: Literal["read_log"], params: Mapping[str, object], *,
                   timeout: float) -> DataReply: ...
    @overload
    async def call(self, node: str, method: Literal["dump_stacks"], params: Mapping[str, object], *,
                   timeout: float) -> DumpStacksReply: ...
    @overload
    async def call(self, node: str, method: Literal["rank_signals"], params: Mapping[str, object], *,
                   timeout: float) -> RankSignalsReply: ...
    @overload
    async def call(self, node: str, method: Literal["stop_rank"], params: Mapping[str, object], *,
                   timeout: float) -> StopRankReply: ...
    @overload
    async def call(self, node: str, method: Literal["list_checkpoints"], params: Mapping[str, object], *,
                   timeout: float) -> ListCheckpointsReply: ...
    @overload
    async def call(self, node: str, method: Literal["remove_checkpoints"], params: Mapping[str, object], *,
                   timeout: float) -> RemoveCheckpointsReply: ...
    @overload
    async def call(self, node: str, method: Literal["hash_file"], params: Mapping[str, object], *,
                   timeout: float) -> HashFileReply: ...
    @overload
    async def call(self, node: str, method: Literal["usage"], params: Mapping[str, object], *,
                   timeout: float) -> UsageReply: ...

    async def head_route_down(self, nodes: list[str]) -> str | None:
        """Why the head's own path toward these nodes is down (no route to them, its interface down),
        or None when it looks fine (coordinator/jobs/outage.py)."""
        ...

    def mark_needs_reboot(self, node: str, reason: str) -> None:
        """The node leaves every job's placement until its agent comes back from a reboot."""

    def slow_links(self, node: str) -> list[str]:
        """What ``coord doctor`` last found wrong with the node's links (slow, down, wrong-route), each
        said in a line; empty when it found nothing or never measured them."""

    def on_head_machine(self, node: str) -> bool:
        """Whether the node is the head's own machine (host "local", or a loopback address): a
        copy on the head then protects nothing against that node's loss."""


class Launching(Protocol):
    """Sync, pre-flight, and the launch of an attempt."""

    async def sync(self, source: str, nodes: list[str] | None = None, *,
                   follow_outside_links: bool = False) -> SyncReport: ...
    async def preflight(self, *, backend: str | None, source: str | None, nodes: list[str] | None = None,
                        launcher: str | None = None, checkpoint_store: str | None = None) -> PreflightReport:
        """Pre-flight on the job's nodes, with the framework checks its ``launcher`` declares; the job's
        ``checkpoint_store`` (else the cluster file's) is probed."""

    async def plan_launch(self, nodes: list[str], job: JobSpec) -> LaunchPlan:
        """The job's launcher's plan for ``nodes`` (with its backend, if it names one); LaunchError when
        there is none."""

    def start_launcher(self, run_id: str, attempt: int, plan: LaunchPlan) -> int:
        """Write the launch files and start the plan's launcher; its pid. LaunchError when it cannot start."""

    def launcher_exit(self, pid: int) -> int | None:
        """The launcher's exit status once it has exited (None while it runs or when unknown)."""

    async def stop_launcher(self, pid: int, *, final: bool) -> None:
        """SIGTERM (``final`` False) or SIGKILL and reap (``final`` True)."""


class CheckpointBytes(Protocol):
    """Checkpoint bytes: copied between nodes and the head, and into the checkpoint store
    (coordinator/durable): checkpoints off the cluster."""

    async def copy_checkpoint(self, source: CheckpointRow, placements: list[Placement]) -> list[str]:
        """Stream ``source`` (a catalog copy) to every placement, SHA256-checked; the paths written.
        RemoteError, CheckpointDamaged or OSError when it cannot."""

    def head_path(self, *parts: str) -> str: ...
    def remove_head_file(self, path: str) -> None: ...

    def store_url(self, job_store: str | None) -> str | None:
        """The store a job's checkpoints go to: its own (``--checkpoint-store``), else the cluster file's."""

    async def upload_checkpoint(self, url: str, source: CheckpointRow, meta: UploadMeta) -> DurableRow:
        """``source``'s bytes into the store under ``url`` (the checkpoint's prefix there), its manifest
        last. StoreError, UploadDamaged, RemoteError or OSError when it cannot: nothing is then committed."""

    async def remove_stored(self, url: str) -> None:
        """A committed checkpoint out of the store (its manifest first). StoreError when it cannot."""


class RunStore(Protocol):
    """What the head keeps of a run: its spec and record, its checkpoints in the catalog and in the
    store, the head's copy of each rank's output, and the event log."""

    def durable_checkpoints(self, run_id: str) -> list[DurableRow]: ...
    def add_durable(self, run_id: str, row: DurableRow) -> None: ...
    def remove_durable(self, run_id: str, attempt: int, step: int) -> None: ...

    # --- the head's copy of each rank's output ---
    def append_log(self, run_id: str, attempt: int, rank: int, data: bytes) -> None: ...
    def log_size(self, run_id: str, attempt: int, rank: int) -> int: ...
    def log_tail(self, run_id: str, attempt: int, rank: int, size: int) -> bytes: ...

    def save_run(self, run_id: str, name: str, spec: JobSpecFields, state: str,
                 record: Mapping[str, object]) -> None:
        """The run's spec and its record (``JobRecord.to_json``), as the store keeps them."""

    def checkpoints(self, run_id: str) -> list[CheckpointRow]: ...
    def add_checkpoint(self, run_id: str, entry: CheckpointEntry) -> None: ...
    def remove_checkpoint(self, run_id: str, attempt: int, node: str, path: str) -> None: ...
    def event(self, kind: str, message: str, data: Mapping[str, object] | None) -> None:
        """One event of the log; ``data``'s keys depend on the kind."""


class Metrics(Protocol):
    """The metrics history (and TensorBoard); never raises: a chart is not worth a job."""

    def record_attempt(self, run_id: str, attempt: int, start_step: int, nodes: list[str],
                       detail: str | None) -> None:
        """An attempt starts from ``start_step``: the run's points past it are dropped."""

    def record_points(self, run_id: str, points: list[tuple[str, MetricPoint]]) -> None:
        """The ``train`` and ``val`` points (series, point: step, attempt, time and its values) one
        poll read, in order: written together, as one transaction and one append."""


class Tasks(Protocol):
    """Background work that outlives the job's own loop."""

    def spawn(self, func: Task, *, name: str) -> None: ...


class JobEffects(Clock, AgentCalls, Launching, CheckpointBytes, RunStore, Metrics, Tasks, Protocol):
    """Every port: what the daemon and the simulator fill, and the supervisor's loop holds."""


# The ports each part of a job holds (``self.fx``), by what it does.
class NodePorts(Clock, AgentCalls, Protocol):
    """A watch of the nodes and their ranks: the clock and the agents."""


class CatalogPorts(Clock, AgentCalls, CheckpointBytes, RunStore, Protocol):
    """The checkpoints: found on the nodes, catalogued, copied, placed and uploaded."""


class StorePorts(Clock, CheckpointBytes, RunStore, Protocol):
    """The uploads to the checkpoint store, and what the run keeps of them."""


class AttemptPorts(Clock, AgentCalls, Launching, RunStore, Metrics, Protocol):
    """One attempt: the launch, the ranks' start and stop on the nodes, the attempt read back from the
    run, the start of its curve."""


class TreePorts(Clock, Launching, Protocol):
    """The check of the nodes' trees before a relaunch: a sync, timed."""


class RankPorts(Clock, AgentCalls, Launching, RunStore, Metrics, Protocol):
    """The watch of an attempt's ranks: their status and output, the launcher's exit, their metrics."""


class ContextPorts(Clock, AgentCalls, RunStore, Protocol):
    """What the run's shared context does itself: its events and its saved record."""
