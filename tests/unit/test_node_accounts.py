"""Two nodes that are one account on one machine are refused when the cluster file is read, naming
both; the machine and the user are what ssh makes of each node through the ssh config."""

from __future__ import annotations

import getpass
from pathlib import Path

import pytest

from coordinator.config.accounts import account, shared_account
from coordinator.config.cluster_file import ConfigError, load_config

SSH_CONFIG = """\
Host studio
  HostName 10.0.0.2
  User alice
Host studio-b
  HostName 10.0.0.2
  User bob
Host lab-a
  HostName 192.168.1.5
  ProxyJump jump-a
Host lab-b
  HostName 192.168.1.5
  ProxyJump jump-b
"""


def _write(tmp_path: Path, *nodes: str, ssh_config: str = SSH_CONFIG) -> Path:
    (tmp_path / "ssh_config").write_text(ssh_config)
    text = '[cluster]\nname = "lab"\nstate_dir = "state"\n\n[ssh]\nconfig = "ssh_config"\n'
    for index, fields in enumerate(nodes):
        text += f'\n[[nodes]]\nname = "n{index + 1}"\n{fields}\npython = "/usr/bin/python3"\nworkdir = "/w{index}"\n'
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def test_accounts_compare_hosts_as_written_one_way():
    assert account("Mac.LOCAL", 22, "a") == account("mac.local", 22, "a")
    assert account("0:0::1", 22, "a") == account("::1", 22, "a") == account("[::1]", 22, "a")
    assert account("10.0.0.2", 22, "a") != account("10.0.0.2", 2222, "a") != account("10.0.0.2", 22, "b")
    assert str(account("::1", 2222, "a", via="jump")) == "a@[::1]:2222 via jump"
    same = account("h", 22, "a")
    assert shared_account([None, same, None, account("h", 22, "b"), same]) == (1, 4)
    assert shared_account([None, None, account("h", 22, "a")]) is None  # local nodes share nothing


def test_the_same_host_and_user_twice_is_refused_naming_both_nodes_and_lines(tmp_path):
    carol = 'host = "10.0.0.9"\nuser = "carol"'
    path = _write(tmp_path, carol, 'host = "10.0.0.3"', carol)
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert str(refused.value) == (
        f"{path}:23: nodes[2] 'n3' (carol@10.0.0.9) and nodes[0] 'n1' (line 10: carol@10.0.0.9) both log in as "
        "carol@10.0.0.9:22: two nodes must be two machines, or two users of one machine (several ranks on one "
        "machine are one node with a PyTorch job's --procs-per-node)")


@pytest.mark.parametrize("first, second, shared", [
    # an alias of the ssh config is its HostName, with its User
    ('host = "studio"', 'host = "10.0.0.2"\nuser = "alice"', "alice@10.0.0.2:22"),
    # no user anywhere is the user running coord, as for ssh
    ('host = "10.0.0.7"', f'host = "10.0.0.7"\nuser = "{getpass.getuser()}"', f"{getpass.getuser()}@10.0.0.7:22"),
    # port 22 given or not is port 22; a host's case does not matter
    ('host = "Node.Lab"\nuser = "a"', 'host = "node.lab"\nuser = "a"\nport = 22', "a@node.lab:22"),
])
def test_one_account_written_two_ways_is_refused(tmp_path, first, second, shared):
    with pytest.raises(ConfigError, match=f"both log in as {shared}:"):
        load_config(_write(tmp_path, first, second))


@pytest.mark.parametrize("first, second", [
    ('host = "studio"', 'host = "studio-b"'),  # one machine, two users
    ('host = "10.0.0.2"\nuser = "a"', 'host = "10.0.0.2"\nuser = "a"\nport = 2222'),  # two sshds (a container)
    ('host = "lab-a"\nuser = "a"', 'host = "lab-b"\nuser = "a"'),  # one address behind two jump hosts
])
def test_two_machines_or_two_users_load(tmp_path, first, second):
    assert len(load_config(_write(tmp_path, first, second)).nodes) == 2


def test_local_nodes_of_one_machine_load_and_one_ssh_node_reads_no_ssh_config(tmp_path):
    local = 'host = "local"'
    assert len(load_config(_write(tmp_path, local, local, 'host = "10.0.0.2"')).nodes) == 3
    # The ssh config is read only to compare two SSH nodes: a broken one is then named with the cause.
    broken = "Port many\n"
    assert len(load_config(_write(tmp_path, local, 'host = "10.0.0.2"', ssh_config=broken)).nodes) == 2
    with pytest.raises(ConfigError, match=r"cannot read the ssh config \(.*ssh_config\) for 10.0.0.2: .*line 1: "
                                          r"Invalid Port integer value: many"):
        load_config(_write(tmp_path, 'host = "10.0.0.2"', 'host = "10.0.0.3"', ssh_config=broken))
