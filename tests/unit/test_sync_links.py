"""Symlinks and names in a sync: which links go as links, which lead out (refused, or copied by
content when asked), which names a node would refuse, and the agent's own check of every link it makes."""

from __future__ import annotations

import hashlib
import os
from types import SimpleNamespace

import anyio
import pytest

from agent import sync as node_sync
from agent.sync_links import put_links
from coordinator.readiness import push
from coordinator.readiness.source_links import (
    NOT_UTF8,
    NOT_UTF8_DIR,
    LinkFacts,
    SourceLinks,
    decide_link,
    names_left_out,
    names_not_sent,
    refusal,
    refused_names,
)
from shared.file_batch import unpack_batch
from shared.ignore import IgnoreRules
from shared.manifest import LINK_MODE, is_link, keep_links, link_entry, scan_tree
from shared.paths import link_target_problem, name_problem, printable_name
from shared.rpc import RemoteError


@pytest.mark.parametrize("path,why", [
    ("pkg/model.py", None), ("v1./x", None), ("dir with spaces/ünïcode.txt", None),
    ("a\\b.txt", "backslashes are not allowed"), ("c:drive.txt", "absolute paths are not allowed"),
    ("bad-\udcff.txt", "not valid UTF-8 (names cross the wire as UTF-8, and a Mac's disk takes no other)"),
    ("x" * 5000, "too long"), ("d/" + "é" * 128, "a name longer than 255 bytes (no filesystem takes it)"),
    ("é" * 127 + "/x", None),
])
def test_the_names_a_node_refuses_are_known_on_the_head(path, why):
    assert name_problem(path) == why
    assert refused_names({path: [1, 0o644, "h"]}) == ([] if why is None else [[path, why]])


@pytest.mark.parametrize("path,target,ok", [
    ("model", "weights/v1", True), ("pkg/up.py", "../pkg1/m.py", True), ("a/b/c", "../../x", True),
    ("self", ".", True), ("a/b", "./c/./d", True),
    ("model", "/big/disk/model", False), ("up.py", "../x", False), ("a/b", "../../x", False),
    ("a/b", "c/../../x", False), ("a/b", "", False), ("a", "x\0y", False),
])
def test_a_link_target_that_could_lead_out_is_told_by_its_text(path, target, ok):
    assert (link_target_problem(path, target) is None) is ok


def _facts(rel, text, *, inside, real="/src/x", exists=True, loops=False):
    return LinkFacts(rel=rel, text=text, real=real, exists=exists, inside=inside, loops=loops)


def test_a_link_inside_the_tree_is_kept_with_its_target_or_the_relative_path_to_the_same_place():
    choice, said = decide_link(_facts("model", "weights/v1", inside="weights/v1"), follow_outside=False)
    assert choice.target == "weights/v1" and not choice.follow and said is None
    choice, _ = decide_link(_facts("pkg/model", "/src/weights/v1", inside="weights/v1"), follow_outside=False)
    assert choice.target == "../weights/v1"  # an absolute path into the tree: the same place, relative
    choice, _ = decide_link(_facts("a/m", "b/../../weights", inside="weights"), follow_outside=False)
    assert choice.target == "../weights"  # a '..' after a name cannot be checked by counting: said plainly


def test_a_link_leading_out_is_refused_by_default_and_copied_by_content_when_asked():
    facts = _facts("model", "/big/disk/model", inside=None, real="/big/disk/model")
    choice, said = decide_link(facts, follow_outside=False)
    assert choice.target is None and not choice.follow
    assert said is not None and said["action"] == "refused" and said["why"] == "leads out of the source tree"
    choice, said = decide_link(facts, follow_outside=True)
    assert choice.follow and said is not None and said["action"] == "followed"
    choice, said = decide_link(_facts("m", "/gone", inside=None, real="/gone", exists=False), True)
    assert not choice.follow and said is not None and "does not exist" in said["why"]
    choice, said = decide_link(_facts("a/up", "/src", inside=None, real="/outer", loops=True), True)
    assert not choice.follow and said is not None and "never end" in said["why"]


def test_a_link_leading_out_refuses_the_sync_and_a_name_no_node_takes_is_left_out_named():
    outside = [{"path": "data", "target": "/d", "leads_to": "/d", "action": "refused", "why": "leads out"},
               {"path": "m", "target": "/m", "leads_to": "/m", "action": "followed", "why": "copied"}]
    assert refusal(outside) == ("nothing was sent: 1 link the sync cannot send: data -> /d (leads out); pass "
                                "--follow-outside-links to copy what they point to, or list them in .coordignore")
    assert refusal(outside[1:]) is None
    names, count = names_not_sent([["a\\b", "backslashes are not allowed"]], ["caf\\xe9.txt", "d\\xff/"], 2)
    assert count == 3 and names == [["a\\\\b", "backslashes are not allowed"], ["caf\\xe9.txt", NOT_UTF8],
                                    ["d\\xff/", NOT_UTF8_DIR]]
    text = names_left_out(names, count)
    assert text is not None and text.startswith("3 names not sent: a\\\\b (backslashes are not allowed), "
                                                 "caf\\xe9.txt (not valid UTF-8")
    assert text.endswith("rename them, or list them in .coordignore (the rest of the tree was sent)")
    assert names_left_out([], 0) is None
    many, count = names_not_sent([[f"n{i}\\", "backslashes are not allowed"] for i in range(12)], [], 0)
    said = names_left_out(many, count)
    assert said is not None and "12 names" in said and "and 2 more" in said


