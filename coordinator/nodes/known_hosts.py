"""Host keys: which name ssh files a node's key under, what key the node presents, what known_hosts
says of it (trusted, unknown, changed or revoked), and adding it on the user's word only (never on
our own).

The line written is OpenSSH's plain form, ``host keytype base64`` (``[host]:port`` for a port
other than 22), which ssh, ssh-keygen and asyncssh all read.
"""

from __future__ import annotations

import asyncio
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from coordinator.config.cluster_file import NodeConfig, SshSettings
from coordinator.config.ssh_destination import SshConfigUnreadable, resolve_destination, ssh_config_files
from coordinator.nodes.host_key_verdict import (
    CHANGED,
    REVOKED,
    TRUSTED,
    KnownEntry,
    changed_key_message,
    judge_host_key,
    removal_command,
    revoked_key_message,
)
from coordinator.nodes.ssh_settings import (
    DEFAULT_KNOWN_HOSTS,
    ChangedHostKey,
    NodeUnreachable,
    UnknownHostKey,
    known_hosts_path,
    ssh_options,
)

__all__ = ["KnownEntry", "known_hosts_path"]  # what the trust command and the tests take from here too

DEFAULT_PORT = 22


@dataclass(frozen=True)
class SshTarget:
    """A node as ssh will reach it: the name given, and the host, port and key name after the ssh config."""

    given: str  # what the user or the cluster file called it (an address or a Host alias)
    given_port: int | None  # the port given, if any; otherwise the ssh config's or 22
    host: str  # after the ssh config's HostName
    port: int
    key_alias: str | None = None  # the ssh config's HostKeyAlias

    @property
    def known_hosts_name(self) -> str:
        """The host field of this target's known_hosts line."""
        return host_pattern(self.key_alias or self.host, self.port)


class TrustRefused(Exception):
    """A host key that must not be added; the message says why, ``fix`` what to do."""

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.fix = fix


def host_pattern(host: str, port: int) -> str:
    """``host`` for port 22, ``[host]:port`` otherwise, as OpenSSH writes known_hosts."""
    return host if port == DEFAULT_PORT else f"[{host}]:{port}"


def known_hosts_line(host: str, port: int, key: asyncssh.SSHKey) -> str:
    """One known_hosts line for a key, without a comment."""
    keytype, data = key.export_public_key("openssh").decode("ascii").split()[:2]
    return f"{host_pattern(host, port)} {keytype} {data}\n"


def fingerprint(key: asyncssh.SSHKey) -> str:
    """``SHA256:...``, as ssh and ssh-keygen -l show it."""
    return key.get_fingerprint("sha256")


def fingerprint_matches(given: str, key: asyncssh.SSHKey) -> bool:
    """Whether a fingerprint typed or pasted by a user is this key's (the ``SHA256:`` prefix optional)."""
    text = given.strip()
    text = text[len("SHA256:"):] if text.upper().startswith("SHA256:") else text
    return bool(text) and text.rstrip("=") == fingerprint(key)[len("SHA256:"):]


def resolve_target(node: NodeConfig, ssh: SshSettings) -> SshTarget:
    """Apply the ssh config (HostName, Port, HostKeyAlias) as asyncssh will when it connects."""
    try:
        found = resolve_destination(node.host, node.port, node.user, ssh_config_files(ssh.config))
    except SshConfigUnreadable as exc:
        raise NodeUnreachable(str(exc)) from None
    return SshTarget(given=node.host, given_port=node.port, host=found.host, port=found.port,
                     key_alias=found.key_alias)


async def fetch_host_key(target: SshTarget, ssh: SshSettings, *,
                         like: Sequence[asyncssh.SSHKey] = ()) -> asyncssh.SSHKey:
    """The host key the node presents (nothing is trusted or logged in to). With ``like`` (the keys
    known_hosts holds for it), a key of their types, as a connection negotiates it, so that an old key
    is compared with its own type's successor; any key when the node offers none of those types."""
    algorithms = list(dict.fromkeys(alg.decode("ascii") for key in like for alg in key.sig_algorithms))
    if algorithms:
        try:
            return await _server_host_key(target, ssh, algorithms)
        except asyncssh.KeyExchangeFailed:
            pass  # it no longer has a key of a type recorded: the one it offers is a new, unknown type
    return await _server_host_key(target, ssh, ())


async def _server_host_key(target: SshTarget, ssh: SshSettings, algorithms: Sequence[str]) -> asyncssh.SSHKey:
    options = ssh_options(NodeConfig(name="-", host=target.given, python="", workdir="", port=target.given_port),
                          ssh)
    try:
        key = await asyncio.wait_for(
            asyncssh.get_server_host_key(target.given, target.given_port or (), config=options.get("config", ()),
                                         server_host_key_algs=list(algorithms) or ()),
            ssh.connect_timeout_s)
    except asyncssh.KeyExchangeFailed:
        if algorithms:
            raise
        raise NodeUnreachable(f"cannot fetch the host key of {target.host}:{target.port}: the key exchange "
                              "failed") from None
    except (TimeoutError, OSError, asyncssh.Error) as exc:
        raise NodeUnreachable(f"cannot fetch the host key of {target.host}:{target.port}: "
                              f"{str(exc) or exc.__class__.__name__}") from None
    if key is None:
        raise NodeUnreachable(f"{target.host}:{target.port} presented no host key")
    return key


