"""Sync policy with plain data: ignore rules, path checks, plans, consistency reports."""

from __future__ import annotations

import os

import pytest

from coordinator.readiness.consistency import compare_nodes, diff_manifests
from coordinator.readiness.push import plan_sync
from shared.ignore import IgnoreRules
from shared.manifest import HashCache, scan_tree, tree_hash
from shared.paths import UnsafePath, check_relative, resolve_under


@pytest.mark.parametrize("patterns,path,is_dir,ignored", [
    (["*.log"], "a/b/x.log", False, True),
    (["*.log", "!keep.log"], "a/keep.log", False, False),
    (["/build"], "build", True, True),
    (["/build"], "src/build", True, False),
    (["build/"], "src/build", True, True),
    (["build/"], "src/build", False, False),
    (["docs/*.md"], "docs/a.md", False, True),
    (["docs/*.md"], "docs/sub/a.md", False, False),
    (["**/tmp"], "a/b/tmp", True, True),
    (["a/**/z"], "a/z", False, True),
    (["a/**/z"], "a/b/c/z", False, True),
    (["out/**"], "out/x/y", False, True),
    (["\\#notes"], "#notes", False, True),
    (["# comment"], "# comment", False, False),
    (["data?.bin"], "data1.bin", False, True),
    (["[ab].txt"], "b.txt", False, True),
    (["[!ab].txt"], "b.txt", False, False),
    # A pattern without a slash is about the last component only: nothing in it spans a "/".
    (["a[!x]b"], "a/b", False, False),
    (["a[!x]b"], "deep/a-b", False, True),
    (["*.log", "!keep.log"], "a/keep.log/x.log", False, True),
    (["*.log", "!keep.log"], "keep.log", True, False),
    (["!x", "*"], "d/x", False, True),
    (["x", "!d/x"], "d/x", False, False),
    (["*.pyc"], "a.pyc\n", False, False),  # a name may end in a newline; it is not "a.pyc"
])
def test_ignore_rules_follow_gitignore(patterns, path, is_dir, ignored):
    assert IgnoreRules(patterns).matches(path, is_dir) is ignored


def test_defaults_skip_vcs_caches_venvs_and_checkpoints(tmp_path):
    for rel in (".git/HEAD", "pkg/__pycache__/m.pyc", "venv/bin/python", "checkpoints/0000010.safetensors",
                "env2/pyvenv.cfg", "env2/lib/x.py", "pkg/m.py", "train.py", "nested/checkpoints/keep.txt"):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rel)
    manifest, _ = scan_tree(str(tmp_path), IgnoreRules.with_defaults())
    assert sorted(manifest) == ["nested/checkpoints/keep.txt", "pkg/m.py", "train.py"]


def test_a_warm_rescan_reads_no_file_and_a_change_is_rehashed(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(50):
        (src / f"f{i}").write_text(str(i))
    cache_path = str(tmp_path / "cache.json")
    first, cold = scan_tree(str(src), IgnoreRules(), cache=HashCache(cache_path))
    assert cold.hashed_files == 50
    second, warm = scan_tree(str(src), IgnoreRules(), cache=HashCache(cache_path))
    assert warm.hashed_files == 0 and second == first
    (src / "f7").write_text("changed")
    third, again = scan_tree(str(src), IgnoreRules(), cache=HashCache(cache_path))
    assert again.hashed_files == 1 and third["f7"][2] != first["f7"][2]
    assert tree_hash(third) != tree_hash(first)


@pytest.mark.parametrize("bad", ["../x", "/etc/passwd", "a/../../x", "", ".", "a\0b", "c:/x", "a\\..\\b"])
def test_unsafe_relative_paths_are_refused_by_form(bad):
    with pytest.raises(UnsafePath):
        check_relative(bad)


def test_the_quick_form_check_agrees_with_the_full_one_on_every_path():
    """check_relative's shortcut for ordinary paths must never accept what the full check refuses,
    nor return another form: 200,000 random paths over the characters that matter."""
    import random

    from shared.paths import _check_relative_fully

    def outcome(check, path):
        try:
            return check(path)
        except UnsafePath as exc:
            return ("refused", exc.why)

    rng = random.Random(13)
    alphabet = ["a", "b", "/", ".", "..", "\\", ":", "\0", " ", "é", "\udcff"]
    for _ in range(200_000):
        path = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
        assert outcome(check_relative, path) == outcome(_check_relative_fully, path), path
    long_name = "a/" * 2100
    assert outcome(check_relative, long_name) == outcome(_check_relative_fully, long_name)


def test_a_symlink_out_of_the_root_is_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, root / "escape")
    os.symlink(root / "inside", root / "fine")
    (root / "inside").mkdir()
    with pytest.raises(UnsafePath, match="symlink leads outside"):
        resolve_under(str(root), "escape/x")
    assert resolve_under(str(root), "fine/x").endswith("fine/x")
    assert check_relative("./a//b/") == "a/b"


def test_a_guard_checks_a_new_trees_paths_once_per_directory_and_still_refuses_an_escape(tmp_path):
    from shared.paths import PathGuard

    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", root / "escape")
    guard = PathGuard(str(root))
    real = os.path.realpath(root)
    assert [guard.resolve(f"new/dir/f{i}") for i in range(3)] == [f"{real}/new/dir/f{i}" for i in range(3)]
    for _ in range(2):  # refused every time, not only when first seen
        with pytest.raises(UnsafePath, match="symlink leads outside"):
            guard.resolve("escape/new/x")
    with pytest.raises(UnsafePath, match="no such file"):
        guard.resolve("new/dir/f9", must_exist=True)
    with pytest.raises(UnsafePath):
        guard.resolve("new/../../x")


