"""Recovery on the multi-host cluster: a hung rank, a cut link, a daemon restart, a damaged checkpoint, a
checkpoint holding a NaN."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import time
from pathlib import Path

import pytest

from shared.safetensors_header import read_header_block, tensor_entries
from tests.cluster.jobs import at_step, events, finish, job_of, rank_pid, ranks_left, submit, tiny_project_and_daemon
from tests.integration.daemon_harness import DaemonProcess, all_up, coord

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def setup(netns_cluster):
    with tiny_project_and_daemon(netns_cluster) as holder:
        yield holder, holder["project"], holder["root"]


def test_a_cut_link_is_seen_within_10_s_and_the_job_waits_for_the_node(netns_cluster, setup):
    holder, project, _ = setup
    daemon = holder["daemon"]
    submit(daemon, project, "link")
    at_step(netns_cluster, daemon, "link", 15, lambda job: netns_cluster.cut_link("n3"))
    cut = time.monotonic()
    try:
        daemon.wait_for(lambda d: any(e["kind"] == "job.attempt_ended" and "node_lost" in e["message"]
                                      for e in d["events"]), 10, "node loss seen by the job")
        assert time.monotonic() - cut < 10
        daemon.wait_for(lambda d: job_of(d, "link")["state"] == "recovering", 30, "job waiting for the node")
        time.sleep(3)
    finally:
        netns_cluster.restore_link("n3")
    final = finish(daemon, "link")
    assert final["restarts"] == 1
    assert any(e["kind"] == "job.waiting_for_nodes" for e in events(daemon, "link"))
    assert ranks_left(netns_cluster) == {}  # the old attempt's rank on n3 was stopped too


def test_a_restarted_daemon_reattaches_and_the_job_finishes(netns_cluster, setup):
    holder, project, _ = setup
    daemon = holder["daemon"]
    submit(daemon, project, "reattach")
    job, _ = at_step(netns_cluster, daemon, "reattach", 15, lambda job: daemon.stop(signal.SIGKILL))
    first_attempt = job["attempt"]
    holder["daemon"] = daemon = DaemonProcess(daemon.config, env=daemon.env, prefix=daemon.prefix).start()
    daemon.wait_for(all_up, 30, "all nodes up under the new daemon")
    final = finish(daemon, "reattach")
    assert final["attempt"] == first_attempt and final["restarts"] == 0  # supervised, not relaunched
    assert any(e["kind"] == "job.reattached" for e in events(daemon, "reattach"))


def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before(netns_cluster, setup):
    holder, project, _ = setup
    daemon = holder["daemon"]
    # no replica: a copy of the newest checkpoint would stand in for the damaged one (tested elsewhere)
    submit(daemon, project, "damaged", "--hang-timeout", "300", "--replica", "none")
    # freeze the ranks so no newer checkpoint appears meanwhile
    job, _ = at_step(netns_cluster, daemon, "damaged", 25,
                     lambda job: [os.killpg(rank_pid(netns_cluster, job, rank), signal.SIGSTOP) for rank in range(3)])
    time.sleep(3)  # the catalog polls every 2 s
    doc = json.loads(coord("status", "--json", "--config", str(daemon.config), env=daemon.env).stdout)
    newest = job_of(doc, "damaged")["last_checkpoint_step"]
    assert newest and newest >= 20
    node = netns_cluster.node(job["nodes"][0])
    path = (Path(node.workdir) / "checkpoints" / job["run_id"] / f"attempt-{job['attempt']}"
            / f"{newest:07d}_adapters.safetensors")
    with open(path, "r+b") as handle:  # damaged after it was validated
        handle.seek(100)
        handle.write(b"\xff" * 64)
    os.killpg(rank_pid(netns_cluster, job, 1), signal.SIGKILL)
    final = finish(daemon, "damaged")
    assert final["restarts"] == 1
    found = events(daemon, "damaged")
    assert any(e["kind"] == "job.checkpoint_rejected" and e["data"]["step"] == newest for e in found), found
    resumed = [e for e in found if e["kind"] == "job.resume_from"]
    assert resumed and resumed[-1]["data"]["step"] == newest - 10


#: A quiet NaN in each float type a checkpoint of this model may hold.
NAN_BYTES = {"F32": struct.pack("<f", float("nan")), "BF16": struct.pack("<f", float("nan"))[2:],
             "F16": struct.pack("<e", float("nan")), "F64": struct.pack("<d", float("nan"))}


def _nan_into_a_tensor(path: Path) -> str:
    """A NaN written over the middle element of the file's first float tensor; the tensor's name."""
    header, data_start = read_header_block(path)
    name, entry = next((name, entry) for name, entry in sorted(tensor_entries(header).items())
                       if entry["dtype"] in NAN_BYTES and entry["data_offsets"][1] > entry["data_offsets"][0])
    nan = NAN_BYTES[entry["dtype"]]
    begin, end = entry["data_offsets"]
    with open(path, "r+b") as handle:
        handle.seek(data_start + begin + ((end - begin) // len(nan) // 2) * len(nan))
        handle.write(nan)
    return name


def test_a_checkpoint_written_with_a_nan_is_invalid_and_the_resume_goes_back_further(netns_cluster, setup):
    holder, project, _ = setup
    daemon = holder["daemon"]
    submit(daemon, project, "nan", "--hang-timeout", "300")
    job, _ = at_step(netns_cluster, daemon, "nan", 25,
                     lambda job: [os.killpg(rank_pid(netns_cluster, job, rank), signal.SIGSTOP) for rank in range(3)])
    time.sleep(3)  # the catalog polls every 2 s
    doc = json.loads(coord("status", "--json", "--config", str(daemon.config), env=daemon.env).stdout)
    newest = job_of(doc, "nan")["last_checkpoint_step"]
    assert newest and newest >= 20
    directory = (Path(netns_cluster.node(job["nodes"][0]).workdir) / "checkpoints" / job["run_id"]
                 / f"attempt-{job['attempt']}")
    # What a run that diverged after its newest checkpoint writes next (or a disk that damaged it before coord
    # read it): mlx-lm's own file with a NaN in a tensor, written under another name and renamed by its owner.
    nan_file = directory / f"{newest + 10:07d}_adapters.safetensors"
    written = directory / f".{nan_file.name}.tmp"
    shutil.copyfile(directory / f"{newest:07d}_adapters.safetensors", written)
    tensor = _nan_into_a_tensor(written)
    owner = directory.stat()
    os.chown(written, owner.st_uid, owner.st_gid)
    os.rename(written, nan_file)
    os.killpg(rank_pid(netns_cluster, job, 1), signal.SIGKILL)
    final = finish(daemon, "nan")
    assert final["restarts"] == 1
    found = events(daemon, "nan")
    invalid = [e for e in found if e["kind"] == "job.checkpoint_invalid" and e["data"]["step"] == newest + 10]
    assert invalid, final["story"]
    assert f"{nan_file.name}: tensor {tensor!r} holds NaN" in invalid[0]["message"], invalid
    assert invalid[0]["data"]["nonfinite"]["tensor"] == tensor and invalid[0]["data"]["nonfinite"]["value"] == "NaN"
    resumed = [e for e in found if e["kind"] == "job.resume_from"]
    assert resumed and resumed[-1]["data"]["step"] == newest, final["story"]
    # the valid checkpoints, the resumed attempt's too, said what they read of their values
    validated = [e for e in found if e["kind"] == "job.checkpoint"]
    assert {e["data"]["step"] for e in validated} >= {newest, newest + 20}, final["story"]
    assert all("float tensors read, no NaN" in e["message"] for e in validated), validated


def test_a_stopped_rank_is_caught_by_the_hang_watchdog_and_recovered(netns_cluster, setup):
    holder, project, _ = setup
    daemon = holder["daemon"]
    # Last in the module: the jobs before it compiled MLX's CPU kernels into the nodes' TMPDIR. With
    # a cold cache (a fresh cluster) the first step's compile takes longer than the 8 s this job
    # allows every phase, and the job is rightly called hung before it ever trains.
    submit(daemon, project, "hang", "--hang-timeout", "8")
    at_step(netns_cluster, daemon, "hang", 15, lambda job: os.kill(rank_pid(netns_cluster, job, 2), signal.SIGSTOP),
            timeout=120)
    final = finish(daemon, "hang")
    assert final["restarts"] == 1, final["story"]
    kinds = [e["kind"] for e in events(daemon, "hang")]
    assert "job.stacks" in kinds and "job.resume_from" in kinds
    # the Python stacks of the ranks blocked behind the frozen one reached the job's log before the kill
    logs = coord("logs", "--config", str(daemon.config), "--rank", "0", "--attempt", "0", "hang", env=daemon.env)
    assert logs.returncode == 0 and "most recent call first" in logs.stdout, logs.stdout[-2000:]
    assert any("hung" in e["message"] for e in events(daemon, "hang"))