def test_a_name_is_said_escaped_so_that_the_words_name_exactly_one_path():
    assert printable_name("pkg/ünïcode model.py") == "pkg/ünïcode model.py"
    assert printable_name("caf\udce9.txt") == "caf\\xe9.txt"  # the byte 0xe9, as os.fsdecode gives it
    assert printable_name("a\\xe9") == "a\\\\xe9"  # a real backslash is doubled: never read as a byte
    assert printable_name("line\nbreak\x1b") == "line\\nbreak\\x1b"


def _tree(tmp_path):
    source = tmp_path / "src"
    (source / "weights" / "v1").mkdir(parents=True)
    (source / "weights" / "v1" / "w.bin").write_bytes(b"w" * 10)
    (source / "model").symlink_to("weights/v1")
    outside = tmp_path / "big" / "data"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "train.jsonl").write_text("{}\n")
    (outside / "back").symlink_to(outside)  # a loop, inside the followed directory
    (source / "data").symlink_to(outside)
    (source / "one.txt").symlink_to(outside / "sub" / "train.jsonl")
    (source / "ignored").symlink_to("/etc")
    return source, outside


def test_the_source_scan_keeps_inside_links_and_follows_outside_ones_only_when_asked(tmp_path):
    source, outside = _tree(tmp_path)
    rules = IgnoreRules(["ignored"])
    links = SourceLinks(str(source), follow_outside=False)
    manifest, stats = scan_tree(str(source), rules, on_link=links)
    assert sorted(manifest) == ["model", "weights/v1/w.bin"]
    assert manifest["model"] == link_entry("weights/v1") and is_link(manifest["model"]) and stats.links == 1
    assert sorted((e["path"], e["action"]) for e in links.outside) == [("data", "refused"), ("one.txt", "refused")]
    assert stats.skipped == []  # nothing left out without a word: the links outside are in links.outside

    links = SourceLinks(str(source), follow_outside=True)
    manifest, _ = scan_tree(str(source), rules, on_link=links)
    assert sorted(manifest) == ["data/sub/train.jsonl", "model", "one.txt", "weights/v1/w.bin"]
    assert manifest["one.txt"][1] == 0o644 & manifest["one.txt"][1]  # a file now, with its mode
    said = {e["path"]: e for e in links.outside}
    assert said["data"]["action"] == said["one.txt"]["action"] == "followed"
    assert said["data/back"]["action"] == "refused" and "never end" in said["data/back"]["why"]


def test_a_node_lists_its_links_as_the_head_does_and_creates_only_safe_ones(tmp_path):
    root = tmp_path / "node"
    (root / "pkg1").mkdir(parents=True)
    (root / "pkg1" / "m.py").write_text("x = 1\n")
    put_links(str(root), [["model", "weights/v1"], ["pkg0/up.py", "../pkg1/m.py"]])
    assert os.readlink(root / "model") == "weights/v1" and (root / "pkg0" / "up.py").read_text() == "x = 1\n"
    listed = {rel: entry for rel, *entry in node_sync.describe(str(root), [])["files"]}
    assert listed["model"] == link_entry("weights/v1") and listed["model"][1] == LINK_MODE
    assert listed["pkg0/up.py"] == link_entry("../pkg1/m.py")
    for rel, target in (["evil", "/etc"], ["evil", "../outside"], ["a/evil", "b/../../x"]):
        with pytest.raises(RemoteError, match="refused link"):
            put_links(str(root), [["fine", "pkg1"], [rel, target]])
        assert not os.path.lexists(root / "fine")  # every link is checked before any is made


def test_a_link_is_checked_from_where_its_directory_really_is(tmp_path):
    """'in/x -> ../y' is harmless by its text, but 'in' may be a link of the node's own to a directory
    higher up (here the root itself): from there, '..' leaves the workdir. The agent counts from the
    directory's real place."""
    root = tmp_path / "node"
    root.mkdir()
    (root / "in").symlink_to(".")
    with pytest.raises(RemoteError, match="lead out of the workdir"):
        put_links(str(root), [["in/x", "../y"]])
    assert not os.path.lexists(root / "x")


def test_a_link_replaces_a_file_or_an_empty_directory_never_one_with_files(tmp_path):
    root = tmp_path / "node"
    (root / "empty").mkdir(parents=True)
    (root / "full").mkdir()
    (root / "full" / "keep.txt").write_text("mine\n")
    (root / "file.txt").write_text("old\n")
    put_links(str(root), [["empty", "file.txt"], ["file.txt", "full/keep.txt"]])
    assert os.readlink(root / "empty") == "file.txt" and os.readlink(root / "file.txt") == "full/keep.txt"
    with pytest.raises(RemoteError, match="a directory with files in it stands where the source has a link"):
        put_links(str(root), [["full", "elsewhere"]])
    assert (root / "full" / "keep.txt").read_text() == "mine\n"
    assert not [p for p in root.iterdir() if ".coord-" in p.name]
    node_sync.delete_files(str(root), ["empty"])  # a link is deleted itself, not what it leads to
    assert not os.path.lexists(root / "empty") and (root / "full" / "keep.txt").exists()