def known_entries(path: Path, target: SshTarget) -> list[KnownEntry]:
    """The lines of known_hosts that name this target, with their line numbers: under its own name
    only (``[host]:port`` for a port other than 22; hashed lines included), not under the port-22 name
    that asyncssh falls back to when a port has no line of its own, since a line for this port added by
    `coord trust` ends that fallback, while removing the port-22 line would take another sshd's key."""
    if not path.is_file():
        return []
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise TrustRefused(f"{path}: cannot read it as known_hosts: {exc}") from None
    name = target.known_hosts_name
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        try:
            # Matched through asyncssh itself, so a line counts exactly when it does for a connection.
            keys, _, revoked = asyncssh.import_known_hosts(stripped).match(name, "", None)[:3]
        except ValueError as exc:
            raise TrustRefused(f"{path}:{number}: cannot read it as known_hosts: {exc}") from None
        hosts = stripped.split()[1 if stripped.startswith("@") else 0]
        found += [KnownEntry(path, number, hosts, key, None) for key in keys]
        found += [KnownEntry(path, number, hosts, key, "revoked") for key in revoked]
    return found


def check_can_add(path: Path, target: SshTarget, key: asyncssh.SSHKey, *, trust_command: str = "coord trust") -> bool:
    """True when the key must be added, False when it is there already; refuses a changed or revoked key."""
    entries = known_entries(path, target)
    verdict = judge_host_key(entries, key)
    if verdict.state == TRUSTED:
        return False
    if verdict.state == CHANGED:
        raise TrustRefused(changed_key_message(f"{target.host}:{target.port}", target.known_hosts_name, key,
                                               verdict.offending, trust_command),
                           fix=f"{removal_command(target.known_hosts_name, verdict.offending)} (only if the node "
                               "was reinstalled)")
    if verdict.state == REVOKED:
        raise TrustRefused(revoked_key_message(f"{target.host}:{target.port}", key, verdict.offending))
    return True


def append_known_host(path: Path, target: SshTarget, key: asyncssh.SSHKey) -> str:
    """Append the key's line (making ~/.ssh 0700 and the file 0600 if new); returns the line."""
    line = known_hosts_line(target.key_alias or target.host, target.port, key)
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a", encoding="ascii") as out:
        if out.tell() > 0 and not path.read_bytes().endswith(b"\n"):
            out.write("\n")  # a file whose last line lacks its newline would join ours
        out.write(line)
    return line


def trust_command(node: NodeConfig, ssh: SshSettings, cluster_file: str | None) -> str:
    """The `coord trust` command that reaches the node as coord does: by name with its cluster file, else
    by host with the ssh files in use (coord init's hosts have no cluster file yet)."""
    if cluster_file:
        return shlex.join(["coord", "trust", node.name, "--config", cluster_file])
    words = ["coord", "trust", node.host]
    if node.port:
        words += ["--port", str(node.port)]
    if ssh.known_hosts:
        words += ["--known-hosts", ssh.known_hosts]
    if ssh.config:
        words += ["--ssh-config", ssh.config]
    return shlex.join(words)


async def refused_host_key(node: NodeConfig, ssh: SshSettings, exc: Exception) -> NodeUnreachable:
    """Why a connection refused the node's host key, as OpenSSH would say it (changed, revoked or
    unknown), with the key it presented and the command that fixes it; never trust it ourselves."""
    target = resolve_target(node, ssh)
    where = f"{target.host}:{target.port}"
    path = known_hosts_path(ssh)
    shown = ssh.known_hosts or DEFAULT_KNOWN_HOSTS
    trust = trust_command(node, ssh, ssh.cluster_file)
    try:
        entries = known_entries(path, target)
    except TrustRefused as unreadable:
        return NodeUnreachable(f"host key of {where} cannot be checked: {unreadable}")
    try:
        key = await fetch_host_key(target, ssh, like=[entry.key for entry in entries if entry.marker is None])
    except NodeUnreachable:  # best effort: the reason is still shown without the fingerprint
        return UnknownHostKey(f"host key of {where} is not trusted ({exc}); check it, then trust it with: {trust}",
                              key=None)
    verdict = judge_host_key(entries, key)
    if verdict.state == CHANGED:
        return ChangedHostKey(changed_key_message(where, target.known_hosts_name, key, verdict.offending, trust),
                              key=key, remove=removal_command(target.known_hosts_name, verdict.offending))
    if verdict.state == REVOKED:
        return NodeUnreachable(revoked_key_message(where, key, verdict.offending))
    if verdict.state == TRUSTED:  # added while this connection was under way: the next one takes it
        return NodeUnreachable(f"host key of {where} was refused ({exc}), though {shown} holds it now; retrying")
    fingerprint = key.get_fingerprint("sha256")
    return UnknownHostKey(
        f"host key of {where} is not trusted ({key.get_algorithm()} {fingerprint}, not in {shown}: {exc}); "
        f"if that fingerprint is the node's, trust it with: {trust} --fingerprint {fingerprint}", key=key)
