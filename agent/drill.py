"""What `coord drill` asks of a node: a fault in a rank, and the drill's files removed afterwards.

A drill is a rehearsal on the user's own cluster: coord kills one rank (SIGKILL) and stops
another (SIGSTOP) to time how it finds and recovers from each, then leaves nothing behind. The
faults reach a rank's whole process group, as a crash or a frozen machine would; removal only
ever touches the run's own directories (``.coord/jobs/RUN``, ``checkpoints/RUN``) and the
drill's project directory, all named by patterns a user's own file cannot match by accident.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import time

from agent import proc_state
from agent.ranks import _read_int, rank_dir
from shared import protocol as p
from shared.agent_api.ranks import RemoveRunReply, SignalRankReply
from shared.rpc import RemoteError

FAULTS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
#: The drill's project directory in a node's workdir: ``coord-drill-`` and the drill's stamp.
DRILL_TREE = re.compile(r"coord-drill-[0-9a-z]{6,32}")


def signal_rank(workdir: str, job: str, attempt: int, rank: int, fault: str) -> SignalRankReply:
    """``fault`` ("kill" or "stop") to the rank's process group, as it is now."""
    sig = FAULTS.get(fault)
    if sig is None:
        raise RemoteError(p.BAD_ARGS, f"fault must be one of {', '.join(FAULTS)}, got {fault!r}")
    directory = rank_dir(workdir, job, attempt, rank)
    pgid = _read_int(os.path.join(directory, "pid"))
    if pgid is None or not proc_state.alive(pgid):
        raise RemoteError(p.NOT_FOUND, f"rank {rank} of {job} attempt {attempt} is not running here")
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        raise RemoteError(p.NOT_FOUND, f"rank {rank} of {job} attempt {attempt} ended before the signal") from None
    return {"pid": pgid, "time": time.time()}


def remove_run(workdir: str, job: str, tree: str | None = None) -> RemoveRunReply:
    """The run's files on this node (its rank directories and checkpoints) and the drill's ``tree``."""
    if not os.path.isabs(workdir):
        raise RemoteError(p.BAD_ARGS, f"workdir must be absolute, got {workdir!r}")
    rank_dir(workdir, job, 0, 0)  # the job's name checked as every rank call checks it
    if tree is not None and not DRILL_TREE.fullmatch(tree):
        raise RemoteError(p.BAD_ARGS, f"refused {tree!r}: not a drill's directory")
    targets = [os.path.join(workdir, ".coord", "jobs", job), os.path.join(workdir, "checkpoints", job)]
    if tree is not None:
        targets.append(os.path.join(workdir, tree))
    removed = []
    for target in targets:
        if os.path.islink(target) or not os.path.isdir(target):
            continue
        shutil.rmtree(target)
        removed.append(os.path.relpath(target, workdir))
    # The directories every run shares, once the last run's files went: a node as it was before its first job.
    for shared_dir in (os.path.join(workdir, "checkpoints"), os.path.join(workdir, ".coord", "jobs")):
        with contextlib.suppress(OSError):
            os.rmdir(shared_dir)  # only when empty
    return {"removed": removed}
