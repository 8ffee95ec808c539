"""Which nodes of a cluster file are one account on one machine (pure).

A node is one place to run a rank: a home, processes, ports and memory of its own. Two
``[[nodes]]`` that log in as the same user on the same machine share all of them, and fail later
on side effects (permission denied, a workdir changed under the other node's feet, a consistency
report of 2/3), so the file is refused when it is read. The machine is the host as ssh reaches
it (after the ssh config's HostName, not DNS: two names DNS gives one address are two hosts
here), its SSH port, and the jump host in between; the account is the user ssh logs in as.
``host = "local"`` nodes are exempt: they are this machine by design, one workdir each.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Account:
    """One user on one SSH server, as ssh reaches it."""

    host: str  # lower-case; an IP address in its shortest form
    port: int
    user: str
    via: str | None = None  # the jump host or proxy command in between, if any

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        shown = f"{self.user}@{host}:{self.port}"
        return f"{shown} via {self.via}" if self.via else shown


def account(host: str, port: int, user: str, via: str | None = None) -> Account:
    """The account with its host written one way: ``Mac.LOCAL`` is ``mac.local``, ``::0:1`` is ``::1``."""
    name = host.strip().lower()
    with contextlib.suppress(ValueError):  # a name, not an address: kept as written
        name = ipaddress.ip_address(name.strip("[]")).compressed
    return Account(host=name, port=port, user=user, via=via)


def shared_account(accounts: Sequence[Account | None]) -> tuple[int, int] | None:
    """The first two indexes (earlier, later) that hold the same account; None entries (local nodes)
    share nothing. None when every account is its own."""
    first: dict[Account, int] = {}
    for index, found in enumerate(accounts):
        if found is None:
            continue
        if found in first:
            return first[found], index
        first[found] = index
    return None
