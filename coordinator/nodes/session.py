"""One node as the daemon sees it: connect, install the agent if needed, handshake, watch.

A session runs forever: it connects (SSH or local), starts the agent with the
node's own Python, checks the protocol in ``hello``, fetches the node's facts
and then watches the agent's heartbeat. Whatever ends that (a dead agent, a cut link, a host
key nobody trusted yet) marks the node down with the reason, and tenacity
reconnects with exponential backoff capped at 30 s.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

import anyio
import structlog
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from coordinator.config.cluster_file import NodeConfig, SshSettings
from coordinator.nodes.agent_bundle import NOT_INSTALLED, AgentBundle
from coordinator.nodes.transport import (
    AgentProcess,
    LineReader,
    LocalTransport,
    NodeUnreachable,
    SshTransport,
    Transport,
)
from shared import protocol as p
from shared.rpc import ConnectionLost, Peer, RemoteError

CONNECTING, INSTALLING, UP, DOWN = "connecting", "installing", "up", "down"
HELLO_TIMEOUT_S = 30.0
FACTS_TIMEOUT_S = 90.0
MAX_BACKOFF_S = 30.0

log = structlog.get_logger("node")

OnChange = Callable[["NodeSession", str, str | None], Awaitable[None] | None]
Connect = Callable[[NodeConfig, SshSettings], Awaitable[Transport]]
#: A node's facts as its agent reported them (agent/facts.py): free-form (what a node can tell
#: depends on its OS, its Python and its mlx), so every reader takes the keys it needs with .get.
Facts = dict[str, Any]


class AgentHello(TypedDict):
    """The agent's answer to ``hello`` (agent/server.py)."""

    protocol: int
    agent_version: str
    bundle: str
    pid: int
    python: str


class NodeViewDict(TypedDict):
    """``NodeView.as_dict``: a node as status and the checks see it."""

    name: str
    address: str
    state: str
    reason: str | None
    facts: Facts | None
    agent: AgentHello | None
    last_seen: float | None
    since: float


async def open_transport(node: NodeConfig, ssh: SshSettings) -> Transport:
    if node.is_local:
        return LocalTransport()
    return await SshTransport.connect(node, ssh)


class Backoff:
    """The sleeps between reconnect tries, shared by a cluster's sessions: any of them cut short when
    another node comes back. A head whose own network was down sees every session fail and back off
    (up to 30 s); once one node is reached again the path is likely back for all, and the others try
    at once instead of sleeping out their backoff (docs/recovery.md, a head that loses its path)."""

    def __init__(self) -> None:
        self._back: anyio.Event | None = None  # made in the event loop, by the first sleep

    def node_back(self) -> None:
        if self._back is not None:
            self._back.set()
            self._back = None

    async def sleep(self, seconds: float) -> None:
        if self._back is None:
            self._back = anyio.Event()
        back = self._back
        with anyio.move_on_after(seconds):
            await back.wait()


class NodeDown(RemoteError):
    def __init__(self, node: str, reason: str | None):
        super().__init__(p.CONNECTION_LOST, f"node {node} is not up" + (f": {reason}" if reason else ""))


@dataclass
class NodeView:
    """What status shows of a node: plain data, safe to send over the wire."""

    name: str
    address: str
    state: str
    reason: str | None = None
    facts: Facts | None = None
    agent: AgentHello | None = None
    last_seen: float | None = None
    since: float = field(default_factory=time.time)

    def as_dict(self) -> NodeViewDict:
        return {"name": self.name, "address": self.address, "state": self.state, "reason": self.reason,
                "facts": self.facts, "agent": self.agent, "last_seen": self.last_seen, "since": self.since}


