"""The agent's method table, served over any framed stream (stdio, SSH, a test pipe)."""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from agent import facts as node_facts
from agent import launch as node_launch
from agent import process_end, upkeep
from agent import ranks as node_ranks
from agent import sync as node_sync
from shared import protocol as p
from shared.rpc import ArgType, Dispatcher, Emit, Peer, Reader, RemoteError, Writer
from shared.version import COORD_VERSION

if TYPE_CHECKING:
    from agent.link_probe import LinkProbes
    from agent.relay import Relay
    from agent.rendezvous import Rendezvous
    from shared.agent_api.calibration import CalibrationProgress, CalibrationReply
    from shared.agent_api.facts import FactsReply
    from shared.agent_api.link import LinkMeasureReply
    from shared.agent_api.ranks import RankStatusReply
    from shared.agent_api.session import HeartbeatEvent, HelloReply, PingReply
    from shared.agent_api.torch import TorchFactsReply

Reply = TypeVar("Reply")
STATUS_CHECK_S = 0.1  # how often a waiting status request looks whether its rank has ended, without exit events
RECHECK_S = 1.0  # how often it looks anyway, with them
MAX_STATUS_WAIT_S = 10.0  # the longest a status request waits, whatever it asks


#: (module, function) of every method imported at its first call: a test imports each.
LATER: list[tuple[str, str]] = []


def _later(module: str, name: str) -> Callable[..., Any]:
    """``agent.<module>.<name>``, its module imported at the first call. A session's start imports only
    what every session uses (facts, sync, ranks); the rest (the relay, link probes, drills, topology,
    calibration) waits until asked. Each node's agent starts with each daemon start, and at a hundred
    nodes those starts are most of a restart's time (bench/scale.py)."""
    if (module, name) not in LATER:
        LATER.append((module, name))

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(f"agent.{module}"), name)(*args, **kwargs)

    return call


class SessionParts:
    """A session's stateful parts (the relay's transfers, the probes' listeners), each made, its module
    imported, when first used; ``close_all`` ends those that were."""

    def __init__(self, relay: Relay | None = None, rendezvous: Rendezvous | None = None,
                 links: LinkProbes | None = None) -> None:
        self._relay, self._rendezvous, self._links = relay, rendezvous, links
        self.peer: Peer | None = None  # the session's connection, once made

    def quiet_for(self) -> float:
        """Seconds since this session last sent the head a frame (its heartbeat's business)."""
        return time.monotonic() - self.peer.last_sent if self.peer is not None else float("inf")

    def relay(self) -> Relay:
        if self._relay is None:
            from agent.relay import Relay

            self._relay = Relay()
        return self._relay

    def rendezvous(self) -> Rendezvous:
        if self._rendezvous is None:
            from agent.rendezvous import Rendezvous

            self._rendezvous = Rendezvous()
        return self._rendezvous

    def links(self) -> LinkProbes:
        if self._links is None:
            from agent.link_probe import LinkProbes

            self._links = LinkProbes()
        return self._links

    async def close_all(self) -> None:
        # No half-received file outlives the session that asked for it, nor a probe's listener.
        for part in (self._relay, self._rendezvous, self._links):
            if part is not None:
                await part.close_all()


def bundle_id() -> str:
    """The digest of the installed bundle this agent runs from ("source" in a checkout)."""
    marker = Path(__file__).resolve().parent.parent / "BUNDLE_ID"
    try:
        return marker.read_text().strip() or "source"
    except OSError:
        return "source"


async def hello(protocol: int, client: str = "") -> HelloReply:
    if protocol != p.PROTOCOL_VERSION:
        raise RemoteError(p.PROTOCOL_MISMATCH,
                          f"agent speaks protocol {p.PROTOCOL_VERSION}, caller speaks {protocol}")
    return {
        "protocol": p.PROTOCOL_VERSION,
        "agent_version": COORD_VERSION,
        "bundle": bundle_id(),
        "pid": os.getpid(),
        "python": sys.executable,
    }


