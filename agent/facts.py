"""What a node is: OS, chip, memory, disk, Python and MLX, measured on the node itself.

``collect_facts`` never raises for a fact it cannot read: that fact is ``None``. Every
value is a plain str/int/float/bool/None/list/dict so the result can cross the wire as is.
Child processes get ``stdin=DEVNULL``: the agent's own stdin carries protocol frames.
"""

from __future__ import annotations

import getpass
import importlib.metadata
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from typing import TYPE_CHECKING

from agent import facts_parsers

if TYPE_CHECKING:
    from shared.agent_api.common import JsonObject
    from shared.agent_api.facts import FactsReply, PythonFacts, SystemFacts

COMMAND_TIMEOUT_S = 10.0
GPU_PROBE_TIMEOUT_S = 30.0

# Run in the node's Python; imports MLX there so the agent's own process never does.
_GPU_PROBE = """\
import json
import mlx.core as mx
def available(name):
    try:
        backend = getattr(mx, name, None)
        return None if backend is None else bool(backend.is_available())
    except Exception:
        return None
print(json.dumps({"metal": available("metal"), "cuda": available("cuda"),
                  "device": str(mx.default_device())}))
"""

# Asks another interpreter for its versions without importing mlx.
_VERSIONS_PROBE = """\
import json, platform
from importlib import metadata
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
print(json.dumps({"python_version": platform.python_version(),
                  "mlx_version": version("mlx"), "mlx_lm_version": version("mlx-lm")}))
"""


def collect_facts(workdir: str | None = None, python_executable: str | None = None) -> FactsReply:
    """Describe this node; ``python_executable`` is the interpreter ranks will use
    (default: the agent's own), and the Python, MLX and GPU facts are about it."""
    python = python_executable or sys.executable
    workdir_path = _expand(workdir)
    hostname, user, home, arch = socket.gethostname() or None, read_user(), read_home(), platform.machine() or None
    disk_free = read_disk_free(workdir_path)
    # MLX's own switches in the environment ranks inherit on this node (they start from the
    # same user's SSH login as this agent); some are known to hurt (MLX_METAL_FAST_SYNCH).
    mlx_env = {key: value for key, value in os.environ.items() if key.startswith("MLX_")}
    system = read_system_facts()
    python_facts = read_python_facts(python)
    gpu, gpu_detail = _gpu_facts(python, python_facts["mlx_version"])
    return {
        "hostname": hostname,
        "user": user,
        "home": home,
        "arch": arch,
        "workdir": workdir_path,
        "disk_free_bytes": disk_free,
        "python_executable": python,
        "mlx_env": mlx_env,
        **system,
        **python_facts,
        "gpu": gpu,
        "gpu_detail": gpu_detail,
        "boot_id": read_boot_id(),
    }


def read_boot_id() -> str | None:
    """This boot of the machine: Linux's random boot id, macOS's boot session UUID. The daemon
    tells a node that was rebooted (a new id) from an agent that merely reconnected."""
    text = read_text("/proc/sys/kernel/random/boot_id")
    if text is None and platform.system() == "Darwin":
        text = run_command(["sysctl", "-n", "kern.bootsessionuuid"])
    return text.strip() or None if text else None


def read_system_facts() -> SystemFacts:
    """OS, chip, cores and memory, read the way this OS allows."""
    system = platform.system()
    if system == "Darwin":
        facts = read_macos_facts()
    elif system == "Linux":
        facts = read_linux_facts()
    else:
        facts = _generic_os_facts(system)
    if facts["cores"] is None:
        facts["cores"] = os.cpu_count()
    if facts["memory_bytes"] is None:
        facts["memory_bytes"] = read_physical_memory()
    return facts


def read_macos_facts() -> SystemFacts:
    versions = facts_parsers.parse_sw_vers(run_command(["sw_vers"]) or "")
    hardware = facts_parsers.parse_sp_hardware(
        run_command(["system_profiler", "SPHardwareDataType", "-json"]) or ""
    )
    name = versions["product_name"] or "macOS"
    version = versions["product_version"] or platform.mac_ver()[0] or None
    return {
        "os": "macOS",
        "os_version": version,
        "os_build": versions["build_version"],
        "os_pretty": f"{name} {version}" if version else None,
        "chip": hardware["chip"],
        "cores": hardware["cores"],
        "performance_cores": hardware["performance_cores"],
        "efficiency_cores": hardware["efficiency_cores"],
        "memory_bytes": hardware["memory_bytes"],
        # The system sleep timer: a Mac that sleeps between attempts drops off the cluster.
        "power": facts_parsers.parse_pmset(run_command(["pmset", "-g"]) or ""),
    }


def read_linux_facts() -> SystemFacts:
    cpu = facts_parsers.parse_proc_cpuinfo(read_text("/proc/cpuinfo") or "")
    release_text = read_text("/etc/os-release") or read_text("/usr/lib/os-release") or ""
    release = facts_parsers.parse_os_release(release_text)
    return {
        "os": "Linux",
        "os_version": release["version"] or platform.release() or None,
        "os_build": platform.release() or None,
        "os_pretty": release["name"],
        "chip": cpu["chip"],
        "cores": cpu["cores"],
        "performance_cores": None,
        "efficiency_cores": None,
        "memory_bytes": facts_parsers.parse_meminfo(read_text("/proc/meminfo") or ""),
        "power": None,  # system sleep is a macOS concern here (pmset)
    }


