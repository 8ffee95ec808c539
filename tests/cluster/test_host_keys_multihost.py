"""A node whose sshd host key really changed, on the multi-host cluster.

n1's sshd restarts with a new key, as after a reinstall, while the head's known_hosts (hashed, as
Debian's ssh writes it) holds the old one. The daemon must say the key CHANGED before anything else,
with both fingerprints and the command that removes the old key; that command, run as printed,
leaves n1 unknown (not changed) with the trust command, which, run as printed, brings n1 up.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess

import pytest

from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, node_states, short_tempdir

pytestmark = pytest.mark.cluster


def _fingerprint(pub) -> str:
    return subprocess.run(["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True, check=True).stdout.split()[1]


def _reason(doc, name: str) -> str:
    return next(n["reason"] or "" for n in doc["nodes"] if n["name"] == name)


def test_a_changed_host_key_is_said_first_and_the_printed_commands_bring_the_node_back(netns_cluster):
    root = short_tempdir()
    known_hosts = root / "known_hosts"
    shutil.copy(netns_cluster.known_hosts, known_hosts)  # the cluster's own stays as it is, for the other tests
    hashed = subprocess.run(["ssh-keygen", "-H", "-f", str(known_hosts)], capture_output=True, text=True)
    assert hashed.returncode == 0 and known_hosts.read_text().count("|1|") == 3, hashed.stderr
    config = netns_cluster.write_cluster_toml(root / "cluster.toml", state_dir=root / "state")
    config.write_text(config.read_text().replace(str(netns_cluster.known_hosts), str(known_hosts)))
    ip = netns_cluster.node_ip("n1")
    head = ["ip", "netns", "exec", netns_cluster.head_ns]
    old = _fingerprint(netns_cluster.host_key_pub("n1"))
    netns_cluster.change_host_key("n1")
    daemon = None
    try:
        new = _fingerprint(netns_cluster.host_key_pub("n1"))
        assert new != old
        daemon = DaemonProcess(config, env=environment(), prefix=head).start()
        doc = daemon.wait_for(lambda d: node_states(d) == {"n1": "down", "n2": "up", "n3": "up"}
                              and "CHANGED" in _reason(d, "n1"), 40, "n1 refused for its changed key")
        reason = _reason(doc, "n1")
        assert reason.startswith(f"host key of {ip}:22 has CHANGED: the node presents ssh-ed25519 {new}, but "
                                 f"{known_hosts}:1 holds ssh-ed25519 {old} for {ip} (hashed)."), reason
        remove = re.search(r"remove the old key with: (.*), then trust the new one", reason).group(1)
        assert remove == f"ssh-keygen -R {ip} -f {known_hosts}"

        # coord trust says the same before anything is removed, even given the new key's fingerprint.
        refused = coord("trust", "n1", "--config", str(config), "--fingerprint", new, env=environment(), prefix=head)
        assert refused.returncode == 1 and "has CHANGED" in refused.stderr and remove in refused.stderr
        assert known_hosts.read_text().count("|1|") == 3

        removed = netns_cluster.exec_in("head", ["sh", "-c", remove], timeout=30)
        assert removed.returncode == 0, removed.stderr
        assert known_hosts.read_text().count("|1|") == 2  # n2's and n3's lines stay

        doc = daemon.wait_for(lambda d: "is not trusted" in _reason(d, "n1"), 40, "n1 unknown once the old key is gone")
        reason = _reason(doc, "n1")
        assert "CHANGED" not in reason and node_states(doc)["n1"] == "down"
        fix = re.search(r"trust it with: (coord trust .*)$", reason).group(1)
        assert fix == f"coord trust n1 --config {config} --fingerprint {new}"
        trusted = coord(*shlex.split(fix)[1:], env=environment(), prefix=head)
        assert trusted.returncode == 0, trusted.stderr
        daemon.wait_for(all_up, 40, "n1 up with its new key trusted")
    finally:
        if daemon is not None:
            daemon.stop()
        netns_cluster.restore_host_key("n1")
        shutil.rmtree(root, ignore_errors=True)
