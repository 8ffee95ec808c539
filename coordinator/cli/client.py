"""Asking coordd from the CLI: where its control socket is, one call over it (with asyncio, or with plain
blocking I/O where start-up time counts), a long call drawn as progress bars, and the exit statuses.

Nothing heavy is imported here: asyncio, the rpc layer and rich are imported by the calls that use them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from coordinator.cli.console import make_console
from coordinator.cli.json_output import print_json

# Not coordinator.config.cluster_file: its dataclasses and checks are a third of a start that every command pays
# (each imports it where it needs the whole file).
from coordinator.control.address import SOCKET_NAME, default_state_dir, socket_from_file

if TYPE_CHECKING:
    from types import TracebackType

    from rich.console import Console

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

# A request's arguments and the daemon's answers are plain data off the wire (msgpack). Each control method's
# answer is declared with its serve_* in coordinator/commands: a caller names it where it takes the answer
# (``doc: StatusDocument = ask_daemon(...)``), and ``streamed`` takes it from the renderer it is given.
Answer = TypeVar("Answer")
OnEvent = Callable[[Any], None]  # gets each event a streaming method sends, as it came


class ProgressDisplay(Protocol):
    """Progress bars drawn from a long call's events (coordinator/cli/progress.py)."""

    def __enter__(self) -> ProgressDisplay: ...

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None: ...

    def update(self, event: Any) -> None: ...


class CliError(Exception):
    def __init__(self, message: str, status: int = EXIT_FAILED):
        super().__init__(message)
        self.status = status


def resolve_socket(args: argparse.Namespace) -> Path:
    """--socket, then COORD_SOCKET, then --config (or COORD_CONFIG), then the default state dir.

    A cluster file's ``[cluster]`` table alone names the socket; the rest of the file is the daemon's
    to check (it did, when it started), so a command still reaches a running daemon while its file is
    being edited."""
    if getattr(args, "socket", None):
        return Path(args.socket)
    if os.environ.get("COORD_SOCKET"):
        return Path(os.environ["COORD_SOCKET"])
    config_path = getattr(args, "config", None) or os.environ.get("COORD_CONFIG")
    if config_path:
        socket = socket_from_file(config_path)
        if socket is not None:
            return socket
        from coordinator.config.cluster_file import ConfigError, load_config

        try:  # the file or its [cluster] table is unusable: the full check says where and why
            return load_config(config_path).socket
        except ConfigError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
    return default_state_dir() / SOCKET_NAME


def ask_daemon(socket: Path, method: str, args: Mapping[str, object] | None = None, *,
               config_hint: str | None = None, timeout: float | None = 30.0, on_event: OnEvent | None = None) -> Any:
    import asyncio

    from coordinator.control.server import DaemonNotRunning, call_daemon
    from shared.rpc import RemoteError

    try:
        return asyncio.run(call_daemon(socket, method, args, timeout=timeout, on_event=on_event))
    except DaemonNotRunning:
        raise _not_running(socket, config_hint) from None
    except RemoteError as exc:
        raise _refused(method, exc.code, exc.message) from None
    except TimeoutError:
        raise CliError(f"coordd did not answer {method} in time on {socket}") from None
    except OSError as exc:  # a socket path that cannot be used ($COORD_SOCKET is not checked by the parser)
        raise CliError(f"cannot reach coordd on {socket}: {exc.strerror or exc}", EXIT_USAGE) from None


def _refused(method: str, code: str, message: str) -> CliError:
    """The daemon's refusal: exit status 2 when what was asked is wrong (the daemon checks what it is
    sent as the CLI does), 1 when it could not be done."""
    from shared import protocol as p

    return CliError(f"coordd refused {method}: {message}", EXIT_USAGE if code == p.BAD_ARGS else EXIT_FAILED)


def _not_running(socket: Path, config_hint: str | None) -> CliError:
    start = f"coord daemon --config {config_hint}" if config_hint else "coord daemon --config CLUSTER.toml"
    return CliError(f"coordd is not running (no daemon answers on {socket}).\n"
                    f"Start it with: {start}\n"
                    f"(or as a service: see deploy/ for launchd and systemd)", EXIT_USAGE)


def ask_daemon_blocking(socket: Path, method: str, args: Mapping[str, object] | None = None, *,
                        config_hint: str | None = None, on_event: OnEvent | None = None) -> Any:
    """One call over the control socket with plain blocking I/O, no event loop (no asyncio to import):
    the same frames as ``call_daemon``, the events of the call passed to ``on_event``, then its result."""
    import socket as sockets

    from shared import protocol as p

    connection = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    try:
        try:
            connection.connect(str(socket))
        except (FileNotFoundError, NotADirectoryError, ConnectionRefusedError):
            raise _not_running(socket, config_hint) from None
        except OSError as exc:
            raise CliError(f"cannot reach coordd on {socket}: {exc.strerror or exc}", EXIT_USAGE) from None
        connection.sendall(p.pack(p.Request(1, method, args or {})))
        stream = connection.makefile("rb")

        def read_exactly(n: int) -> bytes:
            data = stream.read(n)
            if data is None or len(data) < n:
                raise CliError(f"coordd closed the connection during {method} on {socket}")
            return data

        while True:
            length = p.frame_length(read_exactly(p.HEADER.size), p.DEFAULT_MAX_FRAME)
            message = p.unpack(read_exactly(length))
            if isinstance(message, p.Event):
                if on_event is not None and message.id == 1:
                    on_event(message.data)
            elif isinstance(message, p.Result) and message.id == 1:
                return message.value
            elif isinstance(message, p.Error) and message.id in (1, None):
                raise _refused(method, message.code, message.message)
    except p.ProtocolError as exc:
        raise CliError(f"coordd sent a frame that could not be read during {method}: {exc.message}") from None
    finally:
        connection.close()


def streamed(args: argparse.Namespace, method: str, request: Mapping[str, object],
             render: Callable[[Answer, Console], None], progress_class: Callable[[Console], ProgressDisplay], *,
             blocking: bool = False) -> Answer:
    """Call a long daemon method: progress bars from its events, then its report (or --json).

    ``blocking``: over a plain socket (``ask_daemon_blocking``), for the commands whose start-up
    time is part of what they cost (``coord sync`` on an unchanged tree)."""
    socket = resolve_socket(args)
    hint = args.config or os.environ.get("COORD_CONFIG")

    def ask(on_event: OnEvent | None = None) -> Any:
        if blocking:
            return ask_daemon_blocking(socket, method, request, config_hint=hint, on_event=on_event)
        return ask_daemon(socket, method, request, config_hint=hint, timeout=None, on_event=on_event)

    if args.json:
        report = ask()
        print_json(report)
        return report
    console = make_console()
    with progress_class(console) as progress:
        report = ask(progress.update)
    render(report, console)
    return report