def test_a_plan_sends_links_as_links_and_removes_a_node_link_where_the_source_has_a_directory(tmp_path):
    source = {"model": link_entry("weights/v1"), "weights/v1/w.bin": [1, 0o644, hashlib.sha256(b"w").hexdigest()],
              "data/x": [1, 0o644, hashlib.sha256(b"x").hexdigest()]}
    remote = {"data": link_entry("/mnt/data"), "old": link_entry("x")}
    plan = push.plan_sync(source, remote, delete=False)
    assert sorted(plan.send) == ["data/x", "model", "weights/v1/w.bin"]
    assert plan.unlink_first == ["data"] and plan.extra == ["old"]
    held = push.plan_sync(source, {"model": link_entry("weights/v1")}, delete=False)
    assert sorted(held.send) == ["data/x", "weights/v1/w.bin"]  # the link it holds already is not sent again
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x").write_bytes(b"x")
    (tmp_path / "weights" / "v1").mkdir(parents=True)
    (tmp_path / "weights" / "v1" / "w.bin").write_bytes(b"w")
    calls = []

    async def call(method, args, timeout=None):
        calls.append((method, args))
        return {}

    session = SimpleNamespace(node=SimpleNamespace(name="n1", workdir="/w"), call=call)
    result = anyio.run(lambda: push.sync_node(session, str(tmp_path), source, plan, links={"model": "weights/v1"}))
    assert [m for m, _ in calls] == ["delete_files", "put_files", "put_links"]
    assert calls[0][1]["paths"] == ["data"] and calls[2][1]["links"] == [["model", "weights/v1"]]
    assert sorted(f[0] for f in unpack_batch(calls[1][1]["batch"])) == ["data/x", "weights/v1/w.bin"]
    assert result["files_sent"] == 3


def test_a_node_walk_keeps_links_and_a_head_walk_without_a_choice_skips_them_as_before(tmp_path):
    (tmp_path / "a").write_text("a")
    (tmp_path / "l").symlink_to("a")
    kept, _ = scan_tree(str(tmp_path), IgnoreRules(), on_link=keep_links)
    plain, stats = scan_tree(str(tmp_path), IgnoreRules())
    assert sorted(kept) == ["a", "l"] and sorted(plain) == ["a"] and stats.skipped == ["l"]


def test_the_report_on_screen_names_every_link_name_and_special_file_not_sent_as_is():
    import io

    from rich.console import Console

    from coordinator.commands.sync import render_sync

    report = {"source": "/src", "source_files": 2, "source_bytes": 20, "hook": None, "nodes": {},
              "status": "failed", "detail": "nothing was sent: ...", "links": 1,
              "outside_links": [{"path": "data", "target": "/d", "leads_to": "/d", "action": "refused",
                                 "why": "leads out of the source tree"},
                                {"path": "model", "target": "/m", "leads_to": "/big/m", "action": "followed",
                                 "why": "copied by content (--follow-outside-links)"}],
              "names_not_sent": [["a\\\\b.txt", "backslashes are not allowed"], ["caf\\xe9", NOT_UTF8]],
              "names_not_sent_count": 3,
              "source_scan": {"skipped": ["run/socket"], "skipped_count": 1}}
    out = io.StringIO()
    render_sync(report, Console(file=out, width=300))
    text = out.getvalue()
    assert "links inside the source, sent as links: 1" in text
    assert "link data -> /d (leads to /d): REFUSED: leads out of the source tree" in text
    assert "link model -> /m (leads to /big/m): copied by content" in text
    assert "name a\\\\b.txt NOT SENT: backslashes are not allowed" in text
    assert "name caf\\xe9 NOT SENT: not valid UTF-8" in text and "and 1 more names not sent" in text
    assert "not sent, neither files nor links (1): run/socket" in text


def test_a_hash_cache_that_cannot_be_saved_fails_nothing_and_leaves_no_temporary(tmp_path, monkeypatch):
    import errno

    from shared.manifest import HashCache

    cache = HashCache(str(tmp_path / ".coord" / "hashcache.json"))
    cache.store("a", os.stat(tmp_path), "h")
    real_write = __import__("shared.manifest").manifest._write_file

    def full(path, text):
        with open(path, "w") as handle:  # the temporary is made, then the disk is full
            handle.write(text[:1])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("shared.manifest._write_file", full)
    assert cache.save() is False and cache.dirty
    assert os.listdir(tmp_path / ".coord") == []
    monkeypatch.setattr("shared.manifest._write_file", real_write)
    assert cache.save() is True and os.listdir(tmp_path / ".coord") == ["hashcache.json"]
