"""The real effects behind a job's supervisor: the daemon's node sessions, mlx.launch, the
wall clock, SQLite, the event log and the head's state directory."""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import structlog

from coordinator.config.store_url import MANIFEST, parse_store_url
from coordinator.durable.manifest import FileEntry, StoreManifest
from coordinator.durable.manifest import build as build_manifest
from coordinator.durable.objects import StoreError, open_store
from coordinator.durable.transfer import Pace, SpreadFile, UploadFile, upload_spread
from coordinator.durable.transfer import remove_checkpoint as remove_from_store
from coordinator.durable.transfer import upload_checkpoint as upload_to_store
from coordinator.jobs import catalog
from coordinator.jobs.checkpoint_formats import written_last
from coordinator.jobs.effects import HEAD, LaunchError, NodeView, Placement, Task, UploadMeta
from coordinator.jobs.head_paths import attempt_dir
from coordinator.jobs.spec import JobSpec, JobSpecFields
from coordinator.jobs.store_upload import node_senders
from coordinator.jobs.straggler_cause import link_findings
from coordinator.jobs.transfer import (
    CheckpointDamaged,
    HeadSink,
    HeadSource,
    NodeSink,
    NodeSource,
    Sink,
    Source,
    copy_verified,
)
from coordinator.launch.plan import node_topologies
from coordinator.launch.registry import capabilities, launcher_named
from coordinator.launch.seam import CommandError, LaunchPlan, NodeReadings, PlanError, StartError
from coordinator.nodes.session import DOWN, UP
from coordinator.readiness.node_facts import facts_named, gather_facts, session_call
from coordinator.relay.broadcast import Source as RelaySource
from coordinator.relay.broadcast import Target, broadcast
from coordinator.store.state import CheckpointEntry, CheckpointRow, DurableRow
from shared.checkpoint_dirs import DIR_NAME, DirFile, digest, walk
from shared.errors import first_error
from shared.manifest import sha256_file
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from coordinator.jobs.metric_point import MetricPoint
    from coordinator.nodes.cluster import Cluster
    from coordinator.readiness.preflight import PreflightReport
    from coordinator.readiness.sync import SyncReport
    from coordinator.relay.links import LinkBook

LAUNCHER_REAP_S = 5.0
log = structlog.get_logger("job")


class RunMetrics(Protocol):
    """Where a run's curves go (the metrics history and TensorBoard); never raises."""

    def record_attempt(self, run_id: str, attempt: int, start_step: int, nodes: list[str],
                       detail: str | None) -> None: ...
    def record_points(self, run_id: str, points: list[tuple[str, MetricPoint]]) -> None: ...


