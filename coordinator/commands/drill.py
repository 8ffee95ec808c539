"""`coord drill`: the daemon halves. A fault put into one rank of a drill's job, and the drill's run
forgotten afterwards: its rows, its events, the head's files and each node's (the CLI half and the
timing are coordinator/cli/drill.py and coordinator/observe/drill_report.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from coordinator.nodes.session import UP
from coordinator.readiness.sync import forget_source
from shared import protocol as p
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from coordinator.jobs.manager import JobManager
    from coordinator.nodes.cluster import Cluster

FAULTS = ("kill", "stop", "cut")


class FaultAnswer(TypedDict):
    run_id: str
    attempt: int
    rank: int
    node: str
    pid: int  # the rank's process group (0 for a cut)
    time: float  # when the signal went (the link went down), by the node's clock
    step: int  # the run's step as the daemon knew it then


class ForgetAnswer(TypedDict):
    run_id: str
    removed: dict[str, list[str]]  # node -> what went from its workdir
    unreached: dict[str, str]  # node -> why its files could not be removed


async def drill_fault(cluster: Cluster, jobs: JobManager, name: str, fault: str, rank: int,
                      seconds: float = 20.0) -> FaultAnswer:
    """SIGKILL (``kill``) or SIGSTOP (``stop``) to rank ``rank`` of the running job ``name``, or its node's
    link down for ``seconds`` (``cut``)."""
    if fault not in FAULTS:
        raise RemoteError(p.BAD_ARGS, f"fault must be one of {', '.join(FAULTS)}, got {fault!r}")
    runner = jobs.find(name)
    view = runner.view()
    if view["state"] != "running":
        raise RemoteError(p.REFUSED, f"job {view['name']} is {view['state']}, not running: no rank to put a fault in")
    if not 0 <= rank < len(view["nodes"]):
        raise RemoteError(p.BAD_ARGS, f"rank {rank}: job {view['name']} has ranks 0 to {len(view['nodes']) - 1}")
    node = view["nodes"][rank]
    session = cluster.sessions[node]
    if fault == "cut":
        if session.node.host == "local":
            raise RemoteError(p.REFUSED, f"{node} runs on the head's own machine (host local): it has no link of its "
                                         "own to take down")
        # The address the head reached it at (an ssh config alias may not resolve on the node itself).
        host = session.peer_address or session.node.host
        cut = await session.call("cut_link", {"host": host, "seconds": seconds}, timeout=30)
        pid, at = 0, cut["time"]
        what = f"its link {cut['interface']} down for {seconds:g} s"
    else:
        answer = await session.call("signal_rank", {"workdir": session.node.workdir, "job": runner.run_id,
                                                    "attempt": view["attempt"], "rank": rank, "fault": fault},
                                    timeout=30)
        pid, at = answer["pid"], answer["time"]
        what = f"{'SIGKILL' if fault == 'kill' else 'SIGSTOP'} to rank {rank} (pid {pid})"
    runner.event("drill_fault", f"drill: {what} on {node} at step {view['step']}", rank=rank, node=node,
                 fault=fault, step=view["step"])
    return {"run_id": runner.run_id, "attempt": view["attempt"], "rank": rank, "node": node, "pid": pid,
            "time": at, "step": view["step"]}


async def forget_run(cluster: Cluster, jobs: JobManager, name: str, tree: str | None = None,
                     source: str | None = None) -> ForgetAnswer:
    """The finished run ``name`` as if it had never been, on the head and on every node that is up
    (``tree``: the drill's project directory in each workdir, removed too; ``source``: the drill's
    source directory on the head, whose hash cache goes). A node that is not up keeps its files,
    and is named."""
    runner = jobs.forget(name)
    if source is not None:
        forget_source(cluster, Path(source))
    run_id = runner.run_id
    kept = [event for event in cluster.events if (event.get("data") or {}).get("run") != run_id]
    cluster.events.clear()
    cluster.events.extend(kept)
    removed: dict[str, list[str]] = {}
    unreached: dict[str, str] = {}
    for node, session in cluster.sessions.items():
        if session.state != UP:
            unreached[node] = f"node is {session.state}"
            continue
        args: dict[str, object] = {"workdir": session.node.workdir, "job": run_id}
        if tree is not None:
            args["tree"] = tree
        try:
            removed[node] = (await session.call("remove_run", args, timeout=120))["removed"]
        except RemoteError as exc:
            unreached[node] = exc.message
    return {"run_id": run_id, "removed": removed, "unreached": unreached}
