"""The link probe of ``coord doctor`` (agent/link_probe.py): one node listens on its link address
(``link_listen``), its neighbour connects from its own and measures (``link_measure``), the listener
is closed (``link_close``); ``link_route`` reads the route toward the peer and the MTUs at one end."""

from __future__ import annotations

from typing import TypedDict


class _LinkListenRequest(TypedDict):
    address: str  # this node's address on the link (the one coord puts in the hostfile)
    token: str  # a connector must send it first: nothing else is measured


class LinkListenRequest(_LinkListenRequest, total=False):
    seconds: float  # the listener closes by itself after this long (at most 300)


class LinkListenReply(TypedDict):
    listening: bool
    port: int  # the kernel's pick; 0 when not listening
    address: str
    detail: str


class _LinkMeasureRequest(TypedDict):
    host: str  # the peer's link address
    port: int
    token: str
    bytes: int  # each way, at most


class LinkMeasureRequest(_LinkMeasureRequest, total=False):
    source: str | None  # this node's link address, which the connection leaves from
    seconds: float  # the whole measurement's time limit
    pings: int


class LinkMeasureReply(TypedDict):
    connected: bool
    latency_ms: float | None  # median round trip of the pings
    bits_per_second: float | None  # this node to the peer
    reverse_bits_per_second: float | None  # the peer to this node
    bytes_up: int
    bytes_down: int
    seconds: float
    complete: bool  # every byte asked for went each way within the time
    detail: str


class LinkCloseRequest(TypedDict):
    port: int


class LinkCloseReply(TypedDict):
    closed: bool
    served: int  # connections the listener took


class _LinkRouteRequest(TypedDict):
    address: str  # the peer's link address


class LinkRouteRequest(_LinkRouteRequest, total=False):
    interface: str | None  # the interface coord chose toward it


class RouteInfo(TypedDict):
    interface: str | None
    source: str | None
    gateway: str | None


class LinkRouteReply(TypedDict):
    address: str
    route: RouteInfo | None  # None: no route, or it could not be read (detail says)
    route_mtu: int | None
    interface: str | None
    interface_mtu: int | None
    interface_speed_bps: float | None  # what it negotiated, where the OS says (Linux); None: unknown
    detail: str
