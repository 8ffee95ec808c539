"""What a node offers a PyTorch job: torch, CUDA, NCCL, Accelerate and DeepSpeed versions, GPUs and
their memory, InfiniBand/RoCE ports, ``/dev/shm``, physical memory, and the C++ compiler and
``Python.h`` that DeepSpeed compiles its own ops with when a job starts.

The agent itself never imports torch (it stays standard library and msgpack): package versions
are read with ``importlib.metadata`` (in the node's Python, through a small child process when that
is not the agent's own interpreter), and only where torch is installed does a child process of the
node's Python import it, with a timeout, for what only torch can say (the CUDA it was built with,
NCCL's version, its distributed backends; its GPUs where ``nvidia-smi`` cannot answer).

``collect_torch_facts`` never raises for a fact it cannot read: that fact is None (or ``[]`` for
GPUs), with the reason in ``detail``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import socket
import sys
import sysconfig
from typing import TYPE_CHECKING

from agent import rdma_parsers, torch_parsers
from agent.facts import read_package_version, read_physical_memory
from agent.topology import read_sysfs_infiniband, run_command

if TYPE_CHECKING:
    from shared.agent_api.common import JsonObject
    from shared.agent_api.topology import IbvDevice
    from shared.agent_api.torch import GpuDevice, ShmFacts, TorchFactsReply, TorchVersions

PACKAGES = {"torch": "torch", "accelerate": "accelerate", "deepspeed": "deepspeed"}
VERSIONS_TIMEOUT_S = 30.0
# Importing torch with CUDA takes seconds, more on a cold disk; initialising CUDA for the GPU list more.
TORCH_PROBE_TIMEOUT_S = 120.0
SHM_PATH = "/dev/shm"

# Run in the node's Python when it is not the agent's own: versions without importing anything, and
# where torch's distribution lies (its stamp: a reinstall makes a new one), for the probe's cache.
_VERSIONS_PROBE = """\
import json, sys, sysconfig
from importlib import metadata
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
answer = {name: version(name) for name in sys.argv[1:]}
answer["_include"] = sysconfig.get_paths().get("include")
try:
    answer["_torch_at"] = str(metadata.distribution("torch")._path)
except Exception:
    pass
print(json.dumps(answer))
"""

# Run in the node's Python only when torch is installed. With the argument "gpus" it lists the
# GPUs too (which initialises CUDA: asked only where nvidia-smi could not say).
_TORCH_PROBE = """\
import json, sys
answer = {}
try:
    import torch
except Exception as error:
    print(json.dumps({"error": f"import torch failed: {type(error).__name__}: {error}"}))
    raise SystemExit(0)
answer["cuda"] = getattr(torch.version, "cuda", None)
try:
    version = torch.cuda.nccl.version()
    answer["nccl"] = list(version) if isinstance(version, tuple) else version
except Exception:
    answer["nccl"] = None
try:
    import torch.distributed as dist
    answer["distributed"] = bool(dist.is_available())
    answer["gloo"] = bool(dist.is_available() and dist.is_gloo_available())
    answer["nccl_available"] = bool(dist.is_available() and dist.is_nccl_available())
except Exception:
    answer["distributed"] = answer["gloo"] = answer["nccl_available"] = None
try:
    answer["cuda_available"] = bool(torch.cuda.is_available())
except Exception:
    answer["cuda_available"] = None
if "gpus" in sys.argv[1:] and answer["cuda_available"]:
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        try:
            free, total = torch.cuda.mem_get_info(index)
            used = total - free
        except Exception:
            used = None
        gpus.append({"index": index, "name": props.name, "memory_total_bytes": int(props.total_memory),
                     "memory_used_bytes": used, "compute_capability": f"{props.major}.{props.minor}"})
    answer["gpus"] = gpus
