"""Parsers for the RDMA command outputs and files the agent reads: ``rdma_ctl status`` (macOS),
``ibv_devices`` and ``ibv_devinfo``, and ``/sys/class/infiniband`` (Linux).

An ``rdma_ctl`` answer other than the two documented ones is not "enabled".

Pure functions: text in, plain values out, no I/O, stdlib only (this runs in the node's
own Python, 3.10 or later). Output that cannot be read is ``None`` ("unknown"), never
``[]``, ``False`` or ``0``. Every value returned is a plain str/int/float/bool/None/list/dict
with string keys, so it can cross the wire (msgpack) as is.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from agent.parse_helpers import leading_int

if TYPE_CHECKING:
    from shared.agent_api.common import JsonObject
    from shared.agent_api.topology import ActiveRdmaPort, IbvDevice, IbvPort

# --- rdma_ctl ----------------------------------------------------------------------------

_RDMA_CTL_ANSWERS = ("enabled", "disabled")


def parse_rdma_ctl_status(text: str | None) -> str | None:
    """``rdma_ctl status`` prints ``enabled`` or ``disabled``; anything else is None."""
    if not isinstance(text, str):
        return None
    answer = text.strip().lower()
    return answer if answer in _RDMA_CTL_ANSWERS else None


# --- ibv_devices / ibv_devinfo -----------------------------------------------------------

_GUID = re.compile(r"^(?:[0-9a-fA-F]{16}|[0-9a-fA-F]{4}(?::[0-9a-fA-F]{4}){3})$")
_NO_DEVICES = "no ib devices found"


def parse_ibv_devices(text: str | None) -> list[str] | None:
    """Device names from ``ibv_devices``: the header alone is ``[]``, anything
    without the ``device / node GUID`` header, or with a row that is not
    ``<name> <guid>``, is None."""
    if not isinstance(text, str):
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    header_at = None
    for index, line in enumerate(lines):
        words = line.split()
        if words[:1] == ["device"] and "GUID" in words:
            header_at = index
            break
    if header_at is None:
        return None
    devices: list[str] = []
    for line in lines[header_at + 1:]:
        if set(line) <= set("-\t "):
            continue
        words = line.split()
        if len(words) != 2 or not _GUID.match(words[1]):
            return None
        devices.append(words[0])
    return devices


def parse_ibv_devinfo(text: str | None) -> list[IbvDevice] | None:
    """Devices and ports from ``ibv_devinfo``.

    Returns ``[{"name", "transport", "node_guid", "phys_port_cnt", "ports": [{"port",
    "state", "link_layer", "active_mtu", "max_mtu"}]}]``; ``state`` is the symbolic
    name (``PORT_ACTIVE``, ``PORT_DOWN``, ...). "No IB devices found" is ``[]``;
    output with no ``hca_id`` block is None.
    """
    if not isinstance(text, str):
        return None
    devices: list[IbvDevice] = []
    device: IbvDevice | None = None
    port: IbvPort | None = None
    for raw in text.splitlines():
        line = raw.strip()
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "hca_id":
            if not value:
                return None
            device = {
                "name": value,
                "transport": None,
                "node_guid": None,
                "phys_port_cnt": None,
                "ports": [],
            }
            devices.append(device)
            port = None
        elif device is None:
            continue
        elif key == "port":
            number = leading_int(value)
            if number is None:
                return None
            port = {
                "port": number,
                "state": None,
                "link_layer": None,
                "active_mtu": None,
                "max_mtu": None,
            }
            device["ports"].append(port)
        elif port is not None:
            _read_port_line(port, key, value)
        else:
            _read_device_line(device, key, value)
    if not devices:
        return [] if _NO_DEVICES in text.lower() else None
    return devices


def _read_port_line(port: IbvPort, key: str, value: str) -> None:
    """A ``key: value`` line of a port block; keys the port does not keep are skipped."""
    if key == "state":
        port["state"] = _port_state_name(value)
    elif key == "link_layer":
        port["link_layer"] = value or None
    elif key == "active_mtu":
        port["active_mtu"] = leading_int(value)
    elif key == "max_mtu":
        port["max_mtu"] = leading_int(value)


def _read_device_line(device: IbvDevice, key: str, value: str) -> None:
    """A ``key: value`` line of a device block, before its first port."""
    if key == "transport":
        device["transport"] = value or None
    elif key == "node_guid":
        device["node_guid"] = value or None
    elif key == "phys_port_cnt":
        device["phys_port_cnt"] = leading_int(value)


def _port_state_name(value: str) -> str | None:
    """``PORT_DOWN (1)`` -> ``PORT_DOWN``."""
    words = value.split()
    if not words:
        return None
    name = words[0].upper()
    return name if re.fullmatch(r"PORT_[A-Z_]+", name) else None


_SYSFS_PORT_STATES = {
    "DOWN": "PORT_DOWN",
    "INIT": "PORT_INIT",
    "ARMED": "PORT_ARMED",
    "ACTIVE": "PORT_ACTIVE",
    "ACTIVE_DEFER": "PORT_ACTIVE_DEFER",
}


def parse_sysfs_port_state(text: str | None) -> str | None:
    """``/sys/class/infiniband/<dev>/ports/<n>/state`` (``4: ACTIVE``) -> ``PORT_ACTIVE``."""
    if not isinstance(text, str):
        return None
    _, _, name = text.strip().partition(":")
    return _SYSFS_PORT_STATES.get(name.strip().upper())


def rdma_devices_from_sysfs(raw: JsonObject | None) -> list[IbvDevice] | None:
    """Turn what the agent read under ``/sys/class/infiniband`` into
    :func:`parse_ibv_devinfo`'s shape.

    ``raw`` is ``{device: {"ports": {"1": {"state": "4: ACTIVE", "link_layer":
    "Ethernet"}}, "netdevs": ["eth2"]}}`` (``agent.topology.read_sysfs_infiniband``), each
    field checked here; each device also gets ``"netdevs"``.
    """
    if not isinstance(raw, dict):
        return None
    devices: list[IbvDevice] = []
    for name in sorted(raw):
        info = raw[name] if isinstance(raw[name], dict) else {}
        ports: list[IbvPort] = []
        raw_ports = info.get("ports")
        if not isinstance(raw_ports, dict):
            raw_ports = {}
        for number in sorted(raw_ports, key=lambda p: (leading_int(p) or 0, p)):
            port = raw_ports[number] if isinstance(raw_ports[number], dict) else {}
            link_layer = port.get("link_layer")
            ports.append({
                "port": leading_int(number),
                "state": parse_sysfs_port_state(port.get("state")),
                "link_layer": link_layer.strip() or None if isinstance(link_layer, str) else None,
                "active_mtu": None,
                "max_mtu": None,
            })
        netdevs = info.get("netdevs")
        devices.append({
            "name": name,
            "transport": None,
            "node_guid": None,
            "phys_port_cnt": len(ports),
            "ports": ports,
            "netdevs": sorted(n for n in netdevs if isinstance(n, str))
            if isinstance(netdevs, list) else [],
        })
    return devices


def active_rdma_ports(devices: list[IbvDevice] | None) -> list[ActiveRdmaPort] | None:
    """The ports in state ``PORT_ACTIVE``: ``[{"device", "port", "state", "link_layer",
    "active_mtu"}]``; None when the device list is unknown."""
    if devices is None:
        return None
    active: list[ActiveRdmaPort] = []
    for device in devices:
        for port in device.get("ports") or []:
            if port.get("state") == "PORT_ACTIVE":
                active.append({
                    "device": device.get("name"),
                    "port": port.get("port"),
                    "state": port.get("state"),
                    "link_layer": port.get("link_layer"),
                    "active_mtu": port.get("active_mtu"),
                })
    return active
