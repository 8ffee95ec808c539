"""Host keys: OpenSSH's known_hosts lines, fingerprints, and trusting a key only on the user's word."""

from __future__ import annotations

import base64
import hashlib
import hmac
import io
import os
import subprocess
from pathlib import Path

import asyncssh
import pytest

from coordinator.commands.trust import ask_user, decide_and_add
from coordinator.config.cluster_file import NodeConfig, SshSettings
from coordinator.nodes.host_key_verdict import (CHANGED, REVOKED, TRUSTED, UNKNOWN, KnownEntry, changed_key_message,
                                                judge_host_key, removal_command)
from coordinator.nodes.known_hosts import (SshTarget, TrustRefused, append_known_host, check_can_add, fingerprint,
                                           fingerprint_matches, known_entries, known_hosts_line, resolve_target,
                                           trust_command)


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
    assert [(e.line, e.key.public_data) for e in known_entries(path, target)] == [(1, key.public_data)]
    assert check_can_add(path, target, key) is False
    assert check_can_add(path, _target(port=22), key) is True  # port 22 is another entry


def test_a_changed_key_is_refused_with_the_command_that_removes_the_old_one(tmp_path):
    path = tmp_path / "known_hosts"
    old, new = _key(), _key()
    append_known_host(path, _target(), old)
    with pytest.raises(TrustRefused, match="^host key of 10.0.0.2:22 has CHANGED") as refused:
        check_can_add(path, _target(), new, trust_command="coord trust n1 --config lab.toml")
    assert f"ssh-keygen -R 10.0.0.2 -f {path}" in refused.value.fix
    message = str(refused.value)
    assert fingerprint(old) in message and fingerprint(new) in message and f"{path}:1 holds" in message
    assert message.endswith(f"then trust the new one with: coord trust n1 --config lab.toml --fingerprint "
                            f"{fingerprint(new)}")
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


def _entry(key: asyncssh.SSHKey, marker: str | None = None, hosts: str = "10.0.0.2", line: int = 1) -> KnownEntry:
    return KnownEntry(path=Path("/kh"), line=line, hosts=hosts, key=key, marker=marker)


def test_a_key_is_judged_as_openssh_does():
    old, new, other_type = _key(), _key(), _key("ecdsa-sha2-nistp256")
    assert judge_host_key([], new).state == UNKNOWN
    assert judge_host_key([_entry(new)], new).state == TRUSTED
    assert judge_host_key([_entry(old), _entry(new, line=2)], new).state == TRUSTED  # one of them is enough
    changed = judge_host_key([_entry(other_type), _entry(old, line=2)], new)
    assert changed.state == CHANGED and [e.line for e in changed.offending] == [2]  # only its own type's old key
    assert judge_host_key([_entry(other_type)], new).state == UNKNOWN  # a new type of key: unknown, not changed
    revoked = judge_host_key([_entry(new), _entry(new, marker="revoked", line=3)], new)
    assert revoked.state == REVOKED and revoked.offending[0].line == 3  # a revoked key is never trusted


def _hashed(name: str) -> str:
    salt = os.urandom(20)
    digest = hmac.new(salt, name.encode(), hashlib.sha1).digest()
    return f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()}"


def _public(key: asyncssh.SSHKey) -> str:
    return " ".join(key.export_public_key("openssh").decode().split()[:2])


