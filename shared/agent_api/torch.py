"""``torch_facts`` and the rendezvous probe: what a PyTorch job needs to know of a node.

``torch_facts`` is asked only for jobs whose launcher is torch-based (torchrun, Accelerate,
DeepSpeed): it runs the node's Python, and imports torch there when torch is installed. The
rendezvous probe is three calls: rank 0's node opens a listener on the master port
(``rendezvous_listen``), every node connects to the master address from where it is
(``rendezvous_connect``), and the listener is closed (``rendezvous_close``).
"""

from __future__ import annotations

from typing import TypedDict

from shared.agent_api.topology import IbvDevice


class TorchFactsRequest(TypedDict):
    python: str  # the interpreter ranks run with (the cluster file's python for the node)


class GpuDevice(TypedDict):
    index: int
    name: str
    memory_total_bytes: int
    memory_used_bytes: int | None  # None where the source does not say
    compute_capability: str | None  # "8.0"; None where the source does not say (old nvidia-smi)


class TorchVersions(TypedDict):
    """Each None when not installed (or, for cuda and nccl, not built in or not readable)."""

    torch: str | None
    cuda: str | None  # torch.version.cuda: the CUDA torch was built with
    nccl: str | None  # torch.cuda.nccl.version(), as "2.21.5"
    accelerate: str | None
    deepspeed: str | None


class ShmFacts(TypedDict):
    path: str
    total_bytes: int
    free_bytes: int  # available to an unprivileged process (statvfs f_bavail)


class _TorchFactsReply(TypedDict):
    hostname: str | None
    network_id: str | None  # this boot and network namespace: nodes that share it meet on loopback
    os: str | None  # platform.system(): "Linux", "Darwin"
    python: str
    memory_bytes: int | None  # physical memory
    versions: TorchVersions
    distributed: bool | None  # torch.distributed.is_available(); None without torch
    gloo: bool | None  # torch.distributed.is_gloo_available()
    nccl_available: bool | None  # torch.distributed.is_nccl_available()
    cuda_available: bool | None  # torch.cuda.is_available()
    gpus: list[GpuDevice]
    gpu_source: str  # "nvidia-smi", "torch.cuda", or why no GPU was found
    infiniband: list[IbvDevice] | None  # ibv_devinfo (or /sys/class/infiniband); None: unknown
    infiniband_source: str
    shm: ShmFacts | None  # /dev/shm; None where there is none (macOS) or it cannot be read
    detail: dict[str, str]  # what could not be read, by what


class TorchFactsReply(_TorchFactsReply, total=False):
    # What DeepSpeed's op builds need (absent: not asked, an agent before these were reported)
    compiler: str | None  # the C++ compiler's path
    python_headers: str | None  # Python.h of the ranks' Python


class _RendezvousListenRequest(TypedDict):
    port: int
    token: str  # sent to every connection, so a connector knows it reached this listener


class RendezvousListenRequest(_RendezvousListenRequest, total=False):
    seconds: float  # the listener closes by itself after this long (at most 300)


class RendezvousListenReply(TypedDict):
    listening: bool
    port: int
    detail: str


class _RendezvousConnectRequest(TypedDict):
    host: str  # the master address as the ranks will be given it: an IP or a name
    port: int
    token: str


class RendezvousConnectRequest(_RendezvousConnectRequest, total=False):
    timeout: float


class RendezvousConnectReply(TypedDict):
    host: str
    port: int
    resolved: list[str]  # what ``host`` resolves to on this node
    loopback: bool  # every resolved address is a loopback one (127.x, ::1)
    connected: bool  # a TCP connection was made and the listener's token came back
    detail: str


class RendezvousCloseRequest(TypedDict):
    port: int


class RendezvousCloseReply(TypedDict):
    closed: bool  # False: no listener was open on that port
    accepted: int  # connections it accepted
