"""`coord hostfile` on the multi-host cluster, used as a user would: plain `mlx.launch --hostfile`
from their own shell, with their own ~/.ssh, runs an all_sum across the three nodes.

Whose shell. The head namespace runs as root, and ssh reads its config from the passwd home
(/root here), never from $HOME; this test must not touch the machine's /root/.ssh. So "the
user" is root in a private mount namespace where /etc/passwd is bind-mounted with root's home
set to a directory the test made: ssh, ssh -G and Python all see that directory as ~, nothing
outside the process tree changes, and no flag or wrapper is added to ssh. The daemon runs in
such a namespace too (with the same home), as a user's daemon runs as that user.

What each rank runs. mlx.launch runs its command as given on every node (a bare ``script.py``
is not found there; ``--python`` is one path for all), and each node here has its own user, home
and venv. So the command is ``sh -c 'exec "$HOME/coord-hostfile-test/run"'``: each node's user
has that small script (its own venv's python, a private TMPDIR, the all_sum script beside it).
"""

from __future__ import annotations

import json
import os
import pwd
import shlex
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.cluster.test_ready_multihost import ALLSUM
from tests.integration.daemon_harness import (
    DaemonProcess,
    all_up,
    coord,
    environment,
    short_tempdir,
)

pytestmark = pytest.mark.cluster

RANK_DIR = "coord-hostfile-test"  # in each node user's home
COMMAND = ["sh", "-c", f'exec "$HOME/{RANK_DIR}/run"']
MLX_LAUNCH = str(Path(sys.executable).parent / "mlx.launch")


class UserShell:
    """Root with a home of the test's own (see the module docstring)."""

    def __init__(self, netns_cluster, root: Path):
        self.cluster = netns_cluster
        self.home = root / "home"
        (self.home / ".ssh").mkdir(parents=True, mode=0o700)
        self.home.chmod(0o700)
        self.passwd = root / "passwd"
        lines = Path("/etc/passwd").read_text().splitlines()
        self.passwd.write_text("".join(self._rehome(line) + "\n" for line in lines))
        self.env = {**environment(HOME=str(self.home)),
                    "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"}

    def _rehome(self, line: str) -> str:
        fields = line.split(":")
        if fields[0] == "root" and len(fields) == 7:
            fields[5] = str(self.home)
        return ":".join(fields)

    @property
    def prefix(self) -> list[str]:
        """Runs the argv appended to it as this user, in the head namespace."""
        return ["ip", "netns", "exec", self.cluster.head_ns, "unshare", "--mount", "--propagation", "private",
                "sh", "-c", 'mount --bind "$1" /etc/passwd && shift && exec "$@"', "sh", str(self.passwd)]

    def run(self, command: str, timeout: float = 180):
        return subprocess.run([*self.prefix, "bash", "-c", command], capture_output=True, text=True,
                              env=self.env, timeout=timeout, cwd=self.home, check=False)


@contextmanager
def daemon_for(shell: UserShell, config: Path):
    daemon = DaemonProcess(config, env=shell.env, prefix=shell.prefix).start()
    try:
        daemon.wait_for(all_up, 60, "all nodes up")
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture(scope="module")
def rank_scripts(netns_cluster):
    """In each node user's home: the all_sum script and the run script that starts it with that node's python."""
    made = []
    for node in netns_cluster.nodes:
        entry = pwd.getpwnam(node.user)
        directory = Path(node.home) / RANK_DIR
        directory.mkdir(mode=0o700)
        made.append(directory)
        (directory / "allsum.py").write_text(ALLSUM)
        # MLX compiles CPU kernels under $TMPDIR; users sharing one /tmp must not share that.
        (directory / "run").write_text(f'#!/bin/sh\nexport TMPDIR="$HOME/{RANK_DIR}/tmp"\nmkdir -p "$TMPDIR"\n'
                                       f'cd "$HOME/{RANK_DIR}" && exec {shlex.quote(node.python)} allsum.py\n')
        (directory / "run").chmod(0o755)
        for path in (directory, directory / "allsum.py", directory / "run"):
            os.chown(path, entry.pw_uid, entry.pw_gid)
    yield
    for directory in made:
        shutil.rmtree(directory, ignore_errors=True)


