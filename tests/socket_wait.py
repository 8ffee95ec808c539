"""Waiting ranks that sleep: MLX's ring backend on machines that share two cores.

MLX's ring backend (``mlx/distributed/ring/ring.cpp``, ``SocketThread::worker``) waits for a peer by
calling ``recv`` on a non-blocking socket in a loop with nothing in between. On a user's cluster each
rank has its own machine, and the loop spins a core of its own that nothing else wanted. The tests'
nodes share this machine's two cores, so a rank waiting in a collective took the CPU of the rank it
waited for: measured here, one ``all_sum`` a rank waited 6 s in cost it 4.2 s of CPU, and 300 small
``all_sum`` between two ranks took 3.1 ms each, against 1.3 ms with the shim below (4.2 s of CPU a rank
against 0.9 s).

The shim (``LD_PRELOAD``) keeps every call and every result as it was, and only waits: once a thread's
``recv`` has said EAGAIN a thousand times in a row with no byte sent or received in between, each
further EAGAIN first waits up to a millisecond for the socket to become readable. A blocking socket
never says EAGAIN, so nothing else changes. The tests' processes take it (tests/conftest.py), and so
do the multi-host cluster's nodes (its sshd passes it to every session). ``COORD_TEST_RING_SPIN=1``
runs without it. Built once per machine with the system's C compiler; where there is none, the tests
run without it (slower).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>

/* Consecutive EAGAINs of this thread's recv, with nothing sent or received since. */
static __thread unsigned long idle;
static ssize_t (*real_recv)(int, void *, size_t, int);
static ssize_t (*real_send)(int, const void *, size_t, int);

ssize_t recv(int fd, void *buf, size_t len, int flags) {
    if (!real_recv) real_recv = (ssize_t (*)(int, void *, size_t, int))dlsym(RTLD_NEXT, "recv");
    ssize_t got = real_recv(fd, buf, len, flags);
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (++idle > 1000) {
            struct pollfd readable = {fd, POLLIN, 0};
            poll(&readable, 1, 1);
            errno = EAGAIN;
        }
    } else {
        idle = 0;
    }
    return got;
}

ssize_t send(int fd, const void *buf, size_t len, int flags) {
    if (!real_send) real_send = (ssize_t (*)(int, const void *, size_t, int))dlsym(RTLD_NEXT, "send");
    ssize_t sent = real_send(fd, buf, len, flags);
    if (sent > 0) idle = 0;
    return sent;
}
"""

_built: str | None = None


def preload() -> str | None:
    """The shim's path (built on first use, readable by every user), or None: turned off, not Linux, or
    no C compiler."""
    global _built
    if _built is not None:
        return _built or None
    _built = ""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if os.environ.get("COORD_TEST_RING_SPIN") == "1" or os.uname().sysname != "Linux" or compiler is None:
        return None
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:12]
    directory = Path(tempfile.gettempdir()) / f"coord-test-socket-wait-{digest}"
    library = directory / "socket_wait.so"
    if not library.exists():
        directory.mkdir(mode=0o755, exist_ok=True)
        directory.chmod(0o755)  # the nodes' users load it
        partial = directory / f".partial-{os.getpid()}"
        source = directory / f".source-{os.getpid()}.c"
        source.write_text(SOURCE)
        try:
            done = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(source), "-ldl"],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                return None
            partial.chmod(0o755)
            os.replace(partial, library)  # whole or absent, for the other test worker too
        finally:
            source.unlink(missing_ok=True)
            partial.unlink(missing_ok=True)
    _built = str(library)
    return _built
