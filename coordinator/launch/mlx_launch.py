"""``python -m coordinator.launch.mlx_launch [mlx.launch options]``: mlx.launch without its busy loops.

mlx.launch relays each rank's output from a thread that waits in ``select()`` with
the rank's stdin pipe in the write set. A pipe with room is always writable, so
every one of those threads spins; its main loop spins as well when its own stdin
is at EOF, as it is under a daemon. In ``bench/launcher_cpu.py`` (two local ring
ranks on 2 cores) stock mlx.launch used 11.8 s of CPU for a 12 s job and this
launcher 0.1 s, and the ranks ran 1.96x faster: on a Mac that is both the head
and rank 0, that core is taken from training.

coord never writes to a rank's stdin, so this runs mlx.launch's own ``main()``
(hostfile, backends, environment: all mlx's) with a ``select()`` that waits on
reads only, and a stdin that never becomes readable. Where mlx's launcher
module has another shape, it runs unchanged.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import select
import shutil
import sys
from collections.abc import Iterable
from typing import Any

_LAUNCH_MODULE = "mlx._distributed_utils.launch"


def _reads_only(rlist: Iterable[Any], wlist: Iterable[Any], xlist: Iterable[Any],
                timeout: float | None = None) -> tuple[list[Any], list[Any], list[Any]]:  # select.select's own types
    """select() as mlx.launch calls it, without the write set coord never uses."""
    readable, _, exceptional = select.select(rlist, [], xlist, timeout)
    return readable, [], exceptional


def _stdin_that_never_reads() -> int:
    """Point fd 0 at a pipe whose write end this process holds open and never writes to."""
    read_end, write_end = os.pipe()
    os.dup2(read_end, 0)
    os.close(read_end)
    return write_end


def find_launcher() -> tuple[str, ...] | None:
    """The command that starts mlx.launch: this module under the daemon's own Python when
    that Python has mlx's launcher, else the ``mlx.launch`` found on PATH; None when there
    is neither. Looked up afresh each time: mlx may have been installed since coordd started."""
    if _LAUNCH_MODULE not in sys.modules:
        importlib.invalidate_caches()
    try:
        found = importlib.util.find_spec(_LAUNCH_MODULE) is not None
    except ImportError:
        found = False
    if found:
        return (sys.executable, "-m", __name__)
    on_path = shutil.which("mlx.launch")
    return (on_path,) if on_path else None


#: Where each attempt's ring ports are drawn from: above the usual services, below every usual
#: ephemeral range (Linux gives outgoing connections 32768-60999, macOS 49152-65535): a port an
#: outgoing connection holds, an earlier attempt's ranks' own included, would fail the bind
#: ("Couldn't bind socket") and burn a restart.
RING_PORTS = (20000, 32768)
RING_PORTS_WIDTH = 256  # ports one attempt may use: one per rank, IP and connection


def ring_starting_port(run_id: str, attempt: int) -> int:
    """This attempt's own base port for the ranks' connections (``mlx.launch --starting-port``).

    mlx.launch's default (32323) is the same for every job: two jobs whose ranks share a machine
    (local nodes, two people's runs on one Mac) would connect to each other's ranks and sum each
    other's gradients, a wrong answer nobody sees. Drawn from the run id and the attempt, it is
    stable across a daemon restart, and a new attempt never waits on the last one's sockets."""
    digest = hashlib.sha256(f"{run_id}:{attempt}".encode()).digest()
    span = RING_PORTS[1] - RING_PORTS[0] - RING_PORTS_WIDTH
    return RING_PORTS[0] + int.from_bytes(digest[:4], "big") % span


def launcher_argv() -> tuple[str, ...]:
    """find_launcher()'s command, or a bare ``mlx.launch`` whose absence the launch reports
    (pre-flight's ``launcher.head`` check says so, with the fix, before that)."""
    return find_launcher() or ("mlx.launch",)


def main() -> int:
    from mlx._distributed_utils import launch

    if callable(getattr(launch, "select", None)):
        launch.select = _reads_only
        keep_open = _stdin_that_never_reads()  # noqa: F841 (held until exit)
    sys.argv[0] = "mlx.launch"
    result = launch.main()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
