"""``python -m agent``: serve the coord protocol on stdin/stdout, logs on stderr."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys

# An installed bundle carries a pure-Python msgpack for nodes whose Python lacks one;
# the node's own msgpack, when present, is preferred.
try:
    import msgpack  # noqa: F401 - imported only to learn whether this Python has one
except ImportError:
    sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_vendor"))

# coord's own modules only once the vendored msgpack can be found (shared imports it).
from shared.log import configure_json_logging


async def serve_stdio() -> None:
    from agent.server import serve

    loop = asyncio.get_running_loop()
    # The protocol gets a private copy of fd 1; fd 1 itself now points at stderr,
    # so a stray print() from any library cannot corrupt the frame stream.
    protocol_out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    reader = asyncio.StreamReader(limit=2**20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, protocol_out)
    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
    await serve(reader, writer, name="agent")


def main() -> None:
    configure_json_logging(level=os.environ.get("COORD_AGENT_LOG_LEVEL", "info"))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_stdio())


if __name__ == "__main__":
    main()
