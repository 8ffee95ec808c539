"""Parsers for a Mac's Thunderbolt: ``system_profiler SPThunderboltDataType -json`` (buses,
receptacles, the Macs cabled to them) and ``networksetup -listallhardwareports`` (which
interface and RDMA device each receptacle is).

A Mac whose ``system_profiler`` printed garbage is not a Mac with no Thunderbolt ports.

Pure functions: text in, plain values out, no I/O, stdlib only (this runs in the node's
own Python, 3.10 or later). Output that cannot be read is ``None`` ("unknown"), never
``[]``, ``False`` or ``0``. Every value returned is a plain str/int/float/bool/None/list/dict
with string keys, so it can cross the wire (msgpack) as is.
"""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING

from agent.parse_helpers import int_if_whole, leading_int, stripped_text

if TYPE_CHECKING:
    from shared.agent_api.common import JsonObject
    from shared.agent_api.topology import (
        HardwarePort,
        NamedThunderboltBus,
        NamedThunderboltInfo,
        NamedThunderboltPeer,
        Receptacle,
        ThunderboltBus,
        ThunderboltDevice,
        ThunderboltHost,
        ThunderboltInfo,
    )

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
    return int_if_whole(speed)


def parse_speed_capability(text: object) -> int | float | None:
    """``"Up to 120 Gb/s"`` -> 120."""
    if not isinstance(text, str):
        return None
    match = _UP_TO_SPEED.match(text)
    return int_if_whole(float(match.group(1))) if match else None


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
    name = stripped_text(raw.get("_name")) or f"bus_{index}"
    receptacle_tag = _first_receptacle_tag(raw)
    receptacle = None
    connected = False
    link_speed = None
    capability = None
    if receptacle_tag is not None:
        receptacle = leading_int(stripped_text(receptacle_tag.get("receptacle_id_key")) or "")
        connected = receptacle_tag.get("receptacle_status_key") == "receptacle_connected"
        speed_text = stripped_text(receptacle_tag.get("current_speed_key"))
        if connected and parse_link_speed(speed_text) is not None:
            link_speed = speed_text
        capability = parse_speed_capability(speed_text)
    link_gbps = parse_link_speed(link_speed)
    peer: ThunderboltHost | None = None
    devices: list[ThunderboltDevice] = []
    indirect: list[str] = []
    for item in _items(raw):
        uuid = stripped_text(item.get("domain_uuid_key"))
        if uuid is not None and peer is None:
            peer = {
                "domain_uuid": uuid,
                "name": stripped_text(item.get("_name")),
                "model": stripped_text(item.get("device_name_key")),
                "vendor": stripped_text(item.get("vendor_name_key")),
                "ip_service": _has_ip_service(item),
            }
        elif uuid is not None:
            indirect.append(uuid)  # a second host on one receptacle: not a plain cable
        else:
            _collect_devices(item, 1, devices, indirect)
    return {
        "bus": name,
        "domain_uuid": stripped_text(raw.get("domain_uuid_key")),
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
        "name": stripped_text(item.get("_name")) or stripped_text(item.get("device_name_key")),
        "vendor": stripped_text(item.get("vendor_name_key")),
        "mode": stripped_text(item.get("mode_key")),
        "link_gbps": parse_link_speed(upstream.get("current_speed_key"))
        if isinstance(upstream, dict) else None,
        "depth": depth,
    })
    for child in _items(item):
        uuid = stripped_text(child.get("domain_uuid_key"))
        if uuid is not None:
            indirect.append(uuid)
            _collect_nested_hosts(child, indirect)
        else:
            _collect_devices(child, depth + 1, devices, indirect)


def _collect_nested_hosts(item: JsonObject, indirect: list[str]) -> None:
    """Hosts further down a chain that passes through a host: none is a direct cable."""
    for child in _items(item):
        uuid = stripped_text(child.get("domain_uuid_key"))
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
