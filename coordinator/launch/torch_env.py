"""What a torch-based launcher (torchrun, Accelerate, DeepSpeed) gives its ranks, from what the nodes
measured: the rendezvous (master address, each node's interface toward it), the collective backend,
and the NCCL/Gloo environment.

Pure functions over the nodes' ``torch_facts`` (``shared/agent_api/torch.py``) and the link matrix
(:mod:`coordinator.launch.topology`): no I/O. Pre-flight checks the same facts
(:mod:`coordinator.readiness.torch_checks`) and the plan sizes from them
(:mod:`coordinator.plan.torch_plan`).

The environment's rules, each with why:

- ``NCCL_SOCKET_IFNAME`` (``=IFACE``) and ``GLOO_SOCKET_IFNAME`` (``IFACE``): the interface coord
  chose toward rank 0 (the leading ``=`` asks NCCL for that exact name, not every interface whose
  name it prefixes). Left to
  themselves NCCL and Gloo take the first interface that is up, often a docker bridge or a
  management network the other nodes cannot reach: the job hangs at its first collective.
- ``NCCL_IB_DISABLE``: ``0`` where every node has an InfiniBand/RoCE port that is active, ``1``
  otherwise, on every node alike: NCCL picks its network per process, and ranks that disagree
  cannot connect. The GPUDirect RDMA level (``NCCL_NET_GDR_LEVEL``) would need whether a GPU and
  an HCA share a PCIe switch, which coord does not read: it is not set, and NCCL's own topology
  detection decides.
- ``NCCL_DEBUG=WARN``: NCCL's warnings reach the rank's log, where coord looks for failures; a job
  that sets its own ``NCCL_DEBUG`` keeps it (the launcher lays the job's environment over this).
- ``COORD_TORCH_BACKEND``: ``nccl`` where every node has an NVIDIA GPU and a torch built with
  NCCL, ``gloo`` on CPU-only nodes, for a script's ``init_process_group(backend=...)``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Literal, Protocol

from shared.agent_api.torch import GpuDevice, TorchFactsReply

DEFAULT_MASTER_PORT = 29500  # torchrun's and Accelerate's default
Backend = Literal["nccl", "gloo"]

#: GPUs with bfloat16 arithmetic (compute capability 8.0 and later: Ampere, Ada, Hopper, Blackwell), by
#: name, for a driver too old to report ``compute_cap``.
_BF16_NAMES = re.compile(r"\b(A100|A800|A40|A30|A16|A10G?|A2|H100|H200|H800|H20|GH200|B100|B200|GB200|L40S?|L4|"
                         r"RTX\s*(30|40|50)\d\d|RTX\s*A\d{4}|RTX\s*\d{4}\s*Ada|RTX\s*PRO)\b", re.IGNORECASE)
_NO_BF16_NAMES = re.compile(r"\b(V100|T4|P100|P40|P4|K80|M60|M40|TITAN\s*V|TITAN\s*RTX|RTX\s*20\d\d|GTX|"
                            r"Quadro\s*RTX)\b", re.IGNORECASE)


class NodePlace(Protocol):
    """What of a node's cluster-file entry says where it is."""

    @property
    def is_local(self) -> bool: ...


def shares_network(node: NodePlace, other: NodePlace, facts: TorchFactsReply, other_facts: TorchFactsReply) -> bool:
    """Whether two nodes' ranks reach each other on loopback: both this machine's (host "local"), or the
    same network stack as their agents read it (a hostname is no proof: two Macs share a default one,
    network namespaces share the machine's)."""
    if node.is_local and other.is_local:
        return True
    mine, theirs = facts.get("network_id"), other_facts.get("network_id")
    return mine is not None and mine == theirs


def torch_backend(facts: Mapping[str, TorchFactsReply]) -> Backend:
    """``nccl`` where every node has a GPU and a torch with NCCL (or one that cannot say); ``gloo``."""
    if facts and all(f["gpus"] and f.get("nccl_available") is not False for f in facts.values()):
        return "nccl"
    return "gloo"


def infiniband_ready(facts: TorchFactsReply) -> bool:
    """An InfiniBand or RoCE port that is active on this node."""
    return any(port.get("state") == "PORT_ACTIVE" for device in facts.get("infiniband") or []
               for port in device.get("ports") or [])


def torch_env(facts: TorchFactsReply, chosen_interface: str | None, *, infiniband: bool | None = None,
              backend: Backend | None = None) -> dict[str, str]:
    """The environment one node's ranks get (see the module docstring for each rule).

    ``infiniband`` and ``backend`` are the cluster's decisions (:func:`torch_envs` makes them for
    every node alike); without them this node's own facts decide.
    """
    backend = backend or ("nccl" if facts["gpus"] and facts.get("nccl_available") is not False else "gloo")
    env: dict[str, str] = {"COORD_TORCH_BACKEND": backend}
    if chosen_interface:
        env["GLOO_SOCKET_IFNAME"] = chosen_interface
    if backend == "nccl":
        if chosen_interface:
            env["NCCL_SOCKET_IFNAME"] = f"={chosen_interface}"
        use_ib = infiniband_ready(facts) if infiniband is None else infiniband
        env["NCCL_IB_DISABLE"] = "0" if use_ib else "1"
        env["NCCL_DEBUG"] = "WARN"
    return env


def torch_envs(facts: Mapping[str, TorchFactsReply],
               interfaces: Mapping[str, str | None]) -> dict[str, dict[str, str]]:
    """Every node's environment, with the backend and InfiniBand decided for all of them at once."""
    backend = torch_backend(facts)
    infiniband = bool(facts) and all(infiniband_ready(f) for f in facts.values())
    return {name: torch_env(f, interfaces.get(name), infiniband=infiniband, backend=backend)
            for name, f in facts.items()}


def bf16_capable(gpu: GpuDevice) -> bool | None:
    """Whether the GPU computes in bfloat16: compute capability 8.0 or later, or else known by its
    name; None when neither says."""
    capability = gpu.get("compute_capability")
    if capability:
        major, _, minor = capability.partition(".")
        if major.isdigit():
            return (int(major), int(minor) if minor.isdigit() else 0) >= (8, 0)
    if _NO_BF16_NAMES.search(gpu["name"]):
        return False
    if _BF16_NAMES.search(gpu["name"]):
        return True
    return None
