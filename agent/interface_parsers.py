"""Parsers for a node's network interfaces: ``ip -j addr`` (Linux) and ``ifconfig`` (macOS, and
Linux net-tools), and the kind (ethernet, wifi, thunderbolt, loopback) each interface is.

Pure functions: text in, plain values out, no I/O, stdlib only (this runs in the node's
own Python, 3.10 or later). Output that cannot be read is ``None`` ("unknown"), never
``[]``, ``False`` or ``0``. Every value returned is a plain str/int/float/bool/None/list/dict
with string keys, so it can cross the wire (msgpack) as is.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import re
from typing import TYPE_CHECKING

from agent.parse_helpers import json_list, leading_int, stripped_text

if TYPE_CHECKING:
    from shared.agent_api.topology import AddressInfo, IfconfigInterface, IpInterface

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
        name = stripped_text(entry.get("ifname"))
        if name is None:
            continue  # some iproute2 versions print {} for a link without addresses
        flags = [f for f in json_list(entry.get("flags")) if isinstance(f, str)]
        state = stripped_text(entry.get("operstate"))
        addresses: list[AddressInfo] = []
        for info in json_list(entry.get("addr_info")):
            if not isinstance(info, dict):
                continue
            family_name = info.get("family")
            family = _IP_FAMILIES.get(family_name) if isinstance(family_name, str) else None
            local = stripped_text(info.get("local"))
            if family is None or local is None:
                continue
            prefixlen = info.get("prefixlen")
            addresses.append({
                "family": family,
                "address": local,
                "prefixlen": prefixlen if isinstance(prefixlen, int) else None,
                "scope": stripped_text(info.get("scope")),
            })
        interfaces.append({
            "name": name,
            "up": ("UP" in flags and "LOWER_UP" in flags) or state == "UP",
            "state": state,
            "flags": flags,
            "link_type": stripped_text(entry.get("link_type")),
            "mac": stripped_text(entry.get("address")),
            "master": stripped_text(entry.get("master")),
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
            prefixlen = leading_int(value)
    if prefixlen is None and "/" in words[1]:
        prefixlen = leading_int(words[1].split("/")[1])
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
