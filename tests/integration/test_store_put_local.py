"""The checkpoint store's pieces against a real S3 server (moto's server, its own process, over HTTP):
the node's signed PUTs (agent/store_put.py), the upload spread over the nodes that hold a copy
(coordinator/durable/transfer.py), and pre-flight's probe of the store, against a server that checks
every request's signature with its own IAM users. (moto answers a signed URL with a 500 while it checks
signatures, so the PUTs go to a server that does not.) Every byte goes to the server and is read back."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import anyio
import pytest

from agent import store_put
from coordinator.config.store_url import parse_store_url
from coordinator.durable import manifest as mf
from coordinator.durable.objects import ObstoreStore
from coordinator.durable.probe import probe
from coordinator.durable.transfer import (
    PartJob,
    SenderLost,
    SpreadFile,
    download_file,
    read_manifest,
    upload_spread,
)
from shared import protocol as p
from shared.rpc import RemoteError
from tests.s3_server import S3Server

pytestmark = pytest.mark.timeout(300)
MiB = 1 << 20


@pytest.fixture(scope="module")
def s3():
    server = S3Server().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def s3_auth():
    server = S3Server(auth=True).start()
    yield server
    server.stop()


def _store(server: S3Server, url: str = "s3://ckpt/runs", user: str = "coord", **limits: float) -> ObstoreStore:
    return ObstoreStore(parse_store_url(url), env=server.env_of(user), **limits)


def _file(tmp_path: Path, size: int, name: str = "w.safetensors") -> tuple[Path, str]:
    path = tmp_path / name
    path.write_bytes(os.urandom(size))
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


class AgentSender:
    """A node with a copy, as the head's NodePartSender drives it, minus the SSH session: the head signs
    each part's URL, the agent's own put_parts reads, hashes and PUTs it."""

    def __init__(self, name: str, store: ObstoreStore, workdir: Path, lose_after: int | None = None,
                 bandwidth: float | None = None):
        self.name, self.store, self.workdir = name, store, workdir
        self.lose_after, self.bandwidth, self.batches = lose_after, bandwidth, 0

    async def send(self, file_index: int, file: SpreadFile, jobs: list[PartJob], keys: list[str]):
        if self.lose_after is not None and self.batches >= self.lose_after:
            raise SenderLost(f"{self.name} went away")
        self.batches += 1
        urls = await self.store.sign_puts(keys, 60)
        assert urls is not None
        reply = await store_put.put_parts(str(self.workdir), file.path, file.sha256, [
            {"offset": j.offset, "size": j.size, "url": u, "headers": {}} for j, u in zip(jobs, urls, strict=True)],
            bandwidth=self.bandwidth)
        return [(part["size"], part["sha256"], (part["encoding"], part["stored"]) if "encoding" in part else None)
                for part in reply["parts"]]


def _describe(entries: list[mf.FileEntry]) -> mf.StoreManifest:
    return mf.build(run="r-1", job="r", attempt=0, step=40, format="safetensors", world_size=2, created=time.time(),
                    files=entries)


def test_two_nodes_each_put_a_share_and_the_checkpoint_reads_back_whole(s3, tmp_path):
    path, sha = _file(tmp_path, 5 * MiB + 123)
    store = _store(s3)
    senders = [AgentSender("a", store, tmp_path), AgentSender("b", store, tmp_path)]
    manifest = anyio.run(lambda: upload_spread(store, "step-40", [SpreadFile(path.name, path.stat().st_size, sha)],
                                               senders, describe=_describe, part_bytes=MiB, batch=2, parallel=1))
    assert [p["size"] for p in manifest["files"][0]["parts"]] == [MiB] * 5 + [123]
    assert senders[0].batches and senders[1].batches  # a share each: both uplinks worked
    assert senders[0].batches + senders[1].batches == 3

    async def back() -> None:
        got = await read_manifest(store, "step-40")
        await download_file(store, "step-40", got["files"][0], tmp_path / "back" / path.name)
    anyio.run(back)
    assert (tmp_path / "back" / path.name).read_bytes() == path.read_bytes()


def test_a_node_lost_halfway_hands_its_parts_to_the_other(s3, tmp_path):
    path, sha = _file(tmp_path, 6 * MiB)
    store = _store(s3)
    senders = [AgentSender("a", store, tmp_path, lose_after=1), AgentSender("b", store, tmp_path)]
    manifest = anyio.run(lambda: upload_spread(store, "lost", [SpreadFile(path.name, 6 * MiB, sha)], senders,
                                               describe=_describe, part_bytes=MiB, batch=1, parallel=1))
    assert len(manifest["files"][0]["parts"]) == 6 and senders[0].batches == 1 and senders[1].batches == 5


def test_every_node_lost_leaves_nothing_in_the_store(s3, tmp_path):
    path, sha = _file(tmp_path, 3 * MiB)
    store = _store(s3)
    senders = [AgentSender("a", store, tmp_path, lose_after=1), AgentSender("b", store, tmp_path, lose_after=0)]
    with pytest.raises(SenderLost, match="no node holding a copy could send it: a: a went away; b: b went away"):
        anyio.run(lambda: upload_spread(store, "none", [SpreadFile(path.name, 3 * MiB, sha)], senders,
                                        describe=_describe, part_bytes=MiB, batch=1, parallel=1))
    assert anyio.run(lambda: store.list_objects("none/")) == []  # the part a put was removed


def test_a_copy_changed_since_it_was_validated_is_not_sent(s3, tmp_path):
    path, sha = _file(tmp_path, MiB)
    path.write_bytes(os.urandom(MiB))
    url = anyio.run(lambda: _store(s3).sign_puts(["changed/p"], 60))[0]
    with pytest.raises(RemoteError) as refused:
        anyio.run(lambda: store_put.put_parts(str(tmp_path), path.name, sha,
                                              [{"offset": 0, "size": MiB, "url": url, "headers": {}}]))
    assert refused.value.code == p.DAMAGED and "SHA256 recorded when it was validated" in refused.value.message


def test_a_put_the_store_refuses_is_its_error_with_its_code(s3, tmp_path):
    path, sha = _file(tmp_path, 1000)
    url = anyio.run(lambda: _store(s3, "s3://no-such-bucket/runs").sign_puts(["p"], 60))[0]
    with pytest.raises(RemoteError) as refused:
        anyio.run(lambda: store_put.put_parts(str(tmp_path), path.name, sha,
                                              [{"offset": 0, "size": 1000, "url": url, "headers": {}}]))
    assert refused.value.code == p.STORE and "404" in refused.value.message
    assert "(NoSuchBucket)" in refused.value.message, refused.value.message


def test_a_store_that_stops_answering_fails_the_put_in_bounded_time(s3, tmp_path, monkeypatch):
    path, sha = _file(tmp_path, 1000)
    url = anyio.run(lambda: _store(s3).sign_puts(["hung/p"], 60))[0]
    monkeypatch.setattr(store_put, "REQUEST_TIMEOUT_S", 1.0)
    s3.pause()
    try:
        started = time.monotonic()
        with pytest.raises(RemoteError) as hung:
            anyio.run(lambda: store_put.put_parts(str(tmp_path), path.name, sha,
                                                  [{"offset": 0, "size": 1000, "url": url, "headers": {}}]))
        took = time.monotonic() - started
    finally:
        s3.resume()
    assert hung.value.code == p.STORE and "3 tries" in hung.value.message and took < 20, (hung.value, took)


def test_bad_parts_from_the_wire_are_refused(tmp_path):
    path, sha = _file(tmp_path, 10)
    for part, said in (({"offset": 0, "size": 10, "url": "file:///etc/passwd", "headers": {}}, "http or https"),
                       ({"offset": -1, "size": 10, "url": "http://x/", "headers": {}}, "whole numbers"),
                       ({"offset": 0, "size": 10, "url": "http://x/", "headers": {"X-A": "1\r\nEvil: 1"}}, "one line")):
        with pytest.raises(RemoteError, match=said):
            anyio.run(lambda part=part: store_put.put_parts(str(tmp_path), path.name, sha, [part]))
    with pytest.raises(RemoteError) as outside:
        anyio.run(lambda: store_put.put_parts(str(tmp_path), "/etc/passwd", sha,
                                              [{"offset": 0, "size": 1, "url": "http://x/", "headers": {}}]))
    assert outside.value.code == p.REFUSED


def test_the_bandwidth_cap_holds_the_node_to_its_rate(s3, tmp_path):
    path, sha = _file(tmp_path, 3 * MiB)
    store = _store(s3)
    started = time.monotonic()
    anyio.run(lambda: upload_spread(store, "capped", [SpreadFile(path.name, 3 * MiB, sha)],
                                    [AgentSender("a", store, tmp_path, bandwidth=1.5e6)], describe=_describe,
                                    part_bytes=MiB, batch=3, parallel=1))
    took = time.monotonic() - started
    assert 3 * MiB / 1.5e6 <= took < 10, took  # 2.1 s at 1.5 MB/s; uncapped it is a tenth of that here


def test_preflight_probe_names_each_fault_and_its_fix(s3_auth, tmp_path):
    s3 = s3_auth
    assert anyio.run(lambda: probe(_store(s3))).ok
    # the keys from an AWS profile, where the environment names none
    key, secret = s3.users["coord"]
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text(f"[lab]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n")
    profiled = ObstoreStore(parse_store_url("s3://ckpt/runs"), env={
        "HOME": str(tmp_path), "AWS_PROFILE": "lab", "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3.endpoint})
    assert anyio.run(lambda: probe(profiled)).ok
    writer = anyio.run(lambda: probe(_store(s3, user="writer")))
    assert writer.kind == "denied" and "list failed" in writer.detail and "s3:ListBucket is needed" in writer.detail
    stranger = anyio.run(lambda: probe(ObstoreStore(parse_store_url("s3://ckpt/runs"), env={
        **s3.env, "AWS_ACCESS_KEY_ID": "AKIANOSUCHKEY", "AWS_SECRET_ACCESS_KEY": "x"})))
    assert stranger.kind == "credentials" and "InvalidAccessKeyId" in stranger.detail
    assert "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in stranger.detail
    missing = anyio.run(lambda: probe(_store(s3, "s3://no-such-bucket/runs")))
    assert missing.kind == "no_bucket" and "aws s3 mb s3://no-such-bucket" in missing.detail
    s3.pause()
    try:
        started = time.monotonic()
        hung = anyio.run(lambda: probe(_store(s3, request_timeout_s=1, operation_timeout_s=4)))
        assert hung.kind == "timeout" and time.monotonic() - started < 30, hung
    finally:
        s3.resume()


def _bf16_weights(path: Path, size: int) -> str:
    """bf16 values of a normal distribution, as a model's weights are: their exponents repeat."""
    import numpy as np

    values = np.random.default_rng(3).normal(0, 0.02, size // 2).astype(np.float32)
    path.write_bytes((values.view(np.uint32) >> 16).astype(np.uint16).tobytes())
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_bf16_weights_go_compressed_where_that_pays_and_come_back_exact(s3, tmp_path, monkeypatch):
    # An uplink of 10 MB/s, as a user's home or office upload, whatever the tests before measured here.
    uplink = store_put.Uplink()
    uplink.rate = 10e6
    monkeypatch.setattr(store_put, "_uplink", uplink)
    monkeypatch.setattr(store_put, "_compressing", {})
    store = _store(s3)
    weights = tmp_path / "bf16.safetensors"
    sha = _bf16_weights(weights, 3 * MiB)
    noise, noise_sha = _file(tmp_path, 2 * MiB, "fp32.safetensors")  # random bytes: as fp32 weights, no gain
    files = [SpreadFile(weights.name, 3 * MiB, sha), SpreadFile(noise.name, 2 * MiB, noise_sha)]
    manifest = anyio.run(lambda: upload_spread(store, "packed", files, [AgentSender("a", store, tmp_path)],
                                               describe=_describe, part_bytes=MiB, batch=2, parallel=1))
    bf16, fp32 = manifest["files"]
    assert all(p.get("encoding") == "zstd" and p["stored"] < 0.9 * p["size"] for p in bf16["parts"]), bf16
    assert not any("encoding" in p for p in fp32["parts"]), fp32
    back = mf.parse(mf.dumps(manifest))
    assert back["files"][0]["parts"] == bf16["parts"]  # the encoding survives the manifest's own check

    async def fetch() -> None:
        for entry in back["files"]:
            await download_file(store, "packed", entry, tmp_path / "back" / entry["path"])
    anyio.run(fetch)
    assert (tmp_path / "back" / weights.name).read_bytes() == weights.read_bytes()
    assert (tmp_path / "back" / noise.name).read_bytes() == noise.read_bytes()
    # On an uplink faster than half the compression's speed, the same file goes as it is.
    monkeypatch.setattr(store_put._uplink, "rate", 1e12)
    monkeypatch.setattr(store_put, "_compressing", {})
    fast = anyio.run(lambda: upload_spread(store, "fast", files[:1], [AgentSender("a", store, tmp_path)],
                                           describe=_describe, part_bytes=MiB, batch=2, parallel=1))
    assert not any("encoding" in p for p in fast["files"][0]["parts"]), fast


def test_the_compression_rule():
    assert store_put.worth_compressing(0.78, 700e6, None)  # bf16, the uplink not measured yet
    assert store_put.worth_compressing(0.78, 700e6, 12.5e6)  # 100 Mbit/s
    assert not store_put.worth_compressing(0.78, 700e6, 1.25e9)  # 10 Gbit/s: compressing is the slower part
    assert not store_put.worth_compressing(0.92, 700e6, 12.5e6)  # fp32: too little saved for the CPU it takes


def test_a_files_first_part_decides_for_its_others_whatever_the_uplink_measures_meanwhile(tmp_path, monkeypatch):
    if store_put.compressor() is None:
        pytest.skip("this Python has no zstd")
    monkeypatch.setattr(store_put, "_uplink", store_put.Uplink())
    monkeypatch.setattr(store_put, "_compressing", {})
    path = tmp_path / "bf16.safetensors"
    sha = _bf16_weights(path, 2 * MiB)
    data = path.read_bytes()
    file = (path.name, sha)
    assert store_put._packed(data[:MiB], file) is not None  # not measured yet: it pays
    store_put._uplink.saw(1 << 30, 0.1)  # then a part of another file went at 10 GB/s
    assert store_put._packed(data[MiB:], file) is not None  # this file's others follow its first
    assert store_put._packed(data[MiB:], ("other.safetensors", sha)) is None  # a new file decides anew
    assert store_put._packed(os.urandom(MiB), file) is None  # a part that does not shrink goes as it is
