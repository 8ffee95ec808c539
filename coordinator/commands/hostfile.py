"""`coord hostfile`: the daemon half (the plan itself is in coordinator.launch.plan).

The hostfile written here is for the user's own ``mlx.launch --hostfile``: each node named
as the user's plain ssh reaches it (coordinator.launch.user_hostfile), not by coord's private
aliases, which only coord's own launches (with their ssh wrapper) understand.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from coordinator.config.cluster_file import ClusterConfig
from coordinator.launch.hostfile import HostfileError
from coordinator.launch.plan import node_topologies, plan_backend
from coordinator.launch.user_hostfile import choose_entries, write_include_file
from shared import protocol as p
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from coordinator.launch.hostfile import Hostfile
    from coordinator.launch.mlx_backend import BackendChoice
    from coordinator.nodes.cluster import Cluster


class HostfileFiles(TypedDict):
    hostfile: str
    ssh_include: str | None  # written only when some node needs a Host block


class HostfileAnswer(TypedDict):
    """``coord hostfile``'s answer."""

    hostfile: Hostfile  # mlx.launch's, as coordinator.launch builds it
    files: HostfileFiles
    backend: BackendChoice | None
    ssh: dict[str, object]  # how the user's ssh reaches each node (UserSsh.describe)
    launch: str  # the command that uses the hostfile


async def serve_hostfile(cluster: Cluster, output: str | None = None, backend: str | None = None) -> HostfileAnswer:
    if output and not Path(output).is_absolute():
        raise RemoteError(p.BAD_ARGS, "output must be an absolute path")
    try:
        entries = await choose_entries(cluster.config)
    except HostfileError as exc:
        raise RemoteError(p.REFUSED, f"no hostfile: {exc}") from None
    topologies = await node_topologies(cluster)
    choice, document, error = plan_backend(cluster, topologies, forced=backend,
                                           ssh_names={name: entry.ssh for name, entry in entries.items()})
    if document is None:
        raise RemoteError(p.REFUSED, f"no hostfile: {error}" + (
            "; " + "; ".join(f"{f['node']}: {f['instruction']}" for f in choice.get("fixes", [])) if choice else ""))
    user_ssh = write_include_file(cluster.config, entries)
    target = Path(output) if output else cluster.config.state_dir / "launch" / "hostfile.json"
    if not output:
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        target.write_text(json.dumps(document, indent=2) + "\n")
    except OSError as exc:
        raise RemoteError(p.BAD_ARGS, f"cannot write the hostfile to {target}: {exc.strerror}") from None
    files: HostfileFiles = {"hostfile": str(target), "ssh_include": user_ssh.include_file}
    needing = [e.node for e in entries.values() if e.needs]
    through = f"; {', '.join(needing)} reached through {user_ssh.include_file}" if needing else ""
    cluster.record_event("hostfile.written", f"hostfile ({document['backend']}) written to {target}{through}")
    return {"hostfile": document, "files": files, "backend": choice, "ssh": user_ssh.describe(),
            "launch": launch_hint(cluster.config, target)}


def launch_hint(config: ClusterConfig, hostfile: Path) -> str:
    """The command that uses the hostfile. mlx.launch runs the command as given on every node
    (a bare script.py is not found there); --python names one interpreter for all nodes."""
    pythons = {node.python for node in config.nodes}
    start = f"mlx.launch --hostfile {shlex.quote(str(hostfile))}"
    if len(pythons) == 1:
        return f"{start} --python {shlex.quote(pythons.pop())} SCRIPT.py"
    return f"{start} -- COMMAND  (the nodes' Pythons differ: give a command that each node's shell resolves)"
