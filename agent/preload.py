"""``python -m agent.preload --module MODULE --ack-fd N``: a launcher module imported ahead of its run.

A torch launcher (torchrun, Accelerate, DeepSpeed) imports torch before it starts a worker, and the
worker imports it again: on a relaunch that is two imports in a row on every node, seconds each.
The standby runner (``agent.standby_runner``) starts this process while the job trains: it imports
the launcher's module in a thread of the lowest priority (SCHED_IDLE on Linux, background QoS on
macOS), so the training loses nothing to it, and waits. When coord relaunches the job, the go
line on stdin says where and how to run, and the module runs as ``python -m MODULE`` would have run
it: same interpreter, same arguments, same environment and working directory, and the workers it
starts are this process's children at normal priority (only the importing thread was lowered).

The ack descriptor says ``ready`` once the import is done, then ``ok`` (about to run) or ``stale``
(the module's files changed since they were imported, or the import failed: the runner starts the
rank cold instead). Stdlib only: it runs with the node's Python.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import runpy
import sys
import tempfile
import threading


def lower_this_thread() -> None:
    """The calling thread, and only it, at the lowest priority there is (it takes a core no one else wants)."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):  # Linux: per thread
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    if sys.platform == "darwin":
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            QOS_CLASS_BACKGROUND = 0x09  # <sys/qos.h>
            ctypes.CDLL(None).pthread_set_qos_class_self_np(QOS_CLASS_BACKGROUND, 0)


def file_keys(module: str) -> dict[str, tuple[int, int, int]]:
    """(inode, mtime, size) of the files of ``module`` and its top-level package: a reinstall
    replaces them, which makes an import kept since then stale."""
    keys: dict[str, tuple[int, int, int]] = {}
    for name in {module, module.split(".")[0]}:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            with contextlib.suppress(OSError):
                info = os.stat(path)
                keys[path] = (info.st_ino, info.st_mtime_ns, info.st_size)
    return keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agent.preload")
    parser.add_argument("--module", required=True)
    parser.add_argument("--ack-fd", type=int, required=True)
    args = parser.parse_args(argv)
    ack = os.fdopen(args.ack_fd, "w", buffering=1)
    imported: list[dict[str, tuple[int, int, int]]] = []

    def load() -> None:
        lower_this_thread()
        try:
            importlib.import_module(args.module)
        except BaseException as exc:  # said as stale at go: the rank starts cold and fails there, if it must
            print(f"coord: preloading {args.module} failed: {exc!r}", file=sys.stderr, flush=True)
            return
        imported.append(file_keys(args.module))
        with contextlib.suppress(OSError):
            ack.write("ready\n")

    loader = threading.Thread(target=load, name="preload", daemon=True)
    loader.start()
    line = sys.stdin.buffer.readline()
    if not line:
        return 0  # the runner went away before a go: nothing to run
    go = json.loads(line)
    loader.join()
    if not imported or imported[0] != file_keys(args.module):
        ack.write("stale\n")
        return 75  # EX_TEMPFAIL: the runner starts the rank cold
    # As ``python -m MODULE`` in the rank's script: its directory, environment and arguments.
    os.chdir(go["cwd"])
    os.environ.clear()
    os.environ.update(go["env"])
    tempfile.tempdir = None  # TMPDIR is the rank's now
    sys.path[0] = go["cwd"]
    sys.argv = [args.module, *go["args"]]
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    ack.write("ok\n")
    ack.close()
    # Run as __main__ from its source, as python -m does; the copy imported under its own name goes
    # (runpy warns of a module run that is in sys.modules already). What it imports stays imported.
    del sys.modules[args.module]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
