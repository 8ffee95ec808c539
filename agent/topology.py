"""RDMA and Thunderbolt topology of this node, read on the node itself.

``collect_topology`` never raises for something it cannot read: that value is ``None``
and ``detail`` says why. Commands run without a shell, with a timeout and
``stdin=DEVNULL`` (the agent's own stdin carries protocol frames). Stdlib only: this runs
in the node's Python (3.10 or later). The assembly from command outputs is split out
(:func:`build_macos_topology`, :func:`build_linux_topology`) so it can be checked with
recorded outputs on a machine that cannot run the commands.

Shape (plain data, msgpack-able)::

    {"platform": "macOS" | "Linux" | <platform.system()>,
     "os_version": "26.2" (macOS product version; Linux kernel release) | None,
     "rdma": {"state": "enabled" | "disabled" | None,
              "devices": ["rdma_en6", ...] | None,
              "active_ports": [{"device", "port", "state", "link_layer", "active_mtu"}] | None,
              "ports": [{"device", "port", "state", "link_layer", "interface"}] | None},
     "thunderbolt": thunderbolt_parsers.parse_thunderbolt(...) with each bus's
                    "port_name", "interface", "rdma_device" | None,
     "thunderbolt_bridge": {"enabled": bool | None, "interface": "bridge0" | None,
                            "members": [...]},
     "interfaces": [{"name", "kind", "addresses": [{"family", "address", "prefixlen",
                     "scope"}], "up", "port"}] | None,
     "detail": {source: why it could not be read}}
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from agent import interface_parsers, rdma_parsers, thunderbolt_parsers

if TYPE_CHECKING:
    from shared.agent_api.topology import (
        BridgeInfo,
        HardwarePort,
        IbvDevice,
        IfconfigInterface,
        InterfaceInfo,
        IpInterface,
        ParsedInterface,
        RdmaPortInfo,
        SysfsDevice,
        SysfsPort,
        TopologyReply,
    )

COMMAND_TIMEOUT_S = 10.0
SYSTEM_PROFILER_TIMEOUT_S = 30.0

# An agent started over SSH may have a short PATH; these tools live in the sbin dirs.
_EXTRA_PATH = ("/usr/bin", "/bin", "/usr/sbin", "/sbin", "/usr/local/bin", "/opt/homebrew/bin")

SYSFS_INFINIBAND = "/sys/class/infiniband"

_MACOS_COMMANDS = {
    "rdma_ctl": (["rdma_ctl", "status"], COMMAND_TIMEOUT_S),
    "ibv_devices": (["ibv_devices"], COMMAND_TIMEOUT_S),
    "ibv_devinfo": (["ibv_devinfo"], COMMAND_TIMEOUT_S),
    "system_profiler": (
        ["system_profiler", "SPThunderboltDataType", "-json"],
        SYSTEM_PROFILER_TIMEOUT_S,
    ),
    "networksetup": (["networksetup", "-listallhardwareports"], COMMAND_TIMEOUT_S),
    "ifconfig": (["ifconfig"], COMMAND_TIMEOUT_S),
}


def collect_topology() -> TopologyReply:
    """Describe this node's RDMA devices, Thunderbolt cables and network interfaces."""
    system = platform.system()
    if system == "Darwin":
        return collect_macos_topology()
    if system == "Linux":
        return collect_linux_topology()
    return _empty_topology(system or None, platform.release() or None,
                           f"topology is read on macOS and Linux, not {system or 'this OS'}")


# --- macOS -------------------------------------------------------------------------------


def collect_macos_topology() -> TopologyReply:
    with ThreadPoolExecutor(max_workers=len(_MACOS_COMMANDS)) as pool:
        futures = {
            name: pool.submit(run_command, argv, timeout)
            for name, (argv, timeout) in _MACOS_COMMANDS.items()
        }
        results = {name: future.result() for name, future in futures.items()}
    outputs: dict[str, str | None] = {}
    detail: dict[str, str] = {}
    for name, result in results.items():
        if name in ("ibv_devinfo", "ibv_devices") and result.stdout is None and result.why:
            # ibv_devinfo exits non-zero with "No IB devices found": keep that answer.
            text = (result.stderr or "") + (result.output or "")
            if "no ib devices found" in text.lower():
                outputs[name] = text
                continue
        outputs[name] = result.stdout
        if result.why:
            detail[name] = result.why
    return build_macos_topology(outputs, read_macos_version(), detail)


