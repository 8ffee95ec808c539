"""The cluster file: good files load, bad ones are refused naming the line and the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from coordinator.config.cluster_file import ConfigError, load_config, parse_config
from coordinator.config.example_cluster import EXAMPLE_CLUSTER

GOOD = """\
[cluster]
name = "lab"
state_dir = "state"

[ssh]
known_hosts = "kh"
keepalive_s = 1

[[nodes]]
name = "n1"
host = "10.0.0.2"
user = "alice"
python = "/Users/alice/venv/bin/python"
workdir = "/Users/alice/work/"

[[nodes]]
name = "n2"
host = "studio"
user = "bob"
port = 2222
python = "/opt/mlx/bin/python"
workdir = "/Users/bob/w"
ips = ["192.168.2.3"]
"""


def test_a_good_file_gives_each_node_its_own_user_python_and_workdir(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text(GOOD)
    config = load_config(path)
    n1, n2 = config.nodes
    assert (n1.user, n1.python, n1.workdir, n1.port) == ("alice", "/Users/alice/venv/bin/python", "/Users/alice/work", None)
    assert (n2.user, n2.python, n2.port, n2.ips) == ("bob", "/opt/mlx/bin/python", 2222, ("192.168.2.3",))
    assert n2.address == "bob@studio:2222"
    # relative paths are relative to the cluster file, not to the current directory
    assert config.state_dir == tmp_path / "state"
    assert config.socket == tmp_path / "state" / "coord.sock"
    assert config.ssh.known_hosts == str(tmp_path / "kh")
    assert config.ssh.keepalive_s == 1.0


def test_the_example_written_by_init_is_a_valid_cluster_file():
    config = parse_config(EXAMPLE_CLUSTER)
    assert [n.name for n in config.nodes] == ["n1", "n2"]
    assert config.nodes[0].is_local


def test_the_deploy_example_is_the_init_example():
    deploy = Path(__file__).resolve().parents[2] / "deploy" / "cluster.example.toml"
    assert deploy.read_text() == EXAMPLE_CLUSTER


def _replace(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new, 1)


@pytest.mark.parametrize("text,line,words", [
    (_replace('port = 2222', 'port = "2222"'), 20, ["nodes[1].port", "integer"]),
    (_replace('keepalive_s = 1', 'keepalive_s = true'), 7, ["ssh.keepalive_s", "number"]),
    (_replace('user = "bob"', 'usr = "bob"'), 19, ["unknown key", "nodes[1].usr"]),
    (_replace('state_dir = "state"', 'state_dir = "state"\nspeed = 3'), 4, ["unknown key", "cluster.speed"]),
    (_replace('name = "n2"', 'name = "n1"'), 17, ["duplicate node name", "n1"]),
    (_replace('workdir = "/Users/bob/w"\n', ''), 16, ["nodes[1]", "missing", "workdir"]),
    (_replace('python = "/opt/mlx/bin/python"\n', ''), 16, ["python"]),
    (_replace('workdir = "/Users/bob/w"', 'workdir = "w"'), 22, ["absolute"]),
    (_replace('port = 2222', 'port = 70000'), 20, ["port"]),
    (_replace('ips = ["192.168.2.3"]', 'ips = [3]'), 23, ["ips"]),
    (_replace('host = "studio"', 'host = "-oProxyCommand=x"'), 18, ["host"]),
    (_replace('name = "n2"', 'name = "n 2"'), 17, ["node name"]),
    (_replace('[cluster]\n', '[clustr]\n'), 1, ["unknown key", "clustr"]),
])
def test_a_bad_file_names_the_line_and_the_key(text, line, words):
    with pytest.raises(ConfigError) as caught:
        parse_config(text, Path("lab.toml"))
    message = str(caught.value)
    assert message.startswith(f"lab.toml:{line}: "), message
    for word in words:
        assert word in message, message


def test_broken_toml_reports_its_line():
    with pytest.raises(ConfigError, match=r"line 2"):
        parse_config('[cluster]\nname = \n', Path("x.toml"))


def test_a_file_without_nodes_or_cluster_is_refused():
    with pytest.raises(ConfigError, match="no nodes"):
        parse_config('[cluster]\nname = "x"\n')
    with pytest.raises(ConfigError, match=r"\[cluster\]"):
        parse_config('[[nodes]]\nname = "a"\nhost = "local"\nworkdir = "/w"\n')


def test_a_missing_file_says_how_to_make_one(tmp_path):
    with pytest.raises(ConfigError, match="coord init"):
        load_config(tmp_path / "nope.toml")


def test_a_socket_path_too_long_for_unix_sockets_is_refused():
    with pytest.raises(ConfigError, match="longer than"):
        parse_config(GOOD.replace('state_dir = "state"', f'state_dir = "/{"x" * 120}"'))


def test_local_nodes_default_to_the_running_python():
    import sys
    config = parse_config('[cluster]\nname = "x"\n[[nodes]]\nname = "a"\nhost = "local"\nworkdir = "/w"\n')
    assert config.nodes[0].python == sys.executable


def test_the_dashboard_listens_on_loopback_by_default():
    dashboard = parse_config(GOOD).dashboard
    assert (dashboard.host, dashboard.port, dashboard.token, dashboard.enabled) == ("127.0.0.1", 8470, None, True)
    assert dashboard.url == "http://127.0.0.1:8470/"


def test_a_dashboard_off_loopback_needs_a_token():
    with pytest.raises(ConfigError, match=r"the dashboard on 0.0.0.0, which other machines can reach, needs a token"):
        parse_config(GOOD + '\n[dashboard]\nlisten = "0.0.0.0:8470"\n')
    dashboard = parse_config(GOOD + '\n[dashboard]\nlisten = "0.0.0.0:0"\ntoken = "0123456789abcdef0123"\n').dashboard
    assert (dashboard.host, dashboard.port, dashboard.token) == ("0.0.0.0", 0, "0123456789abcdef0123")
    assert parse_config(GOOD + '\n[dashboard]\nlisten = "[::1]:9000"\n').dashboard.url == "http://[::1]:9000/"


@pytest.mark.parametrize("table, message", [
    ('listen = "8470"', r"is not HOST:PORT"),
    ('listen = "127.0.0.1:99999"', r"port must be a number from 0 to 65535"),
    ('listen = "127.0.0.1:8470"\ntoken = "short"', r"at least 16 characters"),
    ('enabled = "yes"', r"dashboard.enabled must be true or false"),
])
def test_a_bad_dashboard_table_is_refused_with_its_line(table, message):
    with pytest.raises(ConfigError, match=message) as caught:
        parse_config(GOOD + "\n[dashboard]\n" + table + "\n")
    assert re.match(r"<cluster file>:\d+: ", str(caught.value))
