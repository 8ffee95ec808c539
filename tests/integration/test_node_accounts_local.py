"""The real coordd and `coord trust` refuse a cluster file in which two nodes are one account on one
machine (here through an alias of the ssh config), naming both; local nodes of this machine, one
workdir each (the demo's), still come up."""

from __future__ import annotations

import shutil

from tests.integration.daemon_harness import (
    DaemonProcess,
    all_up,
    coord,
    environment,
    short_tempdir,
    write_local_cluster,
)

CLUSTER = """\
[cluster]
name = "twice"
state_dir = "{root}/state"

[ssh]
config = "{root}/ssh_config"

[[nodes]]
name = "studio"
host = "10.0.0.2"
user = "alice"
python = "/usr/bin/python3"
workdir = "/Users/alice/a"

[[nodes]]
name = "studio-again"
host = "mac-studio"
python = "/usr/bin/python3"
workdir = "/Users/alice/b"
"""


def test_two_nodes_of_one_account_are_refused_by_the_daemon_and_by_trust_naming_both():
    root = short_tempdir()
    try:
        (root / "ssh_config").write_text("Host mac-studio\n  HostName 10.0.0.2\n  User alice\n")
        config = root / "cluster.toml"
        config.write_text(CLUSTER.format(root=root))
        expected = (f"{config}:17: nodes[1] 'studio-again' (mac-studio) and nodes[0] 'studio' (line 10: "
                    "alice@10.0.0.2) both log in as alice@10.0.0.2:22: two nodes must be two machines, or two "
                    "users of one machine (several ranks on one machine are one node with a PyTorch job's "
                    "--procs-per-node)")
        daemon = coord("daemon", "--config", str(config), env=environment(), timeout=60)
        assert daemon.returncode == 2 and daemon.stderr.strip() == f"coordd: {expected}", daemon.stderr
        assert not (root / "state").exists()  # refused before anything started
        trust = coord("trust", "studio", "--config", str(config), env=environment(), timeout=60)
        assert trust.returncode == 2 and expected in trust.stderr, trust.stderr
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_local_nodes_of_this_machine_with_their_own_workdirs_come_up():
    root = short_tempdir()
    daemon = DaemonProcess(write_local_cluster(root, ["a", "b"]), env=environment()).start()
    try:
        daemon.wait_for(all_up, 60, "both local nodes up")
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_init_refuses_two_hosts_of_one_account_before_connecting_to_either():
    root = short_tempdir()
    try:
        (root / "ssh_config").write_text("Host mac-studio\n  HostName 10.0.0.2\n  User alice\n")
        output = root / "cluster.toml"
        # 10.0.0.2 is not reachable from here: the refusal comes before any connection is tried.
        init = coord("init", "--hosts", "alice@10.0.0.2,mac-studio", "--ssh-config", str(root / "ssh_config"),
                     "--timeout", "1", "-o", str(output), env=environment(), timeout=60)
        assert init.returncode == 2, init.stderr
        assert ("--hosts names alice@10.0.0.2 and mac-studio, which both log in as alice@10.0.0.2:22: give each "
                "node its own machine or user") in init.stderr
        assert not output.exists()
    finally:
        shutil.rmtree(root, ignore_errors=True)