def hostfile(daemon: DaemonProcess, output: Path) -> dict:
    result = coord("hostfile", "-o", str(output), "--json", "--config", str(daemon.config), env=daemon.env,
                   timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def launch(shell: UserShell, output: Path):
    """Plain mlx.launch from the user's shell; every rank's line, sorted."""
    result = shell.run(shlex.join([MLX_LAUNCH, "--hostfile", str(output), "--", *COMMAND]))
    lines = sorted(line.strip() for line in result.stdout.splitlines() if line.strip().startswith("rank "))
    return result, lines


EXPECTED = [f"rank {r} of 3 sum [6.0, 6.0, 6.0, 6.0]" for r in range(3)]


def test_with_the_cluster_files_own_key_and_known_hosts_the_printed_include_line_is_all_plain_mlx_launch_needs(
        netns_cluster, rank_scripts):
    root = short_tempdir()
    root.chmod(0o700)
    try:
        shell = UserShell(netns_cluster, root)
        # The fixture's cluster file: its key, known_hosts and an (empty) ssh config of its own, none
        # of which the user's ssh knows.
        config = netns_cluster.write_cluster_toml(root / "cluster.toml", state_dir=root / "state")
        with daemon_for(shell, config) as daemon:
            output = root / "hosts.json"
            result = hostfile(daemon, output)
            names = [f"coord-netns-test-{n.name}" for n in netns_cluster.nodes]
            assert [h["ssh"] for h in json.loads(output.read_text())["hosts"]] == names
            include = result["ssh"]["include_line"]
            assert include == f"Include {root / 'state' / 'ssh' / 'coord_hosts.conf'}"
            assert all("known_hosts" in " ".join(e["needs"]) for e in result["ssh"]["entries"])
            # The user adds the one line coord printed; coord never wrote ~/.ssh/config itself.
            assert not (shell.home / ".ssh" / "config").exists()
            (shell.home / ".ssh" / "config").write_text(include + "\n")
            (shell.home / ".ssh" / "config").chmod(0o600)
            ran, lines = launch(shell, output)
            assert lines == EXPECTED, (ran.stdout, ran.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_with_the_users_own_key_known_hosts_and_alias_the_hostfile_is_user_at_host_and_needs_no_include(
        netns_cluster, rank_scripts):
    root = short_tempdir()
    root.chmod(0o700)
    try:
        shell = UserShell(netns_cluster, root)
        ssh_dir = shell.home / ".ssh"
        shutil.copy(netns_cluster.client_key, ssh_dir / "id_ed25519")
        shutil.copy(netns_cluster.known_hosts, ssh_dir / "known_hosts")
        n1, n2, n3 = netns_cluster.nodes
        # As a user's own config would be: one alias, for n1; the others are plain addresses.
        (ssh_dir / "config").write_text(f"Host alice-box\n  HostName {netns_cluster.node_ip('n1')}\n"
                                        f"  User {n1.user}\n")
        (ssh_dir / "config").chmod(0o600)
        config = netns_cluster.write_cluster_toml(root / "cluster.toml", state_dir=root / "state", extra_node_fields={
            "n1": {"host": "alice-box", "ips": [netns_cluster.node_ip("n1")]}})
        # No [ssh] key, known_hosts or config of the cluster's own: coord uses the user's, as ssh does.
        text = config.read_text().splitlines()
        config.write_text("\n".join(line for line in text if line.split(" =")[0] not in
                                    ("known_hosts", "identity_file", "config")) + "\n")
        with daemon_for(shell, config) as daemon:
            output = root / "hosts.json"
            result = hostfile(daemon, output)
            assert [h["ssh"] for h in json.loads(output.read_text())["hosts"]] == [
                "alice-box", f"{n2.user}@{netns_cluster.node_ip('n2')}", f"{n3.user}@{netns_cluster.node_ip('n3')}"]
            assert result["ssh"]["include_line"] is None and result["files"]["ssh_include"] is None
            assert all(not e["needs"] for e in result["ssh"]["entries"])
            ran, lines = launch(shell, output)
            assert lines == EXPECTED, (ran.stdout, ran.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
