"""A plain script on a local cluster reports through coord_script (shipped in the agent bundle, found on
the rank's PYTHONPATH with nothing installed), and coord shows its progress and finds its checkpoint
directories where the contract puts them; one of them holding a NaN is not resumed from."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir
from tests.integration.test_jobs_local import CLUSTER, job_of

HELPED = '''\
import os, time
import coord_script

total = 12
start = coord_script.step_offset()
with open("coord_script_from.txt", "w") as handle:  # in the node's workdir
    handle.write(coord_script.__file__)
for step in range(start + 1, total + 1):
    time.sleep(0.1)
    if os.environ["COORD_RANK"] == "0":
        coord_script.report(step, loss=1.0 / step, tokens_per_second=100.0 * step)
        if step % 4 == 0:
            with open(os.path.join(coord_script.checkpoint_dir(step - start), "state.txt"), "w") as handle:
                handle.write(str(step))
'''

# Saves a checkpoint directory of its own every 4 steps (a safetensors file, then COMPLETE); on its first
# attempt the one of step 8 holds a NaN, as a run that diverged writes it, and every rank fails at step 10.
DIVERGES = '''\
import json, os, struct, sys, time
import coord_script

total = 12
start = coord_script.step_offset()
resumed = coord_script.resume_dir()
if resumed:
    with open(os.path.join(resumed, "model.safetensors"), "rb") as handle:
        assert struct.unpack("<4f", handle.read()[-16:])[2] == 0.5, "resumed from a checkpoint holding a NaN"


def save(step, value):
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    header += b" " * (-len(header) % 8)
    directory = coord_script.checkpoint_dir(step - start)
    with open(os.path.join(directory, "model.safetensors"), "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header + struct.pack("<4f", 1.0, 2.0, value, 3.0))
    open(os.path.join(directory, "COMPLETE"), "w").close()


for step in range(start + 1, total + 1):
    time.sleep(0.1)
    if os.environ["COORD_RANK"] == "0":
        coord_script.report(step, loss=1.0 / step)
        if step % 4 == 0:
            save(step, float("nan") if step == 8 and start == 0 else 0.5)
    if step == 10 and start == 0:
        sys.exit(3)
'''


@pytest.fixture(scope="module")
def cluster():
    root = short_tempdir()
    (root / "project").mkdir()
    (root / "project" / "helped.py").write_text(HELPED)
    (root / "project" / "diverges.py").write_text(DIVERGES)
    config = root / "cluster.toml"
    config.write_text(CLUSTER.format(root=root))
    daemon = DaemonProcess(config, env=environment()).start()
    daemon.wait_for(all_up, 30, "all nodes up")
    yield daemon, root
    daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_a_script_reports_through_coord_script_and_coord_shows_its_progress(cluster):
    daemon, root = cluster
    submitted = coord("run", "--config", str(daemon.config), "--name", "helped", "--source", str(root / "project"),
                      "--total-steps", "12", "--detach", "--", "python", "helped.py", env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), "helped", env=daemon.env, timeout=300)
    final = json.loads(waited.stdout)
    assert waited.returncode == 0 and final["state"] == "succeeded", final
    job = job_of(daemon.status(), "helped")
    assert job["step"] == 12 and job["loss"] == pytest.approx(1 / 12) and job["tokens_per_second"] == 1200.0
    attempt = root / job["nodes"][0] / "checkpoints" / job["run_id"] / "attempt-0"
    assert sorted(p.name for p in attempt.iterdir()) == ["0000004", "0000008", "0000012"]
    assert (attempt / "0000008" / "state.txt").read_text() == "8"
    # Imported from the agent bundle coord installed on the node, not from this checkout.
    assert "/.coord/agent/" in (root / job["nodes"][0] / "coord_script_from.txt").read_text()


def test_a_checkpoint_directory_holding_a_nan_is_invalid_and_the_resume_goes_back_further(cluster):
    daemon, root = cluster
    submitted = coord("run", "--config", str(daemon.config), "--name", "diverges", "--source", str(root / "project"),
                      "--total-steps", "12", "--detach", "--", "python", "diverges.py", env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), "diverges", env=daemon.env,
                   timeout=300)
    final = json.loads(waited.stdout)
    found = [e for e in daemon.status(events=5000)["events"] if e["message"].startswith("diverges:")]
    story = "\n".join(e["message"] for e in found)
    assert waited.returncode == 0 and final["state"] == "succeeded" and final["restarts"] == 1, story
    invalid = [e for e in found if e["kind"] == "job.checkpoint_invalid" and e["data"]["step"] == 8]
    assert invalid and invalid[0]["data"]["nonfinite"] == {
        "file": "model.safetensors", "tensor": "w", "value": "NaN", "element": 2, "dtype": "float32"}, story
    assert "model.safetensors: tensor 'w' holds NaN (float32 element 2)" in invalid[0]["message"]
    resumed = [e for e in found if e["kind"] == "job.resume_from"]
    assert resumed and resumed[-1]["data"]["step"] == 4, story
    assert any(e["kind"] == "job.checkpoint" and e["data"]["step"] == 4
               and "1 float tensor read, no NaN" in e["message"] for e in found), story
