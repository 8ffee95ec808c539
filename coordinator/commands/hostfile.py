"""`coord hostfile`: the daemon half (the plan itself is in coordinator.services.launch_plan)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator.services.launch_plan import node_topologies, plan_backend, write_launch_files
from shared import protocol as p
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from coordinator.daemon import Daemon


async def serve_hostfile(daemon: "Daemon", output: str | None = None, backend: str | None = None) -> dict[str, Any]:
    topologies = await node_topologies(daemon)
    choice, document, error = plan_backend(daemon, topologies, forced=backend)
    if document is None:
        raise RemoteError(p.REFUSED, f"no hostfile: {error}" + (
            "; " + "; ".join(f"{f['node']}: {f['instruction']}" for f in choice.get("fixes", [])) if choice else ""))
    directory = daemon.config.state_dir / "launch"
    files = write_launch_files(directory, daemon.config, document)
    if output:
        target = Path(output)
        if not target.is_absolute():
            raise RemoteError(p.BAD_ARGS, "output must be an absolute path")
        target.write_text(json.dumps(document, indent=2) + "\n")
        files["hostfile"] = str(target)
    daemon.cluster.record_event("hostfile.written", f"hostfile ({document['backend']}) written to {files['hostfile']}")
    return {"hostfile": document, "files": files, "backend": choice}
