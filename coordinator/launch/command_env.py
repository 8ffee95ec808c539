"""What each process of a ``--launcher command`` job finds in its environment: coord's own ``COORD_*``
world, and, with ``--env-style``, the variables a framework reads to form its own.

- ``jax``: ``JAX_COORDINATOR_ADDRESS``, which ``jax.distributed.initialize()`` reads itself when it
  is not given one (jax/_src/distributed.py); ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``, which it
  does not (outside Slurm, Open MPI, Kubernetes and TPUs it must be given them: JAX's own documentation
  of ``initialize``), so ``jax.distributed.initialize(**coord_script.jax_distributed())`` passes all
  three; ``JAX_LOCAL_PROCESS_ID``; and with several processes a node ``JAX_LOCAL_DEVICE_IDS``, which
  JAX reads itself: each process its own GPU (no effect on a CPU).
- ``tf``: ``TF_CONFIG``, the JSON TensorFlow's ``MultiWorkerMirroredStrategy`` reads through its
  ``TFConfigClusterResolver``: ``{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker",
  "index": i}}``, one worker per process, each on its node's address and a port of its own.

Pure functions over plain values; no I/O. Imported by the job's spec check (the style's names), so it
imports nothing of coord's launchers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

ENV_STYLES = ("jax", "tf")
#: Where each attempt's coordinator port is drawn from: below torch's rendezvous ports (17000-20000,
#: coordinator/launch/torch_launchers.py), the MLX ring's (20000 on) and Linux's ephemeral ports.
COORDINATOR_PORTS = (14000, 17000)
#: The ports one attempt may use from its first: TF gives each process of a node a port of its own.
PORTS_WIDTH = 64


def coordinator_port(run_id: str, attempt: int) -> int:
    """This attempt's own coordinator port: stable across a daemon restart, different for each job and
    attempt (two jobs on one machine never meet at one port; a new attempt never waits on the last one's
    socket in TIME_WAIT)."""
    digest = hashlib.sha256(f"command:{run_id}:{attempt}".encode()).digest()
    span = COORDINATOR_PORTS[1] - COORDINATOR_PORTS[0] - PORTS_WIDTH
    return COORDINATOR_PORTS[0] + int.from_bytes(digest[:4], "big") % span


def process_env(style: str | None, *, node_rank: int, local_rank: int, procs: int, addresses: Sequence[str],
                port: int) -> dict[str, str]:
    """One process's variables: the ``local_rank``-th of ``procs`` on the node of rank ``node_rank``, in a
    world whose nodes are reached at ``addresses`` (rank by rank; the first is the coordinator's) and
    whose coordinator listens on ``port``."""
    nodes = len(addresses)
    rank = node_rank * procs + local_rank
    world = nodes * procs
    coordinator = f"{_host(addresses[0])}:{port}"
    env = {"COORD_RANK": str(rank), "COORD_LOCAL_RANK": str(local_rank), "COORD_WORLD_SIZE": str(world),
           "COORD_NODE_RANK": str(node_rank), "COORD_NNODES": str(nodes), "COORD_PROCS_PER_NODE": str(procs),
           "COORD_COORDINATOR_ADDR": coordinator}
    if style == "jax":
        env.update({"JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": str(world),
                    "JAX_PROCESS_ID": str(rank), "JAX_LOCAL_PROCESS_ID": str(local_rank)})
        if procs > 1:
            env["JAX_LOCAL_DEVICE_IDS"] = str(local_rank)
    elif style == "tf":
        workers = [f"{_host(address)}:{port + local}" for address in addresses for local in range(procs)]
        env["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}},
                                      separators=(",", ":"))
    elif style is not None:
        raise ValueError(f"unknown environment style {style!r} (one of {', '.join(ENV_STYLES)})")
    return env


def _host(address: str) -> str:
    """An address as it goes before ``:port``: an IPv6 literal in brackets."""
    return f"[{address}]" if ":" in address and not address.startswith("[") else address
