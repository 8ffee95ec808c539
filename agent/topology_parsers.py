"""Parsers for the RDMA, Thunderbolt and network command outputs the agent reads.

Pure functions: text in, plain values out, no I/O, stdlib only (this runs in the node's
own Python, 3.10 or later). Output that cannot be read is ``None`` ("unknown"), never
``[]``, ``False`` or ``0``: a Mac whose ``system_profiler`` printed garbage is not a Mac
with no Thunderbolt ports, and an ``rdma_ctl`` answer other than the two documented ones
is not "enabled".

Every value returned is a plain str/int/float/bool/None/list/dict with string keys, so it
can cross the wire (msgpack) as is.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import math
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.agent_api.common import JsonObject
    from shared.agent_api.topology import (
        ActiveRdmaPort,
        AddressInfo,
        HardwarePort,
        IbvDevice,
        IbvPort,
        IfconfigInterface,
        IpInterface,
        NamedThunderboltBus,
        NamedThunderboltInfo,
        NamedThunderboltPeer,
        Receptacle,
        ThunderboltBus,
        ThunderboltDevice,
        ThunderboltHost,
        ThunderboltInfo,
    )

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
            number = _leading_int(value)
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
        port["active_mtu"] = _leading_int(value)
    elif key == "max_mtu":
        port["max_mtu"] = _leading_int(value)


def _read_device_line(device: IbvDevice, key: str, value: str) -> None:
    """A ``key: value`` line of a device block, before its first port."""
    if key == "transport":
        device["transport"] = value or None
    elif key == "node_guid":
        device["node_guid"] = value or None
    elif key == "phys_port_cnt":
        device["phys_port_cnt"] = _leading_int(value)


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
        for number in sorted(raw_ports, key=lambda p: (_leading_int(p) or 0, p)):
            port = raw_ports[number] if isinstance(raw_ports[number], dict) else {}
            link_layer = port.get("link_layer")
            ports.append({
                "port": _leading_int(number),
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


# --- system_profiler SPThunderboltDataType -json -----------------------------------------

_PLAIN_SPEED = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/s\s*(?:x\s*(\d+))?\s*$", re.IGNORECASE)
_UP_TO_SPEED = re.compile(r"^\s*up\s+to\s+(\d+(?:\.\d+)?)\s*Gb/s", re.IGNORECASE)
_RECEPTACLE_TAG = re.compile(r"^receptacle_(\d+)_tag$")


def parse_link_speed(text: object) -> int | float | None:
    """A negotiated link speed in Gb/s: ``"80 Gb/s"`` -> 80; ``"20 Gb/s x2"`` -> 40.

    ``"Up to 120 Gb/s"`` is a capability, not a link: None.
    """
    if not isinstance(text, str):
        return None
    match = _PLAIN_SPEED.match(text)
    if not match:
        return None
    speed = float(match.group(1)) * int(match.group(2) or 1)
    return _int_if_whole(speed)


def parse_speed_capability(text: object) -> int | float | None:
    """``"Up to 120 Gb/s"`` -> 120."""
    if not isinstance(text, str):
        return None
    match = _UP_TO_SPEED.match(text)
    return _int_if_whole(float(match.group(1))) if match else None


def thunderbolt_generation(speed_gbps: object) -> int | None:
    """5 for a link above 40 Gb/s, 4 for a link at or below it (Thunderbolt 4 or
    older: the speed cannot tell 3 from 4), None for no link or an unknown speed."""
    if isinstance(speed_gbps, bool) or not isinstance(speed_gbps, (int, float)):
        return None
    if (isinstance(speed_gbps, float) and math.isnan(speed_gbps)) or speed_gbps <= 0:  # unknown or no link
        return None
    return 5 if speed_gbps > 40 else 4


def parse_thunderbolt(json_text: str | bytes | None) -> ThunderboltInfo | None:
    """Buses, receptacles, direct peers and devices from
    ``system_profiler SPThunderboltDataType -json``.

    Returns::

        {"buses": [{"bus": "thunderboltusb4_bus_1",
                    "domain_uuid": "...",          # this Mac's domain on that bus
                    "receptacle": 2,               # "Thunderbolt 2" in networksetup
                    "connected": True,
                    "link_speed": "80 Gb/s",       # negotiated, None if not connected
                    "link_gbps": 80, "generation": 5,
                    "capability_gbps": None,       # from "Up to 120 Gb/s"
                    "peer": {"domain_uuid", "name", "model", "vendor", "ip_service"} | None,
                    "devices": [{"name", "vendor", "mode", "link_gbps", "depth"}],
                    "indirect_peers": [domain_uuid, ...]}],   # Macs behind a dock
         "own_domain_uuids": {bus name: domain_uuid},
         "peers": [{"bus", "receptacle", "domain_uuid", "link_gbps", "generation"}]}

    A peer is a host listed directly in the bus's ``_items`` with its own
    ``domain_uuid_key``; one nested deeper (behind a dock) is not a direct cable.
    Not JSON, not an object, or no ``SPThunderboltDataType`` list: None.
    """
    if json_text is None:
        return None
    try:
        data = json.loads(json_text)
    except (TypeError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    raw_buses = data.get("SPThunderboltDataType")
    if not isinstance(raw_buses, list) or not all(isinstance(b, dict) for b in raw_buses):
        return None
    buses = [_parse_bus(raw, index) for index, raw in enumerate(raw_buses)]
    buses.sort(key=_natural_key)
    return {
        "buses": buses,
        "own_domain_uuids": {b["bus"]: b["domain_uuid"] for b in buses if b["domain_uuid"]},
        "peers": [
            {
                "bus": b["bus"],
                "receptacle": b["receptacle"],
                "domain_uuid": peer["domain_uuid"],
                "link_gbps": b["link_gbps"],
                "generation": b["generation"],
            }
            for b in buses
            if (peer := b["peer"]) is not None
        ],
    }


def _parse_bus(raw: JsonObject, index: int) -> ThunderboltBus:
    name = _text(raw.get("_name")) or f"bus_{index}"
    receptacle_tag = _first_receptacle_tag(raw)
    receptacle = None
    connected = False
    link_speed = None
    capability = None
    if receptacle_tag is not None:
        receptacle = _leading_int(_text(receptacle_tag.get("receptacle_id_key")) or "")
        connected = receptacle_tag.get("receptacle_status_key") == "receptacle_connected"
        speed_text = _text(receptacle_tag.get("current_speed_key"))
        if connected and parse_link_speed(speed_text) is not None:
            link_speed = speed_text
        capability = parse_speed_capability(speed_text)
    link_gbps = parse_link_speed(link_speed)
    peer: ThunderboltHost | None = None
    devices: list[ThunderboltDevice] = []
    indirect: list[str] = []
    for item in _items(raw):
        uuid = _text(item.get("domain_uuid_key"))
        if uuid is not None and peer is None:
            peer = {
                "domain_uuid": uuid,
                "name": _text(item.get("_name")),
                "model": _text(item.get("device_name_key")),
                "vendor": _text(item.get("vendor_name_key")),
                "ip_service": _has_ip_service(item),
            }
        elif uuid is not None:
            indirect.append(uuid)  # a second host on one receptacle: not a plain cable
        else:
            _collect_devices(item, 1, devices, indirect)
    return {
        "bus": name,
        "domain_uuid": _text(raw.get("domain_uuid_key")),
        "receptacle": receptacle,
        "connected": connected,
        "link_speed": link_speed,
        "link_gbps": link_gbps,
        "generation": thunderbolt_generation(link_gbps),
        "capability_gbps": capability,
        "peer": peer,
        "devices": devices,
        "indirect_peers": indirect,
    }


def _natural_key(bus: ThunderboltBus) -> tuple[tuple[int, int, str], ...]:
    """thunderboltusb4_bus_2 before thunderboltusb4_bus_10."""
    return tuple(
        (0, int(part), "") if part.isdigit() else (1, 0, part)
        for part in re.split(r"(\d+)", bus["bus"])
    )


def _first_receptacle_tag(raw: JsonObject) -> JsonObject | None:
    tags = []
    for key, value in raw.items():
        match = _RECEPTACLE_TAG.match(key)
        if match and isinstance(value, dict):
            tags.append((int(match.group(1)), value))
    return min(tags, key=lambda t: t[0])[1] if tags else None


def _items(raw: JsonObject) -> list[JsonObject]:
    items = raw.get("_items")
    if not isinstance(items, list):
        return []
    return [item for item in items if isinstance(item, dict)]


def _collect_devices(
    item: JsonObject, depth: int, devices: list[ThunderboltDevice], indirect: list[str]
) -> None:
    """A device (dock, drive) and, below it, more devices and Macs behind it."""
    upstream = item.get("receptacle_upstream_ambiguous_tag")
    devices.append({
        "name": _text(item.get("_name")) or _text(item.get("device_name_key")),
        "vendor": _text(item.get("vendor_name_key")),
        "mode": _text(item.get("mode_key")),
        "link_gbps": parse_link_speed(upstream.get("current_speed_key"))
        if isinstance(upstream, dict) else None,
        "depth": depth,
    })
    for child in _items(item):
        uuid = _text(child.get("domain_uuid_key"))
        if uuid is not None:
            indirect.append(uuid)
            _collect_nested_hosts(child, indirect)
        else:
            _collect_devices(child, depth + 1, devices, indirect)


def _collect_nested_hosts(item: JsonObject, indirect: list[str]) -> None:
    """Hosts further down a chain that passes through a host: none is a direct cable."""
    for child in _items(item):
        uuid = _text(child.get("domain_uuid_key"))
        if uuid is not None:
            indirect.append(uuid)
        _collect_nested_hosts(child, indirect)


def _has_ip_service(item: JsonObject) -> bool:
    services = item.get("services_title")
    if not isinstance(services, list):
        return False
    return any(isinstance(s, dict) and s.get("_name") == "service_ip" for s in services)


# --- networksetup -listallhardwareports --------------------------------------------------

_THUNDERBOLT_PORT = re.compile(r"^Thunderbolt (\d+)$")


def parse_networksetup_ports(text: str | None) -> list[HardwarePort] | None:
    """``[{"port": "Thunderbolt 2", "device": "en6", "mac": "02:..."}]`` from
    ``networksetup -listallhardwareports``; None when no ``Hardware Port:`` line."""
    if not isinstance(text, str):
        return None
    ports: list[HardwarePort] = []
    current: HardwarePort | None = None
    for raw in text.splitlines():
        key, sep, value = raw.strip().partition(":")
        if not sep:
            continue
        value = value.strip()
        if key == "Hardware Port":
            current = {"port": value or None, "device": None, "mac": None}
            ports.append(current)
        elif current is not None and key == "Device":
            current["device"] = value or None
        elif current is not None and key == "Ethernet Address":
            current["mac"] = value if value and value != "N/A" else None
    return ports or None


def networksetup_port_kind(port_name: str | None) -> str:
    """thunderbolt | ethernet | wifi | other, from a hardware port's name."""
    name = (port_name or "").strip()
    lower = name.lower()
    if _THUNDERBOLT_PORT.match(name) or lower == "thunderbolt bridge":
        return "thunderbolt"
    if lower in ("wi-fi", "airport") or "wi-fi" in lower or "wifi" in lower:
        return "wifi"
    if "ethernet" in lower or re.search(r"\blan\b", lower):
        return "ethernet"
    return "other"


