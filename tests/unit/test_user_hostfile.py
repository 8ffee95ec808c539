"""Hostfile entries as the user's own ssh reaches each node: user@host, their alias as is, or a
Host block in coord's include file when the cluster file needs what their ssh config lacks.

What ssh would do is given here by a small stand-in for ``ssh -G`` (user config blocks as
plain data); tests/integration/test_user_hostfile_ssh.py runs the real ``ssh -G``."""

from __future__ import annotations

import os
import stat

import anyio
import pytest

from coordinator.config.cluster_file import parse_config
from coordinator.launch.hostfile import HostfileError, build_hostfile
from coordinator.nodes.ssh_view import SshView, parse_ssh_g
from coordinator.launch.user_hostfile import (
    INCLUDE_FILE,
    choose_entries,
    config_value,
    host_alias,
    include_line,
    write_include_file,
)

HOME = "/home/me"
DEFAULT_KEYS = tuple(f"{HOME}/.ssh/{k}" for k in ("id_rsa", "id_ecdsa", "id_ed25519"))
DEFAULT_KNOWN = (f"{HOME}/.ssh/known_hosts {HOME}/.ssh/known_hosts2", "/etc/ssh/ssh_known_hosts")


class FakeSsh:
    """``ssh -G`` over Host blocks given as dicts: the user's config, or the one ``-F`` names."""

    def __init__(self, user_config: dict | None = None, other_configs: dict | None = None):
        self.user_config = user_config or {}
        self.other_configs = other_configs or {}
        self.calls: list[tuple] = []

    async def __call__(self, destination, *, user=None, port=None, config_file=None) -> SshView:
        self.calls.append((destination, user, port, config_file))
        blocks = self.other_configs.get(config_file, self.user_config) if config_file else self.user_config
        login, _, host = destination.rpartition("@")
        block = blocks.get(host.lower(), {})
        return SshView(hostname=block.get("hostname", host.lower()), user=user or login or block.get("user", "me"),
                       port=port or block.get("port", 22), identity_files=block.get("identity", DEFAULT_KEYS),
                       known_hosts=block.get("known", DEFAULT_KNOWN), proxy_jump=block.get("proxyjump"))


def cluster(nodes: str, ssh: str = "", name: str = "lab", state_dir: str = "/tmp/coord-unit-state"):
    return parse_config(f'[cluster]\nname = "{name}"\nstate_dir = "{state_dir}"\n\n[ssh]\n{ssh}\n{nodes}')


def node(name: str, host: str, user: str | None = "alice", port: int | None = None, extra: str = "") -> str:
    lines = [f'[[nodes]]\nname = "{name}"\nhost = "{host}"', 'python = "/v/bin/python"\nworkdir = "/w"']
    if user:
        lines.append(f'user = "{user}"')
    if port:
        lines.append(f"port = {port}")
    return "\n".join(lines) + "\n" + extra + "\n"


def entries(config, fake: FakeSsh):
    return anyio.run(choose_entries, config, fake)


def test_a_plain_address_with_a_user_is_written_user_at_host_and_needs_nothing():
    found = entries(cluster(node("n1", "10.0.0.2") + node("n2", "10.0.0.3", user=None)), FakeSsh())
    assert found["n1"].ssh == "alice@10.0.0.2" and not found["n1"].needs and not found["n1"].block
    assert found["n2"].ssh == "10.0.0.3" and not found["n2"].needs


def test_the_users_own_alias_is_kept_as_is_and_gets_the_user_only_when_it_names_another():
    fake = FakeSsh({"studio": {"hostname": "10.0.0.9", "user": "alice"}, "mini": {"hostname": "10.0.0.8",
                                                                             "user": "carol"}})
    found = entries(cluster(node("n1", "studio") + node("n2", "mini", user="bob") + node("n3", "studio", user=None)),
                    fake)
    assert found["n1"].ssh == "studio" and not found["n1"].needs
    assert found["n2"].ssh == "bob@mini" and not found["n2"].needs
    assert found["n3"].ssh == "studio" and not found["n3"].needs


