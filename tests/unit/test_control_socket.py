"""Where the CLI looks for coordd: the [cluster] table's rule, shared with the config, read without
loading the whole cluster file (every command pays for what the CLI imports at start)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.cli.client import CliError, resolve_socket
from coordinator.config.cluster_file import load_config
from coordinator.control.address import socket_from_file

NODES = """
[[nodes]]
name = "n1"
host = "10.0.0.2"
python = "/opt/venv/bin/python"
workdir = "/w"
"""


def _args(config: Path) -> argparse.Namespace:
    return argparse.Namespace(socket=None, config=str(config))


@pytest.mark.parametrize("cluster", [
    'name = "lab"',
    'name = "lab"\nstate_dir = "state"',
    'name = "lab"\nstate_dir = "~/coord-state"',
    'name = "lab"\nstate_dir = "/var/lib/coord"\nsocket = "run/c.sock"',
    'name = "lab"\nsocket = "/tmp/elsewhere.sock"',
])
def test_the_cli_finds_the_socket_the_daemon_listens_on(tmp_path, monkeypatch, cluster):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("COORD_SOCKET", raising=False)
    path = tmp_path / "conf" / "cluster.toml"
    path.parent.mkdir()
    path.write_text(f"[cluster]\n{cluster}\n{NODES}")
    expected = load_config(path).socket
    assert socket_from_file(path) == expected
    assert resolve_socket(_args(path)) == expected


def test_a_relative_config_path_resolves_from_its_own_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("COORD_SOCKET", raising=False)
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "cluster.toml").write_text(f'[cluster]\nname = "lab"\nstate_dir = "state"\n{NODES}')
    monkeypatch.chdir(tmp_path)
    assert resolve_socket(_args(Path("conf/cluster.toml"))) == tmp_path / "conf" / "state" / "coord.sock"


def test_a_file_whose_nodes_are_being_edited_still_reaches_the_running_daemon(tmp_path, monkeypatch):
    monkeypatch.delenv("COORD_SOCKET", raising=False)
    path = tmp_path / "cluster.toml"
    path.write_text('[cluster]\nname = "lab"\nstate_dir = "state"\n\n[[nodes]]\nname = "n1"\n')  # no host yet
    assert resolve_socket(_args(path)) == tmp_path / "state" / "coord.sock"


@pytest.mark.parametrize("text, words", [
    ('[cluster]\nname = "lab"\nstate_dir = 3\n' + NODES, ["cluster.toml:3", "state_dir must be a string"]),
    ('[cluster\nname = "lab"\n', ["not valid TOML", "line 1"]),
    ('cluster = 1\n' + NODES, ["'cluster' must be a table"]),
    (NODES, ["missing the [cluster] table"]),
    ('[cluster]\nname = "lab"\nsocket = "/' + "s" * 120 + '"\n' + NODES, ["longer than 103 bytes"]),
])
def test_an_unusable_cluster_table_is_refused_with_the_full_checks_message(tmp_path, monkeypatch, text, words):
    monkeypatch.delenv("COORD_SOCKET", raising=False)
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    assert socket_from_file(path) is None
    with pytest.raises(CliError) as refused:
        resolve_socket(_args(path))
    assert refused.value.status == 2
    for word in words:
        assert word in str(refused.value)


def test_a_missing_config_says_how_to_make_one(tmp_path, monkeypatch):
    monkeypatch.delenv("COORD_SOCKET", raising=False)
    with pytest.raises(CliError, match="no such cluster file"):
        resolve_socket(_args(tmp_path / "absent.toml"))


def test_starting_the_cli_does_not_load_the_config_module():
    """What keeps `coord sync` on an unchanged tree quick: the CLI's start and its wire format import
    neither the cluster file's checks nor asyncio nor the progress bars nor dataclasses."""
    probe = ("import sys, json; import coordinator.cli.main, shared.protocol; "
             "print(json.dumps([m for m in ('coordinator.config.cluster_file', 'asyncio', 'rich', 'dataclasses') "
             "if m in sys.modules]))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    out = subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.path[:0] = {sys.path!r}; {probe}"],
                         capture_output=True, text=True, env=env, check=True).stdout
    assert json.loads(out) == []