def test_a_device_file_is_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    os.symlink("/dev/null", root / "null")
    with pytest.raises(UnsafePath):
        resolve_under(str(root), "null")


def test_a_plan_sends_only_what_a_node_lacks():
    source = {"a": [1, 0o644, "h1"], "b": [2, 0o755, "h2"], "c": [3, 0o644, "h3"]}
    remote = {"a": [1, 0o644, "h1"], "b": [2, 0o644, "h2"], "c": [3, 0o644, "old"], "x": [1, 0o644, "hx"]}
    plan = plan_sync(source, remote, delete=False)
    assert plan.send == ["c"] and plan.bytes_to_send == 3
    assert plan.chmod == [("b", 0o755)]
    assert plan.delete == [] and plan.extra == ["x"]
    assert plan_sync(source, remote, delete=True).delete == ["x"]
    assert plan_sync(source, source, delete=True).empty


def test_one_divergent_node_is_named_with_its_files():
    good = {"train.py": [1, 0o644, "aaa"], "run.sh": [1, 0o755, "bbb"], "data.jsonl": [1, 0o644, "ccc"]}
    bad = dict(good)
    bad["train.py"] = [1, 0o644, "zzz"]
    bad["run.sh"] = [1, 0o644, "bbb"]
    del bad["data.jsonl"]
    report = compare_nodes({"n1": good, "n2": good, "n3": bad}, threshold=0.95)
    assert report["status"] == "fail" and report["ratio"] == pytest.approx(2 / 3, abs=1e-3)
    [entry] = report["divergent"]
    assert entry["node"] == "n3"
    hows = {d["path"]: d["how"] for d in entry["differences"]}
    assert hows == {"train.py": "other hash", "run.sh": "other mode", "data.jsonl": "missing"}
    assert "n3: " in report["detail"] and "train.py (other hash)" in report["detail"]
    assert compare_nodes({"n1": good, "n2": good, "n3": bad}, threshold=0.6)["status"] == "pass"


def test_no_majority_is_insufficient_consensus_and_one_node_passes():
    a, b = {"x": [1, 0o644, "1"]}, {"x": [1, 0o644, "2"]}
    report = compare_nodes({"n1": a, "n2": b})
    assert report["status"] == "fail" and "insufficient consensus" in report["detail"]
    assert {d["node"] for d in report["divergent"]} == {"n1", "n2"}
    single = compare_nodes({"n1": a})
    assert single["status"] == "pass" and "nothing to compare" in single["detail"]


def test_diff_reports_extra_files():
    assert diff_manifests({}, {"x": [1, 0o644, "h"]}) == [{"path": "x", "how": "extra"}]


def test_a_large_file_is_pushed_in_chunks_read_off_the_event_loop(tmp_path):
    """sync_node's send_large: upload_begin, the chunks in order, upload_finish."""
    import hashlib
    from types import SimpleNamespace

    import anyio

    from coordinator.readiness import push

    data = os.urandom(push.CHUNK_BYTES * 2 + 5)
    (tmp_path / "w.bin").write_bytes(data)
    source = {"w.bin": [len(data), 0o644, hashlib.sha256(data).hexdigest()]}
    calls = []

    async def call(method, args):
        calls.append((method, args))
        return {"upload": 7} if method == "upload_begin" else {}

    session = SimpleNamespace(node=SimpleNamespace(name="n1", workdir="/w"), call=call)
    result = anyio.run(push.sync_node, session, str(tmp_path), source, push.plan_sync(source, {}, delete=False))
    assert [m for m, _ in calls] == ["upload_begin", "upload_chunk", "upload_chunk", "upload_chunk", "upload_finish"]
    assert b"".join(a["data"] for m, a in calls if m == "upload_chunk") == data
    assert [a["offset"] for m, a in calls if m == "upload_chunk"] == [0, push.CHUNK_BYTES, 2 * push.CHUNK_BYTES]
    assert result["files_sent"] == 1 and result["bytes_sent"] == len(data)


def test_a_sync_sends_the_bytes_its_scan_hashed_read_once_within_a_budget(tmp_path):
    """The head reads a new or changed small file once: to hash it, and what it read is what it sends (a
    file edited in between would otherwise reach the node with other bytes than its hash, and be refused)."""
    import hashlib

    import anyio

    from coordinator.readiness.push import SourceReader
    from shared.file_batch import unpack_batch
    from shared.manifest import Contents

    (tmp_path / "a.py").write_text("one\n")
    (tmp_path / "big.bin").write_bytes(b"x" * 300_000)  # above the size kept: read again when sent
    contents = Contents()
    manifest, _ = scan_tree(str(tmp_path), IgnoreRules(), contents=contents)
    assert list(contents.files) == ["a.py"] and contents.size == 4
    (tmp_path / "a.py").write_text("two: edited after the scan\n")
    reader = SourceReader(str(tmp_path), manifest, hashed=contents.files)
    [(rel, _, sha, data), (_, _, _, big)] = unpack_batch(anyio.run(reader.batch, ["a.py", "big.bin"]))
    assert (rel, data, sha.hex()) == ("a.py", b"one\n", hashlib.sha256(b"one\n").hexdigest()) and len(big) == 300_000
    tight = Contents(budget=3)
    again, _ = scan_tree(str(tmp_path), IgnoreRules(), contents=tight)
    assert tight.files == {} and again["a.py"][2] == hashlib.sha256(b"two: edited after the scan\n").hexdigest()
    cache = HashCache(None)
    scan_tree(str(tmp_path), IgnoreRules(), cache=cache)
    warm = Contents()
    scan_tree(str(tmp_path), IgnoreRules(), cache=cache, contents=warm)
    assert warm.files == {}  # an unchanged file is known by its stat: not read, not kept