def _generic_os_facts(system: str) -> SystemFacts:
    return {
        "os": system or None,
        "os_version": platform.release() or None,
        "os_build": platform.version() or None,
        "os_pretty": None,
        "chip": platform.processor() or None,
        "cores": None,
        "performance_cores": None,
        "efficiency_cores": None,
        "memory_bytes": None,
        "power": None,
    }


def read_python_facts(python: str) -> PythonFacts:
    """Python, mlx and mlx-lm versions of ``python``, without importing mlx."""
    if _is_this_interpreter(python):
        return {
            "python_version": platform.python_version(),
            "mlx_version": read_package_version("mlx"),
            "mlx_lm_version": read_package_version("mlx-lm"),
        }
    return read_other_python_facts(python)


def read_other_python_facts(python: str) -> PythonFacts:
    """Ask another interpreter for its versions; all None if it cannot answer."""
    output = run_command([python, "-c", _VERSIONS_PROBE], timeout=GPU_PROBE_TIMEOUT_S)
    answer = _last_json_line(output or "") or {}
    return {"python_version": _str_or_none(answer.get("python_version")),
            "mlx_version": _str_or_none(answer.get("mlx_version")),
            "mlx_lm_version": _str_or_none(answer.get("mlx_lm_version"))}


def read_package_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def detect_gpu(python: str) -> tuple[str | None, str]:
    """Ask MLX in ``python`` which accelerator it has: ("metal"|"cuda"|"none"|None, detail)."""
    try:
        completed = subprocess.run(
            [python, "-c", _GPU_PROBE],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=GPU_PROBE_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"mlx GPU probe timed out after {GPU_PROBE_TIMEOUT_S:.0f} s"
    except (OSError, ValueError) as error:
        return None, f"could not run {python}: {error}"
    if completed.returncode != 0:
        return None, f"mlx GPU probe failed: {_last_line(completed.stderr) or completed.returncode}"
    answer = _last_json_line(completed.stdout)
    if answer is None:
        return None, f"mlx GPU probe gave no answer: {_last_line(completed.stdout)!r}"
    return _classify_gpu(answer)


def _classify_gpu(answer: JsonObject) -> tuple[str | None, str]:
    device = _str_or_none(answer.get("device")) or "unknown device"
    metal, cuda = answer.get("metal"), answer.get("cuda")
    if metal is True:
        return "metal", device
    if cuda is True:
        return "cuda", device
    if metal is False and cuda is False:
        return "none", device
    return None, f"mlx could not say whether Metal or CUDA is available ({device})"


def _gpu_facts(python: str, mlx_version: str | None) -> tuple[str | None, str]:
    if mlx_version is None:
        return None, "mlx is not installed"
    # Importing MLX in a child costs a second of CPU; every agent start (reconnects
    # included) would pay it. The answer only changes with the interpreter or MLX.
    key = f"{os.path.abspath(python)}|{mlx_version}"
    cached = _read_gpu_cache().get(key)
    if isinstance(cached, list) and len(cached) == 2 and cached[0] in ("metal", "cuda", "none"):
        return cached[0], str(cached[1])
    gpu, detail = detect_gpu(python)
    if gpu is not None:
        _write_gpu_cache(key, gpu, detail)
    return gpu, detail


def _gpu_cache_path() -> str:
    return os.path.join(os.path.expanduser("~"), ".coord", "cache", "gpu.json")


def _read_gpu_cache() -> JsonObject:
    try:
        with open(_gpu_cache_path(), encoding="utf-8") as handle:
            data = json.load(handle)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_gpu_cache(key: str, gpu: str, detail: str) -> None:
    path = _gpu_cache_path()
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        data = _read_gpu_cache()
        data[key] = [gpu, detail]
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(data, handle)
        os.replace(tmp, path)  # atomic: concurrent agents never read half a file
    except OSError:
        pass  # a cache that cannot be written only costs time


def read_disk_free(workdir: str | None) -> int | None:
    """Free bytes on the filesystem that holds (or will hold) ``workdir``."""
    if workdir is None:
        return None
    path = _nearest_existing(workdir)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def read_physical_memory() -> int | None:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None
    return total if total > 0 else None


def read_user() -> str | None:
    try:
        return getpass.getuser() or None
    except (OSError, KeyError, ImportError):
        return None


def read_home() -> str | None:
    home = os.path.expanduser("~")
    return home if home and home != "~" else None


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def run_command(argv: list[str], timeout: float = COMMAND_TIMEOUT_S) -> str | None:
    """Stdout of ``argv`` (no shell), or None if it is missing, fails or overruns."""
    try:
        completed = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    return completed.stdout if completed.returncode == 0 else None


def _expand(workdir: str | None) -> str | None:
    if not workdir:
        return None
    return os.path.abspath(os.path.expanduser(workdir))


def _nearest_existing(path: str) -> str:
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _is_this_interpreter(python: str) -> bool:
    # Compare paths, not inodes: a venv's python is a symlink to the base interpreter,
    # yet it sees different packages.
    return os.path.abspath(python) == os.path.abspath(sys.executable)


def _last_json_line(text: str) -> JsonObject | None:
    # MLX or site hooks may print before the probe does; its answer is the last line.
    try:
        answer = json.loads(_last_line(text))
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


def _last_line(text: str) -> str:
    lines = [line for line in (text or "").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and value else None