async def facts(workdir: str | None = None) -> FactsReply:
    if workdir is not None and not os.path.isabs(workdir):
        raise RemoteError(p.BAD_ARGS, f"workdir must be an absolute path, got {workdir!r}")
    # Facts run commands (system_profiler can take seconds): keep the loop free for heartbeats.
    return await asyncio.to_thread(node_facts.collect_facts, workdir)


async def ping() -> PingReply:
    return {"time": time.time()}


async def heartbeat(emit: Emit, interval: float, quiet_for: Callable[[], float]) -> None:
    """A beat every ``interval`` s in which this agent sent the head nothing else, until the session ends:
    the head's watch of this agent (any frame from it proves it alive). One message a beat where a ping
    and its answer were two, and none while a job's polls are answered (at a hundred nodes, the watch was
    most of an idle head's messages)."""
    interval = min(max(float(interval), 0.2), 60.0)
    while True:
        if quiet_for() >= interval * 0.9:  # a frame that went just under an interval ago still counts
            beat: HeartbeatEvent = {"time": time.time()}
            await emit(beat)
        await asyncio.sleep(interval)


def _in_thread(func: Callable[..., Reply]) -> Callable[..., Awaitable[Reply]]:
    """Disk work runs off the event loop, so heartbeats go on during a long hash."""

    async def call(**args: Any) -> Reply:
        return await asyncio.to_thread(func, **args)

    return call


async def rank_status(workdir: str, job: str, attempt: int, rank: int, progress_offset: int = 0,
                      log_offset: int = -1, wait_s: float = 0.0) -> RankStatusReply:
    """A rank's status; with ``wait_s``, not before that many seconds have passed or the rank has
    ended, whichever is first. The daemon's watch then costs one call per rank every few seconds,
    while a rank's end is still seen at once: the kernel says when its runner exits."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(max(float(wait_s), 0.0), MAX_STATUS_WAIT_S)
    while loop.time() < deadline and not node_ranks.rank_ended(workdir, job, attempt, rank):
        runner = node_ranks.runner_pid(workdir, job, attempt, rank)
        left = deadline - loop.time()
        # The runner writes the exit status and then exits, so its end is the rank's end. A look
        # every second besides covers what an exit event cannot (a pid reused, a runner killed
        # before it wrote its pid); without such events, a look every tenth of a second.
        watched = await process_end.wait_exit(runner, min(left, RECHECK_S)) if runner is not None else None
        if watched is None:
            await asyncio.sleep(min(left, STATUS_CHECK_S))
    return await asyncio.to_thread(node_ranks.rank_status, workdir, job, attempt, rank, progress_offset, log_offset)


def _of(method: Callable[[], Callable[..., Awaitable[Any]]]) -> Callable[..., Awaitable[Any]]:
    """A session part's method, the part made (its module imported) at the first call."""

    def call(**args: Any) -> Awaitable[Any]:
        return method()(**args)

    return call


