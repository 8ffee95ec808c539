"""Prepare a job for mlx.launch: hostfile, ssh settings, and each node's rank script."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, TypedDict

import anyio

from agent.launch import rank_command
from coordinator.launch.mlx_launch import launcher_argv
from coordinator.launch.plan import node_topologies, plan_backend, write_launch_files
from shared import protocol as p
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from coordinator.launch.hostfile import Hostfile
    from coordinator.launch.mlx_backend import BackendChoice
    from coordinator.nodes.cluster import Cluster
    from shared.agent_api.ranks import PrepareRankReply

JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class PreparedJob(TypedDict):
    """What ``prepare_job`` made: the exact mlx.launch command, and what it runs with."""

    job: str
    argv: list[str]  # mlx.launch, its hostfile, and each rank's command
    env: dict[str, str]  # on top of the caller's environment
    order: list[str]  # the nodes, rank by rank
    hostfile: Hostfile  # mlx.launch's, as coordinator.launch builds it
    files: dict[str, str]  # the launch files written (coordinator.launch.plan.write_launch_files)
    scripts: dict[str, PrepareRankReply]  # node -> its agent's prepare_rank answer
    backend: BackendChoice


async def prepare_job(cluster: Cluster, job: str, argv: list[object], env: dict[str, object] | None = None,
                      backend: str | None = None) -> PreparedJob:
    """Everything a launch needs; returns the exact mlx.launch argv and its environment. ``argv`` and
    ``env`` are as they came over the control socket: ``argv`` is checked here, ``env`` by each agent."""
    if not JOB_NAME.match(job):
        raise RemoteError(p.BAD_ARGS, f"job name {job!r} must be letters, digits, '.', '_' or '-' (at most 64)")
    if not argv or not all(isinstance(word, str) for word in argv):
        raise RemoteError(p.BAD_ARGS, "the command must be a non-empty list of words")
    topologies = await node_topologies(cluster)
    choice, document, error = plan_backend(cluster, topologies, forced=backend)
    if document is None:
        raise RemoteError(p.REFUSED, f"cannot launch: {error}")
    assert choice is not None  # a hostfile is made from a backend choice
    files = write_launch_files(cluster.config.state_dir / "jobs" / job, cluster.config, document)
    order = choice.get("order") or [n.name for n in cluster.config.nodes]
    sessions = cluster.sessions
    down = [name for name in order if sessions[name].state != "up"]
    if down:
        raise RemoteError(p.REFUSED, f"cannot launch: {', '.join(down)} not up")
    scripts: dict[str, PrepareRankReply] = {}

    async def one(rank: int, name: str) -> None:
        node = sessions[name].node
        scripts[name] = await sessions[name].call("prepare_rank", {
            "job": job, "rank": rank, "workdir": node.workdir, "python": node.python, "argv": list(argv),
            "env": dict(env or {})}, timeout=60)

    async with anyio.create_task_group() as tasks:
        for rank, name in enumerate(order):
            tasks.start_soon(one, rank, name)
    command = [*launcher_argv(), "--hostfile", files["hostfile"], "--", *rank_command(job)]
    path = files["path_prefix"] + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin")
    return {"job": job, "argv": command, "env": {"PATH": path}, "order": order, "hostfile": document,
            "files": files, "scripts": scripts, "backend": choice}