def read_macos_version() -> str | None:
    result = run_command(["sw_vers", "-productVersion"], COMMAND_TIMEOUT_S)
    version = (result.stdout or "").strip()
    if version and version[0].isdigit():
        return version
    return platform.mac_ver()[0] or None


def build_macos_topology(
    outputs: dict[str, str | None],
    os_version: str | None,
    detail: dict[str, str] | None = None,
) -> TopologyReply:
    """Assemble the topology from the commands' outputs (None: not run or failed).

    Keys of ``outputs``: rdma_ctl, ibv_devices, ibv_devinfo, system_profiler,
    networksetup, ifconfig.
    """
    detail = dict(detail or {})

    state = rdma_parsers.parse_rdma_ctl_status(outputs.get("rdma_ctl"))
    if state is None and "rdma_ctl" not in detail:
        detail["rdma_ctl"] = _unreadable("rdma_ctl status", outputs.get("rdma_ctl"))

    devinfo = rdma_parsers.parse_ibv_devinfo(outputs.get("ibv_devinfo"))
    if devinfo is None and "ibv_devinfo" not in detail:
        detail["ibv_devinfo"] = _unreadable("ibv_devinfo", outputs.get("ibv_devinfo"))
    devices = rdma_parsers.parse_ibv_devices(outputs.get("ibv_devices"))
    if devices is None and "ibv_devices" not in detail:
        detail["ibv_devices"] = _unreadable("ibv_devices", outputs.get("ibv_devices"))
    if devices is None and devinfo is not None:
        devices = [d["name"] for d in devinfo]

    ports = thunderbolt_parsers.parse_networksetup_ports(outputs.get("networksetup"))
    if ports is None and "networksetup" not in detail:
        detail["networksetup"] = _unreadable(
            "networksetup -listallhardwareports", outputs.get("networksetup")
        )

    parsed_thunderbolt = thunderbolt_parsers.parse_thunderbolt(outputs.get("system_profiler"))
    if parsed_thunderbolt is None and "system_profiler" not in detail:
        detail["system_profiler"] = _unreadable(
            "system_profiler SPThunderboltDataType -json", outputs.get("system_profiler")
        )
    thunderbolt = thunderbolt_parsers.annotate_thunderbolt(parsed_thunderbolt, ports)

    rdma_ports = _devinfo_ports(devinfo, _interfaces_of_rdma(ports))
    ifconfig = interface_parsers.parse_ifconfig(outputs.get("ifconfig"))
    if ifconfig is None and "ifconfig" not in detail:
        detail["ifconfig"] = _unreadable("ifconfig", outputs.get("ifconfig"))

    kinds = thunderbolt_parsers.interface_kinds(ports)
    port_names = {p["device"]: p["port"] for p in ports or [] if p.get("device")}
    interfaces: list[InterfaceInfo] | None = None
    if ifconfig is not None:
        interfaces = [
            {
                "name": entry["name"],
                "kind": interface_parsers.macos_interface_kind(entry["name"], kinds),
                "addresses": entry["addresses"],
                "up": entry["up"],
                "port": port_names.get(entry["name"]),
            }
            for entry in ifconfig
        ]

    bridge_name = thunderbolt_parsers.thunderbolt_bridge_device(ports) or "bridge0"
    return {
        "platform": "macOS",
        "os_version": os_version,
        "rdma": {
            "state": state,
            "devices": devices,
            "active_ports": rdma_parsers.active_rdma_ports(devinfo),
            "ports": rdma_ports,
        },
        "thunderbolt": thunderbolt,
        "thunderbolt_bridge": _macos_bridge(bridge_name, ifconfig),
        "interfaces": interfaces,
        "detail": detail,
    }


def _macos_bridge(name: str, ifconfig: list[IfconfigInterface] | None) -> BridgeInfo:
    """Enabled when the bridge interface is up with member interfaces."""
    if ifconfig is None:
        return {"enabled": None, "interface": name, "members": []}
    for entry in ifconfig:
        if entry["name"] == name:
            members = list(entry["members"])
            return {
                "enabled": "UP" in entry["flags"] and bool(members),
                "interface": name,
                "members": members,
            }
    return {"enabled": False, "interface": None, "members": []}


