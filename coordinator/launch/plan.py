"""The launch plan: the backend and the mlx.launch hostfile from what the nodes measured about their links,
and the files a launch needs."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, cast

import anyio

from coordinator.launch.hostfile import (
    Hostfile,
    HostfileError,
    build_hostfile,
    node_address,
    render_ssh_config,
    write_ssh_wrapper,
)
from coordinator.launch.mlx_backend import BackendChoice, Host, choose_backend
from coordinator.launch.topology import Topology, connectivity_matrix
from coordinator.nodes.session import UP, NodeSession
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from coordinator.config.cluster_file import ClusterConfig
    from coordinator.nodes.cluster import Cluster


async def node_topologies(cluster: Cluster) -> dict[str, Topology]:
    found: dict[str, Topology] = {}

    async def one(session: NodeSession) -> None:
        if session.state == UP:
            with contextlib.suppress(RemoteError, TimeoutError):  # a node that does not answer has no links
                found[session.node.name] = await session.call("topology", timeout=120)

    async with anyio.create_task_group() as tasks:
        for session in cluster.sessions.values():
            tasks.start_soon(one, session)
    return found


def plan_backend(cluster: Cluster, topologies: dict[str, Topology], *, forced: str | None = None,
                 envs: list[str] | None = None, nodes: list[str] | None = None,
                 ssh_names: dict[str, str] | None = None,
                 ) -> tuple[BackendChoice | None, Hostfile | None, str | None]:
    """(backend choice, hostfile document, error): the choice is measured, the hostfile follows it.

    ``nodes`` narrows the cluster to the nodes an attempt runs on (elastic shrink).
    ``ssh_names`` gives each node's ``ssh`` entry as the user's own ssh reaches it
    (``coord hostfile``); without it the entries are coord's private aliases, which
    only work through the files write_launch_files writes (coord's own launches)."""
    config = cluster.config
    names = nodes or [n.name for n in config.nodes]
    missing = [n for n in names if n not in topologies]
    if missing:
        return None, None, f"no link information from {', '.join(missing)} (is it up?)"
    by_name = {n.name: n for n in config.nodes}
    if all(by_name[name].is_local for name in names):
        if forced not in (None, "ring"):
            return None, None, f"backend {forced} needs RDMA links between machines; every node is this machine"
        # Every rank on this machine: a ring over loopback, nothing to measure.
        choice: BackendChoice = {"ok": True, "backend": "ring", "transport": "tcp", "order": names, "hosts": [],
                                 "reasons": ["every node is this machine: ring over loopback"], "warnings": [],
                                 "fixes": []}
    else:
        choice = choose_backend(connectivity_matrix(topologies), names, forced)
        if not choice["ok"]:
            return choice, None, choice.get("error") or "no usable backend"
    measured: dict[str, Host] = {host["node"]: host for host in choice["hosts"]}
    ips: dict[str, list[str]] = {}
    rdma: dict[str, list[str | None]] = {}
    try:
        for name in names:
            node, host = by_name[name], measured.get(name)
            # A configured address wins over a measured one; loopback only when all ranks are local.
            if node.ips or host is None or not host["ips"]:
                ips[name] = [node_address(node)]
            else:
                ips[name] = list(host["ips"])
            rdma[name] = list(host["rdma"]) if host is not None else []
        backend = cast(str, choice["backend"])  # an ok choice names its backend
        document = build_hostfile(config, backend=backend, ips=ips, rdma=rdma, envs=envs,
                                  nodes=choice.get("order") or names, ssh_names=ssh_names)
    except HostfileError as exc:
        return choice, None, str(exc)
    return choice, document, None


def write_launch_files(directory: Path, config: ClusterConfig, document: Hostfile, *,
                       outlive_silence_s: float | None = None) -> dict[str, str]:
    """hostfile.json, ssh_config and the ssh wrapper, in a private directory."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    hostfile = directory / "hostfile.json"
    hostfile.write_text(json.dumps(document, indent=2) + "\n")
    ssh_config = directory / "ssh_config"
    ssh_config.write_text(render_ssh_config(config, outlive_silence_s=outlive_silence_s))
    os.chmod(ssh_config, 0o600)
    wrapper = write_ssh_wrapper(directory / "bin", ssh_config)
    return {"hostfile": str(hostfile), "ssh_config": str(ssh_config), "path_prefix": str(wrapper.parent)}
