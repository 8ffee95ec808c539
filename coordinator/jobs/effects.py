"""What a job's supervisor may do to the world, as one narrow interface.

The supervisor decides; these effects act: calls to a node's agent, the launcher, the
clock, the store, the event log and the head's own files. The daemon fills them with the
real parts (``coordinator.jobs.daemon_effects``); the fault simulator (``tests/simulation``)
fills them with simulated nodes and ranks under a virtual clock, so the same supervisor
loop runs under thousands of fault schedules without a process.

Sleeping is not an effect: the supervisor sleeps with anyio, which a virtual clock
(trio's ``MockClock``) makes free.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from coordinator.launch.launcher import LaunchPlan

HEAD = "head"  # the catalog's node name for a copy in the head's state directory


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
    facts: dict[str, Any] | None = None
    # Counts the node's sessions: a node that failed a call is trusted again only once it has
    # reconnected, not merely because its old session has not noticed the failure yet.
    generation: int = 0


@dataclass(frozen=True)
class Placement:
    """Where a checkpoint copy should land: a node (``path`` relative to its workdir) or the head."""

    node: str
    path: str
    extra: dict[str, Any] = field(default_factory=dict)


class JobEffects(Protocol):
    # --- the clock (sleeps are anyio's) ---
    def now(self) -> float: ...
    def monotonic(self) -> float: ...

    # --- nodes ---
    def node_names(self) -> list[str]: ...
    def node(self, name: str) -> NodeView: ...
    async def call(self, node: str, method: str, params: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        """Call the node's agent (its workdir is added); RemoteError on any failure."""

    def on_head_machine(self, node: str) -> bool:
        """Whether the node is the head's own machine (host "local", or a loopback address): a
        copy on the head then protects nothing against that node's loss."""

    # --- before the first attempt ---
    async def sync(self, source: str, nodes: list[str] | None = None) -> dict[str, Any]: ...
    async def preflight(self, *, backend: str | None, source: str | None,
                        nodes: list[str] | None = None) -> dict[str, Any]: ...

    # --- launching ---
    async def plan_launch(self, nodes: list[str], backend: str | None, launcher: str) -> LaunchPlan:
        """The named launcher's plan for ``nodes``; LaunchError when there is none."""

    def start_launcher(self, run_id: str, attempt: int, plan: LaunchPlan) -> int:
        """Write the launch files and start the plan's launcher; its pid. LaunchError when it cannot start."""

    def launcher_exit(self, pid: int) -> int | None:
        """The launcher's exit status once it has exited (None while it runs or when unknown)."""

    async def stop_launcher(self, pid: int, *, final: bool) -> None:
        """SIGTERM (``final`` False) or SIGKILL and reap (``final`` True)."""

    # --- checkpoint bytes ---
    async def copy_checkpoint(self, source: dict[str, Any], placements: list[Placement]) -> list[str]:
        """Stream ``source`` (a catalog copy) to every placement, SHA256-checked; the paths written.
        RemoteError, CheckpointDamaged or OSError when it cannot."""

    def head_path(self, *parts: str) -> str: ...
    def remove_head_file(self, path: str) -> None: ...

    # --- the head's copy of each rank's output ---
    def append_log(self, run_id: str, attempt: int, rank: int, data: bytes) -> None: ...
    def log_size(self, run_id: str, attempt: int, rank: int) -> int: ...
    def log_tail(self, run_id: str, attempt: int, rank: int, size: int) -> bytes: ...

    # --- the store and the event log ---
    def save_run(self, run_id: str, name: str, spec: dict[str, Any], state: str, record: dict[str, Any]) -> None: ...
    def checkpoints(self, run_id: str) -> list[dict[str, Any]]: ...
    def add_checkpoint(self, run_id: str, entry: dict[str, Any]) -> None: ...
    def remove_checkpoint(self, run_id: str, attempt: int, node: str, path: str) -> None: ...
    def event(self, kind: str, message: str, data: dict[str, Any] | None) -> None: ...

    # --- the metrics history (and TensorBoard); never raises: a chart is not worth a job ---
    def record_attempt(self, run_id: str, attempt: int, start_step: int, nodes: list[str],
                       detail: str | None) -> None:
        """An attempt starts from ``start_step``: the run's points past it are dropped."""

    def record_point(self, run_id: str, series: str, point: dict[str, Any]) -> None:
        """One ``train`` or ``val`` point: step, attempt, time and its values."""

    # --- background work that outlives the job's own loop ---
    def spawn(self, func: Callable[[], Awaitable[None]], *, name: str) -> None: ...
