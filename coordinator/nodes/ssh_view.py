"""What the plain ``ssh`` command would do for a destination, from ``ssh -G``.

mlx.launch starts every rank with the plain ``ssh`` command, so whether a hostfile
entry works from the user's shell is a question only OpenSSH's own config parsing
answers exactly (Host and Match blocks, Include, /etc/ssh/ssh_config, defaults).
``ssh -G`` prints the settings it would use and connects to nothing.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass

import anyio


class SshViewError(RuntimeError):
    pass


@dataclass(frozen=True)
class SshView:
    """The settings ssh would connect with; paths with ``~`` and ``%d``/``%u`` expanded."""

    hostname: str
    user: str
    port: int
    identity_files: tuple[str, ...] = ()
    # As ssh -G prints them: each line a space-joined list, so a name with a space is ambiguous.
    known_hosts: tuple[str, ...] = ()  # the user's files, then the global ones
    proxy_jump: str | None = None
    proxy_command: str | None = None

    def checks_known_hosts(self, path: str) -> bool:
        """Whether ssh would look a host key up in ``path``."""
        path = os.path.normpath(path)
        return any(value == path or f" {path} " in f" {value} " for value in self.known_hosts)


def ssh_g_argv(destination: str, *, user: str | None = None, port: int | None = None,
               config_file: str | None = None) -> list[str]:
    # launchd and systemd give daemons a short PATH; OpenSSH's client is /usr/bin/ssh on macOS and Debian.
    ssh = shutil.which("ssh") or ("/usr/bin/ssh" if os.access("/usr/bin/ssh", os.X_OK) else None)
    if ssh is None:
        raise SshViewError("no ssh client on PATH (mlx.launch needs one too); install OpenSSH's client")
    argv = [ssh, "-G"]
    if config_file:
        argv += ["-F", config_file]
    if user:
        argv += ["-l", user]
    if port:
        argv += ["-p", str(port)]
    return [*argv, "--", destination]


async def resolve_ssh(destination: str, *, user: str | None = None, port: int | None = None,
                      config_file: str | None = None) -> SshView:
    """``ssh -G``: the user's own config unless ``config_file`` names another (as ``-F`` does)."""
    argv = ssh_g_argv(destination, user=user, port=port, config_file=config_file)
    try:
        with anyio.fail_after(10):
            done = await anyio.run_process(argv, check=False, stdin=subprocess.DEVNULL)
    except TimeoutError:
        raise SshViewError(f"`ssh -G {destination}` did not answer within 10 s "
                           "(a Match exec in the ssh config?)") from None
    if done.returncode != 0:
        reason = done.stderr.decode(errors="replace").strip().splitlines()
        raise SshViewError(f"`ssh -G {destination}` failed: {reason[-1] if reason else f'exit {done.returncode}'}; "
                           f"fix the ssh config it names")
    return parse_ssh_g(done.stdout.decode(errors="replace"))


def parse_ssh_g(text: str) -> SshView:
    """``ssh -G`` prints one lowercase keyword and its value a line; some keywords repeat."""
    single: dict[str, str] = {}
    identities: list[str] = []
    known: dict[str, list[str]] = {"userknownhostsfile": [], "globalknownhostsfile": []}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        value = value.strip()
        if key == "identityfile":
            identities.append(value)
        elif key in known:
            known[key].append(value)
        elif key:
            single.setdefault(key, value)
    if "hostname" not in single or "port" not in single or "user" not in single:
        raise SshViewError("`ssh -G` printed no hostname, user or port; is this OpenSSH's ssh (6.8 or later)?")
    user = single["user"]
    return SshView(
        hostname=single["hostname"], user=user, port=int(single["port"]),
        identity_files=tuple(expand_path(p, user) for p in identities),
        known_hosts=tuple(known["userknownhostsfile"] + known["globalknownhostsfile"]),
        proxy_jump=_unless_none(single.get("proxyjump")),
        proxy_command=_unless_none(single.get("proxycommand")))


def expand_path(path: str, remote_user: str = "") -> str:
    """A path as ssh opens it: ``~`` and ``%d`` are the passwd home (ssh ignores $HOME)."""
    home = local_home()
    local_user = pwd.getpwuid(os.getuid()).pw_name
    if path == "~" or path.startswith("~/"):
        path = home + path[1:]
    if "%" in path:
        out, i = [], 0
        while i < len(path):
            token = path[i:i + 2]
            if token in ("%d", "%u", "%r", "%%"):
                out.append({"%d": home, "%u": local_user, "%r": remote_user, "%%": "%"}[token])
                i += 2
            else:
                out.append(path[i])
                i += 1
        path = "".join(out)
    return os.path.normpath(path)


def local_home() -> str:
    return pwd.getpwuid(os.getuid()).pw_dir


def _unless_none(value: str | None) -> str | None:
    return None if value in (None, "", "none") else value
