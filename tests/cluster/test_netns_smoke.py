"""Smoke test of the network-namespace test cluster itself."""

from __future__ import annotations

import importlib.metadata

import pytest

pytestmark = pytest.mark.cluster

PROBE = "import mlx.core, getpass; print(getpass.getuser(), mlx.core.__version__)"


def test_ssh_to_every_node_as_its_user_with_its_venv(netns_cluster):
    want = importlib.metadata.version("mlx")
    for node in netns_cluster.nodes:
        proc = netns_cluster.ssh(node.name, [node.python, "-c", PROBE])
        assert proc.returncode == 0, f"{node.name}: {proc.stderr}"
        assert proc.stdout.split() == [node.user, want], node.name


def test_nodes_have_no_coord(netns_cluster):
    for node in netns_cluster.nodes:
        proc = netns_cluster.ssh(node.name, [node.python, "-c", "import coordinator"])
        assert proc.returncode != 0, f"{node.name} can import coordinator"


def test_unknown_host_key_is_refused(netns_cluster, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    node = netns_cluster.nodes[0]
    proc = netns_cluster.ssh(
        node.name,
        "true",
        options=["-o", f"UserKnownHostsFile={empty}", "-o", "StrictHostKeyChecking=yes"],
    )
    assert proc.returncode == 255
    assert "host key verification failed" in proc.stderr.lower()


def test_cut_link_makes_node_unreachable_and_restore_brings_it_back(netns_cluster):
    node = netns_cluster.nodes[1].name
    opts = ["-o", "ConnectTimeout=2"]
    netns_cluster.cut_link(node)
    try:
        proc = netns_cluster.ssh(node, "true", options=opts, timeout=20)
        assert proc.returncode == 255, proc.stderr
        # the other nodes stay reachable
        other = netns_cluster.nodes[0].name
        assert netns_cluster.ssh(other, "true", options=opts).returncode == 0
    finally:
        netns_cluster.restore_link(node)
    proc = netns_cluster.ssh(node, "true", options=opts, timeout=20)
    assert proc.returncode == 0, proc.stderr


def test_stop_and_start_sshd(netns_cluster):
    node = netns_cluster.nodes[2].name
    opts = ["-o", "ConnectTimeout=2"]
    netns_cluster.stop_sshd(node)
    try:
        proc = netns_cluster.ssh(node, "true", options=opts, timeout=20)
        assert proc.returncode == 255
        assert "refused" in proc.stderr.lower()
    finally:
        netns_cluster.start_sshd(node)
    assert netns_cluster.ssh(node, "true", options=opts).returncode == 0


def test_nodes_reach_each_other_and_exec_in_runs_as_user(netns_cluster):
    a, b = netns_cluster.nodes[0], netns_cluster.nodes[1]
    proc = netns_cluster.exec_in(a.name, ["id", "-un"], user=a.user)
    assert proc.stdout.strip() == a.user
    script = (
        "import socket, sys; socket.create_connection((sys.argv[1], 22), timeout=3).close()"
    )
    proc = netns_cluster.exec_in(
        a.name, [a.python, "-c", script, netns_cluster.node_ip(b.name)], user=a.user, timeout=10
    )
    assert proc.returncode == 0, proc.stderr


def test_cluster_toml(netns_cluster, tmp_path):
    import tomllib

    path = netns_cluster.write_cluster_toml(
        tmp_path / "cluster.toml",
        state_dir=tmp_path / "state",
        extra_node_fields={"n2": {"env": {"TMPDIR": "/srv/coordbob/work/tmp"}}},
    )
    doc = tomllib.loads(path.read_text())
    assert doc["cluster"]["name"] == "netns-test"
    assert doc["ssh"]["known_hosts"] == str(netns_cluster.known_hosts)
    assert doc["ssh"]["identity_file"] == str(netns_cluster.client_key)
    assert doc["ssh"]["keepalive_s"] == 1
    assert [n["name"] for n in doc["nodes"]] == [n.name for n in netns_cluster.nodes]
    for entry, node in zip(doc["nodes"], netns_cluster.nodes):
        assert entry["host"] == netns_cluster.node_ip(node.name)
        assert entry["user"] == node.user
        assert entry["python"] == f"{node.venv}/bin/python"
        proc = netns_cluster.ssh(node.name, ["test", "-d", entry["workdir"], "-a", "-w", entry["workdir"]])
        assert proc.returncode == 0, f"{node.name} workdir not writable"
    assert doc["nodes"][1]["env"] == {"TMPDIR": "/srv/coordbob/work/tmp"}
