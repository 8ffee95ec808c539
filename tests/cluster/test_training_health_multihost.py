"""Watching the training, not only the processes, on the multi-host cluster.

- A real MLX run (coord's trainer) whose weights turn NaN at a chosen step: rolled back to the
  checkpoint before it, the batches after it skipped, finished with finite losses; with
  ``--on-divergence stop``, failed naming the step.
- The head's own interface down for 30 s during a 3-node job: the ranks train on, the job stays
  ``running`` with the ``head_disconnected`` note, the checkpoints of that time are catalogued once it
  is back, no restart; and the head cut off while a node is really gone: a recovery once it is back.
- A node's workdir deleted mid-run: the relaunch sends it again and names what it lost.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.cluster.jobs import at_step, events, finish, job_of, rank_pid, submit, tiny_project_and_daemon, wait_event
from tests.integration.daemon_harness import coord

pytestmark = pytest.mark.cluster

#: A plain MLX script under the COORD_* contract, one rank per node joined by a ring all_sum every step,
#: slow enough (--sleep) to outlive a 30 s outage. Rank 0 reports through coord_script and saves
#: .safetensors checkpoints; a resume loads the one coord names.
SLOW = '''\
import argparse, os, time
import mlx.core as mx
import coord_script

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--sleep", type=float, default=0.1)
args = parser.parse_args()
group = mx.distributed.init()
rank = group.rank()
offset = coord_script.step_offset()
save_every = int(os.environ["COORD_SAVE_EVERY"])
w = mx.zeros(4)
if os.environ.get("COORD_RESUME_FILE"):
    w = mx.load(os.environ["COORD_RESUME_FILE"])["w"]
for step in range(offset + 1, args.steps + 1):
    w = w + mx.distributed.all_sum(mx.ones(4), group=group)
    mx.eval(w)
    time.sleep(args.sleep)
    if rank == 0:
        coord_script.report(step, loss=1.0 / step)
        if (step - offset) % save_every == 0:
            os.makedirs(os.environ["COORD_CHECKPOINT_DIR"], exist_ok=True)
            mx.save_safetensors(os.path.join(os.environ["COORD_CHECKPOINT_DIR"],
                                             f"{step - offset:07d}_adapters.safetensors"), {"w": w})
'''

COORD_TRAINER = ["python", "-m", "mlx_lm", "lora", "--model", "model", "--train", "--data", "data", "--fine-tune-type",
                 "full", "--batch-size", "3", "--iters", "40", "--learning-rate", "1e-4", "--steps-per-report", "1"]


@pytest.fixture(scope="module")
def setup(netns_cluster):
    with tiny_project_and_daemon(netns_cluster) as holder:
        script = holder["project"] / "slow.py"
        script.write_text(SLOW)
        script.chmod(0o644)
        yield holder


def _status_job(daemon, name: str) -> dict:
    return job_of(daemon.status(), name)


def test_weights_that_turn_nan_roll_back_to_the_checkpoint_before_and_skip_the_batches_after_it(netns_cluster, setup):
    daemon = setup["daemon"]
    submit(daemon, setup["project"], "nan", "--trainer", "coord", "--skip-on-rollback", "3", "--hang-timeout", "300",
           command=[*COORD_TRAINER, "--debug-nan", "25"])
    final = finish(daemon, "nan", steps=40)
    story = final["story"]
    assert final["restarts"] == 0 and final["rollbacks"] == 1, story
    assert isinstance(final["loss"], float) and math.isfinite(final["loss"]), final
    found = events(daemon, "nan")
    (diverged,) = [e for e in found if e["kind"] == "job.diverged"]
    # Every weight NaN after step 25: the loss of step 26 is the first NaN, and the checkpoint of step 30
    # (written from NaN weights) is not resumed from; the one of step 20 is, with 3 batches skipped.
    assert diverged["data"]["step"] == 26 and diverged["data"]["value"] == "nan", story
    assert "rolling back to the checkpoint of step 20, skipping the 3 batches after it" in diverged["message"], story
    resumed = [e for e in found if e["kind"] == "job.resume_from"]
    assert resumed[-1]["data"]["step"] == 20, story
    log = coord("logs", "--config", str(daemon.config), "--rank", "0", "--attempt", "1", "nan", env=daemon.env)
    assert "Skipping 3 global batches after the rollback" in log.stdout, log.stdout[-3000:]
    # The curve goes on from the rollback's step: the NaN steps after it are dropped with the attempt.
    history = json.loads(coord("status", "--json", "--history", "--run", final["run_id"], "--config",
                               str(daemon.config), env=daemon.env).stdout)
    losses = history["history"]["runs"][0]["train"]["loss"]
    assert all(isinstance(loss, float) and math.isfinite(loss) for loss in losses), losses


def test_with_on_divergence_stop_a_nan_fails_the_run_naming_the_step(netns_cluster, setup):
    daemon = setup["daemon"]
    submit(daemon, setup["project"], "nanstop", "--trainer", "coord", "--on-divergence", "stop",
           "--hang-timeout", "300", command=[*COORD_TRAINER, "--debug-nan", "12"])
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), "nanstop", env=daemon.env,
                   timeout=600)
    final = json.loads(waited.stdout)
    assert waited.returncode != 0 and final["state"] == "failed", final
    assert "loss is nan at step 13" in final["error"] and "--on-divergence stop" in final["error"], final
    assert final["loss"] == "nan", final  # --json: the word, since JSON has no NaN
    # The history kept the NaN as what it was: a value, not a gap that shows the last finite loss.
    history = json.loads(coord("status", "--json", "--history", "--run", final["run_id"], "--config",
                               str(daemon.config), env=daemon.env).stdout)
    train = history["history"]["runs"][0]["train"]
    first_nan = train["loss"].index("nan")
    assert train["step"][first_nan] == 13 and train["loss"][-1] == "nan", train
    shown = coord("status", "--config", str(daemon.config), env=daemon.env).stdout
    assert "loss nan" in shown, shown


def test_a_head_cut_off_for_30_s_keeps_the_job_running_and_reattaches_without_a_restart(netns_cluster, setup):
    daemon = setup["daemon"]
    submit(daemon, setup["project"], "blip", "--total-steps", "500", "--save-every", "20", "--node-timeout", "60",
           command=["python", "slow.py", "--steps", "500", "--sleep", "0.1"])
    job, step_at_cut = at_step(netns_cluster, daemon, "blip", 40, lambda job: netns_cluster.cut_head())
    cut = time.monotonic()
    seen: list[tuple[float, str, str | None]] = []
    try:
        while time.monotonic() - cut < 30:
            view = _status_job(daemon, "blip")  # the control socket is the head's own: it answers while cut off
            seen.append((time.monotonic() - cut, view["state"], view.get("note")))
            time.sleep(1)
    finally:
        netns_cluster.restore_head()
    back = time.monotonic()
    assert all(state == "running" for _, state, _ in seen), seen
    noted = [t for t, _, note in seen if note and note.startswith("head_disconnected")]
    assert noted and noted[0] < 15 and all(note for t, _, note in seen if t > noted[0] + 1), seen
    wait_event(daemon, "blip", "job.head_reconnected", 60, "the head reaching its nodes again")
    reached = _status_job(daemon, "blip")
    assert reached["note"] is None and reached["state"] == "running", reached
    assert time.monotonic() - back < 60
    final = finish(daemon, "blip", steps=500)
    assert final["restarts"] == 0 and final["attempt"] == job["attempt"], final["story"]
    found = events(daemon, "blip")
    kinds = [e["kind"] for e in found]
    assert "job.head_disconnected" in kinds and "job.attempt_ended" not in kinds[:kinds.index("job.head_reconnected")]
    # The checkpoints written while the head was away are catalogued once it is back.
    reconnected = next(e for e in found if e["kind"] == "job.head_reconnected")
    during = [e["data"]["step"] for e in found if e["kind"] == "job.checkpoint"
              and step_at_cut + 20 <= e["data"]["step"] <= reconnected["data"]["step_now"]]
    assert len(during) >= 2, (step_at_cut, reconnected, [e["data"] for e in found if e["kind"] == "job.checkpoint"])


def test_a_head_cut_off_while_a_node_is_really_gone_is_a_recovery_once_it_is_back(netns_cluster, setup):
    daemon = setup["daemon"]
    submit(daemon, setup["project"], "blipgone", "--total-steps", "150", "--save-every", "20", "--node-timeout", "60",
           command=["python", "slow.py", "--steps", "150", "--sleep", "0.1"])

    def cut_head_and_lose_n3(job: dict) -> None:
        netns_cluster.cut_head()
        netns_cluster.cut_link(job["nodes"][2])  # the machine of rank 2 goes away, its rank with it
        os.killpg(rank_pid(netns_cluster, job, 2), signal.SIGKILL)

    job, _ = at_step(netns_cluster, daemon, "blipgone", 30, cut_head_and_lose_n3)
    cut = time.monotonic()
    lost = job["nodes"][2]
    try:
        time.sleep(15)
        assert _status_job(daemon, "blipgone")["state"] == "running"  # nothing decided while the head is away
        netns_cluster.restore_head()
        back = time.monotonic()
        wait_event(daemon, "blipgone", "job.attempt_ended", 60, "the attempt ended once the head is back")
        ended = time.monotonic()
    finally:
        netns_cluster.restore_head()
        netns_cluster.restore_link(lost)
    # Judged once the head reaches n1 and n2 again and their ranks step no more (they wait for the rank that
    # is gone), not at the --node-timeout of 60 s counted from the cut.
    assert ended - back < 35 and ended - cut < 55, (ended - back, ended - cut)
    final = finish(daemon, "blipgone", steps=150)
    assert final["restarts"] == 1, final["story"]
    ended_events = [e for e in events(daemon, "blipgone") if e["kind"] == "job.attempt_ended"]
    message = ended_events[0]["message"]
    assert "node_lost" in message and f"but not {lost}" in message, final["story"]


def test_a_workdir_deleted_mid_run_is_sent_again_before_the_relaunch_and_named(netns_cluster, setup):
    daemon = setup["daemon"]
    submit(daemon, setup["project"], "lostdir")

    def lose_workdir(job: dict) -> None:
        # Held still while its workdir goes (nothing of it writes there meanwhile), then killed: coord
        # relaunches only once the whole workdir is gone.
        group = rank_pid(netns_cluster, job, 1)  # its pid file is in the workdir
        os.killpg(group, signal.SIGSTOP)
        workdir = Path(netns_cluster.node(job["nodes"][1]).workdir)
        for _ in range(50):
            shutil.rmtree(workdir, ignore_errors=True)
            if not workdir.exists():
                break
            time.sleep(0.05)
        assert not workdir.exists(), f"{workdir} could not be removed"
        os.killpg(group, signal.SIGKILL)

    job, _ = at_step(netns_cluster, daemon, "lostdir", 25, lose_workdir)
    final = finish(daemon, "lostdir")
    lost = job["nodes"][1]
    restored = [e for e in events(daemon, "lostdir") if e["kind"] == "job.workdir_restored"]
    assert restored and restored[0]["data"]["node"] == lost, final["story"]
    message, data = restored[0]["message"], restored[0]["data"]
    # model/ and data/ went with the workdir: named as lost files, and as directories it lacked
    assert message.startswith(f"lostdir: {lost}'s workdir lost {data['missing']} files ") and data["missing"] >= 9, \
        message
    assert "lacked or changed" in message and "before the relaunch" in message, message
    assert {"model/config.json", "data/train.jsonl"} <= set(data["paths"]), data
    assert Path(netns_cluster.node(lost).workdir, "model", "config.json").is_file()


def test_a_workdir_that_cannot_be_restored_fails_the_relaunch_with_that_reason_not_the_ranks_error(netns_cluster,
                                                                                                    setup):
    daemon = setup["daemon"]
    submit(daemon, setup["project"], "nodir", "--max-restarts", "5")
    held: dict[str, str] = {}

    def lose_model_for_good(job: dict) -> None:
        node = netns_cluster.node(job["nodes"][1])
        held["workdir"], held["owner"] = node.workdir, node.user
        pid = rank_pid(netns_cluster, job, 1)
        shutil.rmtree(Path(node.workdir) / "model")
        os.chown(node.workdir, 0, 0)  # its user may no longer create anything in it: model/ cannot come back
        os.killpg(pid, signal.SIGKILL)

    job, _ = at_step(netns_cluster, daemon, "nodir", 25, lose_model_for_good)
    try:
        waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), "nodir", env=daemon.env,
                       timeout=600)
    finally:
        shutil.chown(held["workdir"], held["owner"], held["owner"])
    final = json.loads(waited.stdout)
    lost = job["nodes"][1]
    assert final["state"] == "failed", final
    assert f"{lost}'s workdir could not be restored from" in final["error"], final["error"]
    assert "Permission denied" in final["error"] or "permission" in final["error"].lower(), final["error"]
    assert "could not locate" not in final["error"] and "Hub" not in final["error"]
