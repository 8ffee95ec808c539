"""Metrics on a local cluster: a real daemon and a real MLX job (two ranks) whose rank 1 is killed.
The history continues one curve across the restart, /metrics answers with the job's metrics (read
with prometheus_client's own parser), the history survives a daemon restart, and the TensorBoard
files read back with the resumed attempt's purge."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import urllib.request

import pytest

from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir

SCRIPT = '''\
import argparse, json, os, time
import mlx.core as mx

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--sleep", type=float, default=0.2)
parser.add_argument("--nan-from", type=int, help="the loss (a NaN) and every value after it, from this step")
args = parser.parse_args()
group = mx.distributed.init()
rank = int(os.environ["COORD_RANK"])
offset = int(os.environ.get("COORD_STEP_OFFSET", "0"))
save_every = int(os.environ["COORD_SAVE_EVERY"])
w = mx.zeros(4)
if os.environ.get("COORD_RESUME_FILE"):
    w = mx.load(os.environ["COORD_RESUME_FILE"])["w"]
ballast = mx.ones((256, 1024))  # a few MiB, so each rank has memory to report
for local in range(1, args.steps - offset + 1):
    step = offset + local
    w = w + mx.distributed.all_sum(mx.ones(4), group=group)
    mx.eval(w, ballast)
    time.sleep(args.sleep)
    if rank == 0:
        loss = float("nan") if args.nan_from and step >= args.nan_from else 4.0 / step
        records = [{"kind": "train", "step": step, "loss": loss, "learning_rate": 1e-3 * (1 - step / 100),
                    "tokens_per_second": 1000.0 + step, "peak_memory_gb": 0.001, "time": time.time()}]
        if step % 10 == 0:
            records.append({"kind": "val", "step": step, "val_loss": 5.0 / step, "time": time.time()})
        with open(os.environ["COORD_PROGRESS_FILE"], "a") as handle:
            handle.write("".join(json.dumps(r) + "\\n" for r in records))
        if local % save_every == 0:
            os.makedirs(os.environ["COORD_CHECKPOINT_DIR"], exist_ok=True)
            mx.save_safetensors(os.path.join(os.environ["COORD_CHECKPOINT_DIR"], f"{local:07d}_adapters.safetensors"),
                                {"w": w})
'''

CLUSTER = """\
[cluster]
name = "metrics-local"
state_dir = "{root}/state"

[ssh]
keepalive_s = 0.5

[dashboard]
listen = "127.0.0.1:0"

[[nodes]]
name = "a"
host = "local"
workdir = "{root}/a"

