"""``topology``: RDMA, Thunderbolt and network interfaces as a node measured them, and the parsed
command outputs they are built from."""

from __future__ import annotations

from typing import TypedDict


class AddressInfo(TypedDict):
    family: str  # "ipv4" or "ipv6"
    address: str
    prefixlen: int | None
    scope: str | None


class ParsedInterface(TypedDict):
    """An interface as ``ip -j addr`` or ``ifconfig`` describe it."""

    name: str
    up: bool
    flags: list[str]
    mac: str | None
    addresses: list[AddressInfo]


class IpInterface(ParsedInterface):
    state: str | None
    link_type: str | None
    master: str | None


class IfconfigInterface(ParsedInterface):
    status: str | None
    members: list[str]


class IbvPort(TypedDict):
    port: int | None
    state: str | None
    link_layer: str | None
    active_mtu: int | None
    max_mtu: int | None


class _IbvDevice(TypedDict):
    name: str
    transport: str | None
    node_guid: str | None
    phys_port_cnt: int | None
    ports: list[IbvPort]


class IbvDevice(_IbvDevice, total=False):
    netdevs: list[str]  # read under /sys on Linux


class SysfsPort(TypedDict):
    state: str | None
    link_layer: str | None


class SysfsDevice(TypedDict):
    ports: dict[str, SysfsPort]
    netdevs: list[str]


class HardwarePort(TypedDict):
    """One entry of ``networksetup -listallhardwareports``."""

    port: str | None
    device: str | None
    mac: str | None


class Receptacle(TypedDict):
    port: str
    interface: str
    rdma_device: str | None


class ThunderboltHost(TypedDict):
    domain_uuid: str
    name: str | None
    model: str | None
    vendor: str | None
    ip_service: bool


class ThunderboltDevice(TypedDict):
    name: str | None
    vendor: str | None
    mode: str | None
    link_gbps: int | float | None
    depth: int


class ThunderboltBus(TypedDict):
    bus: str
    domain_uuid: str | None
    receptacle: int | None
    connected: bool
    link_speed: str | None
    link_gbps: int | float | None
    generation: int | None
    capability_gbps: int | float | None
    peer: ThunderboltHost | None
    devices: list[ThunderboltDevice]
    indirect_peers: list[str]


class ThunderboltPeer(TypedDict):
    bus: str
    receptacle: int | None
    domain_uuid: str
    link_gbps: int | float | None
    generation: int | None


class ThunderboltInfo(TypedDict):
    buses: list[ThunderboltBus]
    own_domain_uuids: dict[str, str]
    peers: list[ThunderboltPeer]


class PortNames(TypedDict):
    """What networksetup says about a Thunderbolt bus's port (None where it does not)."""

    port_name: str | None
    interface: str | None
    rdma_device: str | None


class NamedThunderboltBus(ThunderboltBus, PortNames):
    pass


class NamedThunderboltPeer(ThunderboltPeer):
    interface: str | None
    rdma_device: str | None


class NamedThunderboltInfo(TypedDict):
    buses: list[NamedThunderboltBus]
    own_domain_uuids: dict[str, str]
    peers: list[NamedThunderboltPeer]


class ActiveRdmaPort(TypedDict):
    device: str | None
    port: int | None
    state: str | None
    link_layer: str | None
    active_mtu: int | None


class RdmaPortInfo(TypedDict):
    device: str
    port: int | None
    state: str | None
    link_layer: str | None
    interface: str | None


class RdmaInfo(TypedDict):
    state: str | None  # "enabled", "disabled", or None when unknown
    devices: list[str] | None
    active_ports: list[ActiveRdmaPort] | None
    ports: list[RdmaPortInfo] | None


class BridgeInfo(TypedDict):
    enabled: bool | None
    interface: str | None
    members: list[str]


class InterfaceInfo(TypedDict):
    name: str
    kind: str  # thunderbolt, ethernet, wifi, loopback, other
    addresses: list[AddressInfo]
    up: bool
    port: str | None  # the hardware port's name (macOS)


class TopologyReply(TypedDict):
    platform: str | None
    os_version: str | None
    rdma: RdmaInfo
    thunderbolt: NamedThunderboltInfo | None
    thunderbolt_bridge: BridgeInfo
    interfaces: list[InterfaceInfo] | None
    detail: dict[str, str]  # source: why it could not be read