def build_dispatcher(parts: SessionParts | None = None, uploads: node_sync.Uploads | None = None) -> Dispatcher:
    table = Dispatcher()
    parts = parts or SessionParts()
    uploads = uploads or node_sync.Uploads()
    table.add("hello", hello, required={"protocol": int}, optional={"client": str})
    table.add("facts", facts, optional={"workdir": (str, type(None))})
    table.add("ping", ping)
    table.add("heartbeat", lambda emit, interval: heartbeat(emit, interval, parts.quiet_for),
              required={"interval": (int, float)}, streams=True)
    table.add("usage", _in_thread(_later("usage", "collect_usage")))

    table.add("manifest", _in_thread(node_sync.describe), required={"root": str, "patterns": list})
    table.add("put_files", _in_thread(node_sync.put_files), required={"root": str, "batch": dict})
    table.add("put_links", _in_thread(_later("sync_links", "put_links")), required={"root": str, "links": list})
    table.add("sync_state", _in_thread(node_sync.sync_state), required={"root": str, "patterns": list},
              optional={"known": (list, type(None))})
    table.add("upload_begin", _in_thread(uploads.begin),
              required={"root": str, "path": str, "size": int, "mode": int, "sha256": str})
    table.add("upload_chunk", _in_thread(uploads.chunk), required={"upload": int, "offset": int, "data": bytes})
    table.add("upload_finish", _in_thread(uploads.finish), required={"upload": int})
    table.add("upload_abort", _in_thread(uploads.abort_reply), required={"upload": int})
    table.add("delete_files", _in_thread(node_sync.delete_files), required={"root": str, "paths": list})
    table.add("set_modes", _in_thread(node_sync.set_modes), required={"root": str, "modes": list})
    table.add("make_dirs", _in_thread(_later("sync_dirs", "make_dirs")), required={"root": str, "dirs": list})
    table.add("remove_dirs", _in_thread(_later("sync_dirs", "remove_dirs")), required={"root": str, "paths": list})
    table.add("inspect_files", _in_thread(node_sync.inspect_files), required={"root": str, "paths": list},
              optional={"count_lines": bool})
    table.add("relay_receive", _of(lambda: parts.relay().open_receiver),
              required={"transfer": str, "token": str, "root": str, "path": str, "size": int, "mode": int,
                        "sha256": str, "chunk_bytes": int, "chunks": list})
    table.add("relay_source", _of(lambda: parts.relay().open_source),
              required={"transfer": str, "token": str, "workdir": str, "path": str, "size": int, "sha256": str},
              optional={"chunk_bytes": int})
    table.add("relay_forward", _of(lambda: parts.relay().forward), required={"transfer": str, "targets": list})
    table.add("relay_wait", _of(lambda: parts.relay().wait), required={"transfer": str},
              optional={"timeout": (int, float), "have": int})
    table.add("relay_close", _of(lambda: parts.relay().close), required={"transfer": str})
    table.add("topology", _in_thread(_later("topology", "collect_topology")))
    table.add("check_writable", _in_thread(node_sync.check_writable), required={"root": str, "subdir": str})
    table.add("prepare_rank", _in_thread(node_launch.prepare_rank),
              required={"job": str, "rank": int, "workdir": str, "python": str, "argv": list, "env": dict},
              optional={"attempt": int, "pass_output": bool, "files": dict, "free_ports": list})
    rank: dict[str, ArgType] = {"workdir": str, "job": str, "attempt": int, "rank": int}
    table.add("start_rank", _in_thread(node_launch.start_rank), required=rank, optional={"standby": bool})
    table.add("retire_standbys", _in_thread(node_launch.retire_standbys), required={"workdir": str, "job": str})
    table.add("rank_status", rank_status, required=rank,
              optional={"progress_offset": int, "log_offset": int, "wait_s": (int, float)})
    table.add("read_log", _in_thread(node_ranks.read_log), required=rank, optional={"offset": int})
    table.add("dump_stacks", _in_thread(node_ranks.dump_stacks), required=rank)
    table.add("rank_signals", _in_thread(_later("rank_signals", "rank_signals")), required=rank,
              optional={"seconds": (int, float)})
    table.add("stop_rank", _in_thread(node_ranks.stop_rank), required=rank, optional={"grace": (int, float)})
    table.add("signal_rank", _in_thread(_later("drill", "signal_rank")), required={**rank, "fault": str})
    table.add("remove_run", _in_thread(_later("drill", "remove_run")), required={"workdir": str, "job": str},
              optional={"tree": str})
    table.add("cut_link", _in_thread(_later("drill", "cut_link")), required={"host": str, "seconds": (int, float)})
    # The checkpoint upkeep of a training job, at the lower priority of agent/upkeep.py.
    table.add("list_checkpoints", upkeep.in_upkeep(node_ranks.list_checkpoints),
              required={"workdir": str, "job": str, "attempt": int}, optional={"known": list})
    table.add("remove_checkpoints", upkeep.in_upkeep(node_ranks.remove_checkpoints),
              required={"workdir": str, "job": str, "attempt": int, "names": list}, optional={"replica": bool})
    table.add("hash_file", _in_thread(node_ranks.hash_file), required={"workdir": str, "path": str})
    table.add("checkpoint_files", upkeep.in_upkeep(node_ranks.checkpoint_files), required={"workdir": str, "path": str})
    table.add("read_file", upkeep.in_upkeep(node_ranks.read_file), required={"workdir": str, "path": str},
              optional={"offset": int})
    table.add("store_put", _later("store_put", "put_parts"),
              required={"workdir": str, "path": str, "sha256": str, "parts": list},
              optional={"bandwidth": (int, float, type(None))})
    table.add("torch_facts", torch_facts, required={"python": str})
    table.add("rendezvous_listen", _of(lambda: parts.rendezvous().listen), required={"port": int, "token": str},
              optional={"seconds": (int, float)})
    table.add("rendezvous_connect", _of(lambda: parts.rendezvous().connect),
              required={"host": str, "port": int, "token": str},
              optional={"timeout": (int, float)})
    table.add("rendezvous_close", _of(lambda: parts.rendezvous().close), required={"port": int})
    table.add("link_listen", _of(lambda: parts.links().listen), required={"address": str, "token": str},
              optional={"seconds": (int, float)})
    table.add("link_measure", _in_thread(_measure_link),
              required={"host": str, "port": int, "token": str, "bytes": int},
              optional={"source": (str, type(None)), "seconds": (int, float), "pings": int})
    table.add("link_close", _of(lambda: parts.links().close), required={"port": int})
    table.add("link_route", _in_thread(_later("link_probe", "link_route")), required={"address": str},
              optional={"interface": (str, type(None))})
    table.add("calibrate", calibrate, required={"python": str, "workdir": str},
              optional={"quick": bool, "timeout": (int, float)}, streams=True)
    return table


