"""Whether the head's own path toward a node is down: the route the kernel would take to its address,
and the interface that route leaves by (Linux: ``ip -j route get`` and ``/sys/class/net``; macOS:
``route -n get`` and ``ifconfig``).

A job's supervisor asks this when it loses nodes (coordinator/jobs/outage.py): a head whose Wi-Fi
dropped, or whose cable was pulled, has no route or a dead interface, and the nodes it lost are
then most likely fine. The readers of the commands' output are pure; a command that cannot be run
says nothing either way (None).
"""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import sys
from pathlib import Path

ROUTE_TIMEOUT_S = 3.0
_DOWN_STATES = ("down", "lowerlayerdown", "notpresent")


def linux_route(output: str) -> tuple[str | None, list[str]]:
    """``ip -j route get ADDR``'s answer: the interface it leaves by and the route's flags."""
    try:
        routes = json.loads(output)
    except ValueError:
        return None, []
    if not isinstance(routes, list) or not routes or not isinstance(routes[0], dict):
        return None, []
    route = routes[0]
    dev = route.get("dev")
    flags = route.get("flags") or []
    return (dev if isinstance(dev, str) else None), [f for f in flags if isinstance(f, str)]


def mac_route_interface(output: str) -> str | None:
    """``route -n get ADDR``'s interface line."""
    found = re.search(r"^\s*interface:\s*(\S+)\s*$", output, re.M)
    return found.group(1) if found else None


def mac_interface_inactive(output: str) -> bool:
    """``ifconfig IF`` says ``status: inactive`` (a Wi-Fi off, a cable out)."""
    return re.search(r"^\s*status:\s*inactive\s*$", output, re.M) is not None


def _run(argv: list[str]) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=ROUTE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None


def route_down(address: str, *, platform: str = sys.platform, sys_net: Path = Path("/sys/class/net")) -> str | None:
    """Why the head cannot send to ``address`` (an IP address) now (no route, its interface down), or
    None when it looks as if it could (or nothing could be asked: a name is not looked up, since a
    resolver that fails would say nothing of the route)."""
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return None
    if platform.startswith("linux"):
        done = _run(["ip", "-j", "route", "get", address])
        if done is None:
            return None
        if done.returncode != 0:
            said = done.stderr.strip().splitlines()[-1:] or ["no route"]
            return f"the head has no route to {address} ({said[0].removeprefix('RTNETLINK answers: ')})"
        dev, flags = linux_route(done.stdout)
        if dev is None:
            return None
        if "linkdown" in flags:
            return f"the head's interface {dev} toward {address} has no link"
        try:
            state = (sys_net / dev / "operstate").read_text().strip().lower()
        except OSError:
            return None
        return f"the head's interface {dev} toward {address} is {state}" if state in _DOWN_STATES else None
    if platform == "darwin":
        done = _run(["route", "-n", "get", address])
        if done is None:
            return None
        dev = mac_route_interface(done.stdout) if done.returncode == 0 else None
        if dev is None:
            return f"the head has no route to {address}"
        shown = _run(["ifconfig", dev])
        if shown is not None and shown.returncode == 0 and mac_interface_inactive(shown.stdout):
            return f"the head's interface {dev} toward {address} is inactive"
    return None
