"""Directories and names in a sync, as rsync -a has them: an empty directory arrives, a directory's mode
arrives, a node's extra directory goes with --delete once empty; a name that is not UTF-8 is in no
listing on either side (the wire could not carry it), and is said, escaped."""

from __future__ import annotations

import os
import stat

import pytest

from agent import sync as node_sync
from agent import sync_durable as durable
from agent.sync_dirs import make_dirs, remove_dirs
from coordinator.readiness.consistency import diff_manifests
from coordinator.readiness.push import SyncPlan, dirs_to_open, plan_sync
from shared import protocol as p
from shared.ignore import IgnoreRules
from shared.manifest import DIR_DIGEST, dir_entry, is_dir, scan_tree, tree_hash
from shared.rpc import RemoteError


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_scan_for_a_sync_enters_every_directory_with_its_mode_and_an_empty_one_too(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("x = 1\n")
    (tmp_path / "private").mkdir(mode=0o700)
    (tmp_path / "empty" / "deeper").mkdir(parents=True)
    (tmp_path / "__pycache__").mkdir()  # ignored: neither it nor what it holds is entered
    os.chmod(tmp_path / "private", 0o2700)  # setgid: never from the wire, so not in the entry either
    manifest, stats = scan_tree(str(tmp_path), IgnoreRules.with_defaults(), directories=True)
    assert manifest["private"] == [0, stat.S_IFDIR | 0o700, DIR_DIGEST] and is_dir(manifest["private"])
    assert [rel for rel, entry in manifest.items() if is_dir(entry)] == ["empty", "empty/deeper", "pkg", "private"]
    assert stats.directories == 4 and stats.files == 1
    plain, _ = scan_tree(str(tmp_path), IgnoreRules.with_defaults())
    assert list(plain) == ["pkg/m.py"]  # a scan that did not ask for them (pre-flight's) is as before
    os.chmod(tmp_path / "empty", 0o750)
    changed, _ = scan_tree(str(tmp_path), IgnoreRules.with_defaults(), directories=True)
    assert tree_hash(changed) != tree_hash(manifest)  # a directory's mode is part of the tree


def test_a_plan_makes_the_directories_a_node_lacks_and_sets_the_modes_that_differ():
    source = {"a": dir_entry(0o755), "a/x.py": [3, 0o644, "h1"], "empty": dir_entry(0o700),
              "keep": dir_entry(0o755)}
    plan = plan_sync(source, {}, delete=False)
    assert plan.dirs == [("a", stat.S_IFDIR | 0o755), ("empty", stat.S_IFDIR | 0o700),
                         ("keep", stat.S_IFDIR | 0o755)]
    assert plan.send == ["a/x.py"] and plan.bytes_to_send == 3
    node = {"a": dir_entry(0o755), "a/x.py": [3, 0o644, "h1"], "empty": dir_entry(0o755), "keep": [1, 0o644, "h"],
            "old": dir_entry(0o755), "old/y.py": [1, 0o644, "h2"]}
    plan = plan_sync(source, node, delete=False)
    assert plan.dirs == [("empty", stat.S_IFDIR | 0o700), ("keep", stat.S_IFDIR | 0o755)] and not plan.send
    assert plan.unlink_first == ["keep"]  # the node's file where the source has a directory goes first
    assert plan.extra == ["old", "old/y.py"] and not plan.delete and not plan.delete_dirs
    deleting = plan_sync(source, node, delete=True)
    assert deleting.delete == ["old/y.py"] and deleting.delete_dirs == ["old"] and not deleting.extra
    assert deleting.as_dict()["delete"] == 2 and deleting.as_dict()["dir_paths"] == ["empty", "keep"]
    assert plan_sync(source, source, delete=True).empty


def test_a_directory_the_sync_writes_into_is_opened_to_its_owner_and_closed_last():
    source = {"ro": dir_entry(0o555), "ro/a.py": [1, 0o644, "h"], "open": dir_entry(0o755),
              "open/b.py": [1, 0o644, "h"], "ro2": dir_entry(0o500)}
    first, last = dirs_to_open(plan_sync(source, {}, delete=False), source)
    assert first == [("open", stat.S_IFDIR | 0o755), ("ro", stat.S_IFDIR | 0o755), ("ro2", stat.S_IFDIR | 0o700)]
    assert last == [("ro", stat.S_IFDIR | 0o555), ("ro2", stat.S_IFDIR | 0o500)]
    # A changed file under a read-only directory the node already has: opened for the write, closed after.
    first, last = dirs_to_open(SyncPlan(send=["ro/a.py"]), source)
    assert first == [("ro", stat.S_IFDIR | 0o755)] and last == [("ro", stat.S_IFDIR | 0o555)]
    assert dirs_to_open(SyncPlan(send=["open/b.py"]), source) == ([], [])


def test_the_agent_makes_directories_with_their_exact_mode_whatever_its_umask(tmp_path):
    root = str(tmp_path / "work")
    old = os.umask(0o077)
    try:
        made = make_dirs(root, [["a", 0o755], ["a/b", 0o2750], ["empty", 0o711]])
    finally:
        os.umask(old)
    assert made == {"made": 3, "modes": 3}
    assert _mode(tmp_path / "work/a") == 0o755 and _mode(tmp_path / "work/empty") == 0o711
    assert _mode(tmp_path / "work/a/b") == 0o750  # permission bits only: no setgid from the wire
    assert make_dirs(root, [["a", 0o700]]) == {"made": 0, "modes": 1} and _mode(tmp_path / "work/a") == 0o700
    assert os.path.realpath(root) in durable.pending(root).dirs  # the new entries are flushed by sync_state


@pytest.mark.parametrize("bad", ["../out", "/abs", "link/inside"])
def test_the_agent_refuses_a_directory_outside_the_workdir_and_makes_none_of_the_batch(tmp_path, bad):
    root = tmp_path / "work"
    root.mkdir()
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", root / "link")
    with pytest.raises(RemoteError) as caught:
        make_dirs(str(root), [["fine", 0o755], [bad, 0o755]])
    assert caught.value.code == p.REFUSED
    assert not (root / "fine").exists() and list((tmp_path / "outside").iterdir()) == []


def test_a_file_where_a_directory_is_to_be_is_refused_by_name(tmp_path):
    root = tmp_path / "work"
    root.mkdir()
    (root / "model").write_text("a file\n")
    with pytest.raises(RemoteError, match="model: a file or link stands where the source has a directory"):
        make_dirs(str(root), [["model", 0o755]])
    with pytest.raises(RemoteError, match="each directory must be"):
        make_dirs(str(root), [["model"]])


def test_delete_removes_a_directory_once_empty_the_deepest_first_and_keeps_one_with_ignored_files(tmp_path):
    root = tmp_path / "work"
    (root / "old" / "deeper").mkdir(parents=True)
    (root / "cached" / "__pycache__").mkdir(parents=True)
    (root / "cached" / "__pycache__" / "m.pyc").write_bytes(b"\0")
    (root / "afile").write_text("not a directory: not this method's\n")
    answer = remove_dirs(str(root), ["old", "old/deeper", "cached", "afile", "gone"])
    assert answer == {"removed": 2, "kept": ["cached"], "kept_count": 1}
    assert not (root / "old").exists() and (root / "cached").is_dir() and (root / "afile").exists()


def test_a_name_that_is_not_utf8_is_in_no_listing_and_is_said_escaped(tmp_path):
    """The regression: a node (or the source) holding such a name answered 'result could not be
    encoded' for the whole tree. Now its listing is whole but for that name, and it encodes."""
    root = tmp_path / "work"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "ok.py").write_text("x = 1\n")
    base = os.fsencode(root)
    with open(os.path.join(base, b"caf\xe9.txt"), "wb") as handle:
        handle.write(b"latin-1 name\n")
    os.mkdir(os.path.join(base, b"d\xff"))
    with open(os.path.join(base, b"d\xff", b"inside.txt"), "wb") as handle:
        handle.write(b"never walked\n")
    with open(os.path.join(base, b"skip\xe9.pyc"), "wb") as handle:  # ignored by the rules: not said either
        handle.write(b"\0")
    state = node_sync.sync_state(str(root), ["*.pyc"], known=[])
    assert [row[0] for row in state["files"]] == ["pkg", "pkg/ok.py"]
    assert state["stats"]["unlisted"] == ["caf\\xe9.txt", "d\\xff/"] and state["stats"]["unlisted_count"] == 2
    p.pack(p.Result(1, state))  # every name in it is text the wire carries
    described = node_sync.describe(str(root), [])
    assert [row[0] for row in described["files"]] == ["pkg/ok.py"]
    p.pack(p.Result(1, described))


def test_a_node_directory_where_the_source_has_a_file_differs_by_its_kind():
    [difference] = diff_manifests({"model": [3, 0o644, "abc123"]}, {"model": dir_entry(0o755)})
    assert difference == {"path": "model", "how": "other hash", "expected": "abc123", "found": "directory"}
    [difference] = diff_manifests({"d": dir_entry(0o700)}, {"d": dir_entry(0o755)})
    assert difference == {"path": "d", "how": "other mode", "expected": "700", "found": "755"}
