"""A real local HTTP receiver for webhook tests: http.server in a thread, answering each POST
with the next status of a script (the last one repeats)."""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    statuses: list[int] = field(default_factory=lambda: [200])
    received: list[Received] = field(default_factory=list)
    server: http.server.ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "Receiver":
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with lock:
                    receiver.received.append(Received(self.path, dict(self.headers), body))
                    status = receiver.statuses[min(len(receiver.received), len(receiver.statuses)) - 1]
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        lock = threading.Lock()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def main() -> None:
    """Serve in this process (e.g. under `ip netns exec`, where the daemon's loopback is): the port
    goes to --port-file once listening, each request as one JSON line to --out."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--statuses", default="200", help="comma-separated, one per request; the last repeats")
    args = parser.parse_args()

    def leave(*_) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, leave)
    with Receiver(statuses=[int(s) for s in args.statuses.split(",")]) as receiver:
        with open(args.port_file + ".tmp", "w") as handle:
            handle.write(str(receiver.server.server_address[1]))
        os.replace(args.port_file + ".tmp", args.port_file)  # whole, or not there yet
        written = 0
        while True:
            for request in receiver.received[written:]:
                with open(args.out, "a") as out:
                    out.write(json.dumps({"path": request.path, "headers": request.headers,
                                          "body": request.body.decode(errors="replace")}) + "\n")
                written += 1
            time.sleep(0.1)


if __name__ == "__main__":
    main()
