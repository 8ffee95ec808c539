"""coordd on a multi-host cluster: one network namespace, sshd, Unix user, home and venv per node.

The daemon runs in the head namespace and reaches each node over real OpenSSH with
key auth and verified host keys; nodes have only their Python with mlx and mlx-lm,
so the daemon installs its agent on each of them first.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, node_states, short_tempdir

pytestmark = pytest.mark.cluster


def _node(doc, name):
    return next(n for n in doc["nodes"] if n["name"] == name)


@pytest.fixture(scope="module")
def daemon(netns_cluster):
    root = short_tempdir()
    config = netns_cluster.write_cluster_toml(root / "cluster.toml", state_dir=root / "state")
    proc = DaemonProcess(config, env=environment(), prefix=["ip", "netns", "exec", netns_cluster.head_ns])
    # Nodes without an agent yet (fresh in CI; earlier tests may have installed one) must get one.
    proc.fresh = {spec.name for spec in netns_cluster.nodes if not (Path(spec.home) / ".coord" / "agent").exists()}
    proc.started_at = time.monotonic()
    proc.start()
    yield proc
    proc.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_every_node_is_up_within_15_s_with_its_own_user_and_venv(netns_cluster, daemon):
    doc = daemon.wait_for(all_up, 15, "all nodes up")
    assert time.monotonic() - daemon.started_at < 15
    import importlib.metadata
    for spec in netns_cluster.nodes:
        node = _node(doc, spec.name)
        facts = node["facts"]
        assert facts["user"] == spec.user
        assert facts["home"] == spec.home
        assert facts["python_executable"] == spec.python
        assert facts["mlx_version"] == importlib.metadata.version("mlx")
        assert facts["mlx_lm_version"] == importlib.metadata.version("mlx-lm")
        assert facts["workdir"] == spec.workdir
        assert node["address"] == f"{spec.user}@{netns_cluster.node_ip(spec.name)}:22"
        # The node had no agent: the daemon installed its own under that user's home.
        installed = list(Path(spec.home, ".coord", "agent").iterdir())
        assert [p.name for p in installed] == [node["agent"]["bundle"]]
        assert (installed[0] / "BUNDLE_ID").stat().st_uid == os.stat(spec.home).st_uid
    installs = [e for e in doc["events"] if e["kind"] == "node.installing"]
    assert {e["node"] for e in installs} == daemon.fresh


def test_an_agent_killed_on_one_node_is_back_up_within_10_s(netns_cluster, daemon):
    doc = daemon.wait_for(all_up, 30, "all nodes up")
    old_pid = _node(doc, "n2")["agent"]["pid"]
    os.kill(old_pid, signal.SIGKILL)  # namespaces share the pid space: this is n2's agent
    killed = time.monotonic()
    daemon.wait_for(lambda d: _node(d, "n2")["state"] == "up" and _node(d, "n2")["agent"]["pid"] != old_pid,
                    10, "n2 back up with a new agent")
    assert time.monotonic() - killed < 10


def test_a_cut_link_is_down_within_10_s_and_up_within_10_s_of_coming_back(netns_cluster, daemon):
    daemon.wait_for(all_up, 30, "all nodes up")
    netns_cluster.cut_link("n3")
    cut = time.monotonic()
    try:
        doc = daemon.wait_for(lambda d: node_states(d)["n3"] == "down", 10, "n3 down after its link was cut")
        assert time.monotonic() - cut < 10
        assert node_states(doc)["n1"] == "up" and node_states(doc)["n2"] == "up"
    finally:
        netns_cluster.restore_link("n3")
    restored = time.monotonic()
    daemon.wait_for(lambda d: node_states(d)["n3"] == "up", 10, "n3 up after its link came back")
    assert time.monotonic() - restored < 10


def test_an_unknown_host_key_keeps_that_node_down_with_the_fix(netns_cluster):
    root = short_tempdir()
    known_hosts = root / "known_hosts"
    n3_ip = netns_cluster.node_ip("n3")
    # Everyone's key but n3's, as on a head that never met n3.
    kept = [line for line in netns_cluster.known_hosts.read_text().splitlines() if not line.startswith(n3_ip + " ")
            and not line.startswith(f"[{n3_ip}]")]
    known_hosts.write_text("\n".join(kept) + "\n")
    config = netns_cluster.write_cluster_toml(root / "cluster.toml", state_dir=root / "state")
    config.write_text(config.read_text().replace(str(netns_cluster.known_hosts), str(known_hosts)))
    daemon = DaemonProcess(config, env=environment(), prefix=["ip", "netns", "exec", netns_cluster.head_ns]).start()
    try:
        doc = daemon.wait_for(lambda d: node_states(d) == {"n1": "up", "n2": "up", "n3": "down"}
                              and "not trusted" in (_node(d, "n3")["reason"] or ""), 20, "n3 refused")
        reason = _node(doc, "n3")["reason"]
        host_key = Path(netns_cluster.tmpdir) / "n3"
        fingerprint = subprocess.run(["ssh-keygen", "-lf", str(next(host_key.glob("*host*key*.pub")))],
                                     capture_output=True, text=True, check=True).stdout.split()[1]
        assert fingerprint in reason
        fix = re.search(r"trust it with: (coord trust .*)$", reason).group(1)
        assert fix == f"coord trust n3 --config {config} --fingerprint {fingerprint}"
        time.sleep(2)
        assert node_states(daemon.status())["n3"] == "down"  # still refused, never accepted on its own
        # The command shown is the fix: run it as a user would (no terminal), and n3 comes up.
        trusted = coord(*shlex.split(fix)[1:], env=environment(),
                        prefix=["ip", "netns", "exec", netns_cluster.head_ns])
        assert trusted.returncode == 0, trusted.stderr
        assert known_hosts.read_text().splitlines()[-1].startswith(f"{n3_ip} ssh-ed25519 ")
        daemon.wait_for(all_up, 35, "n3 up once its key is trusted")
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