def test_a_local_node_is_the_loopback_address_mlx_launch_runs_without_ssh():
    found = entries(parse_config('[cluster]\nname = "l"\n[[nodes]]\nname = "a"\nhost = "local"\nworkdir = "/w"\n'),
                    FakeSsh())
    assert found["a"].ssh == "127.0.0.1" and not found["a"].needs


def test_a_port_the_users_ssh_does_not_know_needs_a_host_block_and_one_it_knows_does_not():
    fake = FakeSsh({"10.0.0.3": {"port": 2222}})
    found = entries(cluster(node("n1", "10.0.0.2", port=2222) + node("n2", "10.0.0.3", port=2222)
                            + node("n3", "10.0.0.4", port=22)), fake)
    assert found["n1"].ssh == "coord-lab-n1" and found["n1"].needs == ("port 2222",)
    assert found["n1"].block == ("Host coord-lab-n1", "  HostName 10.0.0.2", "  User alice", "  Port 2222",
                                 "  BatchMode yes", "  StrictHostKeyChecking yes")
    assert found["n2"].ssh == "alice@10.0.0.3" and not found["n2"].needs
    assert found["n3"].ssh == "alice@10.0.0.4" and not found["n3"].needs  # 22 is ssh's own default


def test_the_cluster_files_identity_and_known_hosts_go_into_the_block_unless_the_users_ssh_uses_them():
    ssh = 'identity_file = "/keys/lab key"\nknown_hosts = "/keys/known_hosts"\n'
    fake = FakeSsh({"10.0.0.3": {"identity": ("/keys/lab key",), "known": ("/keys/known_hosts",)}})
    found = entries(cluster(node("n1", "10.0.0.2") + node("n2", "10.0.0.3"), ssh), fake)
    n1 = found["n1"]
    assert n1.ssh == "coord-lab-n1"
    assert n1.needs == ("identity file /keys/lab key", "known_hosts /keys/known_hosts")
    assert '  IdentityFile "/keys/lab key"' in n1.block and "  IdentitiesOnly yes" in n1.block
    assert "  UserKnownHostsFile /keys/known_hosts" in n1.block
    assert found["n2"].ssh == "alice@10.0.0.3" and not found["n2"].needs


def test_an_alias_only_the_clusters_own_ssh_config_knows_is_resolved_into_the_block():
    fake = FakeSsh({}, {"/cfg/lab_ssh": {"gpu": {"hostname": "10.9.0.1", "port": 2200, "proxyjump": "bastion"}}})
    found = entries(cluster(node("n1", "gpu"), 'config = "/cfg/lab_ssh"\n'), fake)
    n1 = found["n1"]
    assert n1.ssh == "coord-lab-n1"
    assert n1.needs == ("address 10.9.0.1", "port 2200", "proxy bastion")
    assert n1.block[:4] == ("Host coord-lab-n1", "  HostName 10.9.0.1", "  User alice", "  Port 2200")
    assert "  ProxyJump bastion" in n1.block
    # coord's own view reads the cluster's ssh config, the user's view reads theirs
    assert ("gpu", "alice", None, "/cfg/lab_ssh") in fake.calls and ("alice@gpu", None, None, None) in fake.calls


def test_an_ipv6_zone_is_taken_as_is_on_the_command_line_and_its_percent_doubled_in_a_block():
    found = entries(cluster(node("n1", "fe80::1%eth0") + node("n2", "fe80::2%eth0", port=2222)), FakeSsh())
    assert found["n1"].ssh == "alice@fe80::1%eth0" and not found["n1"].needs
    assert found["n2"].ssh == "coord-lab-n2" and "  HostName fe80::2%%eth0" in found["n2"].block


