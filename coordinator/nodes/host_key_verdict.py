"""What known_hosts says of the host key a node presents, and how coord says it (pure).

As OpenSSH decides: a key recorded for the host is trusted; a recorded key of the same type that
differs means the key changed (a reinstalled node, or someone in the middle), which is said first,
with both fingerprints and the command that removes the old key; a key marked ``@revoked`` is never
used; anything else is unknown, and trusted only on the user's word (`coord trust`).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import asyncssh

TRUSTED, UNKNOWN, CHANGED, REVOKED = "trusted", "unknown", "changed", "revoked"


@dataclass(frozen=True)
class KnownEntry:
    """A key a known_hosts line holds for a host."""

    path: Path
    line: int
    hosts: str  # the line's host field as written: one name, a list, a pattern, or a hash (|1|...)
    key: asyncssh.SSHKey
    marker: str | None = None  # None for a host key, "revoked" for a @revoked line

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def holds_only(self, name: str) -> bool:
        """Whether the line is for this one name, so that ``ssh-keygen -R`` takes nothing else with it."""
        return self.hosts == name or self.hosts.startswith("|1|")


@dataclass(frozen=True)
class KeyVerdict:
    state: str  # TRUSTED, UNKNOWN, CHANGED or REVOKED
    offending: tuple[KnownEntry, ...] = ()  # CHANGED: the old keys of the presented key's type; REVOKED: the marks


def judge_host_key(entries: Sequence[KnownEntry], key: asyncssh.SSHKey) -> KeyVerdict:
    """Trusted, revoked, changed or unknown: what known_hosts' lines for the host make of the key presented."""
    revoked = tuple(e for e in entries if e.marker == "revoked" and e.key.public_data == key.public_data)
    if revoked:
        return KeyVerdict(REVOKED, revoked)
    host_keys = [e for e in entries if e.marker is None]
    if any(e.key.public_data == key.public_data for e in host_keys):
        return KeyVerdict(TRUSTED)
    same_type = tuple(e for e in host_keys if e.key.algorithm == key.algorithm)
    return KeyVerdict(CHANGED, same_type) if same_type else KeyVerdict(UNKNOWN)


def removal_command(name: str, entries: Sequence[KnownEntry]) -> str:
    """The ssh-keygen command (one per file) that removes every line for ``name``, hashed ones too."""
    files = dict.fromkeys(str(e.path) for e in entries)
    return " && ".join(shlex.join(["ssh-keygen", "-R", name, "-f", path]) for path in files)


def changed_key_message(where: str, name: str, key: asyncssh.SSHKey, offending: Sequence[KnownEntry],
                        trust_command: str) -> str:
    """OpenSSH's warning in one paragraph: changed, old and new fingerprints, how to check, what to run."""
    new = key.get_fingerprint("sha256")
    held = ", ".join(f"{e.where} holds {e.key.get_algorithm()} {e.key.get_fingerprint('sha256')}" for e in offending)
    hashed = " (hashed)" if any(e.hosts.startswith("|1|") for e in offending) else ""
    text = (f"host key of {where} has CHANGED: the node presents {key.get_algorithm()} {new}, but {held} for "
            f"{name}{hashed}. A reinstalled node looks like this, and so does someone in the middle: compare the new "
            f"fingerprint with the node's own (on the node: ssh-keygen -lf /etc/ssh/ssh_host_{host_key_file_type(key)}"
            f"_key.pub). If it is the node's, remove the old key with: {removal_command(name, offending)}, then "
            f"trust the new one with: {trust_command} --fingerprint {new}")
    shared = [e for e in offending if not e.holds_only(name)]
    if shared:
        text += (f" ({shared[0].where} is {shared[0].hosts!r}, a line for more than {name}: ssh-keygen -R removes "
                 "it whole; to keep it for the others, edit it by hand instead)")
    return text


def revoked_key_message(where: str, key: asyncssh.SSHKey, marks: Sequence[KnownEntry]) -> str:
    return (f"host key of {where} ({key.get_algorithm()} {key.get_fingerprint('sha256')}) is marked @revoked in "
            f"{marks[0].where}: coord never uses it; the node needs a new host key")


def host_key_file_type(key: asyncssh.SSHKey) -> str:
    """ed25519, ecdsa, rsa: the names ssh-keygen and the host key files use."""
    algorithm = key.get_algorithm()
    return "ecdsa" if algorithm.startswith("ecdsa") else algorithm.removeprefix("ssh-")