class NodeSession:
    def __init__(self, node: NodeConfig, ssh: SshSettings, bundle: AgentBundle, *,
                 on_change: OnChange | None = None, connect: Connect = open_transport,
                 backoff: Backoff | None = None) -> None:
        self.node = node
        self.backoff = backoff or Backoff()
        self.ssh = ssh
        self.bundle = bundle
        self.view = NodeView(node.name, node.address, CONNECTING)
        self.generation = 0  # counts the sessions that came up: a new one is a node that came back
        self._on_change = on_change
        self._connect = connect
        self._peer: Peer | None = None
        self.peer_address: str | None = None  # the address the head reached the node at, while connected
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=20)
        self.log = log.bind(node=node.name)

    @property
    def state(self) -> str:
        return self.view.state

    async def call(self, method: str, args: Mapping[str, object] | None = None, *, timeout: float | None = None,
                   on_event: Callable[[Any], Any] | None = None) -> Any:
        """Call the node's agent; fails at once with NodeDown when the node is not up.

        ``args`` and the answer are the agent method's own (agent/server.py declares each one's
        arguments), plain data either way."""
        peer = self._peer
        if peer is None or self.view.state != UP:
            raise NodeDown(self.node.name, self.view.reason)
        return await peer.call(method, args, timeout=timeout, on_event=on_event)

    async def run(self) -> None:
        """Keep the node connected until cancelled."""
        while True:
            retrying = AsyncRetrying(
                retry=retry_if_exception_type(NodeUnreachable),
                wait=wait_exponential(multiplier=0.5, min=0.5, max=MAX_BACKOFF_S),
                before_sleep=self._log_retry,
                sleep=self.backoff.sleep,  # cut short when another node comes back
                reraise=True,
            )
            async for attempt in retrying:
                with attempt:
                    await self._session_once_guarded()
            # A session that was up ended: reconnect at once with a fresh backoff.
            await anyio.sleep(0.2)

    async def _log_retry(self, state: RetryCallState) -> None:
        wait = state.next_action.sleep if state.next_action else 0
        self.log.info("reconnecting", attempt=state.attempt_number, wait_s=round(wait, 2), reason=self.view.reason)

    async def _set(self, state: str, reason: str | None = None) -> None:
        if state == self.view.state and reason == self.view.reason:
            return
        self.view.state, self.view.reason, self.view.since = state, reason, time.time()
        self.log.info("node state", state=state, reason=reason)
        if self._on_change is not None:
            outcome = self._on_change(self, state, reason)
            if outcome is not None:
                await outcome

    async def _session_once_guarded(self) -> None:
        # The edge of a node's life: a bug or surprise here marks the node down and is
        # retried, instead of taking the daemon (and every other node) with it.
        try:
            await self._session_once()
        except NodeUnreachable:
            raise
        except Exception as exc:
            self.log.exception("node session failed")
            reason = f"internal error: {exc.__class__.__name__}: {exc}"
            await self._set(DOWN, reason)
            raise NodeUnreachable(reason) from None

    async def _session_once(self) -> None:
        """Connect and serve until lost. Raises NodeUnreachable if never up; returns after an up period."""
        if self.view.state != DOWN:
            await self._set(CONNECTING, self.view.reason)
        try:
            transport = await self._connect(self.node, self.ssh)
        except NodeUnreachable as exc:
            await self._set(DOWN, exc.reason)
            raise
        was_up = False
        self.peer_address = getattr(transport, "peer_address", None)
        try:
            was_up = await self._run_agent(transport)
        except NodeUnreachable as exc:
            await self._set(DOWN, exc.reason)
            if not was_up:
                raise
        finally:
            self._peer = None
            with anyio.move_on_after(5, shield=True):
                await transport.close()

    async def _run_agent(self, transport: Transport) -> bool:
        """Start the agent and serve it; install the bundle first when the node lacks it."""
        command = self.bundle.start_command(self.node.python)
        for _ in range(2):
            proc = await transport.start(command)
            up = await self._serve_agent(proc)
            if up is not None:
                return up
            await self._install(transport)
        raise NodeUnreachable(f"agent {self.bundle.bundle_id} still missing after installing it")

    async def _serve_agent(self, proc: AgentProcess) -> bool | None:
        """Handshake and watch; True after an up period, None when the bundle is not installed."""
        peer = Peer(proc.reader, proc.writer, name=self.node.name, log=self.log)
        lost_reason = "agent connection closed"
        up = False
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._pump_stderr, proc.stderr)

                async def serve_peer() -> None:
                    await peer.run()
                    tasks.cancel_scope.cancel()

                tasks.start_soon(serve_peer)
                try:
                    await self._handshake(peer)
                    up = True
                    lost_reason = await self._watch(peer)
                except (ConnectionLost, TimeoutError) as exc:
                    lost_reason = str(exc) or "agent did not answer"
                except RemoteError as exc:
                    lost_reason = f"agent refused: {exc.message}"
                tasks.cancel_scope.cancel()
        finally:
            # Also on cancellation (daemon shutdown): no agent outlives its session.
            self._peer = None
            proc.terminate()
        status = None
        with anyio.move_on_after(2, shield=True):
            status = await proc.wait()
        if up:
            # Report the loss, but return normally so the caller reconnects with a fresh backoff.
            await self._set(DOWN, f"lost: {lost_reason}")
            return True
        if status == NOT_INSTALLED:
            return None
        tail = list(self._stderr_tail)[-1:] if self._stderr_tail else []
        raise NodeUnreachable(_agent_start_failure(self.node, status, lost_reason, tail))

    async def _install(self, transport: Transport) -> None:
        await self._set(INSTALLING, f"installing agent {self.bundle.bundle_id}")
        result = await transport.run(self.bundle.install_command(self.node.python), input=self.bundle.data)
        if result.exit_status != 0:
            err = result.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
            raise NodeUnreachable(_agent_start_failure(self.node, result.exit_status, "install failed", err,
                                                       installing=True))
        self.log.info("agent installed", bundle=self.bundle.bundle_id)
        await self._set(CONNECTING, None)

    async def _handshake(self, peer: Peer) -> None:
        hello = await peer.call("hello", {"protocol": p.PROTOCOL_VERSION, "client": "coordd"}, timeout=HELLO_TIMEOUT_S)
        if hello.get("bundle") not in (self.bundle.bundle_id, "source"):
            self.log.warning("agent bundle differs", expected=self.bundle.bundle_id, got=hello.get("bundle"))
        facts = await peer.call("facts", {"workdir": self.node.workdir}, timeout=FACTS_TIMEOUT_S)
        self.view.agent = hello
        self.view.facts = facts
        self.view.last_seen = time.time()
        self._peer = peer
        self.generation += 1
        await self._set(UP, None)

    async def _watch(self, peer: Peer) -> str:
        """Watch the agent until it falls silent; returns why. The agent pushes a beat every ``keepalive_s``
        in which it sent nothing else (one message a beat where a ping and its answer were two, and none
        while a job's polls are answered); any frame from it proves it alive. Nothing for three intervals
        (3 s at least) is a lost agent, as an unanswered ping was."""
        interval = self.ssh.keepalive_s
        timeout = max(3.0, 3 * interval)
        ended: list[RemoteError] = []  # the heartbeat call's end: the connection lost (it never answers)

        async def beats() -> None:
            try:
                await peer.call("heartbeat", {"interval": interval})
            except RemoteError as exc:
                ended.append(exc)
            else:
                ended.append(RemoteError(p.INTERNAL, "the agent ended its heartbeat"))

        reason = ""
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(beats)
            while not reason:
                await anyio.sleep(interval)
                if ended:
                    reason = ended[0].message
                elif time.monotonic() - peer.last_received >= timeout:
                    reason = f"agent sent nothing for {timeout:g} s (no heartbeat, no answer)"
                else:
                    self.view.last_seen = time.time()
            tasks.cancel_scope.cancel()
        return reason

    async def _pump_stderr(self, stream: LineReader) -> None:
        """Forward the agent's log lines into ours, keeping the last few for error reports."""
        try:
            while True:
                line = await stream.readline()
                if not line:
                    return
                text = line.decode("utf-8", "replace").rstrip() if isinstance(line, bytes) else str(line).rstrip()
                if text:
                    self._stderr_tail.append(text[:500])
                    self.log.debug("agent stderr", line=text[:2000])
        except Exception:  # the stream went away with the agent
            return


def _agent_start_failure(node: NodeConfig, status: int | None, reason: str, stderr_tail: list[str], *,
                         installing: bool = False) -> str:
    last = stderr_tail[-1] if stderr_tail else ""
    what = "installing the agent" if installing else "starting the agent"
    if status == 127 or "not found" in last or "No such file" in last:
        return (f"{what} failed: the node's Python {node.python} was not found; "
                f"set nodes.python for {node.name} to a Python with mlx and mlx-lm")
    detail = f"exit status {status}" if status is not None else reason
    return f"{what} failed ({detail}): {last or reason}"