print(json.dumps(answer))
"""


#: The torch probe's answers, by what they depend on (see probe_key): importing torch takes seconds,
#: and a job's pre-flight asks again at every launch.
_PROBES: dict[tuple[object, ...], JsonObject] = {}


def probe_key(python: str, versions: TorchVersions, torch_at: str | None, want_gpus: bool) -> tuple[object, ...] | None:
    """What the torch probe's answer depends on: the interpreter, torch's version and its installed
    files (their directory's inode and time: a reinstall changes them), the GPU driver (its version
    file), and whether GPUs are listed; None when that cannot be told (no stamp): asked every time."""
    if torch_at is None:
        return None
    try:
        stamp = os.stat(torch_at)
    except OSError:
        return None
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8", errors="replace") as file:
            driver: str | None = file.read(4096)
    except OSError:
        driver = None
    return (os.path.realpath(python), versions["torch"], stamp.st_ino, stamp.st_mtime_ns, driver, want_gpus)


def cached_torch_probe(python: str, key: tuple[object, ...] | None, *, want_gpus: bool,
                       detail: dict[str, str]) -> JsonObject:
    """The probe's answer, asked once per ``key``: a failed probe is asked again next time, and so is
    one that listed GPUs through torch (their memory in use changes)."""
    if key is not None and key in _PROBES:
        return _PROBES[key]
    answer = run_torch_probe(python, want_gpus=want_gpus, detail=detail)
    if key is not None and answer and not answer.get("gpus"):
        _PROBES[key] = answer
    return answer


def collect_torch_facts(python: str) -> TorchFactsReply:
    """This node as a PyTorch job sees it, with ``python`` the interpreter its ranks run."""
    detail: dict[str, str] = {}
    located: dict[str, str] = {}
    versions = read_versions(python, detail, located)
    probe: JsonObject = {}
    gpus, gpu_source = read_nvidia_smi(detail)
    if versions["torch"] is not None:
        key = probe_key(python, versions, located.get("torch"), gpus is None)
        probe = cached_torch_probe(python, key, want_gpus=gpus is None, detail=detail)
        versions["cuda"] = probe.get("cuda") if isinstance(probe.get("cuda"), str) else None
        versions["nccl"] = torch_parsers.nccl_version_text(probe.get("nccl"))
    if gpus is None:
        gpus, gpu_source = _gpus_from_torch(probe, gpu_source, versions["torch"] is not None)
    infiniband, ib_source = read_infiniband(detail)
    return {
        "hostname": socket.gethostname() or None,
        "network_id": network_id(),
        "os": platform.system() or None,
        "python": python,
        "memory_bytes": read_physical_memory(),
        "versions": versions,
        "distributed": _bool_or_none(probe.get("distributed")),
        "gloo": _bool_or_none(probe.get("gloo")),
        "nccl_available": _bool_or_none(probe.get("nccl_available")),
        "cuda_available": _bool_or_none(probe.get("cuda_available")),
        "gpus": gpus,
        "gpu_source": gpu_source,
        "infiniband": infiniband,
        "infiniband_source": ib_source,
        "shm": read_shm(SHM_PATH, detail),
        "compiler": find_compiler(python),
        "python_headers": python_header(located.get("include")),
        "detail": detail,
    }


def find_compiler(python: str) -> str | None:
    """The C++ compiler torch's extension builder would run (``$CXX``, else ``c++``), found on the
    PATH the ranks get (the agent's, after the directory of their Python): its path, or None.
    DeepSpeed builds ops with it when a job starts (on CPU nodes its shared-memory op, in
    ``deepspeed.comm``'s init)."""
    path = os.pathsep.join([os.path.dirname(python), os.environ.get("PATH", os.defpath)])
    return shutil.which(os.environ.get("CXX") or "c++", path=path)


def python_header(include: str | None) -> str | None:
    """``Python.h`` in the ranks' Python's include directory, which torch's extension builder
    compiles against (Debian ships it apart, in python3-dev): its path, or None."""
    header = os.path.join(include, "Python.h") if include else None
    return header if header and os.path.isfile(header) else None


def read_versions(python: str, detail: dict[str, str], located: dict[str, str] | None = None) -> TorchVersions:
    """torch, Accelerate and DeepSpeed from their distributions' metadata (nothing is imported);
    ``located`` gets where torch's distribution lies, when it is installed."""
    found: dict[str, str | None]
    located = {} if located is None else located
    if os.path.abspath(python) == os.path.abspath(sys.executable):
        found = {key: read_package_version(dist) for key, dist in PACKAGES.items()}
        with contextlib.suppress(importlib.metadata.PackageNotFoundError, AttributeError):
            # a PathDistribution's directory: what _VERSIONS_PROBE gives for another interpreter
            located["torch"] = str(importlib.metadata.distribution("torch")._path)  # type: ignore[attr-defined]
        located["include"] = sysconfig.get_paths().get("include", "")
    else:
        result = run_command([python, "-c", _VERSIONS_PROBE, *PACKAGES.values()], VERSIONS_TIMEOUT_S)
        answer = _last_json_line(result.stdout) if result.stdout is not None else None
        if answer is None:
            detail["versions"] = result.why or f"{python} gave no versions"
            answer = {}
        found = {key: value if isinstance(value := answer.get(dist), str) and value else None
                 for key, dist in PACKAGES.items()}
        if isinstance(answer.get("_torch_at"), str):
            located["torch"] = answer["_torch_at"]
        if isinstance(answer.get("_include"), str):
            located["include"] = answer["_include"]
    return {"torch": found["torch"], "cuda": None, "nccl": None, "accelerate": found["accelerate"],
            "deepspeed": found["deepspeed"]}


def run_torch_probe(python: str, *, want_gpus: bool, detail: dict[str, str]) -> JsonObject:
    """What torch in ``python`` says of itself (and of the GPUs, with ``want_gpus``); {} on failure."""
    argv = [python, "-c", _TORCH_PROBE, *(["gpus"] if want_gpus else [])]
    result = run_command(argv, TORCH_PROBE_TIMEOUT_S)
    if result.stdout is None:
        detail["torch"] = result.why or "the torch probe gave no answer"
        return {}
    answer = _last_json_line(result.stdout)
    if answer is None:
        detail["torch"] = f"the torch probe's answer is not JSON: {_last_line(result.stdout)!r}"
        return {}
    if isinstance(answer.get("error"), str):
        detail["torch"] = answer["error"]
        return {}
    return answer


def read_nvidia_smi(detail: dict[str, str]) -> tuple[list[GpuDevice] | None, str]:
    """The GPUs as nvidia-smi lists them; (None, why) when it cannot say."""
    fields = torch_parsers.NVIDIA_SMI_FIELDS
    result = run_command(torch_parsers.nvidia_smi_argv(fields))
    if result.stdout is None and torch_parsers.is_unknown_field_error((result.output or "") + (result.stderr or "")):
        fields = torch_parsers.NVIDIA_SMI_FIELDS_OLD  # a driver from before compute_cap
        result = run_command(torch_parsers.nvidia_smi_argv(fields))
    if result.stdout is None:
        why = result.why or "nvidia-smi gave no output"
        detail["nvidia-smi"] = why
        return None, why
    gpus = torch_parsers.parse_nvidia_smi_gpus(result.stdout, fields)
    if gpus is None:
        why = f"nvidia-smi output not understood: {_first_line(result.stdout)!r}"
        detail["nvidia-smi"] = why
        return None, why
    return gpus, "nvidia-smi"


def _gpus_from_torch(probe: JsonObject, smi_why: str, has_torch: bool) -> tuple[list[GpuDevice], str]:
    listed = torch_parsers.gpus_from_probe(probe.get("gpus"))
    if listed:
        return listed, "torch.cuda"
    if not has_torch:
        return [], f"no GPU found: {smi_why}, and torch is not installed"
    if probe.get("cuda_available") is False:
        return [], f"no GPU found: {smi_why}, and torch.cuda.is_available() is False"
    return [], f"no GPU found: {smi_why}"


def read_infiniband(detail: dict[str, str]) -> tuple[list[IbvDevice] | None, str]:
    """HCAs and their ports from ``ibv_devinfo``, else from ``/sys/class/infiniband`` (Linux)."""
    result = run_command(["ibv_devinfo"])
    # "No IB devices found" comes with a non-zero exit: keep that answer.
    text = result.stdout if result.stdout is not None else result.output
    devices = rdma_parsers.parse_ibv_devinfo(text)
    if devices is not None:
        return devices, "ibv_devinfo"
    detail["ibv_devinfo"] = result.why or "ibv_devinfo output not understood"
    if platform.system() != "Linux":
        return None, detail["ibv_devinfo"]
    sysfs, why = read_sysfs_infiniband()
    if sysfs is None:
        detail["sysfs"] = why or "/sys/class/infiniband is not readable"
        return None, f"{detail['ibv_devinfo']}; {detail['sysfs']}"
    return rdma_parsers.rdma_devices_from_sysfs(dict(sysfs)), "/sys/class/infiniband"


def read_shm(path: str, detail: dict[str, str]) -> ShmFacts | None:
    """Size and room of ``path`` (tmpfs): NCCL's shared-memory transport and DataLoader workers use it."""
    if not os.path.isdir(path):
        detail["shm"] = f"{path} does not exist"
        return None
    try:
        stat = os.statvfs(path)
    except OSError as error:
        detail["shm"] = f"cannot statvfs {path}: {error.strerror or error}"
        return None
    return torch_parsers.shm_from_statvfs(path, stat.f_frsize, stat.f_blocks, stat.f_bavail)


def network_id() -> str | None:
    """Which network stack this node's processes share: this boot of the machine and, on Linux, its
    network namespace. Two nodes with the same id reach each other's listeners on loopback; a hostname
    says nothing of that (two Macs are both "MacBook-Pro.local" out of the box, namespaces share one)."""
    from agent.facts import read_boot_id

    boot = read_boot_id()
    if boot is None:
        return None
    try:
        return f"{boot}/{os.readlink('/proc/self/ns/net')}"
    except OSError:
        return boot if platform.system() == "Darwin" else None


def _bool_or_none(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


def _last_json_line(text: str | None) -> JsonObject | None:
    # A site hook or torch itself may print before the probe does: its answer is the last line.
    try:
        answer = json.loads(_last_line(text or ""))
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _first_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[0].strip()[:200] if lines else ""
