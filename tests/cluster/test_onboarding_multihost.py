"""`coord init --hosts` and `coord trust` on the multi-host cluster.

Three nodes, three Unix users with three homes and three venvs in three different places
(``~/venv``, ``~/mlx/env``, ``~/py`` under homes in /home, /srv and /var/tmp), reached over
OpenSSH. init is given nothing but user@address: it must find each venv itself, and the file
it writes must bring the daemon up on all three nodes with those Pythons.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.config.cluster_file import load_config
from tests.integration.daemon_harness import REPO, DaemonProcess, all_up, environment, short_tempdir

pytestmark = pytest.mark.cluster


def _coord_in_head(netns_cluster, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """The CLI in the head namespace with no terminal (stdin is /dev/null), as a script runs it."""
    argv = netns_cluster.ns_argv("head", [sys.executable, "-m", "coordinator.cli.main", *args])
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env, cwd=REPO,
                          stdin=subprocess.DEVNULL)


def _hosts(netns_cluster) -> str:
    return ",".join(f"{n.user}@{netns_cluster.node_ip(n.name)}" for n in netns_cluster.nodes)


def _ssh_options(netns_cluster, known_hosts: Path) -> list[str]:
    return ["--known-hosts", str(known_hosts), "--identity-file", str(netns_cluster.client_key),
            "--ssh-config", str(netns_cluster.empty_ssh_config)]


def _host_fingerprint(netns_cluster, node: str) -> str:
    """The fingerprint as the node's admin reads it from the node's own key file."""
    pub = Path(netns_cluster.tmpdir) / node / "ssh_host_ed25519_key.pub"
    return subprocess.run(["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True,
                          check=True).stdout.split()[1]


def test_init_finds_every_nodes_venv_and_its_file_brings_all_three_up(netns_cluster):
    root = short_tempdir()
    env = environment(XDG_STATE_HOME=str(root / "state"))  # the file names no state_dir: keep it here
    output = root / "cluster.toml"
    try:
        result = _coord_in_head(netns_cluster, "init", "--hosts", _hosts(netns_cluster), "-o", str(output),
                                *_ssh_options(netns_cluster, netns_cluster.known_hosts), "--json", env=env)
        assert result.returncode == 0, result.stderr + result.stdout
        found = {n["spec"]["user"]: n for n in json.loads(result.stdout)["nodes"]}
        config = load_config(output)
        assert [n.user for n in config.nodes] == [spec.user for spec in netns_cluster.nodes]
        for spec, node in zip(netns_cluster.nodes, config.nodes, strict=True):
            assert node.host == netns_cluster.node_ip(spec.name)
            assert node.python == spec.python  # ~/venv, ~/mlx/env, ~/py: each found by the probe
            assert node.workdir == f"{spec.home}/coord-work"
            report = found[spec.user]
            assert report["python"]["mlx"] == importlib.metadata.version("mlx")
            assert report["python"]["mlx_lm"] == importlib.metadata.version("mlx-lm")
            assert report["facts"]["home"] == spec.home and report["disk"]["free_bytes"] > 0
            # The system python3 was asked too, and has no mlx: not chosen.
            assert any(p["path"] == "/usr/bin/python3" and not p["mlx"] for p in report["pythons"])
        text = output.read_text()
        assert text.count("[[nodes]]") == 3 and f"mlx {importlib.metadata.version('mlx')}" in text

        daemon = DaemonProcess(output, env=env, prefix=["ip", "netns", "exec", netns_cluster.head_ns]).start()
        try:
            doc = daemon.wait_for(all_up, 60, "all nodes up from the file coord init wrote")
        finally:
            daemon.stop()
        for spec in netns_cluster.nodes:
            node = next(n for n in doc["nodes"] if n["facts"] and n["facts"]["user"] == spec.user)
            assert node["state"] == "up"
            assert node["facts"]["python_executable"] == spec.python
            assert node["facts"]["workdir"] == f"{spec.home}/coord-work"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_unknown_host_keys_are_refused_without_a_terminal_and_trusted_with_their_fingerprint(netns_cluster):
    root = short_tempdir()
    env = environment(XDG_STATE_HOME=str(root / "state"))
    known_hosts = root / "known_hosts"  # a head that never met these nodes
    output = root / "cluster.toml"
    try:
        refused = _coord_in_head(netns_cluster, "init", "--hosts", _hosts(netns_cluster), "-o", str(output),
                                 *_ssh_options(netns_cluster, known_hosts), env=env)
        assert refused.returncode == 1
        assert not output.exists() and not known_hosts.exists()  # nothing trusted, nothing written
        for spec in netns_cluster.nodes:
            ip = netns_cluster.node_ip(spec.name)
            fingerprint = _host_fingerprint(netns_cluster, spec.name)
            assert (f"fix: coord trust {ip} --known-hosts {known_hosts} --ssh-config "
                    f"{netns_cluster.empty_ssh_config} --fingerprint {fingerprint}") in refused.stdout

        trust = ["--known-hosts", str(known_hosts), "--ssh-config", str(netns_cluster.empty_ssh_config)]
        n1 = netns_cluster.node_ip("n1")
        # The same refusal from `coord trust` itself, and a fingerprint of another node's key is no key.
        alone = _coord_in_head(netns_cluster, "trust", n1, *trust, env=env)
        assert alone.returncode == 1 and "no terminal" in alone.stderr and not known_hosts.exists()
        wrong = _coord_in_head(netns_cluster, "trust", n1, *trust, "--fingerprint",
                               _host_fingerprint(netns_cluster, "n2"), env=env)
        assert wrong.returncode == 1 and "nothing added" in wrong.stderr and not known_hosts.exists()

        for spec in netns_cluster.nodes:
            ip = netns_cluster.node_ip(spec.name)
            added = _coord_in_head(netns_cluster, "trust", f"{spec.user}@{ip}", *trust, "--fingerprint",
                                   _host_fingerprint(netns_cluster, spec.name), env=env)
            assert added.returncode == 0, added.stderr
        # The lines are OpenSSH's: ssh itself accepts them with strict checking.
        for spec in netns_cluster.nodes:
            ssh = netns_cluster.exec_in("head", [
                "ssh", "-F", "/dev/null", "-i", str(netns_cluster.client_key), "-o", "IdentitiesOnly=yes",
                "-o", f"UserKnownHostsFile={known_hosts}", "-o", "GlobalKnownHostsFile=/dev/null",
                "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes",
                f"{spec.user}@{netns_cluster.node_ip(spec.name)}", "id -un"], timeout=30)
            assert ssh.returncode == 0 and ssh.stdout.strip() == spec.user, ssh.stderr

        written = _coord_in_head(netns_cluster, "init", "--hosts", _hosts(netns_cluster), "-o", str(output),
                                 *_ssh_options(netns_cluster, known_hosts), env=env)
        assert written.returncode == 0, written.stderr + written.stdout
        assert [n.python for n in load_config(output).nodes] == [s.python for s in netns_cluster.nodes]
    finally:
        shutil.rmtree(root, ignore_errors=True)