[[nodes]]
name = "b"
host = "local"
workdir = "{root}/b"
"""


@pytest.fixture
def cluster():
    root = short_tempdir()
    (root / "project").mkdir()
    (root / "project" / "train.py").write_text(SCRIPT)
    config = root / "cluster.toml"
    config.write_text(CLUSTER.format(root=root))
    daemon = DaemonProcess(config, env=environment()).start()
    daemon.wait_for(all_up, 30, "all nodes up")
    yield daemon, root
    daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


def job_of(doc, name):
    return next(j for j in doc["jobs"] if j["name"] == name)


def history(daemon, *args) -> dict:
    result = coord("status", "--json", "--history", *args, "--config", str(daemon.config), env=daemon.env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def scrape(doc) -> dict:
    """/metrics, parsed by prometheus_client: {(name, labels...): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(doc["dashboard"]["metrics"], timeout=10) as answer:
        assert answer.headers["Content-Type"].startswith("text/plain; version=")
        text = answer.read().decode()
    return {(sample.name, *sorted(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_a_restarted_run_has_one_curve_metrics_and_tensorboard_files_across_a_daemon_restart(cluster):
    daemon, root = cluster
    submitted = coord("run", "--config", str(daemon.config), "--name", "curve", "--source", str(root / "project"),
                      "--save-every", "10", "--total-steps", "40", "--detach", "--", "python", "train.py",
                      "--steps", "40", env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr
    doc = daemon.wait_for(lambda d: job_of(d, "curve")["step"] >= 14 or job_of(d, "curve")["state"] == "failed",
                          300, "step 14")
    job = job_of(doc, "curve")
    assert job["state"] == "running", job
    assert doc["dashboard"]["url"].startswith("http://127.0.0.1:") and doc["dashboard"]["error"] is None

    running = scrape(doc)  # while it runs: each rank's memory, on its node
    ranks = {(labels[1][1], labels[2][1]): value for (name, *labels), value in running.items()
             if name == "coord_rank_memory_bytes" and dict(labels)["job"] == "curve"}
    assert set(ranks) == {("a", "0"), ("b", "1")} or set(ranks) == {("b", "0"), ("a", "1")}, running
    assert all(value > 1 << 20 for value in ranks.values())

    before = history(daemon)["history"]["runs"][0]["train"]
    reached = max(before["step"])
    assert reached >= 14 and set(before["attempt"]) == {0}
    # Killed a few steps past a checkpoint, read from rank 0's own progress file (the daemon reads
    # it every couple of seconds): attempt 0 then reached past the step it resumes from.
    progress = root / job["nodes"][0] / ".coord" / "jobs" / job["run_id"] / "attempt-0" / "rank-0" / "progress.jsonl"
    reached = _last_step(progress)
    while not 3 <= reached % 10 <= 6:
        time.sleep(0.02)
        reached = _last_step(progress)
    pid = int((root / job["nodes"][1] / ".coord" / "jobs" / job["run_id"] / "attempt-0" / "rank-1" / "pid").read_text())
    os.kill(pid, signal.SIGKILL)
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), "curve", env=daemon.env, timeout=300)
    final = json.loads(waited.stdout)
    assert waited.returncode == 0 and final["state"] == "succeeded" and final["restarts"] == 1, final

    doc = history(daemon)
    run = next(r for r in doc["history"]["runs"] if r["run_id"] == job["run_id"])
    train = run["train"]
    resumed = run["attempts"][1]
    start = resumed["start_step"]
    assert [a["attempt"] for a in run["attempts"]] == [0, 1] and 0 < start < reached
    assert "rank_failed" in resumed["detail"]
    # one curve: every step once, attempt 0's up to the resume step, attempt 1's after it
    assert train["step"] == list(range(1, 41))
    assert train["attempt"] == [0] * start + [1] * (40 - start)
    assert train["loss"] == pytest.approx([4.0 / s for s in range(1, 41)])
    assert train["learning_rate"][0] == pytest.approx(1e-3 * 0.99)
    assert train["peak_memory_bytes"][-1] == 1_000_000
    assert set(train["rank_memory_bytes"]) == {"0", "1"}
    assert sum(v is not None for v in train["rank_memory_bytes"]["1"]) >= 10
    assert run["val"]["step"] == [10, 20, 30, 40] and run["val"]["loss"][-1] == pytest.approx(5.0 / 40)
    nodes = {n["name"]: n for n in doc["history"]["nodes"]}
    assert set(nodes) == {"a", "b"} and all(n["memory_used_bytes"] and n["memory_used_bytes"][-1] > 0
                                           for n in nodes.values())
    assert nodes["a"]["sources"]["memory"].startswith("/proc/meminfo")

    metrics = scrape(doc)
    assert metrics[("coord_job_step", ("job", "curve"))] == 40
    assert metrics[("coord_job_restarts_total", ("job", "curve"))] == 1
    assert metrics[("coord_job_loss", ("job", "curve"))] == pytest.approx(0.1)
    assert metrics[("coord_job_tokens_per_second", ("job", "curve"))] == 1040
    assert metrics[("coord_job_validation_loss", ("job", "curve"))] == pytest.approx(5.0 / 40)
    assert 0 <= metrics[("coord_checkpoint_age_seconds", ("job", "curve"))] < 120
    assert metrics[("coord_node_up", ("node", "a"))] == metrics[("coord_node_up", ("node", "b"))] == 1
    assert metrics[("coord_recovery_seconds_count",)] == 1
    assert 0 < metrics[("coord_recovery_seconds_sum",)] < 120
    assert metrics[("coord_info", ("cluster", "metrics-local"), ("version", doc["daemon"]["version"]))] == 1
    assert metrics[("coord_job_info", ("job", "curve"), ("run_id", job["run_id"]), ("state", "succeeded"))] == 1

    # the history, and the recovery histogram, survive a daemon restart
    daemon.stop()
    daemon.start()
    daemon.wait_for(all_up, 30, "all nodes up again")
    again = history(daemon, "--run", "curve")["history"]["runs"]
    assert [r["run_id"] for r in again] == [job["run_id"]]
    assert again[0]["train"] == train and again[0]["attempts"] == run["attempts"]
    text = coord("status", "--history", "--config", str(daemon.config), env=daemon.env)
    assert text.returncode == 0, text.stderr
    assert f"curve ({job['run_id']}): 40 points, steps 1-40" in text.stdout
    assert f"restart: attempt 1 from step {start}" in text.stdout
    assert "dashboard http://127.0.0.1:" in text.stdout
    assert scrape(daemon.status())[("coord_recovery_seconds_count",)] == 1

    # TensorBoard: one file per attempt; the resumed one starts with the purge at start + 1
    from tests.unit.test_metrics_history import read_events

    files = sorted((root / "state" / "jobs" / job["run_id"] / "tensorboard").iterdir())
    assert len(files) == 2
    first, second = (read_events(f) for f in files)
    assert second[1].session_log.status == 1 and second[1].step == start + 1
    losses = {}
    for events in (first, second):  # what TensorBoard shows: the second file replaces steps past the purge
        if events is second:
            losses = {s: v for s, v in losses.items() if s <= start}
        losses.update({e.step: v.simple_value for e in events for v in e.summary.value if v.tag == "train/loss"})
    assert sorted(losses) == list(range(1, 41))
    assert max(e.step for e in first if e.summary.value) >= reached - 1  # the failed attempt wrote past the resume
    assert [losses[s] for s in range(1, 41)] == pytest.approx([4.0 / s for s in range(1, 41)])


def _last_step(progress) -> int:
    steps = [json.loads(line)["step"] for line in progress.read_text().splitlines()
             if '"kind": "train"' in line.replace('"kind":"train"', '"kind": "train"') and line.endswith("}")]
    return max(steps, default=0)


def test_a_nan_loss_is_nan_in_status_json_the_dashboard_the_history_and_metrics(cluster):
    # The loss turns NaN at step 6 and --on-divergence stop ends the run failed there: every view shows
    # the NaN as what it is (JSON as the word "nan"), never the last finite loss (0.8 at step 5).
    import math

    daemon, root = cluster
    submitted = coord("run", "--config", str(daemon.config), "--name", "nan", "--source", str(root / "project"),
                      "--save-every", "5", "--total-steps", "40", "--on-divergence", "stop", "--detach", "--",
                      "python", "train.py", "--steps", "40", "--sleep", "0.1", "--nan-from", "6", env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), "nan", env=daemon.env, timeout=300)
    final = json.loads(waited.stdout)  # strict JSON: json.loads would take a bare NaN, so the type tells
    assert final["state"] == "failed" and final["loss"] == "nan" and "loss is nan at step 6" in final["error"], final
    shown = coord("status", "--config", str(daemon.config), env=daemon.env).stdout
    assert "nan: failed" in shown and "loss nan" in shown, shown
    doc = history(daemon, "--run", final["run_id"])
    losses = doc["history"]["runs"][0]["train"]["loss"]
    assert losses[:5] == pytest.approx([4.0 / s for s in range(1, 6)]) and losses[5] == "nan"
    dashboard = doc["dashboard"]["url"].split("?")[0].rstrip("/")
    with urllib.request.urlopen(f"{dashboard}/api/dashboard", timeout=10) as answer:
        page = json.loads(answer.read(), parse_constant=lambda word: pytest.fail(f"bare {word} in the JSON"))
    assert job_of(page, "nan")["loss"] == "nan"
    assert math.isnan(scrape(doc)[("coord_job_loss", ("job", "nan"))])