def interface_kinds(ports: list[HardwarePort] | None) -> dict[str, str]:
    """``{device: kind}`` for the devices networksetup names."""
    kinds: dict[str, str] = {}
    for port in ports or []:
        device = port.get("device")
        if isinstance(device, str):
            kinds[device] = networksetup_port_kind(port.get("port"))
    return kinds


def rdma_device_name(interface: str | None) -> str | None:
    """macOS names the RDMA device of a Thunderbolt interface ``rdma_<interface>``."""
    return f"rdma_{interface}" if interface else None


def thunderbolt_receptacles(ports: list[HardwarePort] | None) -> dict[int, Receptacle]:
    """``{receptacle: {"port": "Thunderbolt 2", "interface": "en6", "rdma_device":
    "rdma_en6"}}`` from networksetup's "Thunderbolt N" hardware ports.

    (Integer keys: for use on the node; the topology sent over the wire carries the
    mapping on each bus instead.)
    """
    mapping: dict[int, Receptacle] = {}
    for port in ports or []:
        name, device = port.get("port") or "", port.get("device")
        match = _THUNDERBOLT_PORT.match(name)
        if match and device:
            mapping[int(match.group(1))] = {
                "port": name,
                "interface": device,
                "rdma_device": rdma_device_name(device),
            }
    return mapping


