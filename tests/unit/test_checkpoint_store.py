"""The checkpoint store's pure parts (its URL, the manifest, what to upload and keep) and its transfer
over a real directory store (obstore's LocalStore, as a NAS mounted on the head is used)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import anyio
import pytest

from coordinator.config.store_url import StoreUrlError, checkpoint_dir, parse_checkpoint_dir, parse_store_url
from coordinator.durable import manifest as mf
from coordinator.durable import policy
from coordinator.durable.objects import ObjectInfo, StoreError, open_store
from coordinator.durable.transfer import (
    UploadDamaged,
    UploadFile,
    download_file,
    read_manifest,
    remove_checkpoint,
    upload_checkpoint,
)

# --- the URL ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("url", "scheme", "bucket", "prefix"), [
    ("s3://bucket/coord/runs", "s3", "bucket", "coord/runs"),
    ("s3://bucket", "s3", "bucket", ""),
    ("s3://bucket/coord/", "s3", "bucket", "coord"),
    ("gs://b-1/p", "gs", "b-1", "p"),
    ("az://container/x/y", "az", "container", "x/y"),
    ("file:///mnt/nas/coord/", "file", "", "mnt/nas/coord"),
])
def test_a_store_url_is_taken_apart_and_written_back_the_same(url, scheme, bucket, prefix):
    location = parse_store_url(url)
    assert (location.scheme, location.bucket, location.prefix) == (scheme, bucket, prefix)
    assert parse_store_url(location.url) == location


@pytest.mark.parametrize(("url", "says"), [
    ("http://bucket/x", "is not a checkpoint store"),
    ("/mnt/nas", "is not a checkpoint store"),
    ("s3://key:secret@bucket/x", "credentials and ports do not go in the URL"),
    ("s3://bucket/x?endpoint=y", "takes no ?query"),
    ("s3:///x", "is not a bucket name"),
    ("s3://bucket/a/../b", "may not hold empty, . or .. parts"),
    ("file://host/x", "three slashes"),
    ("file:///", "absolute path below /"),
    ("file:///a/../b", "absolute path below /"),
])
def test_a_bad_store_url_is_refused_with_what_to_write(url, says):
    with pytest.raises(StoreUrlError, match=None) as refused:
        parse_store_url(url)
    assert says in str(refused.value), str(refused.value)


def test_a_checkpoints_directory_name_gives_back_its_step_and_attempt():
    assert checkpoint_dir(40, 2) == "step-0000040-attempt-2"
    assert parse_checkpoint_dir("step-0000040-attempt-2") == (40, 2)
    assert parse_checkpoint_dir("step-40-attempt-2") is None and parse_checkpoint_dir("other") is None


def test_a_locations_parent_and_below_walk_the_prefix():
    run = parse_store_url("s3://b/coord").below("run-1")
    assert run.url == "s3://b/coord/run-1" and run.last == "run-1" and run.parent.url == "s3://b/coord"
    assert parse_store_url("file:///mnt/nas").below("r").url == "file:///mnt/nas/r"


# --- the manifest -----------------------------------------------------------------------------

def _manifest(data: bytes = b"x" * 2500, part: int = 1000) -> mf.StoreManifest:
    parts = [(o, n, hashlib.sha256(data[o:o + n]).hexdigest()) for o, n in mf.split_parts(len(data), part)]
    files: list[mf.FileEntry] = [{"path": "0000040_adapters.safetensors", "size": len(data),
                                  "sha256": hashlib.sha256(data).hexdigest(), "parts": mf.part_entries(0, parts)}]
    return mf.build(run="tiny-0123abcd", job="tiny", attempt=1, step=40, format="safetensors", world_size=2,
                    created=1.0, files=files)


def test_parts_cover_a_file_without_gaps_and_an_empty_file_is_one_empty_part():
    assert mf.split_parts(2500, 1000) == [(0, 1000), (1000, 1000), (2000, 500)]
    assert mf.split_parts(2000, 1000) == [(0, 1000), (1000, 1000)]
    assert mf.split_parts(0, 1000) == [(0, 0)]


def test_a_manifest_read_back_is_the_one_written():
    manifest = _manifest()
    assert mf.parse(mf.dumps(manifest)) == manifest
    assert manifest["bytes"] == 2500 and [p["key"] for p in manifest["files"][0]["parts"]] == [
        "parts/0000-00000", "parts/0000-00001", "parts/0000-00002"]


def _edited(change) -> bytes:
    data = json.loads(mf.dumps(_manifest()))
    change(data)
    return json.dumps(data).encode()


@pytest.mark.parametrize(("change", "says"), [
    (lambda d: d["files"][0].update(path="../../etc/passwd"), "not a plain relative path"),
    (lambda d: d["files"][0].update(path="/etc/passwd"), "not a plain relative path"),
    (lambda d: d["files"][0]["parts"][1].update(offset=999), "gap or an overlap"),
    (lambda d: d["files"][0]["parts"][1].update(key="parts/../x"), "its key is"),
    (lambda d: d["files"][0].update(size=2501), "add up to 2500 bytes"),
    (lambda d: d["files"][0].update(sha256="zz"), "not a SHA256"),
    (lambda d: d.update(bytes=1), "not the sum"),
    (lambda d: d.update(step=-1), "step is not a whole number"),
    (lambda d: d.update(step=True), "step is not a whole number"),
    (lambda d: d.update(format_version=2), "format_version 2"),
    (lambda d: d.update(files=[]), "lists no files"),
    (lambda d: d["files"].append(dict(d["files"][0])), "part 0: its key is"),
])
def test_a_damaged_or_hostile_manifest_is_refused_saying_what_is_wrong(change, says):
    with pytest.raises(mf.ManifestError) as refused:
        mf.parse(_edited(change))
    assert says in str(refused.value), str(refused.value)


def test_a_manifest_that_is_not_json_is_refused():
    with pytest.raises(mf.ManifestError, match="not JSON"):
        mf.parse(b"\xff{")


# --- the policy -------------------------------------------------------------------------------

def _copy(step: int, attempt: int = 0, node: str = "n1", role: str = "primary", valid: bool = True,
          created: float = 0.0) -> dict:
    return {"step": step, "attempt": attempt, "node": node, "path": f"/w/{step:07d}.safetensors",
            "sha256": f"{step:064x}", "size": 10, "valid": valid, "detail": None, "created": created or float(step),
            "role": role}


def _durable(step: int, attempt: int = 0) -> dict:
    return {"step": step, "attempt": attempt, "url": f"s3://b/r/{checkpoint_dir(step, attempt)}", "bytes": 10,
            "seconds": 1.0, "committed": float(step)}


def test_the_newest_valid_checkpoint_newer_than_the_newest_durable_goes_next_its_primary_first():
    copies = [_copy(10), _copy(20), _copy(30, node="n2", role="local"), _copy(30), _copy(40, valid=False)]
    assert policy.to_upload(copies, []) == _copy(30)
    assert policy.to_upload(copies, [_durable(30)]) is None
    assert policy.to_upload(copies, [_durable(10)])["step"] == 30  # 20 is skipped: the store catches up
    assert policy.to_upload([_copy(20, attempt=1), _copy(30, attempt=0)], [_durable(20, 1)])["step"] == 30


def test_the_store_keeps_the_newest_and_every_kth_and_never_its_newest():
    durable = [_durable(s) for s in (10, 20, 30, 40, 50)]
    assert [d["step"] for d in policy.store_to_remove(durable, 2, None)] == [30, 20, 10]
    assert [d["step"] for d in policy.store_to_remove(durable, 2, 20)] == [30, 10]
    assert [d["step"] for d in policy.store_to_remove(durable, 0, None)] == [40, 30, 20, 10]  # the newest stays
    assert policy.store_to_remove([], 3, None) == []


def test_what_is_not_durable_yet_is_held_on_the_nodes_and_the_lag_says_how_long_it_waited():
    copies = [_copy(10, created=100), _copy(20, created=200), _copy(30, created=300)]
    assert policy.held_locally(copies, [_durable(10)]) == {(20, 0), (30, 0)}
    assert policy.held_locally(copies, []) == {(10, 0), (20, 0), (30, 0)}
    lag = policy.lag(copies, [_durable(10)], now=260)
    assert (lag.durable_step, lag.steps, lag.seconds) == (10, 20, 60)
    assert policy.lag(copies, [_durable(30)], now=400) == policy.Lag(30, 0, 0.0)
    assert policy.lag(copies, [], now=400).steps == 30


def test_a_node_short_of_room_for_the_checkpoints_it_holds_for_the_store_is_named_before_its_disk_fills():
    copies = [_copy(10), _copy(20), _copy(30), _copy(20, node="n2"), _copy(30, node="n2"), _copy(40, valid=False)]
    held = policy.held_locally(copies, [_durable(10)])
    # n1: 25 bytes free, room for 2 more of 10; n2: room for 5; n3 holds nothing
    short = policy.short_of_room(copies, held, {"n1": 25, "n2": 50, "n3": 1})
    assert short == [policy.Room("n1", 25, 2, 2, 20)]
    assert policy.short_of_room(copies, set(), {"n1": 25}) == []  # nothing held: retention frees the disk
    assert policy.short_of_room(copies, held, {"n1": 30}) == []  # room for 3


# --- the transfer, over a directory store -----------------------------------------------------

def _upload_file(path: Path, rel: str, *, chunk: int = 700, sha256: str | None = None) -> UploadFile:
    data = path.read_bytes()

    async def chunks():
        for offset in range(0, len(data), chunk):
            yield data[offset:offset + chunk]
    return UploadFile(rel, len(data), sha256 or hashlib.sha256(data).hexdigest(), chunks)


def _describe(entries):
    return mf.build(run="r", job="j", attempt=0, step=40, format="safetensors", world_size=1, created=1.0,
                    files=entries)


def test_a_checkpoint_goes_up_in_parts_its_manifest_last_and_comes_back_checked(tmp_path):
    source = tmp_path / "0000040_adapters.safetensors"
    source.write_bytes(os.urandom(2500))
    store = open_store(parse_store_url(f"file://{tmp_path}/store/run"))

    async def go():
        sent: list[int] = []
        manifest = await upload_checkpoint(store, "step-0000040-attempt-0", [_upload_file(source, source.name)],
                                           describe=_describe, part_bytes=1000, sent=sent.append)
        assert sorted(sent) == [500, 1000, 1000]
        listed = sorted(o.key for o in await store.list_objects("step-0000040-attempt-0/"))
        assert listed == ["step-0000040-attempt-0/manifest.json", "step-0000040-attempt-0/parts/0000-00000",
                          "step-0000040-attempt-0/parts/0000-00001", "step-0000040-attempt-0/parts/0000-00002"]
        again = await read_manifest(store, "step-0000040-attempt-0")
        assert again == manifest
        dest = tmp_path / "back" / source.name
        await download_file(store, "step-0000040-attempt-0", again["files"][0], dest)
        assert dest.read_bytes() == source.read_bytes()
        # a part changed in the store: refused, and nothing left under the file's name
        part = tmp_path / "store" / "run" / "step-0000040-attempt-0" / "parts" / "0000-00001"
        part.write_bytes(b"y" * 1000)
        dest.unlink()
        with pytest.raises(UploadDamaged, match="does not match its manifest"):
            await download_file(store, "step-0000040-attempt-0", again["files"][0], dest)
        assert not dest.exists() and not list(dest.parent.iterdir())
        await remove_checkpoint(store, "step-0000040-attempt-0")
        assert await store.list_objects("step-0000040-attempt-0/") == []
    anyio.run(go)


def test_bytes_that_no_longer_match_what_was_validated_commit_nothing_and_leave_nothing(tmp_path):
    source = tmp_path / "0000040_adapters.safetensors"
    source.write_bytes(os.urandom(2500))
    store = open_store(parse_store_url(f"file://{tmp_path}/store/run"))

    async def go():
        with pytest.raises(UploadDamaged, match="not the 2500 bytes"):
            await upload_checkpoint(store, "step-0000040-attempt-0",
                                    [_upload_file(source, source.name, sha256="0" * 64)], describe=_describe,
                                    part_bytes=1000)
        assert await store.list_objects("") == []
    anyio.run(go)


def test_a_store_that_fails_halfway_leaves_no_manifest_and_removes_its_parts(tmp_path):
    source = tmp_path / "0000040_adapters.safetensors"
    source.write_bytes(os.urandom(5000))
    real = open_store(parse_store_url(f"file://{tmp_path}/store/run"))

    class FailsOnThirdPut:
        location = real.location

        def __init__(self):
            self.puts = 0

        async def put(self, key: str, data: bytes) -> None:
            self.puts += 1
            if self.puts == 3:
                raise StoreError("timeout", "writing took over 180 s")
            await real.put(key, data)

        async def get(self, key: str) -> bytes:
            return await real.get(key)

        async def list_objects(self, prefix: str = "") -> list[ObjectInfo]:
            return await real.list_objects(prefix)

        async def list_dirs(self, prefix: str = "") -> list[str]:
            return await real.list_dirs(prefix)

        async def delete(self, keys: list[str]) -> None:
            await real.delete(keys)

    async def go():
        with pytest.raises(StoreError):
            await upload_checkpoint(FailsOnThirdPut(), "step-0000040-attempt-0", [_upload_file(source, source.name)],
                                    describe=_describe, part_bytes=1000)
        assert await real.list_objects("") == []
    anyio.run(go)


def test_an_aws_profile_gives_the_keys_where_the_environment_names_none(tmp_path):
    from coordinator.durable.aws_profile import profile_config

    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text(
        "[default]\naws_access_key_id = AKIADEFAULT\naws_secret_access_key = s1\n\n"
        "[r2]\naws_access_key_id = AKIAR2\naws_secret_access_key = s2\naws_session_token = t2\n")
    (tmp_path / ".aws" / "config").write_text(
        "[default]\nregion = eu-west-1\n\n[profile r2]\nregion = auto\nendpoint_url = https://acct.r2.example\n")
    home = {"HOME": str(tmp_path)}
    assert profile_config(home) == {"aws_access_key_id": "AKIADEFAULT", "aws_secret_access_key": "s1",
                                    "aws_region": "eu-west-1"}
    assert profile_config({**home, "AWS_PROFILE": "r2"}) == {
        "aws_access_key_id": "AKIAR2", "aws_secret_access_key": "s2", "aws_session_token": "t2",
        "aws_region": "auto", "aws_endpoint": "https://acct.r2.example"}
    # the environment wins, as in the AWS chain: its keys, its region, its endpoint
    assert profile_config({**home, "AWS_ACCESS_KEY_ID": "AKIAENV"}) == {}
    assert "aws_region" not in profile_config({**home, "AWS_REGION": "us-east-2"})
    assert profile_config({**home, "AWS_PROFILE": "missing"}) == {}
    assert profile_config({"HOME": str(tmp_path / "nowhere")}) == {}
