"""The checkpoint store with real parts: a real S3-compatible server (moto's standalone server, its own
process, over HTTP), coordd on a local two-node cluster, coord's trainer training the tiny model.

- Every checkpoint is uploaded and committed; `coord status` says durable up to step N; the store keeps
  --store-keep of them; `coord checkpoints --store` lists them.
- The whole cluster is lost (the run stopped, the daemon gone, its state directory and every node's
  workdir wiped); a new daemon on a fresh state directory continues the run with
  `coord run --resume-from`, and it ends with the weights of an uninterrupted run.
- A missing bucket is said with the fix; a bad URL is refused before the daemon is asked."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import anyio
import pytest

from coordinator.cli.tinymodel import write_project
from coordinator.config.store_url import parse_store_url
from coordinator.durable.objects import open_store
from coordinator.durable.transfer import download_file, read_manifest
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir
from tests.s3_server import S3Server

pytestmark = pytest.mark.timeout(900)

CLUSTER = """\
[cluster]
name = "store-local"
state_dir = "{state}"

[ssh]
keepalive_s = 0.5
""" + "".join(f"""
[[nodes]]
name = "{name}"
host = "local"
workdir = "{{root}}/{name}"
""" for name in ("a", "b"))

TRAIN = ["python", "-m", "mlx_lm", "lora", "--model", "model", "--train", "--data", "data", "--fine-tune-type",
         "full", "--batch-size", "4", "--iters", "300", "--learning-rate", "1e-3", "--seed", "7"]


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on a free port, with a bucket; the environment coordd reads the store's from."""
    server = S3Server().start()
    # an upload cut short: a part, and no manifest
    server.client().put_object(Bucket="ckpt", Key="cut/run-a/step-0000004-attempt-0/parts/0000-00000", Body=b"x" * 10)
    yield server.env
    server.stop()


def _start(root: Path, state: Path, s3_env: dict[str, str]) -> DaemonProcess:
    config = root / f"cluster-{state.name}.toml"
    config.write_text(CLUSTER.format(root=root, state=state))
    daemon = DaemonProcess(config, env={**environment(), **s3_env}).start()
    daemon.wait_for(all_up, 30, "all nodes up")
    return daemon


def _events(daemon: DaemonProcess, name: str) -> list[dict]:
    doc = json.loads(coord("status", "--json", "--events", "400", "--config", str(daemon.config),
                           env=daemon.env).stdout)
    return [e for e in doc["events"] if e["message"].startswith(f"{name}:")]


def _job(daemon: DaemonProcess, name: str) -> dict:
    doc = json.loads(coord("status", "--json", "--config", str(daemon.config), env=daemon.env).stdout)
    return next(j for j in doc["jobs"] if j["name"] == name)


def _final_weights(url: str, dest: Path, env: dict[str, str]) -> dict:
    """The committed checkpoint at ``url`` fetched and loaded (the test reads the store as coord does)."""
    import mlx.core as mx

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # before the store's client exists: obstore reads them when it is made
    try:
        location = parse_store_url(url)

        async def fetch() -> Path:
            store = open_store(location.parent)
            manifest = await read_manifest(store, location.last)
            target = dest / manifest["files"][0]["path"]
            await download_file(store, location.last, manifest["files"][0], target)
            return target
        path = anyio.run(fetch)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return {k: v for k, v in mx.load(str(path)).items() if not k.startswith("__")}