def _interfaces_of_rdma(ports: list[HardwarePort] | None) -> dict[str, str]:
    """``{"rdma_en6": "en6"}`` for the Thunderbolt interfaces networksetup lists."""
    return {
        rdma_device: entry["interface"]
        for entry in thunderbolt_parsers.thunderbolt_receptacles(ports).values()
        if (rdma_device := entry["rdma_device"]) is not None  # an interface always has one
    }


def _devinfo_ports(
    devinfo: list[IbvDevice] | None, interfaces: dict[str, str]
) -> list[RdmaPortInfo] | None:
    if devinfo is None:
        return None
    return [
        {
            "device": device["name"],
            "port": port.get("port"),
            "state": port.get("state"),
            "link_layer": port.get("link_layer"),
            "interface": interfaces.get(device["name"])
            or next(iter(device.get("netdevs") or []), None),
        }
        for device in devinfo
        for port in device.get("ports") or []
    ]


# --- Linux -------------------------------------------------------------------------------


def collect_linux_topology(sysfs_infiniband: str = SYSFS_INFINIBAND) -> TopologyReply:
    detail: dict[str, str] = {}
    sysfs, why = read_sysfs_infiniband(sysfs_infiniband)
    if why:
        detail["sysfs"] = why

    ibv = run_command(["ibv_devices"], COMMAND_TIMEOUT_S)
    if ibv.why:
        detail["ibv_devices"] = ibv.why

    ip = run_command(["ip", "-j", "addr"], COMMAND_TIMEOUT_S)
    ifconfig_text = None
    if ip.why:
        detail["ip"] = ip.why
    if interface_parsers.parse_ip_json_addr(ip.stdout) is None:
        fallback = run_command(["ifconfig", "-a"], COMMAND_TIMEOUT_S)
        ifconfig_text = fallback.stdout
        if fallback.why:
            detail["ifconfig"] = fallback.why
    return build_linux_topology(
        sysfs, ibv.stdout, ip.stdout, platform.release() or None, detail,
        ifconfig_text=ifconfig_text,
    )


def read_sysfs_infiniband(root: str = SYSFS_INFINIBAND) -> tuple[dict[str, SysfsDevice] | None, str | None]:
    """``({device: {"ports": {"1": {"state", "link_layer"}}, "netdevs": [...]}}, why)``.

    No ``/sys/class/infiniband`` is ``{}`` (no RDMA device is registered); a directory
    that cannot be listed is None with the reason.
    """
    if not os.path.isdir(root):
        if os.path.isdir(os.path.dirname(root)):
            return {}, None
        return None, f"{os.path.dirname(root)} is not readable"
    try:
        names = sorted(os.listdir(root))
    except OSError as error:
        return None, f"cannot list {root}: {error.strerror or error}"
    devices: dict[str, SysfsDevice] = {}
    for name in names:
        base = os.path.join(root, name)
        ports: dict[str, SysfsPort] = {}
        try:
            port_numbers = sorted(os.listdir(os.path.join(base, "ports")))
        except OSError:
            port_numbers = []
        for number in port_numbers:
            port_dir = os.path.join(base, "ports", number)
            ports[number] = {
                "state": _read_text(os.path.join(port_dir, "state")),
                "link_layer": _read_text(os.path.join(port_dir, "link_layer")),
            }
        try:
            netdevs = sorted(os.listdir(os.path.join(base, "device", "net")))
        except OSError:
            netdevs = []
        devices[name] = {"ports": ports, "netdevs": netdevs}
    return devices, None