class DaemonEffects:
    """``JobEffects`` filled with the real parts: what the daemon built, handed over one by one."""

    def __init__(self, cluster: Cluster, links: LinkBook, metrics: RunMetrics, spawn: Callable[[Task, str], None]):
        self.cluster = cluster
        self.config = cluster.config
        self.links = links
        self.metrics = metrics
        self._spawn = spawn
        self._launchers: dict[int, subprocess.Popen[bytes]] = {}
        # (agent call, node, session generation) -> the node's answer: what a launcher's
        # ``Capabilities.node_facts`` asks for, asked once per session of each node.
        self._facts: dict[tuple[str, str, int], Mapping[str, Any]] = {}

    # --- the clock ---
    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    # --- nodes ---
    def node_names(self) -> list[str]:
        return [n.name for n in self.config.nodes]

    def node(self, name: str) -> NodeView:
        session = self.cluster.sessions[name]
        never_up = session.generation == 0 and session.state == DOWN
        mark = self.cluster.reboot_marks.get(name)
        up = session.state == UP
        return NodeView(name, up, session.node.workdir, session.node.python,
                        session.view.reason, session.view.facts, session.generation,
                        needs_reboot=f"{mark['reason']}; fix: {mark['fix']}" if mark else None,
                        unreachable=(session.view.reason or "cannot connect") if never_up else None,
                        down_since=None if up else session.view.since)

    async def head_route_down(self, nodes: list[str]) -> str | None:
        from coordinator.nodes.head_route import route_down

        for name in nodes:
            if self.on_head_machine(name):
                continue  # reached without a network
            session = self.cluster.sessions[name]
            address = session.peer_address or session.node.host
            why = await anyio.to_thread.run_sync(route_down, address)
            if why is not None:
                return why
        return None

    def mark_needs_reboot(self, node: str, reason: str) -> None:
        self.cluster.mark_needs_reboot(node, reason)

    def slow_links(self, node: str) -> list[str]:
        return link_findings(self.cluster.state.links("last"), node)

    def on_head_machine(self, node: str) -> bool:
        from coordinator.config.cluster_file import is_loopback

        config = next((n for n in self.config.nodes if n.name == node), None)
        if config is None:
            return False
        try:
            return config.is_local or is_loopback(config.host)
        except ValueError:  # a host name, not an address: another machine
            return False

    async def call(self, node: str, method: str, params: Mapping[str, object], *, timeout: float) -> Any:
        """The agent method's reply as it came off the wire (JobEffects.call names each one's type)."""
        session = self.cluster.sessions[node]
        try:
            return await session.call(method, {"workdir": session.node.workdir, **params}, timeout=timeout)
        except TimeoutError as exc:  # the RPC layer's own timeout: the node is as good as unreachable
            raise RemoteError("timeout", f"{node}: {exc}") from None

    # --- before the first attempt ---
    async def sync(self, source: str, nodes: list[str] | None = None, *,
                   follow_outside_links: bool = False) -> SyncReport:
        from coordinator.readiness.sync import serve_sync
        return await serve_sync(self.cluster, self.links, _quiet, source=source, nodes=nodes,
                                follow_outside_links=follow_outside_links)

    async def preflight(self, *, backend: str | None, source: str | None, nodes: list[str] | None = None,
                        launcher: str | None = None, checkpoint_store: str | None = None) -> PreflightReport:
        from coordinator.readiness.preflight import run_preflight
        # The framework checks the job's launcher declares, beside every job's.
        result = await run_preflight(self.cluster, _quiet, backend=backend, source=source, only=nodes,
                                     launcher=launcher, checkpoint_store=checkpoint_store)
        found = result.get("node_facts")
        if found is not None:  # fresh: the first attempt's plan takes them rather than asking every node again
            sessions = self.cluster.sessions
            for name, facts in found["facts"].items():
                self._facts[(found["method"], name, sessions[name].generation)] = facts
        return result

    # --- launching ---
    async def plan_launch(self, nodes: list[str], job: JobSpec) -> LaunchPlan:
        topologies = await node_topologies(self.cluster)
        facts: Mapping[str, Mapping[str, Any]] = {}
        method = capabilities(job.launcher).node_facts
        if method is not None:
            facts, missing = await self._node_facts(method, nodes)
            if missing:
                name, reason = sorted(missing.items())[0]
                raise LaunchError(f"no {facts_named(method)} from {name}: {reason}", node=name)
        try:
            return launcher_named(job.launcher).plan(self.cluster, NodeReadings(topologies, facts), nodes, job.backend,
                                                     job)
        except PlanError as exc:
            raise LaunchError(exc.message, node=exc.node) from None
        except CommandError as exc:
            raise LaunchError(str(exc)) from None

    async def _node_facts(self, method: str, nodes: list[str]) -> tuple[dict[str, Mapping[str, Any]],
                                                                         dict[str, str]]:
        """Each node's answer to the agent call ``method``, asked once per session of the node (the
        facts change only when the node's Python does, which a reconnect follows; asking may import a
        framework on every node). (facts, why the others gave none)."""
        sessions = self.cluster.sessions
        wanted = {name: sessions[name].node.python for name in nodes
                  if (method, name, sessions[name].generation) not in self._facts}

        found, missing = await gather_facts(session_call(sessions), method, wanted)
        for name, facts in found.items():
            self._facts[(method, name, sessions[name].generation)] = facts
        return {name: self._facts[key] for name in nodes
                if (key := (method, name, sessions[name].generation)) in self._facts}, missing

    def start_launcher(self, run_id: str, attempt: int, plan: LaunchPlan) -> int:
        directory = attempt_dir(self.config.state_dir, run_id, attempt)
        launcher = launcher_named(plan.launcher)
        try:
            proc = launcher.start(directory, self.config, plan, run_id, attempt)
        except StartError as exc:
            raise LaunchError(str(exc)) from None
        except OSError as exc:
            raise LaunchError(f"the launch files could not be written in {directory}: {exc}") from None
        if not leads_its_own_session(proc.pid):
            proc.kill()
            proc.wait()
            raise LaunchError(f"launcher {plan.launcher!r} started its process in the daemon's own session; it must "
                              "start it in a session of its own (start_new_session=True), or stopping the daemon "
                              "would stop the job (docs/deploy.md)")
        self._launchers[proc.pid] = proc
        return proc.pid

    def launcher_exit(self, pid: int) -> int | None:
        proc = self._launchers.get(pid)
        if proc is not None:
            return proc.poll()
        try:  # started by an earlier daemon: only whether it lives can be known
            os.kill(pid, 0)
        except ProcessLookupError:
            return -1
        except PermissionError:
            pass
        return None

    async def stop_launcher(self, pid: int, *, final: bool) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL if final else signal.SIGTERM)
        proc = self._launchers.get(pid)
        if final and proc is not None:
            # Reaped in a worker thread, bounded: a launcher that ignores SIGKILL (a stuck ssh) is
            # left to the next stop rather than holding the supervisor.
            with contextlib.suppress(subprocess.TimeoutExpired):
                await anyio.to_thread.run_sync(proc.wait, LAUNCHER_REAP_S)
            if proc.poll() is not None:
                self._launchers.pop(pid, None)

    # --- checkpoint bytes ---
    async def copy_checkpoint(self, source: CheckpointRow, placements: list[Placement]) -> list[str]:
        """Copies to nodes go through the relay (each byte over each link once, every chunk checked
        on arrival); a node the relay could not reach is sent its copy over its SSH session; a copy
        to the head is streamed from the source beside it. The paths written, in placement order."""
        if DIR_NAME.match(posixpath.basename(source["path"])):
            return await self._copy_directory(source, placements)
        sessions = self.cluster.sessions
        size, sha256 = source["size"], source["sha256"]
        if size is None or not sha256:
            raise CheckpointDamaged(f"{source['node']}:{source['path']}: no size and SHA256 were recorded for it")
        to_nodes = [p for p in placements if p.node != HEAD]
        to_head = [p for p in placements if p.node == HEAD]
        written: dict[int, str] = {}

        async def through_relay() -> None:
            if not to_nodes:
                return
            names = [p.node for p in to_nodes] + ([source["node"]] if source["node"] != HEAD else [])
            await self.links.refresh(sessions, names)
            outcomes = await broadcast(
                sessions, RelaySource(source["node"], source["path"], size, sha256),
                [Target(p.node, p.path) for p in to_nodes], address=self.links.address,
                thunderbolt=self.links.thunderbolt,
                events=lambda kind, text: self.cluster.record_event(kind, text))
            left = []
            for p in to_nodes:
                outcome = outcomes[p.node]
                if outcome.ok and outcome.path is not None:
                    written[id(p)] = outcome.path
                elif outcome.source_damaged:
                    raise CheckpointDamaged(f"{source['node']}:{source['path']} {outcome.detail}")
                else:
                    left.append((p, outcome.detail))
            for p, detail in left:  # the relay could not reach it: its SSH session may
                if p.node not in sessions or sessions[p.node].state != UP:
                    raise RemoteError("connection_lost", f"{p.node}: {detail}")
                log.info("relay failed, copying over ssh", node=p.node, detail=detail)
                (path,) = await self._stream(source, [p], size, sha256)
                written[id(p)] = path

        async def to_the_head() -> None:
            if to_head:
                for p, path in zip(to_head, await self._stream(source, to_head, size, sha256), strict=True):
                    written[id(p)] = path

        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(through_relay)
                tasks.start_soon(to_the_head)
        except BaseExceptionGroup as group:
            raise first_error(group) from None
        return [written[id(p)] for p in placements]

    async def _copy_directory(self, source: CheckpointRow, placements: list[Placement]) -> list[str]:
        """A checkpoint directory, file by file (each through the relay, checked on arrival), after its
        files were found to be the ones catalogued (their digest); the directories written."""
        files = await self._directory_files(source)
        if digest(files) != source["sha256"]:
            raise CheckpointDamaged(f"{source['node']}:{source['path']} no longer holds the files recorded when it "
                                    "was validated")
        written: list[str] = []
        # A format's last file goes last: a copy cut short never looks whole.
        for entry in sorted(files, key=lambda f: (written_last(f["path"]), f["path"])):
            row: CheckpointRow = {**source, "path": posixpath.join(source["path"], entry["path"]),
                                  "size": entry["size"], "sha256": entry["sha256"]}
            targets = [Placement(p.node, posixpath.join(p.path, entry["path"])) for p in placements]
            paths = await self.copy_checkpoint(row, targets)
            written = [path[:len(path) - len(entry["path"]) - 1] for path in paths]
        if not written:  # an empty directory is never catalogued valid; say where it would have gone
            written = [p.path if p.node == HEAD else posixpath.join(self.cluster.sessions[p.node].node.workdir, p.path)
                       for p in placements]
        return written

    async def _directory_files(self, source: CheckpointRow) -> list[DirFile]:
        if source["node"] == HEAD:
            def on_head() -> list[DirFile]:
                entries, problem = walk(source["path"])
                if problem:
                    raise CheckpointDamaged(f"head:{source['path']}: {problem}")
                return [{"path": rel, "size": os.path.getsize(full), "sha256": sha256_file(full)}
                        for rel, full in entries]
            return await anyio.to_thread.run_sync(on_head)
        answer = await self.call(source["node"], "checkpoint_files", {"path": source["path"]},
                                 timeout=max(60.0, (source.get("size") or 0) / 50e6))
        return list(answer["files"])

    async def _stream(self, source: CheckpointRow, placements: list[Placement], size: int, sha256: str) -> list[str]:
        """Read the source once through its agent (or the head's file) into every placement."""
        sessions = self.cluster.sessions
        reader: Source
        if source["node"] == HEAD:
            reader = HeadSource(Path(source["path"]))
        else:
            reader = NodeSource(sessions[source["node"]], source["path"])
        sinks: list[Sink] = [HeadSink(Path(p.path)) if p.node == HEAD else NodeSink(sessions[p.node], p.path)
                             for p in placements]
        try:
            return await copy_verified(reader, sinks, size=size, sha256=sha256)
        except TimeoutError as exc:
            raise RemoteError("timeout", str(exc)) from None

    def head_path(self, *parts: str) -> str:
        return str(self.config.state_dir.joinpath(*parts))

    def remove_head_file(self, path: str) -> None:
        target = Path(path)
        if target.is_dir() and not target.is_symlink():  # a checkpoint directory's copy
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)

    # --- the checkpoint store ---
    def store_url(self, job_store: str | None) -> str | None:
        return job_store or self.config.checkpoint_store

    async def upload_checkpoint(self, url: str, source: CheckpointRow, meta: UploadMeta) -> DurableRow:
        """Put in parts, its manifest last (coordinator/durable/transfer.py): by the nodes that hold a copy,
        each a share, through URLs the head signs (coordinator/jobs/store_upload.py); else read by the head
        from where it lies (its node's agent, or the head's own copy) and put from here."""
        location = parse_store_url(url)
        store = open_store(location.parent)
        directory = bool(DIR_NAME.match(posixpath.basename(source["path"])))
        if directory:
            files = await self._directory_files(source)
            if digest(files) != source["sha256"]:
                raise CheckpointDamaged(f"{source['node']}:{source['path']} no longer holds the files recorded "
                                        "when it was validated")
            listed = [(posixpath.join(source["path"], f["path"]), f["path"], f["size"], f["sha256"])
                      for f in sorted(files, key=lambda f: f["path"])]
        else:
            if source["size"] is None or not source["sha256"]:
                raise CheckpointDamaged(f"{source['node']}:{source['path']}: no size and SHA256 were recorded for it")
            listed = [(source["path"], posixpath.basename(source["path"]), source["size"], source["sha256"])]
        started = time.monotonic()

        def describe(entries: list[FileEntry]) -> StoreManifest:
            kind = "directory" if directory else (posixpath.splitext(source["path"])[1].lstrip(".") or "file")
            return build_manifest(run=meta.run, job=meta.job, attempt=source["attempt"], step=source["step"],
                                  format=kind, world_size=meta.world_size, created=time.time(), files=entries)
        spread = [SpreadFile(rel, size, sha) for _, rel, size, sha in listed]
        held = {node: row["path"] for node, row in catalog.holders(
            [c for c in self.checkpoints(meta.run) if (c["step"], c["attempt"]) == (source["step"], source["attempt"])],
            source["sha256"]).items() if node != HEAD}
        senders = node_senders(self.cluster.sessions, store, held, spread, meta.bandwidth, directory) \
            if meta.from_nodes else []
        signed = bool(senders) and await store.sign_puts([f"{location.last}/{MANIFEST}"], 60) is not None
        manifest: StoreManifest | None = None
        if signed:
            try:
                manifest = await upload_spread(store, location.last, spread, list(senders), describe=describe)
            except StoreError as exc:
                if exc.kind != "timeout":
                    raise
                # The nodes could not reach the store (a private network, a firewall): the head tries,
                # reading the bytes from where they lie, as if the store could not sign.
                log.warning("store_nodes_unreachable", url=location.url, error=str(exc))
                signed = False
        if manifest is None:
            uploads = [UploadFile(rel, size, sha, self._reader(source["node"], full).chunks)
                       for full, rel, size, sha in listed]
            manifest = await upload_to_store(store, location.last, uploads, describe=describe,
                                             pace=Pace(meta.bandwidth))
        return {"attempt": source["attempt"], "step": source["step"], "url": location.url,
                "bytes": manifest["bytes"], "seconds": round(time.monotonic() - started, 3),
                "committed": manifest["created"], "senders": [s.name for s in senders] if signed else [HEAD]}

    def _reader(self, node: str, path: str) -> Source:
        if node == HEAD:
            return HeadSource(Path(path))
        session = self.cluster.sessions.get(node)
        if session is None or session.state != UP:
            raise RemoteError("connection_lost", f"{node} is not up: its checkpoint cannot be read")
        return NodeSource(session, path)

    async def remove_stored(self, url: str) -> None:
        location = parse_store_url(url)
        await remove_from_store(open_store(location.parent), location.last)

    def durable_checkpoints(self, run_id: str) -> list[DurableRow]:
        return self.cluster.state.durable_checkpoints(run_id)

    def add_durable(self, run_id: str, row: DurableRow) -> None:
        self.cluster.state.add_durable(run_id, row)

    def remove_durable(self, run_id: str, attempt: int, step: int) -> None:
        self.cluster.state.remove_durable(run_id, attempt, step)

    # --- each rank's output on the head ---
    def _log_path(self, run_id: str, attempt: int, rank: int) -> Path:
        return attempt_dir(self.config.state_dir, run_id, attempt) / f"rank-{rank}.log"

    def append_log(self, run_id: str, attempt: int, rank: int, data: bytes) -> None:
        path = self._log_path(run_id, attempt, rank)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(path, "ab") as handle:
            handle.write(data)

    def log_size(self, run_id: str, attempt: int, rank: int) -> int:
        try:
            return self._log_path(run_id, attempt, rank).stat().st_size
        except OSError:
            return 0

    def log_tail(self, run_id: str, attempt: int, rank: int, size: int) -> bytes:
        path = self._log_path(run_id, attempt, rank)
        try:
            with open(path, "rb") as handle:
                handle.seek(max(0, path.stat().st_size - size))
                return handle.read()
        except OSError:
            return b""

    # --- the store and the event log ---
    def save_run(self, run_id: str, name: str, spec: JobSpecFields, state: str,
                 record: Mapping[str, object]) -> None:
        self.cluster.state.save_run(run_id, name, dict(spec), state, dict(record))

    def checkpoints(self, run_id: str) -> list[CheckpointRow]:
        return self.cluster.state.checkpoints(run_id)

    def add_checkpoint(self, run_id: str, entry: CheckpointEntry) -> None:
        self.cluster.state.add_checkpoint(run_id, entry)

    def remove_checkpoint(self, run_id: str, attempt: int, node: str, path: str) -> None:
        self.cluster.state.remove_checkpoint(run_id, attempt, node, path)

    def event(self, kind: str, message: str, data: Mapping[str, object] | None) -> None:
        self.cluster.record_event(kind, message, data=dict(data) if data else None)

    def record_attempt(self, run_id: str, attempt: int, start_step: int, nodes: list[str],
                       detail: str | None) -> None:
        self.metrics.record_attempt(run_id, attempt, start_step, nodes, detail)

    def record_points(self, run_id: str, points: list[tuple[str, MetricPoint]]) -> None:
        self.metrics.record_points(run_id, points)

    def spawn(self, func: Task, *, name: str) -> None:
        self._spawn(func, name)


def leads_its_own_session(pid: int) -> bool:
    """Whether ``pid`` leads a session (and so a process group) of its own.

    A launcher must: a service manager that stops the daemon signals the daemon's process group
    (launchd without AbandonProcessGroup, a terminal's Ctrl-C), and a job's launcher in that group
    would die with the daemon and take every rank it holds with it; ``stop_launcher`` signals the
    launcher as a group, too. Asked once the launcher has started (Popen returns after its exec, so
    its setsid() has happened); a process that cannot be asked is let be (one already gone, too:
    its exit is reported as the launcher's)."""
    try:
        return os.getsid(pid) == pid
    except (PermissionError, ProcessLookupError):
        return True


async def _quiet(_event: object) -> None:
    return None