def test_a_run_uploads_its_checkpoints_and_lives_on_from_the_store_after_the_whole_cluster_is_lost(s3):
    root = short_tempdir()
    write_project(root / "project")
    store = "s3://ckpt/coord"
    daemon = _start(root, root / "state1", s3)
    try:
        # The uninterrupted run: every checkpoint committed, the store keeps two.
        done = coord("run", "--config", str(daemon.config), "--name", "whole", "--source", str(root / "project"),
                     "--trainer", "coord", "--save-every", "4", "--hang-timeout", "300", "--checkpoint-store", store,
                     "--store-keep", "2", "--", *TRAIN, env=daemon.env, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        whole = _job(daemon, "whole")
        story = "\n".join(e["message"] for e in _events(daemon, "whole"))
        assert whole["state"] == "succeeded" and whole["durability"]["durable_step"] == 300, story
        assert whole["durability"]["lag_steps"] == 0 and whole["durability"]["error"] is None, whole
        assert "durable up to step 300" in coord("status", "--config", str(daemon.config), env=daemon.env).stdout
        durable = [e for e in _events(daemon, "whole") if e["kind"] == "job.durable"]
        assert {e["data"]["step"] for e in durable} >= {300}, story
        # put by the nodes that hold the copies, each its share through URLs the head signed; not by the head
        assert all(e["data"]["senders"] and set(e["data"]["senders"]) <= {"a", "b"} for e in durable), story
        listed = json.loads(coord("checkpoints", "--store", store, "--json", "--config", str(daemon.config),
                                  env=daemon.env).stdout)["checkpoints"]
        mine = [c for c in listed if c["run"] == whole["run_id"]]
        # newest first; --store-keep 2 (the uploads skip checkpoints that a newer one overtook)
        committed = {e["data"]["step"] for e in durable}
        assert [c["step"] for c in mine] == sorted(committed, reverse=True)[:2] and mine[0]["step"] == 300, mine
        assert all(c["committed"] and c["format"] == "safetensors" for c in mine), mine
        text = coord("checkpoints", "--store", f"{store}/{whole['run_id']}", "--config", str(daemon.config),
                      env=daemon.env).stdout
        assert "committed" in text and whole["run_id"] in text, text

        # The run to lose: stopped once a checkpoint past step 8 is in the store.
        submitted = coord("run", "--config", str(daemon.config), "--name", "lost", "--source",
                          str(root / "project"), "--trainer", "coord", "--save-every", "4", "--hang-timeout", "300",
                          "--checkpoint-store", store, "--detach", "--", *TRAIN, env=daemon.env)
        assert submitted.returncode == 0, submitted.stderr
        def committed_past_8(doc: dict) -> bool:
            job = next((j for j in doc["jobs"] if j["name"] == "lost"), None)
            return (((job or {}).get("durability") or {}).get("durable_step") or 0) >= 8
        daemon.wait_for(committed_past_8, 300, "a checkpoint of step 8 or later committed")
        coord("stop", "--config", str(daemon.config), "lost", env=daemon.env, timeout=120)
        lost = _job(daemon, "lost")
        durable_step = lost["durability"]["durable_step"]
        assert lost["state"] == "stopped" and 8 <= durable_step < 300, lost
    finally:
        daemon.stop()
    # The whole cluster is lost: the head's state and every node's workdir.
    for path in (root / "state1", root / "a", root / "b"):
        shutil.rmtree(path, ignore_errors=True)

    daemon = _start(root, root / "state2", s3)
    try:
        resumed = coord("run", "--config", str(daemon.config), "--name", "lost", "--source", str(root / "project"),
                        "--trainer", "coord", "--save-every", "4", "--hang-timeout", "300", "--resume-from",
                        f"{store}/{lost['run_id']}", "--", *TRAIN, env=daemon.env, timeout=600)
        story = "\n".join(e["message"] for e in _events(daemon, "lost"))
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr + story
        assert f"found the checkpoint of step {durable_step}" in resumed.stdout, resumed.stdout
        again = _job(daemon, "lost")
        assert again["run_id"] == lost["run_id"] and again["state"] == "succeeded" and again["step"] == 300, story
        started = [e for e in _events(daemon, "lost") if e["kind"] == "job.resumed_from_store"]
        assert started and started[0]["data"]["step"] == durable_step, story
        assert again["durability"]["durable_step"] == 300, again
    finally:
        daemon.stop()

    ours = _final_weights(f"{store}/{lost['run_id']}/step-0000300-attempt-{again['attempt']}", root / "ours", s3)
    theirs = _final_weights(f"{store}/{whole['run_id']}/step-0000300-attempt-0", root / "theirs", s3)
    assert ours.keys() == theirs.keys() and ours
    import mlx.core as mx

    worst = max(mx.max(mx.abs(ours[k].astype(mx.float32) - theirs[k].astype(mx.float32))).item() for k in ours)
    assert worst <= 1e-5, f"the run resumed from the store differs from the uninterrupted one by {worst}"
    shutil.rmtree(root, ignore_errors=True)


def test_a_missing_bucket_an_upload_cut_short_and_a_stores_own_prefix_are_said_with_the_fix(s3):
    root = short_tempdir()
    daemon = _start(root, root / "state", s3)
    try:
        missing = coord("checkpoints", "--store", "s3://no-such-bucket/coord", "--config", str(daemon.config),
                        env=daemon.env, timeout=120)
        assert missing.returncode != 0 and "the bucket 'no-such-bucket' does not exist" in missing.stderr, \
            missing.stderr
        bad = coord("checkpoints", "--store", "http://x/y", "--config", str(daemon.config), env=daemon.env)
        assert bad.returncode == 2 and "is not a checkpoint store" in bad.stderr, bad.stderr
        none = coord("run", "--config", str(daemon.config), "--name", "x", "--resume-from", "s3://ckpt/nothing-here",
                     "--", "python", "train.py", env=daemon.env, timeout=120)
        assert none.returncode != 0 and "no committed checkpoint under s3://ckpt/nothing-here" in none.stderr, \
            none.stdout + none.stderr
        cut = coord("run", "--config", str(daemon.config), "--name", "x", "--resume-from", "s3://ckpt/cut/run-a",
                    "--", "python", "train.py", env=daemon.env, timeout=120)
        assert cut.returncode != 0 and "step-0000004-attempt-0 (no manifest: an upload that did not finish)" in \
            cut.stderr, cut.stderr
        listed = coord("checkpoints", "--store", "s3://ckpt/cut", "--config", str(daemon.config), env=daemon.env,
                       timeout=120)
        assert "not committed (no manifest)" in listed.stdout, listed.stdout
        write_project(root / "project")
        refused = coord("run", "--config", str(daemon.config), "--name", "nobucket", "--source", str(root / "project"),
                        "--trainer", "coord", "--checkpoint-store", "s3://no-such-bucket/coord", "--", *TRAIN,
                        env=daemon.env, timeout=300)
        failed = _job(daemon, "nobucket")
        assert refused.returncode != 0 and failed["state"] == "failed" and failed.get("step") in (None, 0), failed
        assert "pre-flight failed" in failed["error"] and "checkpoint.store" in failed["error"], failed["error"]
        assert "the bucket 'no-such-bucket' does not exist: create it" in failed["error"], failed["error"]
        runs = coord("run", "--config", str(daemon.config), "--name", "x", "--resume-from", "s3://ckpt/cut",
                     "--", "python", "train.py", env=daemon.env, timeout=120)
        assert runs.returncode != 0 and "s3://ckpt/cut holds runs, not checkpoints (run-a)" in runs.stderr, \
            runs.stderr
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
