"""Parsers for the route the kernel takes toward a peer and the MTU of an interface: Linux ``ip -j
route get ADDR`` and macOS ``route -n get ADDR`` and ``ifconfig IF``.

Pure functions: text in, plain values out, stdlib only (they run in the node's Python). Output that
cannot be read is None ("unknown"). The head's own reading of the same commands is
coordinator/nodes/head_route.py; the agent cannot import it.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.agent_api.link import RouteInfo

def parse_ip_route_get(output: str | None) -> RouteInfo | None:
    """``ip -j route get ADDR``: ``[{"dst", "dev", "prefsrc", "gateway"?, "flags"}]``."""
    if not output:
        return None
    try:
        routes = json.loads(output)
    except ValueError:
        return None
    if not isinstance(routes, list) or not routes or not isinstance(routes[0], dict):
        return None
    route = routes[0]
    return {"interface": _text(route.get("dev")), "source": _text(route.get("prefsrc")),
            "gateway": _text(route.get("gateway"))}


def parse_route_get(output: str | None) -> RouteInfo | None:
    """macOS ``route -n get ADDR``: ``interface: en5`` and, through a router, ``gateway: 10.0.0.1``."""
    if not output:
        return None
    interface = re.search(r"^\s*interface:\s*(\S+)\s*$", output, re.M)
    if interface is None:
        return None
    gateway = re.search(r"^\s*gateway:\s*(\S+)\s*$", output, re.M)
    return {"interface": interface.group(1), "source": None, "gateway": gateway.group(1) if gateway else None}


def parse_ifconfig_mtu(output: str | None) -> int | None:
    """The ``mtu N`` of ``ifconfig IF``'s header line (macOS and Linux net-tools)."""
    if not output:
        return None
    found = re.search(r"\bmtu\s+(\d+)", output.splitlines()[0] if output.splitlines() else "")
    return int(found.group(1)) if found else None


def _text(value: object) -> str | None:
    return value.strip() or None if isinstance(value, str) else None
