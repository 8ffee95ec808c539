"""Host keys: which name ssh files a node's key under, what key the node presents, and adding it
to known_hosts on the user's word only (never on our own).

The line written is OpenSSH's plain form, ``host keytype base64`` (``[host]:port`` for a port
other than 22), which ssh, ssh-keygen and asyncssh all read.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

import asyncssh

from coordinator.config.cluster_file import NodeConfig, SshSettings
from coordinator.nodes.ssh_settings import NodeUnreachable, UnknownHostKey, ssh_options

DEFAULT_PORT = 22
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"


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


def known_hosts_path(ssh: SshSettings) -> Path:
    """The known_hosts file a cluster uses: its [ssh] known_hosts, or the user's own."""
    return Path(os.path.expanduser(ssh.known_hosts or DEFAULT_KNOWN_HOSTS))


def resolve_target(node: NodeConfig, ssh: SshSettings) -> SshTarget:
    """Apply the ssh config (HostName, Port, HostKeyAlias) as asyncssh will when it connects."""
    options = ssh_options(node, ssh)
    try:
        resolved = asyncssh.SSHClientConnectionOptions(
            host=node.host, port=node.port or (), config=options.get("config", ()))
    except (OSError, ValueError, asyncssh.Error) as exc:
        raise NodeUnreachable(f"cannot read the ssh config for {node.host}: {exc}") from None
    return SshTarget(given=node.host, given_port=node.port, host=resolved.host, port=int(resolved.port),
                     key_alias=resolved.host_key_alias)


async def fetch_host_key(target: SshTarget, ssh: SshSettings) -> asyncssh.SSHKey:
    """The host key the node presents (nothing is trusted or logged in to)."""
    options = ssh_options(NodeConfig(name="-", host=target.given, python="", workdir="", port=target.given_port),
                          ssh)
    try:
        key = await asyncio.wait_for(
            asyncssh.get_server_host_key(target.given, target.given_port or (), config=options.get("config", ())),
            ssh.connect_timeout_s)
    except (TimeoutError, OSError, asyncssh.Error) as exc:
        raise NodeUnreachable(f"cannot fetch the host key of {target.host}:{target.port}: "
                              f"{str(exc) or exc.__class__.__name__}") from None
    if key is None:
        raise NodeUnreachable(f"{target.host}:{target.port} presented no host key")
    return key


def recorded_keys(path: Path, target: SshTarget) -> list[asyncssh.SSHKey]:
    """The keys known_hosts already holds for this target (hashed entries included)."""
    if not path.is_file():
        return []
    try:
        known = asyncssh.read_known_hosts(str(path))
    except (OSError, ValueError, asyncssh.KeyImportError) as exc:
        raise TrustRefused(f"{path}: cannot read it as known_hosts: {exc}") from None
    port = target.port if target.port != DEFAULT_PORT else None
    return list(known.match(target.key_alias or target.host, "", port)[0])


def check_can_add(path: Path, target: SshTarget, key: asyncssh.SSHKey) -> bool:
    """True when the key must be added, False when it is there already; refuses a changed key."""
    present = recorded_keys(path, target)
    if any(k.public_data == key.public_data for k in present):
        return False
    same_type = [k for k in present if k.get_algorithm() == key.get_algorithm()]
    if same_type:
        remove = f"ssh-keygen -R {_quote_arg(target.known_hosts_name)} -f {_quote_arg(str(path))}"
        raise TrustRefused(
            f"{path} already holds another {key.get_algorithm()} key for {target.known_hosts_name} "
            f"({fingerprint(same_type[0])}); the node now presents {fingerprint(key)}. That is what a "
            f"reinstalled node, or someone in the middle, looks like. If the node was reinstalled, remove the "
            f"old key with: {remove}", fix=f"{remove} (only if the node was reinstalled)")
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


def _quote_arg(text: str) -> str:
    import shlex

    return shlex.quote(text)


async def unknown_host_key(node: NodeConfig, ssh: SshSettings, exc: Exception) -> UnknownHostKey:
    """Say which key the node presented and the command that trusts it, never trust it ourselves."""
    target = resolve_target(node, ssh)
    port = target.port
    known = ssh.known_hosts or "~/.ssh/known_hosts"
    trust = f"coord trust {node.name}" + (f" --config {ssh.cluster_file}" if ssh.cluster_file else "")
    try:
        key = await fetch_host_key(target, ssh)
    except NodeUnreachable:  # best effort: the reason is still shown without the fingerprint
        key = None
    if key is not None:
        fingerprint = key.get_fingerprint("sha256")
        return UnknownHostKey(
            f"host key of {target.host}:{port} is not trusted ({key.get_algorithm()} {fingerprint}, "
            f"not in {known}: {exc}); if that fingerprint is the node's, trust it with: "
            f"{trust} --fingerprint {fingerprint}", key=key)
    return UnknownHostKey(f"host key of {target.host}:{port} is not trusted ({exc}); check it, then trust it "
                          f"with: {trust}", key=None)