def test_odd_values_are_quoted_and_escaped_as_ssh_config_reads_them():
    assert config_value("/plain/path", tokens=True) == "/plain/path"
    assert config_value("/a dir/key", tokens=True) == '"/a dir/key"'
    assert config_value('/k"q\\z', tokens=True) == '"/k\\"q\\\\z"'
    assert config_value("/k#1", tokens=False) == '"/k#1"'
    assert config_value("/home/100%/k", tokens=True) == "/home/100%%/k"  # ssh expands %-tokens in paths
    assert config_value("100%", tokens=False) == "100%"
    with pytest.raises(HostfileError, match="control character"):
        config_value("/k\nHost *", tokens=True)
    assert include_line("/state dir/ssh/coord_hosts.conf") == 'Include "/state dir/ssh/coord_hosts.conf"'
    assert host_alias("My Lab #2", "N1") == "coord-my-lab-2-n1"


def test_the_include_file_holds_every_block_with_its_reason_and_names_its_own_include_line(tmp_path):
    config = cluster(node("n1", "10.0.0.2", port=2222) + node("n2", "10.0.0.3"), state_dir=str(tmp_path / "st"))
    found = entries(config, FakeSsh())
    written = write_include_file(config, found)
    path = tmp_path / "st" / INCLUDE_FILE
    assert written.include_file == str(path) and written.include_line == f"Include {path}"
    text = path.read_text()
    assert f"#   Include {path}" in text
    assert "# node n1: port 2222\nHost coord-lab-n1\n  HostName 10.0.0.2\n  User alice\n  Port 2222\n" in text
    assert "coord-lab-n2" not in text  # n2 needs nothing: alice@10.0.0.3
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # ssh refuses a config others can write
    assert written.describe()["entries"] == [{"node": "n1", "ssh": "coord-lab-n1", "needs": ["port 2222"]},
                                             {"node": "n2", "ssh": "alice@10.0.0.3", "needs": []}]


def test_no_include_is_asked_for_when_every_node_needs_nothing_and_an_earlier_file_is_emptied(tmp_path):
    plain = cluster(node("n1", "10.0.0.2"), state_dir=str(tmp_path / "st"))
    written = write_include_file(plain, entries(plain, FakeSsh()))
    assert written.include_line is None and not (tmp_path / "st" / INCLUDE_FILE).exists()
    with_port = cluster(node("n1", "10.0.0.2", port=2222), state_dir=str(tmp_path / "st"))
    write_include_file(with_port, entries(with_port, FakeSsh()))
    written = write_include_file(plain, entries(plain, FakeSsh()))
    assert written.include_line is None
    assert "\nHost " not in (tmp_path / "st" / INCLUDE_FILE).read_text()  # an Include already added stays harmless


def test_coords_own_launches_keep_their_private_aliases_and_the_user_hostfile_takes_the_entries():
    config = cluster(node("n1", "10.0.0.2") + node("n2", "10.0.0.3"))
    own = build_hostfile(config)
    assert [h["ssh"] for h in own["hosts"]] == ["coord-n1", "coord-n2"]
    users = build_hostfile(config, ssh_names={"n1": "alice@10.0.0.2", "n2": "coord-lab-n2"})
    assert [h["ssh"] for h in users["hosts"]] == ["alice@10.0.0.2", "coord-lab-n2"]
    assert [h["ips"] for h in users["hosts"]] == [h["ips"] for h in own["hosts"]]


def test_ssh_g_output_is_read_with_paths_expanded_as_ssh_expands_them():
    text = ("user alice\nhostname 10.0.0.2\nport 2222\nidentityfile ~/.ssh/id_rsa\nidentityfile %d/k%%1\n"
            "globalknownhostsfile /etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2\n"
            "userknownhostsfile /tmp/kh dir/known hosts\nproxyjump none\n")
    view = parse_ssh_g(text)
    home = os.path.expanduser("~" + __import__("pwd").getpwuid(os.getuid()).pw_name)
    assert (view.user, view.hostname, view.port) == ("alice", "10.0.0.2", 2222)
    assert view.identity_files == (f"{home}/.ssh/id_rsa", f"{home}/k%1")
    assert view.checks_known_hosts("/tmp/kh dir/known hosts") and view.checks_known_hosts("/etc/ssh/ssh_known_hosts")
    assert view.proxy_jump is None
