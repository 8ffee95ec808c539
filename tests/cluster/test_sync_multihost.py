"""Sync gives what `rsync -a` gives, on the multi-host cluster (real sshd, each node its own user):
empty directories arrive, every directory's mode arrives (a read-only one too), `--delete` removes
a node's extra directories, and a name that is not UTF-8 is left out and named, escaped, while the
rest of the tree syncs and the consistency checks pass.

Each node syncs into a workdir of this module's own, so `--delete` touches nothing of the other tests.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir

pytestmark = pytest.mark.cluster

WORKDIR = "sync-rsync-a"  # under each node's home
PARITY = "sync-rsync-parity"  # where rsync -a itself copies the same source, on n1


@pytest.fixture(scope="module")
def syncing(netns_cluster):
    root = short_tempdir()
    root.chmod(0o755)
    source = root / "project"
    source.mkdir()
    config = netns_cluster.write_cluster_toml(
        root / "cluster.toml", state_dir=root / "state",
        extra_node_fields={n.name: {"workdir": f"{n.home}/{WORKDIR}"} for n in netns_cluster.nodes})
    with config.open("a") as handle:
        handle.write(f'\n[sync]\nsource = "{source}"\n')
    daemon = DaemonProcess(config, env=environment(), prefix=["ip", "netns", "exec", netns_cluster.head_ns]).start()
    try:
        daemon.wait_for(all_up, 30, "all nodes up")
        yield daemon, source
    finally:
        daemon.stop()
        for node in netns_cluster.nodes:
            for name in (WORKDIR, PARITY):
                shutil.rmtree(Path(node.home) / name, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def _sync(daemon: DaemonProcess, *options: str) -> dict:
    result = coord("sync", "--json", "--config", str(daemon.config), *options, env=daemon.env, timeout=300)
    assert result.stdout, result.stderr
    return json.loads(result.stdout)


def _shape(root: Path) -> dict[str, tuple[str, int]]:
    """Every entry under root (coord's own .coord/ aside): its kind and its permission bits."""
    found: dict[str, tuple[str, int]] = {}
    for directory, dirs, files in os.walk(os.fsencode(root)):
        dirs[:] = [d for d in dirs if d != b".coord"]
        for name in dirs + files:
            path = os.path.join(directory, name)
            info = os.lstat(path)
            kind = "dir" if stat.S_ISDIR(info.st_mode) else "link" if stat.S_ISLNK(info.st_mode) else "file"
            found[os.fsdecode(os.path.relpath(path, os.fsencode(root)))] = (kind, stat.S_IMODE(info.st_mode))
    return found


def _make_directories(source: Path) -> None:
    (source / "top.py").write_text("TOP = 1\n")
    (source / "empty").mkdir()
    (source / "nested" / "empty" / "deeper").mkdir(parents=True)
    (source / "private").mkdir()
    (source / "private" / "secret.txt").write_text("s\n")
    (source / "shared").mkdir()
    (source / "shared" / "a.py").write_text("A = 1\n")
    (source / "readonly").mkdir()
    (source / "readonly" / "frozen.txt").write_text("frozen\n")
    for path, mode in [(source, 0o755), (source / "top.py", 0o644), (source / "empty", 0o755),
                       (source / "nested", 0o755), (source / "nested" / "empty", 0o755),
                       (source / "nested" / "empty" / "deeper", 0o755), (source / "private" / "secret.txt", 0o600),
                       (source / "private", 0o700), (source / "shared" / "a.py", 0o644), (source / "shared", 0o750),
                       (source / "readonly" / "frozen.txt", 0o444), (source / "readonly", 0o555)]:
        path.chmod(mode)


def _rsync_a(netns_cluster, source: Path, node: str, dest: str) -> None:
    proc = netns_cluster.popen_in("head", ["rsync", "-a", "-e", f"ssh -F {netns_cluster.ssh_config}", f"{source}/",
                                           f"{node}:{dest}/"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err


def test_empty_directories_and_every_directory_mode_arrive_as_rsync_a_gives_them(netns_cluster, syncing):
    daemon, source = syncing
    _make_directories(source)
    report = _sync(daemon)
    assert report["status"] == "ok", report
    assert report["source_files"] == 4 and report["source_dirs"] == 7
    expected = _shape(source)
    assert expected["empty"] == ("dir", 0o755) and expected["private"] == ("dir", 0o700)
    for node in netns_cluster.nodes:
        entry = report["nodes"][node.name]
        assert entry["status"] == "synced" and entry["plan"]["dirs"] == 7, entry
        assert _shape(Path(node.home) / WORKDIR) == expected, node.name
    # The same source through rsync -a itself, to n1: coord's copy is entry for entry what rsync's is.
    _rsync_a(netns_cluster, source, "n1", PARITY)
    n1 = netns_cluster.node("n1")
    assert _shape(Path(n1.home) / WORKDIR) == _shape(Path(n1.home) / PARITY)

    again = _sync(daemon)
    assert {e["status"] for e in again["nodes"].values()} == {"unchanged"}, again

    # A file changed inside the read-only directory: written there, and the directory stays read-only.
    (source / "readonly").chmod(0o755)
    (source / "readonly" / "frozen.txt").chmod(0o644)
    (source / "readonly" / "frozen.txt").write_text("thawed once\n")
    (source / "readonly" / "frozen.txt").chmod(0o444)
    (source / "readonly").chmod(0o555)
    (source / "shared").chmod(0o700)  # and a mode changed on the head travels too
    changed = _sync(daemon)
    assert changed["status"] == "ok", changed
    for node in netns_cluster.nodes:
        workdir = Path(node.home) / WORKDIR
        assert (workdir / "readonly" / "frozen.txt").read_text() == "thawed once\n"
        assert _shape(workdir) == _shape(source), node.name
        assert changed["nodes"][node.name]["plan"]["dir_paths"] == ["shared"]


def test_delete_removes_extra_directories_and_keeps_one_holding_ignored_files_named(netns_cluster, syncing):
    daemon, source = syncing
    if not (source / "empty").exists():
        _make_directories(source)
    assert _sync(daemon)["status"] == "ok"
    n1 = netns_cluster.node("n1")
    kept = Path(n1.home) / WORKDIR / "cached" / "__pycache__"
    netns_cluster.exec_in("n1", ["sh", "-c", f"mkdir -p {kept} && echo x > {kept}/m.pyc"], user=n1.user, check=True)
    shutil.rmtree(source / "nested")
    (source / "empty").rmdir()
    report = _sync(daemon, "--delete")
    assert report["status"] == "ok", report
    assert report["nodes"]["n1"]["result"]["dirs_kept"] == ["cached"]  # it holds what the sync ignores
    for node in netns_cluster.nodes:
        workdir = Path(node.home) / WORKDIR
        assert not (workdir / "empty").exists() and not (workdir / "nested").exists(), node.name
    assert kept.joinpath("m.pyc").exists()
    assert report["consistency"]["status"] == "pass"  # a directory of n1's own is no divergence
    again = _sync(daemon, "--delete")  # as rsync --delete does, it tries again, and sends nothing
    assert again["status"] == "ok" and again["nodes"]["n1"]["result"]["dirs_kept"] == ["cached"], again
    assert again["nodes"]["n1"]["plan"]["send"] == 0 and again["nodes"]["n2"]["status"] == "unchanged"


def test_a_name_that_is_not_utf8_is_left_out_named_and_the_rest_syncs_and_checks_pass(netns_cluster, syncing):
    """The regression: such a name failed the whole sync with 'result could not be encoded', without
    the name. Now the head names each one it did not send, a node names its own, and neither counts in
    the tree hashes, so the consistency checks pass."""
    daemon, source = syncing
    (source / "good.py").write_text("GOOD = 1\n")
    base = os.fsencode(source)
    with open(os.path.join(base, b"caf\xe9.txt"), "wb") as handle:
        handle.write(b"a latin-1 name\n")
    os.mkdir(os.path.join(base, b"d\xff"), 0o755)
    with open(os.path.join(base, b"d\xff", b"inside.txt"), "wb") as handle:
        handle.write(b"in a directory whose name is not UTF-8\n")
    n2 = netns_cluster.node("n2")
    own = os.path.join(os.fsencode(n2.home), WORKDIR.encode(), b"r\xe9sum\xe9.log")
    netns_cluster.exec_in("n2", ["sh", "-c", f"mkdir -p {n2.home}/{WORKDIR} && echo own > \"$1\"", "sh",
                                 os.fsdecode(own)], user=n2.user, check=True)
    try:
        dry = _sync(daemon, "--dry-run")
        report = _sync(daemon)
        for said in (dry, report):
            assert said["names_not_sent_count"] == 2, said
            assert [rel for rel, _ in said["names_not_sent"]] == ["caf\\xe9.txt", "d\\xff/"]
            assert "2 names not sent: caf\\xe9.txt (not valid UTF-8" in said["detail"]
        assert report["status"] == "ok", report["detail"]
        assert report["nodes"]["n2"]["unlisted"] == ["r\\xe9sum\\xe9.log"]
        assert report["consistency"]["status"] == "pass"
        for node in netns_cluster.nodes:
            workdir = os.fsencode(Path(node.home) / WORKDIR)
            assert (Path(node.home) / WORKDIR / "good.py").read_text() == "GOOD = 1\n"
            assert not os.path.exists(os.path.join(workdir, b"caf\xe9.txt")), node.name
        assert os.path.exists(own)  # the node's own file is left alone
        preflight = coord("preflight", "--json", "--config", str(daemon.config), env=daemon.env, timeout=300)
        checks = {c["name"]: c for c in json.loads(preflight.stdout)["checks"]}
        assert checks["code.consistency"]["status"] == "pass", checks["code.consistency"]
        again = _sync(daemon)
        assert {e["status"] for e in again["nodes"].values()} == {"unchanged"}, again
    finally:
        os.unlink(os.path.join(base, b"caf\xe9.txt"))
        shutil.rmtree(os.path.join(base, b"d\xff"))
        os.unlink(own)
