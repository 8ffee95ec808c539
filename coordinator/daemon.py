"""coordd: the daemon on the head node.

It holds a session to every node's agent, keeps state in SQLite, and answers
the CLI on the control socket. ``coordd --config FILE`` (launchd, systemd) and
``coord daemon --config FILE`` run the same code in the foreground.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

import anyio
import anyio.abc
import structlog

from coordinator.commands import calibrate as calibrate_command
from coordinator.commands import checkpoint_store as store_command
from coordinator.commands import doctor as doctor_command
from coordinator.commands import drill as drill_command
from coordinator.commands import hostfile as hostfile_command
from coordinator.commands import jobs as jobs_command
from coordinator.commands import prepare as prepare_command
from coordinator.commands import status as status_command
from coordinator.commands.status import DaemonInfo, DashboardInfo, StatusDocument
from coordinator.config.cluster_file import ClusterConfig, ConfigError, load_config
from coordinator.config.daemon_options import add_daemon_arguments
from coordinator.config.logs import configure_logging
from coordinator.control.server import ControlServer, ControlSocketError
from coordinator.jobs.daemon_effects import DaemonEffects
from coordinator.jobs.effects import Task
from coordinator.jobs.head_paths import tensorboard_dir
from coordinator.jobs.manager import JobManager
from coordinator.nodes.agent_bundle import AgentBundle, build_bundle
from coordinator.nodes.cluster import Cluster
from coordinator.nodes.session import Connect, open_transport
from coordinator.observe.alerts.hookup import attach_alerts
from coordinator.observe.dashboard.document import DashboardDocument, dashboard_document
from coordinator.observe.metrics.history import MetricsHistory, RunHistory
from coordinator.observe.metrics.prometheus import cluster_registry
from coordinator.observe.metrics.run_metrics import RunMetrics
from coordinator.observe.metrics.sampler import sample_nodes
from coordinator.observe.metrics.tensorboard import TensorBoardScalars
from coordinator.observe.web.routes import api_routes, page_routes
from coordinator.observe.web.server import Handler, WebServer
from coordinator.readiness import preflight as preflight_service
from coordinator.readiness import sync as sync_service
from coordinator.relay.links import LinkBook
from coordinator.store.state import StateError, StateStore
from shared.rpc import Dispatcher, Emit
from shared.version import COORD_VERSION

if TYPE_CHECKING:  # the plan's modules load only when a plan is asked for
    from coordinator.plan.document import PlanDocument
    from coordinator.plan.orchestration import OrchestrationDocument

log = structlog.get_logger("coordd")
Answer = TypeVar("Answer")


class PingReply(TypedDict):
    pid: int
    version: str


class DaemonError(Exception):
    pass


class StateDirLock:
    """One daemon per state dir: an exclusive flock held for the daemon's life."""

    def __init__(self, state_dir: Path):
        self.path = state_dir / "coordd.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DaemonError(f"another coordd (pid {holder}) is already running on {self.path.parent}") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Daemon:
    """The composition root: builds the parts, hands each what it uses, and answers the control
    socket from a dispatch table. What to do about jobs is the job manager's (coordinator.jobs.manager)."""

    def __init__(self, config: ClusterConfig, state: StateStore, bundle: AgentBundle, *,
                 connect: Connect = open_transport):
        self.config = config
        self.state = state
        self.started = time.time()
        self.cluster = Cluster(config, state, bundle, connect=connect)
        self.links = LinkBook(list(config.nodes))  # where relays send: addresses and cables, per node session
        self.history = MetricsHistory(state.connection, runs_of=self._runs_of,
                                      node_names=lambda: [node.name for node in config.nodes])
        self.tensorboard = TensorBoardScalars(lambda run_id: tensorboard_dir(config.state_dir, run_id))
        self.job_effects = DaemonEffects(self.cluster, self.links, RunMetrics(self.history, self.tensorboard),
                                         self.start_task)
        self.jobs = JobManager(self.job_effects, state, config.state_dir)
        self.alerts = attach_alerts(self.cluster, self.jobs)  # hears every event recorded from here on
        self.web = (WebServer(config.dashboard, self._web_routes(), public=frozenset(page_routes()))
                    if config.dashboard.enabled else None)
        self.web_error: str | None = None
        self.control = ControlServer(config.socket, self._dispatcher())
        self._tasks: anyio.abc.TaskGroup | None = None
        self._pending_tasks: list[tuple[Task, str]] = []

    def start_task(self, func: Task, name: str) -> None:
        """Run func in the daemon's task group (jobs live as long as the daemon)."""
        if self._tasks is None:
            self._pending_tasks.append((func, name))
        else:
            self._tasks.start_soon(func, name=name)

    def _runs_of(self, run_id: str | None) -> list[tuple[str, str]]:
        return self.jobs.runs_of(run_id)

    def _web_routes(self) -> dict[str, Handler]:
        return api_routes(status_document=self.status_document, history=self.history,
                          dashboard_document=self.dashboard_document,
                          registry=cluster_registry(self.cluster, self.jobs, self.history))

    def dashboard(self) -> DashboardInfo:
        """Where the HTTP server (/metrics, the dashboard) answers, or why it does not."""
        if self.web is None:
            return {"url": None, "error": "off ([dashboard] enabled = false)"}
        return {"url": self.web.url, "metrics": f"{self.web.url}metrics" if self.web.url else None,
                "token_required": self.config.dashboard.token is not None, "error": self.web_error}

    async def _serve_web(self, web: WebServer, *,
                         task_status: anyio.abc.TaskStatus[str | None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The HTTP server; an address that cannot be bound is said in status and the events, and
        the daemon runs on without it (a second cluster's daemon on the same head, say)."""
        try:
            await web.serve(task_status=task_status)
        except OSError as exc:
            listen = f"{self.config.dashboard.host}:{self.config.dashboard.port}"
            self.web_error = (f"cannot listen on {listen}: {exc.strerror or exc}; set another address with "
                              "[dashboard] listen = \"127.0.0.1:PORT\" in the cluster file")
            self.cluster.record_event("dashboard.failed", self.web_error)
            log.warning("http server not started", error=self.web_error)
            task_status.started(None)

    def _dispatcher(self) -> Dispatcher:
        jobs, cluster = self.jobs, self.cluster
        table = Dispatcher()
        table.add("status", self._status, optional={"events": int, "all": bool, "history": bool,
                                                     "run": (str, type(None)), "since": (int, float, type(None))})
        table.add("ping", self._ping)
        table.add("sync", partial(sync_service.serve_sync, cluster, self.links),
                  optional={"source": (str, type(None)), "delete": bool, "dry_run": bool,
                            "follow_outside_links": bool}, streams=True)
        table.add("calibrate", partial(calibrate_command.serve_calibrate, cluster),
                  optional={"refresh": bool, "quick": bool}, streams=True)
        table.add("doctor", partial(doctor_command.serve_doctor, cluster, jobs.training_nodes),
                  optional={"all_pairs": bool, "bytes": (int, type(None)), "seconds": (int, float, type(None)),
                            "quick": bool, "set_baseline": bool, "while_training": bool,
                            "ibv_devices": (list, type(None))}, streams=True)
        table.add("preflight", partial(preflight_service.run_preflight, cluster),
                  optional={"backend": (str, type(None)), "launcher": (str, type(None)),
                            "master_port": (int, type(None)), "checkpoint_store": (str, type(None))},
                  streams=True)
        table.add("run", _sync_handler(jobs_command.start_job, jobs), required={"spec": dict},
                  optional={"resume": bool})
        table.add("run_from_store", partial(store_command.serve_run_from_store, cluster, jobs),
                  required={"spec": dict, "url": str}, streams=True)
        table.add("store_checkpoints", store_command.list_store, required={"url": str})
        table.add("stop", _sync_handler(jobs_command.stop_job, jobs), required={"name": str})
        table.add("cancel", _sync_handler(jobs_command.cancel_job, jobs), required={"name": str})
        table.add("resize", _sync_handler(jobs_command.resize_job, jobs), required={"name": str})
        table.add("job", _sync_handler(jobs_command.job_view, jobs), required={"name": str})
        table.add("drill_fault", partial(drill_command.drill_fault, cluster, jobs),
                  required={"name": str, "fault": str, "rank": int}, optional={"seconds": (int, float)})
        table.add("forget_run", partial(drill_command.forget_run, cluster, jobs), required={"name": str},
                  optional={"tree": (str, type(None)), "source": (str, type(None))})
        table.add("logs", _sync_handler(jobs_command.job_logs, jobs), required={"name": str},
                  optional={"rank": int, "attempt": (int, type(None)), "offset": int})
        table.add("prepare_job", partial(prepare_command.prepare_job, cluster), required={"job": str, "argv": list},
                  optional={"env": dict, "backend": (str, type(None))})
        table.add("plan", self._plan, optional={"schema": str, "model": (str, type(None)), "data": (str, type(None)),
                                                "options": dict, "request": (dict, type(None)), "name": str,
                                                "seq_len": int, "launcher": (str, type(None)),
                                                "master_port": (int, type(None))}, streams=True)
        table.add("hostfile", partial(hostfile_command.serve_hostfile, cluster),
                  optional={"output": (str, type(None)), "backend": (str, type(None))})
        return table

    async def _plan(self, emit: Emit, **args: Any) -> PlanDocument | OrchestrationDocument:
        from coordinator.commands.plan import serve_plan  # the plan's modules load only when asked for

        return await serve_plan(self.cluster, list(self.jobs.runs.values()), emit, **args)

    async def _status(self, events: int = 10, all: bool = False, history: bool = False,  # noqa: A002 (wire names)
                      run: str | None = None, since: float | None = None) -> StatusDocument:
        return await self.status_document(events=events, every_run=all, history=history, run=run, since=since)

    async def status_document(self, *, events: int = 10, every_run: bool = False, history: bool = False,
                              run: str | None = None, since: float | None = None) -> StatusDocument:
        """The `coord status --json` document (the web server's /api/status too)."""
        doc = status_command.serve_status(self.cluster, self.jobs, daemon=self.info(), dashboard=self.dashboard(),
                                          events=events, every_run=every_run)
        if history:
            doc["history"] = self.history.document(run_id=run, since=since)
        return doc

    async def _ping(self) -> PingReply:
        return {"pid": os.getpid(), "version": COORD_VERSION}

    def info(self) -> DaemonInfo:
        return {"pid": os.getpid(), "version": COORD_VERSION, "started": self.started,
                "socket": str(self.config.socket), "state_dir": str(self.config.state_dir),
                "config": str(self.config.path) if self.config.path else None}

    async def run(self, *, task_status: anyio.abc.TaskStatus[Daemon] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled or SIGTERM/SIGINT; clean up the socket either way."""
        await self.control.start()
        self.cluster.record_event("daemon.started", f"coordd {COORD_VERSION} started (pid {os.getpid()})")
        log.info("daemon started", socket=str(self.config.socket), nodes=len(self.config.nodes))
        try:
            async with anyio.create_task_group() as tasks:
                self._tasks = tasks
                tasks.start_soon(self._stop_on_signal, tasks.cancel_scope)
                tasks.start_soon(self.cluster.run)
                tasks.start_soon(self.alerts.run, name="alerts")
                tasks.start_soon(sample_nodes, self.cluster.sessions, self.history, name="metrics:nodes")
                if self.web is not None:
                    await tasks.start(self._serve_web, self.web)
                self.jobs.reattach()
                self.jobs.schedule()
                for func, name in self._pending_tasks:
                    tasks.start_soon(func, name=name)
                self._pending_tasks.clear()
                task_status.started(self)
        finally:
            with anyio.CancelScope(shield=True):
                await self.control.close()
                self.cluster.record_event("daemon.stopped", "coordd stopped")
                log.info("daemon stopped")

    def dashboard_document(self) -> DashboardDocument:
        """What the dashboard page draws: the cluster, the runs with their curves, the events."""
        return dashboard_document(self.cluster, list(self.jobs.runs.values()), history=self._run_history,
                                  usage=self.history.latest)

    def _run_history(self, run_id: str) -> RunHistory | None:
        runs = self.history.document(run_id=run_id)["runs"]
        return runs[0] if runs else None

    async def _stop_on_signal(self, scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("stopping on signal", signal=signal.Signals(signum).name)
                scope.cancel()
                return


def _sync_handler(func: Callable[..., Answer], *first: Any) -> Callable[..., Awaitable[Answer]]:
    """A control handler around a plain function of the job manager (the dispatcher awaits handlers)."""
    async def handler(**args: Any) -> Answer:
        return func(*first, **args)
    return handler


def open_state(config: ClusterConfig) -> tuple[StateDirLock, StateStore]:
    try:
        config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise DaemonError(f"cannot create the state dir {config.state_dir}: {exc}") from None
    lock = StateDirLock(config.state_dir)
    lock.acquire()
    try:
        return lock, StateStore(config.state_dir / "coord.db")
    except StateError:
        lock.release()
        raise


def run_daemon(config_path: str, *, log_file: str | None = None, log_level: str = "info") -> int:
    """Run the daemon in the foreground; the exit status for the shell."""
    os.umask(0o077)  # state, logs and the socket are the owner's alone
    with contextlib.ExitStack() as closing:
        stream = closing.enter_context(open(log_file, "a", buffering=1)) if log_file else sys.stderr
        configure_logging(json=True, level=log_level, stream=stream)
        try:
            config = load_config(config_path)
            lock, state = open_state(config)
        except (ConfigError, DaemonError, StateError) as exc:
            print(f"coordd: {exc}", file=sys.stderr)
            return 2
        closing.callback(lock.release)
        closing.callback(state.close)
        try:
            anyio.run(Daemon(config, state, build_bundle()).run)
        except ControlSocketError as exc:
            print(f"coordd: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            pass
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="coordd", description="The coord daemon: keeps a session to every node's agent and "
                                   "answers `coord` on its control socket. Runs in the foreground.")
    add_daemon_arguments(parser)
    args = parser.parse_args(argv)
    sys.exit(run_daemon(args.config, log_file=args.log_file, log_level=args.log_level))


if __name__ == "__main__":
    main()