def thunderbolt_bridge_device(ports: list[HardwarePort] | None) -> str | None:
    """The interface behind the "Thunderbolt Bridge" hardware port (``bridge0``)."""
    for port in ports or []:
        if (port.get("port") or "").strip().lower() == "thunderbolt bridge":
            return port.get("device")
    return None


def annotate_thunderbolt(
    thunderbolt: ThunderboltInfo | None, ports: list[HardwarePort] | None
) -> NamedThunderboltInfo | None:
    """A copy of :func:`parse_thunderbolt`'s result with each bus's ``port_name``,
    ``interface`` and ``rdma_device`` (None where networksetup does not say)."""
    if thunderbolt is None:
        return None
    receptacles = thunderbolt_receptacles(ports)
    buses: list[NamedThunderboltBus] = []
    for bus in thunderbolt.get("buses") or []:
        receptacle = bus.get("receptacle")
        mapped = receptacles.get(receptacle) if receptacle is not None else None
        buses.append({**bus,
                      "port_name": mapped["port"] if mapped else None,
                      "interface": mapped["interface"] if mapped else None,
                      "rdma_device": mapped["rdma_device"] if mapped else None})
    by_bus = {bus["bus"]: bus for bus in buses}
    peers: list[NamedThunderboltPeer] = []
    for peer in thunderbolt.get("peers") or []:
        named = by_bus.get(peer["bus"])
        peers.append({**peer, "interface": named["interface"] if named else None,
                      "rdma_device": named["rdma_device"] if named else None})
    return {**thunderbolt, "buses": buses, "peers": peers}