def build_linux_topology(
    sysfs: dict[str, SysfsDevice] | None,
    ibv_devices_text: str | None,
    ip_json_text: str | None,
    os_version: str | None,
    detail: dict[str, str] | None = None,
    *,
    ifconfig_text: str | None = None,
) -> TopologyReply:
    """Assemble the topology from what was read under /sys, ``ibv_devices`` and
    ``ip -j addr`` (or, where ``ip`` cannot answer, ``ifconfig``)."""
    detail = dict(detail or {})
    devinfo = rdma_parsers.rdma_devices_from_sysfs(sysfs)
    names = [d["name"] for d in devinfo] if devinfo is not None else None
    listed = rdma_parsers.parse_ibv_devices(ibv_devices_text)
    if listed is not None:
        names = sorted(set(names or []) | set(listed))
    if names is None:
        state = None
    elif names:
        state = "enabled"
    else:
        state = "disabled"
        detail.setdefault("rdma", f"no RDMA device under {SYSFS_INFINIBAND}")

    ip_interfaces = interface_parsers.parse_ip_json_addr(ip_json_text)
    source: Sequence[ParsedInterface] | None = ip_interfaces
    if source is None:
        source = interface_parsers.parse_ifconfig(ifconfig_text)
    if source is None:
        detail.setdefault("interfaces", "neither `ip -j addr` nor `ifconfig` could be read")
    interfaces: list[InterfaceInfo] | None = None
    if source is not None:
        interfaces = [
            {
                "name": entry["name"],
                "kind": interface_parsers.linux_interface_kind(entry["name"]),
                "addresses": entry["addresses"],
                "up": entry["up"],
                "port": None,
            }
            for entry in source
        ]
    detail.setdefault("thunderbolt", "Thunderbolt topology is read on macOS only")
    return {
        "platform": "Linux",
        "os_version": os_version,
        "rdma": {
            "state": state,
            "devices": names,
            "active_ports": rdma_parsers.active_rdma_ports(devinfo),
            "ports": _devinfo_ports(devinfo, {}),
        },
        "thunderbolt": None,
        "thunderbolt_bridge": _linux_bridge(ip_interfaces),
        "interfaces": interfaces,
        "detail": detail,
    }


def _linux_bridge(interfaces: list[IpInterface] | None) -> BridgeInfo:
    """Enabled when a thunderbolt* interface is enslaved to a bridge that is up."""
    if interfaces is None:
        return {"enabled": None, "interface": None, "members": []}
    by_name = {entry["name"]: entry for entry in interfaces}
    bridges: dict[str, list[str]] = {}
    for entry in interfaces:
        master_name = entry.get("master")
        if entry["name"].startswith("thunderbolt") and master_name:
            bridges.setdefault(master_name, []).append(entry["name"])
    for bridge, members in sorted(bridges.items()):
        master = by_name.get(bridge)
        if master is not None and "UP" in master.get("flags", []):
            return {"enabled": True, "interface": bridge, "members": sorted(members)}
    return {"enabled": False, "interface": None, "members": []}


def _empty_topology(system: str | None, version: str | None, why: str) -> TopologyReply:
    return {
        "platform": system,
        "os_version": version,
        "rdma": {"state": None, "devices": None, "active_ports": None, "ports": None},
        "thunderbolt": None,
        "thunderbolt_bridge": {"enabled": None, "interface": None, "members": []},
        "interfaces": None,
        "detail": {"topology": why},
    }


# --- running commands --------------------------------------------------------------------


class CommandResult:
    """stdout when the command ran and exited 0, else None with ``why``."""

    __slots__ = ("stdout", "stderr", "output", "why")

    def __init__(self, stdout: str | None, stderr: str | None, output: str | None,
                 why: str | None) -> None:
        self.stdout = stdout
        self.stderr = stderr
        self.output = output  # stdout even after a non-zero exit
        self.why = why


def find_command(name: str) -> str | None:
    path = os.environ.get("PATH", "")
    extended = os.pathsep.join([path, *_EXTRA_PATH]) if path else os.pathsep.join(_EXTRA_PATH)
    return shutil.which(name, path=extended)


def run_command(argv: list[str], timeout: float = COMMAND_TIMEOUT_S) -> CommandResult:
    executable = find_command(argv[0])
    if executable is None:
        return CommandResult(None, None, None, f"{argv[0]} not found")
    try:
        completed = subprocess.run(
            [executable, *argv[1:]],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return CommandResult(None, None, None, f"{' '.join(argv)} timed out after {timeout:g} s")
    except (OSError, ValueError) as error:
        return CommandResult(None, None, None, f"could not run {argv[0]}: {error}")
    if completed.returncode != 0:
        last = _last_line(completed.stderr) or _last_line(completed.stdout)
        why = f"{' '.join(argv)} exited with status {completed.returncode}"
        return CommandResult(None, completed.stderr, completed.stdout,
                             f"{why}: {last}" if last else why)
    return CommandResult(completed.stdout, completed.stderr, completed.stdout, None)


def _unreadable(command: str, text: str | None) -> str:
    if text is None:
        return f"{command} gave no output"
    first = _first_line(text)
    return f"{command} output not understood: {first!r}" if first else f"{command} printed nothing"


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def _last_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def _first_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[0][:200] if lines else ""
