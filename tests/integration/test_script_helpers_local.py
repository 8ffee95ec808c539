"""A plain script on a local cluster reports through coord_script (shipped in the agent bundle, found on
the rank's PYTHONPATH with nothing installed), and coord shows its progress and finds its checkpoint
directories where the contract puts them."""

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


@pytest.fixture(scope="module")
def cluster():
    root = short_tempdir()
    (root / "project").mkdir()
    (root / "project" / "helped.py").write_text(HELPED)
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