# --- interfaces: ip -j addr (Linux), ifconfig (macOS, net-tools) -------------------------


def parse_ip_json_addr(json_text: str | bytes | None) -> list[IpInterface] | None:
    """Interfaces from Linux ``ip -j addr``.

    Returns ``[{"name", "up", "state", "flags", "link_type", "mac", "master",
    "addresses": [{"family": "ipv4"|"ipv6", "address", "prefixlen", "scope"}]}]``;
    ``up`` means administratively up with a carrier. Not a JSON list: None.
    """
    if json_text is None:
        return None
    try:
        data = json.loads(json_text)
    except (TypeError, ValueError):
        return None
    if not isinstance(data, list):
        return None
    interfaces: list[IpInterface] = []
    for entry in data:
        if not isinstance(entry, dict):
            return None
        name = _text(entry.get("ifname"))
        if name is None:
            continue  # some iproute2 versions print {} for a link without addresses
        flags = [f for f in _list(entry.get("flags")) if isinstance(f, str)]
        state = _text(entry.get("operstate"))
        addresses: list[AddressInfo] = []
        for info in _list(entry.get("addr_info")):
            if not isinstance(info, dict):
                continue
            family_name = info.get("family")
            family = _IP_FAMILIES.get(family_name) if isinstance(family_name, str) else None
            local = _text(info.get("local"))
            if family is None or local is None:
                continue
            prefixlen = info.get("prefixlen")
            addresses.append({
                "family": family,
                "address": local,
                "prefixlen": prefixlen if isinstance(prefixlen, int) else None,
                "scope": _text(info.get("scope")),
            })
        interfaces.append({
            "name": name,
            "up": ("UP" in flags and "LOWER_UP" in flags) or state == "UP",
            "state": state,
            "flags": flags,
            "link_type": _text(entry.get("link_type")),
            "mac": _text(entry.get("address")),
            "master": _text(entry.get("master")),
            "addresses": addresses,
        })
    return interfaces


_IP_FAMILIES = {"inet": "ipv4", "inet6": "ipv6"}
_IFCONFIG_HEADER = re.compile(r"^(\S+?):\s+flags=(?:\d+|0x[0-9a-fA-F]+)<([^>]*)>")


