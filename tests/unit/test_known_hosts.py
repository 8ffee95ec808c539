"""Host keys: OpenSSH's known_hosts lines, fingerprints, and trusting a key only on the user's word."""

from __future__ import annotations

import base64
import hashlib
import hmac
import io
import os
import subprocess

import asyncssh
import pytest

from coordinator.commands.trust import ask_user, decide_and_add
from coordinator.config.cluster_file import NodeConfig, SshSettings
from coordinator.nodes.known_hosts import (SshTarget, TrustRefused, append_known_host, check_can_add, fingerprint,
                                     fingerprint_matches, known_hosts_line, recorded_keys, resolve_target)


def _key(kind: str = "ssh-ed25519") -> asyncssh.SSHKey:
    return asyncssh.import_public_key(asyncssh.generate_private_key(kind).export_public_key())


def _target(host: str = "10.0.0.2", port: int = 22, alias: str | None = None) -> SshTarget:
    return SshTarget(given=host, given_port=port, host=host, port=port, key_alias=alias)


def test_a_line_is_host_keytype_key_with_brackets_for_another_port():
    key = _key()
    data = key.export_public_key("openssh").decode().split()[1]
    assert known_hosts_line("10.0.0.2", 22, key) == f"10.0.0.2 ssh-ed25519 {data}\n"
    assert known_hosts_line("mac.local", 2222, key) == f"[mac.local]:2222 ssh-ed25519 {data}\n"


def test_the_fingerprint_is_sshs(tmp_path):
    key = _key()
    (tmp_path / "k.pub").write_bytes(key.export_public_key("openssh"))
    shown = subprocess.run(["ssh-keygen", "-lf", str(tmp_path / "k.pub")], capture_output=True, text=True,
                           check=True).stdout.split()[1]
    assert fingerprint(key) == shown
    assert fingerprint_matches(shown, key) and fingerprint_matches(shown.removeprefix("SHA256:"), key)
    assert fingerprint_matches(f"  {shown}= ", key)
    assert not fingerprint_matches(fingerprint(_key()), key) and not fingerprint_matches("", key)


def test_a_written_line_is_what_ssh_keygen_finds_for_that_host_and_port(tmp_path):
    path = tmp_path / "dotssh" / "known_hosts"
    key = _key()
    append_known_host(path, _target("10.0.0.9", 2200), key)
    assert oct(path.stat().st_mode & 0o777) == "0o600" and oct(path.parent.stat().st_mode & 0o777) == "0o700"
    found = subprocess.run(["ssh-keygen", "-F", "[10.0.0.9]:2200", "-f", str(path)], capture_output=True, text=True)
    assert found.returncode == 0 and key.export_public_key("openssh").decode().split()[1] in found.stdout


def test_a_line_is_appended_on_its_own_line_after_a_file_without_a_final_newline(tmp_path):
    path = tmp_path / "known_hosts"
    path.write_text("other.host ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA")
    append_known_host(path, _target(), _key())
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and lines[1].startswith("10.0.0.2 ssh-ed25519 ")


def test_a_key_already_there_is_not_added_again_even_hashed(tmp_path):
    key = _key()
    salt = os.urandom(20)
    digest = hmac.new(salt, b"[10.0.0.2]:2222", hashlib.sha1).digest()
    hashed = f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()}"
    path = tmp_path / "known_hosts"
    path.write_text(f"{hashed} {' '.join(key.export_public_key('openssh').decode().split()[:2])}\n")
    target = _target(port=2222)
    assert [k.public_data for k in recorded_keys(path, target)] == [key.public_data]
    assert check_can_add(path, target, key) is False
    assert check_can_add(path, _target(port=22), key) is True  # port 22 is another entry


def test_a_changed_key_is_refused_with_the_command_that_removes_the_old_one(tmp_path):
    path = tmp_path / "known_hosts"
    old, new = _key(), _key()
    append_known_host(path, _target(), old)
    with pytest.raises(TrustRefused, match="someone in the middle") as refused:
        check_can_add(path, _target(), new)
    assert f"ssh-keygen -R 10.0.0.2 -f {path}" in refused.value.fix
    assert check_can_add(path, _target(), _key("ecdsa-sha2-nistp256")) is True  # another key type of the host


def test_the_ssh_configs_hostname_port_and_alias_decide_the_name(tmp_path):
    config = tmp_path / "config"
    config.write_text("Host studio\n  HostName 10.9.9.9\n  Port 2222\nHost pinned\n  HostName 10.9.9.8\n"
                      "  HostKeyAlias lab-pinned\n")
    ssh = SshSettings(config=str(config))
    studio = resolve_target(NodeConfig(name="s", host="studio", python="", workdir=""), ssh)
    assert (studio.host, studio.port, studio.known_hosts_name) == ("10.9.9.9", 2222, "[10.9.9.9]:2222")
    pinned = resolve_target(NodeConfig(name="p", host="pinned", python="", workdir=""), ssh)
    assert pinned.known_hosts_name == "lab-pinned"
    given = resolve_target(NodeConfig(name="p", host="studio", python="", workdir="", port=22), ssh)
    assert given.port == 22  # a port in the cluster file wins over the ssh config's


def test_without_a_terminal_nothing_is_trusted_and_the_command_names_the_fingerprint(tmp_path):
    path, key = tmp_path / "known_hosts", _key()
    with pytest.raises(TrustRefused, match="no terminal") as refused:
        decide_and_add(_target(), key, path, expected=None, interactive=False, command="coord trust 10.0.0.2")
    assert refused.value.fix == f"coord trust 10.0.0.2 --fingerprint {fingerprint(key)}"
    assert not path.exists()
    with pytest.raises(TrustRefused, match="nothing added"):
        decide_and_add(_target(), key, path, expected=fingerprint(_key()), interactive=False, command="c")
    assert not path.exists()
    assert decide_and_add(_target(), key, path, expected=fingerprint(key), interactive=False, command="c") \
        .startswith("added 10.0.0.2 ssh-ed25519 SHA256:")
    assert "already trusted" in decide_and_add(_target(), key, path, expected=None, interactive=False, command="c")


@pytest.mark.parametrize("typed, trusted", [
    ("yes\n", True), ("YES\n", True), ("no\n", False), ("", False), ("y\nmaybe\nyes\n", True),
    ("{fp}\n", True), ("SHA256:AAAA\nno\n", False),
])
def test_only_yes_or_the_fingerprint_itself_trusts_a_key(typed, trusted):
    key = _key()
    out = io.StringIO()
    assert ask_user(_target(), key, "/kh", out=out, answers=io.StringIO(typed.format(fp=fingerprint(key)))) is trusted
    assert f"ED25519 key fingerprint is {fingerprint(key)}." in out.getvalue()
