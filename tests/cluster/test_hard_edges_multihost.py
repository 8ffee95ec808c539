"""The hard edges on the multi-host cluster, over real SSH to three nodes with their own users:
bad input refused before anything is submitted, links said out loud, and a full disk on one node
named and cleaned up every time (the local-transport versions of these are in tests/integration)."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.cluster.jobs import tiny_project_and_daemon
from tests.integration.daemon_harness import coord
from tests.integration.small_disk import open_under

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def running(netns_cluster):
    with tiny_project_and_daemon(netns_cluster) as holder:
        yield holder


def _run(daemon, *args: str):
    return coord("run", "--config", str(daemon.config), *args, env=daemon.env, timeout=120)


def test_a_job_that_cannot_start_is_refused_before_it_is_submitted(netns_cluster, running):
    daemon, project = running["daemon"], running["project"]
    cases = [
        (["--source", "/does/not/exist"], "--source", "no such"),
        (["--source", str(project / "model" / "config.json")], "--source", "not a directory"),
        (["--source", str(project), "--nodes", "n1,nowhere"], "nowhere", "n1, n2, n3"),
        (["--source", str(project), "--hang-timeout", "nan"], "--hang-timeout", "nan"),
        (["--source", str(project), "--save-every", "-3"], "--save-every", "-3"),
    ]
    for options, names, says in cases:
        result = _run(daemon, "--name", "refused", *options, "--", "python", "train.py")
        said = result.stdout + result.stderr
        assert result.returncode == 2, (options, said)
        assert names in said and says in said and "Traceback" not in said, (options, said)
    jobs = json.loads(coord("status", "--json", "--config", str(daemon.config), env=daemon.env).stdout)["jobs"]
    assert not [j for j in jobs if j["name"] == "refused"], jobs  # nothing was submitted


def _sync(daemon, source: Path, *options: str) -> dict:
    result = coord("sync", "--json", "--config", str(daemon.config), "--source", str(source), *options,
                   env=daemon.env, timeout=300)
    assert result.stdout, result.stderr
    return json.loads(result.stdout)


def test_links_arrive_as_links_and_one_leading_out_is_refused_until_followed(netns_cluster, running):
    # Names of their own: the session's other tests leave the tiny project's model/ and data/ on the nodes.
    root = running["root"]
    source = root / "linked"
    (source / "lk-weights" / "v1").mkdir(parents=True)
    (source / "lk-weights" / "v1" / "config.json").write_text("{}\n")
    (source / "lk-model").symlink_to("lk-weights/v1")
    outside = root / "big-disk" / "data"
    outside.mkdir(parents=True)
    (outside / "train.jsonl").write_text('{"text": "hi"}\n')
    (source / "lk-data").symlink_to(outside)
    for path in [root / "big-disk", *(root / "big-disk").rglob("*"), source, *source.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)
    try:
        refused = _sync(running["daemon"], source)
        assert refused["status"] == "failed" and "lk-data -> " in refused["detail"], refused
        assert "--follow-outside-links" in refused["detail"], refused["detail"]
        followed = _sync(running["daemon"], source, "--follow-outside-links")
        assert followed["status"] == "ok", followed
        for node in netns_cluster.nodes:
            workdir = Path(node.workdir)
            assert os.readlink(workdir / "lk-model") == "lk-weights/v1", node.name
            assert (workdir / "lk-model" / "config.json").read_text() == "{}\n"
            assert not (workdir / "lk-data").is_symlink() and (workdir / "lk-data" / "train.jsonl").exists()
    finally:  # the other tests' trees stay as they were
        for node in netns_cluster.nodes:
            for name in ("lk-model", "lk-data", "lk-weights"):
                path = Path(node.workdir) / name
                if path.is_symlink() or path.is_file():
                    path.unlink()
                elif path.exists():
                    shutil.rmtree(path)


def _in_mounts_of(pid: int, *argv: str) -> subprocess.CompletedProcess:
    """``argv`` run in the mount namespace of process ``pid``: each node's sshd (and so its agent)
    runs in a mount namespace of its own (``ip netns exec`` makes one), where a mount made in
    this test's namespace is not seen."""
    return subprocess.run(["nsenter", "-t", str(pid), "-m", "--", *argv], capture_output=True, text=True,
                          check=False)


@contextlib.contextmanager
def _small_disk_for(agent: int, user: str, path: Path, size: str):
    """A tmpfs of ``size`` at ``path`` as the node's agent sees it, owned by the node's user."""
    entry = pwd.getpwnam(user)
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, entry.pw_uid, entry.pw_gid)
    done = _in_mounts_of(agent, "mount", "-t", "tmpfs", "-o",
                         f"size={size},mode=0755,uid={entry.pw_uid},gid={entry.pw_gid}", "tmpfs", str(path))
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {path} where n2's agent sees it: {done.stderr.strip()}")
    try:
        yield path
    finally:
        _in_mounts_of(agent, "umount", "-l", str(path))
        shutil.rmtree(path, ignore_errors=True)


def test_a_full_disk_on_one_node_is_named_and_leaves_nothing_open_each_time(netns_cluster, running):
    daemon, root = running["daemon"], running["root"]
    source = root / "heavy"
    (source / "blobs").mkdir(parents=True)
    (source / "blobs" / "weights.bin").write_bytes(os.urandom(6 << 20))
    (source / "small.py").write_text("VALUE = 1\n")
    for path in [source, *source.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    n2 = netns_cluster.node("n2")
    full = Path(n2.workdir) / "blobs"
    agent = next(n for n in daemon.status()["nodes"] if n["name"] == "n2")["agent"]["pid"]
    try:
        _fill_and_check(daemon, source, agent, n2, full)
        for node in ("n1", "n3"):
            assert (Path(netns_cluster.node(node).workdir) / "blobs" / "weights.bin").stat().st_size == 6 << 20
    finally:  # the module's other tests see the nodes' trees as they were
        for node in netns_cluster.nodes:
            shutil.rmtree(Path(node.workdir) / "blobs", ignore_errors=True)
            (Path(node.workdir) / "small.py").unlink(missing_ok=True)


def _fill_and_check(daemon, source: Path, agent: int, n2, full: Path) -> None:
    with _small_disk_for(agent, n2.user, full, "2m"):
        for attempt in range(3):
            report = _sync(daemon, source)
            entry = report["nodes"]["n2"]
            assert report["status"] == "failed" and entry["status"] == "failed", (attempt, report)
            assert f"no space left in {full}" in entry["detail"] and "still to write" in entry["detail"], entry
            assert report["detail"].startswith("not synced: n2 (no space left in "), report["detail"]
            assert {report["nodes"][n]["status"] for n in ("n1", "n3")} <= {"synced", "unchanged"}, report
            assert open_under(agent, full) == [], attempt  # n2's agent holds nothing open on the full disk
            listed = _in_mounts_of(agent, "find", str(full), "-mindepth", "1")
            assert listed.returncode == 0 and listed.stdout.split() == [], (attempt, listed)  # no temporary left
