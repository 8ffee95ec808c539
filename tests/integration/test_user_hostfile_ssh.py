"""The hostfile entries against the real OpenSSH client: ``ssh -G`` reads a user's config
written here (it connects to nothing), and the Host blocks coord writes, brought in with the
Include line it prints, resolve to exactly the cluster file's settings."""

from __future__ import annotations

import shutil
import subprocess

import anyio
import pytest

from coordinator.config.cluster_file import parse_config
from coordinator.nodes.ssh_view import parse_ssh_g, resolve_ssh
from coordinator.launch.user_hostfile import choose_entries, write_include_file

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the OpenSSH client (ssh -G)")

USER_CONFIG = """\
Host studio
  HostName 10.0.0.9
  User alice

Host 10.0.0.3
  Port 2222
"""


def nodes(*rows: tuple[str, str, int | None]) -> str:
    out = []
    for name, host, port in rows:
        out.append(f'[[nodes]]\nname = "{name}"\nhost = "{host}"\nuser = "alice"\npython = "/v/bin/python"\n'
                   f'workdir = "/w"\n' + (f"port = {port}\n" if port else ""))
    return "\n".join(out)


def as_user(user_config):
    """ssh -G as from a shell whose ~/.ssh/config is ``user_config`` (ssh -F, since ssh reads the
    passwd home's config and this test must not touch it)."""
    async def resolve(destination, *, config_file=None, **options):
        return await resolve_ssh(destination, config_file=config_file or str(user_config), **options)
    return resolve


def ssh_g(config, destination):
    done = subprocess.run(["ssh", "-G", "-F", str(config), destination], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, check=True)
    return parse_ssh_g(done.stdout)


def test_the_users_own_ssh_reaches_plain_addresses_aliases_and_ports_it_knows_with_no_include(tmp_path):
    user_config = tmp_path / "config"
    user_config.write_text(USER_CONFIG)
    config = parse_config(f'[cluster]\nname = "lab"\nstate_dir = "{tmp_path / "st"}"\n[ssh]\n'
                          f'config = "{user_config}"\n'
                          + nodes(("n1", "10.0.0.2", None), ("n2", "studio", None), ("n3", "10.0.0.3", 2222)))
    found = anyio.run(choose_entries, config, as_user(user_config))
    assert {name: (e.ssh, e.needs) for name, e in found.items()} == {
        "n1": ("alice@10.0.0.2", ()), "n2": ("studio", ()), "n3": ("alice@10.0.0.3", ())}
    assert write_include_file(config, found).include_line is None


def test_the_host_blocks_coord_writes_give_plain_ssh_the_cluster_files_port_key_and_known_hosts(tmp_path):
    keys = tmp_path / "lab keys"
    keys.mkdir()
    (keys / "id_ed25519").write_text("not read by ssh -G\n")
    user_config = tmp_path / "config"
    user_config.write_text(USER_CONFIG)
    config = parse_config(
        f'[cluster]\nname = "lab"\nstate_dir = "{tmp_path / "state dir"}"\n[ssh]\n'
        f'identity_file = "{keys / "id_ed25519"}"\nknown_hosts = "{keys / "known_hosts"}"\n'
        + nodes(("n1", "10.0.0.2", None), ("n4", "10.0.0.4", 2200)))
    found = anyio.run(choose_entries, config, as_user(user_config))
    assert found["n1"].ssh == "coord-lab-n1" and found["n4"].ssh == "coord-lab-n4"
    assert "port 2200" in found["n4"].needs and "port 2200" not in " ".join(found["n1"].needs)
    written = write_include_file(config, found)
    assert written.include_line == f'Include "{tmp_path / "state dir" / "ssh" / "coord_hosts.conf"}"'
    # The user adds the printed line at the top of their config; nothing else changes.
    users_config_after = tmp_path / "config.after"
    users_config_after.write_text(written.include_line + "\n\n" + USER_CONFIG)
    for name, port in (("n1", 22), ("n4", 2200)):
        view = ssh_g(users_config_after, found[name].ssh)
        assert (view.hostname, view.user, view.port) == (config.nodes[[n.name for n in config.nodes].index(name)].host,
                                                         "alice", port)
        assert view.identity_files == (str(keys / "id_ed25519"),)
        assert view.checks_known_hosts(str(keys / "known_hosts"))
    # the user's own entries resolve as before
    assert ssh_g(users_config_after, "studio").hostname == "10.0.0.9"
    assert ssh_g(users_config_after, "alice@10.0.0.3").port == 2222