def _measure_link(**args: Any) -> LinkMeasureReply:
    size = args.pop("bytes")  # the wire's name; not the builtin's
    from agent.link_probe import measure

    return measure(size=size, **args)


async def torch_facts(python: str) -> TorchFactsReply:
    """A PyTorch job's facts of this node, with ``python`` the interpreter its ranks run (never imported here)."""
    if not python or "\0" in python:
        raise RemoteError(p.BAD_ARGS, f"python must name an interpreter, got {python!r}")
    from agent.torch_facts import collect_torch_facts

    return await asyncio.to_thread(collect_torch_facts, python)


async def calibrate(emit: Emit, python: str, workdir: str, quick: bool = False,
                    timeout: float = 600) -> CalibrationReply:
    """Measure this node with its training Python, in a child process; progress goes out as events."""
    if not os.path.isabs(workdir):
        raise RemoteError(p.BAD_ARGS, f"workdir must be an absolute path, got {workdir!r}")
    loop = asyncio.get_running_loop()
    # MLX's CPU backend compiles kernels under $TMPDIR; users sharing a machine must not share it.
    tmpdir = os.path.join(workdir, ".coord", "tmp", "calibrate")
    os.makedirs(tmpdir, exist_ok=True)

    def forward(progress: CalibrationProgress) -> None:
        asyncio.run_coroutine_threadsafe(emit(progress), loop)

    from agent.calibration_runner import run_calibration

    return await asyncio.to_thread(run_calibration, python, quick=quick, timeout=timeout, on_progress=forward,
                                   env={"TMPDIR": tmpdir})


async def serve(reader: Reader, writer: Writer, *, name: str = "agent") -> None:
    """Serve the agent's methods until the other side hangs up."""
    parts = SessionParts()
    uploads = node_sync.Uploads()
    peer = Peer(reader, writer, dispatcher=build_dispatcher(parts, uploads), name=name)
    parts.peer = peer
    try:
        await peer.run()
    finally:
        # No half-received file outlives the session that asked for it, nor holds a descriptor, nor
        # a probe's listener.
        await parts.close_all()
        uploads.abort_all()