def parse_ifconfig(text: str | None) -> list[IfconfigInterface] | None:
    """Interfaces from ``ifconfig`` (macOS, and Linux net-tools' modern format).

    Returns ``[{"name", "up", "flags", "status", "mac", "members", "addresses":
    [{"family", "address", "prefixlen", "scope"}]}]``; ``members`` are a bridge's
    member interfaces; ``up`` means UP and RUNNING and not ``status: inactive``.
    No interface header at all: None.
    """
    if not isinstance(text, str):
        return None
    interfaces: list[IfconfigInterface] = []
    current: IfconfigInterface | None = None
    for raw in text.splitlines():
        if not raw.strip():
            continue
        header = _IFCONFIG_HEADER.match(raw)
        if header and not raw[0].isspace():
            current = {
                "name": header.group(1),
                "up": False,
                "flags": [f for f in header.group(2).split(",") if f],
                "status": None,
                "mac": None,
                "members": [],
                "addresses": [],
            }
            interfaces.append(current)
            continue
        if current is None:
            continue
        words = raw.split()
        head = words[0]
        if head == "inet" and len(words) > 1:
            address = _ipv4_from_ifconfig(words)
            if address is not None:
                current["addresses"].append(address)
        elif head == "inet6" and len(words) > 1:
            address = _ipv6_from_ifconfig(words)
            if address is not None:
                current["addresses"].append(address)
        elif head == "ether" and len(words) > 1:
            current["mac"] = words[1]
        elif head == "status:" and len(words) > 1:
            current["status"] = words[1]
        elif head == "member:" and len(words) > 1:
            current["members"].append(words[1])
    if not interfaces:
        return None
    for interface in interfaces:
        flags = interface["flags"]
        interface["up"] = (
            "UP" in flags and "RUNNING" in flags and interface["status"] != "inactive"
        )
    return interfaces


def _ipv4_from_ifconfig(words: list[str]) -> AddressInfo | None:
    address = words[1].removeprefix("addr:")
    try:
        parsed = ipaddress.IPv4Address(address)
    except ValueError:
        return None
    prefixlen = None
    for key, value in itertools.pairwise(words):
        if key in ("netmask", "Mask:"):
            prefixlen = _netmask_prefixlen(value)
    return {
        "family": "ipv4",
        "address": str(parsed),
        "prefixlen": prefixlen,
        "scope": _ipv4_scope(parsed),
    }


def _ipv6_from_ifconfig(words: list[str]) -> AddressInfo | None:
    address, _, zone = words[1].partition("%")
    address = address.split("/")[0]
    try:
        parsed = ipaddress.IPv6Address(address)
    except ValueError:
        return None
    prefixlen = None
    for key, value in itertools.pairwise(words):
        if key == "prefixlen":
            prefixlen = _leading_int(value)
    if prefixlen is None and "/" in words[1]:
        prefixlen = _leading_int(words[1].split("/")[1])
    scope = "host" if parsed.is_loopback else "link" if parsed.is_link_local else "global"
    return {"family": "ipv6", "address": str(parsed), "prefixlen": prefixlen, "scope": scope}


def _netmask_prefixlen(value: str) -> int | None:
    try:
        if value.lower().startswith("0x"):
            mask = int(value, 16)
            if not 0 <= mask <= 0xFFFFFFFF:
                return None
        else:
            mask = int(ipaddress.IPv4Address(value))
    except ValueError:
        return None
    bits = bin(mask)[2:].zfill(32)
    if "01" in bits:  # not a contiguous mask
        return None
    return bits.count("1")


def _ipv4_scope(address: ipaddress.IPv4Address) -> str:
    if address.is_loopback:
        return "host"
    if address.is_link_local:
        return "link"
    return "global"


def linux_interface_kind(name: str) -> str:
    """wl* wifi, en*/eth* ethernet, thunderbolt* thunderbolt, lo loopback, else other."""
    if name == "lo":
        return "loopback"
    if name.startswith("wl"):
        return "wifi"
    if name.startswith(("en", "eth")):
        return "ethernet"
    if name.startswith("thunderbolt"):
        return "thunderbolt"
    return "other"


def macos_interface_kind(name: str, kinds: dict[str, str]) -> str:
    """The kind networksetup gives the device; lo* is loopback; anything else other."""
    if name in kinds:
        return kinds[name]
    if name.startswith("lo"):
        return "loopback"
    return "other"


# --- small helpers -----------------------------------------------------------------------


def _text(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    value = value.strip()
    return value or None


def _list(value: Any) -> list[Any]:
    """A JSON list, or [] for anything else (null, a number or a string where a list belongs)."""
    return value if isinstance(value, list) else []


def _leading_int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        return None
    match = re.match(r"^\s*(\d+)", value)
    return int(match.group(1)) if match else None


def _int_if_whole(value: float) -> int | float:
    return int(value) if value == int(value) else value
