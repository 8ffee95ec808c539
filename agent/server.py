"""The agent's method table, served over any framed stream (stdio, SSH, a test pipe)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import asyncio
from shared import protocol as p
from shared.rpc import Dispatcher, Peer, Reader, RemoteError, Writer
from shared.version import COORD_VERSION

from agent import facts as node_facts


def bundle_id() -> str:
    """The digest of the installed bundle this agent runs from ("source" in a checkout)."""
    marker = Path(__file__).resolve().parent.parent / "BUNDLE_ID"
    try:
        return marker.read_text().strip() or "source"
    except OSError:
        return "source"


async def hello(protocol: int, client: str = "") -> dict[str, Any]:
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


async def facts(workdir: str | None = None) -> dict[str, Any]:
    if workdir is not None and not os.path.isabs(workdir):
        raise RemoteError(p.BAD_ARGS, f"workdir must be an absolute path, got {workdir!r}")
    # Facts run commands (system_profiler can take seconds): keep the loop free for pings.
    return await asyncio.to_thread(node_facts.collect_facts, workdir)


async def ping() -> dict[str, Any]:
    return {"time": time.time()}


def build_dispatcher() -> Dispatcher:
    table = Dispatcher()
    table.add("hello", hello, required={"protocol": int}, optional={"client": str})
    table.add("facts", facts, optional={"workdir": (str, type(None))})
    table.add("ping", ping)
    return table


async def serve(reader: Reader, writer: Writer, *, name: str = "agent") -> None:
    """Serve the agent's methods until the other side hangs up."""
    peer = Peer(reader, writer, dispatcher=build_dispatcher(), name=name)
    await peer.run()