@pytest.mark.parametrize("target, written", [
    (_target("10.0.0.2"), "10.0.0.2"),
    (_target("10.0.0.2", 2222), "[10.0.0.2]:2222"),
    (_target("10.0.0.2", 2222), "hashed"),
    (SshTarget(given="studio", given_port=None, host="10.9.9.9", port=22, key_alias="lab-studio"), "lab-studio"),
])
def test_the_removal_command_as_printed_removes_the_old_key_and_nothing_else(tmp_path, target, written):
    path = tmp_path / "dir with space" / "known_hosts"
    path.parent.mkdir()
    old, new, bystander = _key(), _key(), _key()
    host = _hashed(target.known_hosts_name) if written == "hashed" else written
    # Another sshd of the same machine (port 22, or 2222) and another host stay trusted.
    neighbour = "10.0.0.2" if target.port != 22 else "[10.0.0.2]:2222"
    path.write_text(f"other.host {_public(bystander)}\n{host} {_public(old)}\n{neighbour} {_public(bystander)}\n")
    with pytest.raises(TrustRefused) as refused:
        check_can_add(path, target, new)
    command = refused.value.fix.removesuffix(" (only if the node was reinstalled)")
    assert command == removal_command(target.known_hosts_name, known_entries(path, target))
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert known_entries(path, target) == []  # refused as unknown now, not as changed
    assert check_can_add(path, target, new) is True
    kept = path.read_text()
    assert f"other.host {_public(bystander)}" in kept and f"{neighbour} {_public(bystander)}" in kept


def test_a_port_without_a_line_of_its_own_is_unknown_not_changed(tmp_path):
    # asyncssh falls back to the port-22 line for a port that has none; that is another sshd's key, so the
    # node at 2222 is unknown (its own line, once trusted, ends the fallback), and nothing says remove it.
    path = tmp_path / "known_hosts"
    path.write_text(f"10.0.0.2 {_public(_key())}\n")
    assert known_entries(path, _target("10.0.0.2", 2222)) == []
    assert check_can_add(path, _target("10.0.0.2", 2222), _key()) is True


def test_a_line_for_more_hosts_than_this_one_is_named_before_ssh_keygen_removes_it_whole(tmp_path):
    path = tmp_path / "known_hosts"
    old, new = _key(), _key()
    path.write_text(f"10.0.0.2,studio {_public(old)}\n")
    with pytest.raises(TrustRefused) as refused:
        check_can_add(path, _target(), new)
    assert f"{path}:1 is '10.0.0.2,studio', a line for more than 10.0.0.2: ssh-keygen -R removes it whole" \
        in str(refused.value)


def test_a_revoked_key_is_refused_without_a_command_that_would_trust_it(tmp_path):
    path = tmp_path / "known_hosts"
    key = _key()
    path.write_text(f"@revoked 10.0.0.2 {_public(key)}\n")
    with pytest.raises(TrustRefused, match=f"marked @revoked in {path}:1") as refused:
        check_can_add(path, _target(), key)
    assert refused.value.fix is None


def test_a_known_hosts_line_that_cannot_be_read_is_named_by_its_line(tmp_path):
    path = tmp_path / "known_hosts"
    path.write_text(f"10.0.0.3 {_public(_key())}\nbroken\n")
    with pytest.raises(TrustRefused, match=f"{path}:2: cannot read it as known_hosts"):
        known_entries(path, _target())


def test_the_changed_message_says_so_first_with_both_fingerprints_and_both_commands():
    old, new = _key(), _key()
    text = changed_key_message("10.0.0.2:22", "10.0.0.2", new, [_entry(old, hosts=_hashed("10.0.0.2"), line=4)],
                               "coord trust n1 --config lab.toml")
    assert text.startswith(f"host key of 10.0.0.2:22 has CHANGED: the node presents ssh-ed25519 {fingerprint(new)}, "
                           f"but /kh:4 holds ssh-ed25519 {fingerprint(old)} for 10.0.0.2 (hashed).")
    assert "ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub" in text
    assert "remove the old key with: ssh-keygen -R 10.0.0.2 -f /kh, then trust" in text
    assert "removes it whole" not in text  # a hashed line holds this host only


def test_the_trust_command_reaches_the_node_as_coord_does():
    node = NodeConfig(name="n1", host="10.0.0.2", python="", workdir="", port=2222)
    assert trust_command(node, SshSettings(), "/etc/coord/lab.toml") == "coord trust n1 --config /etc/coord/lab.toml"
    ssh = SshSettings(known_hosts="/keys/known hosts", config="/keys/ssh_config")
    assert trust_command(node, ssh, None) == ("coord trust 10.0.0.2 --port 2222 --known-hosts '/keys/known hosts' "
                                              "--ssh-config /keys/ssh_config")
