"""The rank runner and the agent's rank methods, on real processes."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time

import pytest

from agent import proc_state, ranks
from tests.integration.daemon_harness import REPO


def _runner(tmp_path, job: str, command: list[str], *options: str) -> subprocess.Popen:
    rank_dir = ranks.rank_dir(str(tmp_path), job, 0, 0)
    return subprocess.Popen([sys.executable, "-m", "agent.rank_runner", "--dir", rank_dir, *options, "--", *command],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize("keep", [False, True])
def test_a_rank_that_exits_leaves_its_status_and_output(tmp_path, keep):
    options = ["--keep-output"] if keep else []
    proc = _runner(tmp_path, "j1", [sys.executable, "-c", "print('hello from rank'); raise SystemExit(3)"], *options)
    assert proc.wait(30) == 3
    said = proc.stdout.read()
    if keep:  # coord's own launch: the output stays on the node (the agent reads it), mlx.launch is told where
        assert b"hello from rank" not in said and b"output.log" in said
    else:  # a launch the user watches: the output is passed on
        assert b"hello from rank" in said
    status = ranks.rank_status(str(tmp_path), "j1", 0, 0)
    assert status["state"] == "exited" and status["exit"] == 3
    assert b"hello from rank" in ranks.read_log(str(tmp_path), "j1", 0, 0)["data"]


def _rank_with_a_child(tmp_path, job: str) -> tuple[subprocess.Popen, int]:
    """A running rank that started a child of its own; returns its runner and its process group."""
    script = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
              "print('ready', flush=True); time.sleep(600)")
    proc = _runner(tmp_path, job, [sys.executable, "-c", script])
    deadline = time.monotonic() + 30
    while ranks.rank_status(str(tmp_path), job, 0, 0)["state"] != "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    pgid = ranks._read_int(os.path.join(ranks.rank_dir(str(tmp_path), job, 0, 0), "pid"))
    while len(ranks._rank_members(pgid, None)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc, pgid


def test_stop_rank_kills_the_whole_process_group_even_when_stopped(tmp_path):
    proc, pgid = _rank_with_a_child(tmp_path, "j2")
    os.killpg(pgid, 19)  # SIGSTOP: a hung rank
    result = ranks.stop_rank(str(tmp_path), "j2", 0, 0, grace=1.0)
    assert result["stopped"] and result["left"] == []
    assert ranks._rank_members(pgid, None) == []
    proc.wait(10)


def test_progress_lines_are_read_incrementally(tmp_path):
    directory = ranks.rank_dir(str(tmp_path), "j3", 0, 0)
    os.makedirs(directory)
    path = os.path.join(directory, "progress.jsonl")
    with open(path, "w") as handle:
        handle.write(json.dumps({"kind": "train", "step": 1}) + "\n" + '{"kind": "train", "st')
    status = ranks.rank_status(str(tmp_path), "j3", 0, 0)
    assert [r["step"] for r in status["progress"]] == [1]  # the half-written line waits
    with open(path, "a") as handle:
        handle.write('ep": 2}\n')
    again = ranks.rank_status(str(tmp_path), "j3", 0, 0, progress_offset=status["progress_offset"])
    assert [r["step"] for r in again["progress"]] == [2]


def test_only_the_newest_heartbeat_of_a_read_is_sent(tmp_path):
    directory = ranks.rank_dir(str(tmp_path), "j5", 0, 0)
    os.makedirs(directory)
    lines = [{"kind": "heartbeat", "phase": "loading", "time": 1.0}, {"kind": "train", "step": 1},
             {"kind": "heartbeat", "phase": "training", "time": 2.0, "step": 1},
             {"kind": "heartbeat", "phase": "training", "time": 3.0, "step": 2}]
    with open(os.path.join(directory, "progress.jsonl"), "w") as handle:
        handle.write("".join(json.dumps(line) + "\n" for line in lines))
    status = ranks.rank_status(str(tmp_path), "j5", 0, 0)
    assert status["progress"] == [lines[1], lines[3]]


def test_the_compute_times_of_heartbeats_not_sent_go_with_the_newest(tmp_path):
    """A checkpoint every few steps: the beat at the change of phase carries the steps' compute time,
    and the next, at once, carries none. The one sent carries the mean over every step of the read."""
    from agent.heartbeat import Heartbeat

    directory = ranks.rank_dir(str(tmp_path), "j8", 0, 0)
    os.makedirs(directory)
    beat = Heartbeat(os.path.join(directory, "progress.jsonl"), every=3600)
    beat.phase("training")
    steps = iter(range(1, 100))
    for seconds in (0.1, 0.3):  # two steps, then a save: its beats
        beat.step(next(steps), compute_s=seconds)
    with beat.during("saving"):
        pass
    beat.step(next(steps), compute_s=0.5)
    beat.beat()
    beat.step(next(steps), compute_s=0.7)
    with beat.during("saving"):
        pass
    status = ranks.rank_status(str(tmp_path), "j8", 0, 0)
    [sent] = status["progress"]
    assert sent["phase"] == "training" and sent["step"] == 4, sent
    assert sent["compute_steps"] == 4 and sent["compute_s"] == pytest.approx(0.4), sent
    # The next read holds only what came after: nothing counted twice.
    beat.step(next(steps), compute_s=0.2)
    beat.beat()
    [later] = ranks.rank_status(str(tmp_path), "j8", 0, 0, progress_offset=status["progress_offset"])["progress"]
    assert later["compute_steps"] == 1 and later["compute_s"] == pytest.approx(0.2), later


def test_a_heartbeats_compute_time_the_head_would_refuse_adds_nothing_to_the_mean(tmp_path):
    directory = ranks.rank_dir(str(tmp_path), "j9", 0, 0)
    os.makedirs(directory)
    lines = [{"kind": "heartbeat", "phase": "training", "time": 1.0, "compute_s": 0.2, "compute_steps": 2},
             {"kind": "heartbeat", "phase": "training", "time": 2.0, "compute_s": 1e999, "compute_steps": 1},
             {"kind": "heartbeat", "phase": "training", "time": 3.0, "compute_s": 9.0},  # no count
             {"kind": "heartbeat", "phase": "training", "time": 4.0, "compute_s": -1.0, "compute_steps": 1},
             {"kind": "heartbeat", "phase": "training", "time": 5.0, "compute_s": 0.5, "compute_steps": 1}]
    with open(os.path.join(directory, "progress.jsonl"), "w") as handle:
        handle.write("".join(json.dumps(line).replace("Infinity", "1e999") + "\n" for line in lines))
    [sent] = ranks.rank_status(str(tmp_path), "j9", 0, 0)["progress"]
    assert sent["time"] == 5.0 and sent["compute_steps"] == 3 and sent["compute_s"] == pytest.approx(0.3), sent


def test_a_stopped_rank_says_so_and_one_left_after_sigkill_is_named_with_its_state(tmp_path, monkeypatch):
    proc, pgid = _rank_with_a_child(tmp_path, "j6")
    assert ranks.rank_status(str(tmp_path), "j6", 0, 0)["process"] == "running"
    os.killpg(pgid, 19)  # SIGSTOP
    deadline = time.monotonic() + 10
    while ranks.rank_status(str(tmp_path), "j6", 0, 0).get("process") != "stopped" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ranks.rank_status(str(tmp_path), "j6", 0, 0)["process"] == "stopped"
    # A process that outlives SIGKILL (in the kernel, state D) cannot be made here: the group
    # is seen left over, as it would be, and named with its state.
    real_members = ranks._rank_members
    monkeypatch.setattr(ranks, "_rank_members",
                        lambda group, runner: [pgid] if group == pgid else real_members(group, runner))
    monkeypatch.setattr(ranks.proc_state, "process_state", lambda pid: "D")
    result = ranks.stop_rank(str(tmp_path), "j6", 0, 0, grace=0.2)
    assert not result["stopped"] and result["states"][0] == "D" and "(state D)" in result["detail"]
    monkeypatch.undo()
    assert ranks.stop_rank(str(tmp_path), "j6", 0, 0, grace=1.0)["stopped"]
    proc.wait(10)


def _safetensors(path, *, truncate: int = 0):
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    data = struct.pack("<Q", len(header)) + header + b"\0" * 8
    path.write_bytes(data[:len(data) - truncate])


def test_checkpoints_are_validated_and_a_truncated_one_is_refused(tmp_path):
    directory = tmp_path / "checkpoints" / "j4" / "attempt-0"
    directory.mkdir(parents=True)
    _safetensors(directory / "0000010_adapters.safetensors")
    _safetensors(directory / "0000020_adapters.safetensors", truncate=4)
    (directory / "0000030_adapters.safetensors").write_bytes(b"garbage")
    (directory / "adapters.safetensors").write_bytes(b"ignored")
    found = {c["iteration"]: c for c in ranks.list_checkpoints(str(tmp_path), "j4", 0)["checkpoints"]}
    assert sorted(found) == [10, 20, 30]
    assert found[10]["valid"] and found[10]["sha256"]
    assert not found[20]["valid"] and "bytes" in found[20]["detail"]
    assert not found[30]["valid"]


def test_the_checkpoints_mark_changes_with_every_write_and_only_then(tmp_path):
    mark = lambda: ranks.checkpoints_mark(str(tmp_path), "j6", 0)  # noqa: E731
    assert mark() == "none"  # nothing written yet
    directory = tmp_path / "checkpoints" / "j6" / "attempt-0"
    directory.mkdir(parents=True)
    empty = mark()
    assert empty not in ("", "none") and mark() == empty
    seen = {empty}
    (directory / "0000010_adapters.safetensors").write_bytes(b"a" * 10)
    seen.add(mark())
    with open(directory / "0000010_adapters.safetensors", "ab") as grow:  # a write under way
        grow.write(b"b")
    seen.add(mark())
    part = directory / "0000020" / "pytorch_model_fsdp_0"
    part.mkdir(parents=True)
    seen.add(mark())
    (part / "shard.distcp").write_bytes(b"x")  # deep in a checkpoint directory
    seen.add(mark())
    stamp = os.stat(part / "shard.distcp").st_mtime_ns
    (part / "shard.distcp").write_bytes(b"y")  # rewritten in place, the same size
    os.utime(part / "shard.distcp", ns=(stamp + 1000, stamp + 1000))
    seen.add(mark())
    assert len(seen) == 6 and mark() == mark()
    (directory / "0000010_adapters.safetensors").unlink()  # retention
    assert mark() not in seen


def test_without_proc_the_rank_is_stopped_and_confirmed_through_ps(tmp_path, monkeypatch):
    """macOS has no /proc: the rank's processes are read from ps, and stopped as they are with /proc."""
    proc, pgid = _rank_with_a_child(tmp_path, "j5")
    members = ranks._rank_members(pgid, None)
    real_listdir = os.listdir

    def listdir_without_proc(path="."):
        if str(path) == "/proc":
            raise FileNotFoundError(path)
        return real_listdir(path)

    monkeypatch.setattr(ranks.proc_state.os, "listdir", listdir_without_proc)
    assert sorted(ranks._rank_members(pgid, None)) == sorted(members)  # the same, read from ps
    result = ranks.stop_rank(str(tmp_path), "j5", 0, 0, grace=1.0)
    assert result["stopped"] and result["left"] == []
    monkeypatch.setattr(ranks.proc_state.os, "listdir", real_listdir)
    for pid in members:  # the rank and the child it started, both gone
        assert not proc_state.alive(pid)
    proc.wait(10)


def test_a_running_rank_reports_its_memory_and_an_exited_one_when_it_ended(tmp_path):
    proc = _runner(tmp_path, "j6", [sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(2)"])
    deadline = time.monotonic() + 30
    status = ranks.rank_status(str(tmp_path), "j6", 0, 0)
    while not (status["rss_bytes"] or 0) > 64 << 20 and time.monotonic() < deadline:
        time.sleep(0.05)
        status = ranks.rank_status(str(tmp_path), "j6", 0, 0)
    assert status["state"] == "running" and status["rss_bytes"] > 64 << 20
    assert proc.wait(30) == 0
    ended = time.time()
    status = ranks.rank_status(str(tmp_path), "j6", 0, 0)
    assert status["state"] == "exited" and status["rss_bytes"] is None
    assert ended - 5 < status["exited_at"] <= status["time"]


def test_preparing_a_rank_clears_what_an_earlier_run_left_in_its_directory(tmp_path, monkeypatch):
    from agent.launch import prepare_rank

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    stale = ranks.rank_dir(str(tmp_path), "tiny-0a1b2c3d", 0, 0)
    os.makedirs(stale)
    for name, text in (("progress.jsonl", '{"kind": "train", "step": 5}\n'), ("exit", "0\n"), ("pid", "99999\n")):
        with open(os.path.join(stale, name), "w") as handle:
            handle.write(text)
    prepare_rank("tiny-0a1b2c3d", 0, str(tmp_path), sys.executable, ["python", "train.py"], {}, attempt=0)
    assert os.listdir(stale) == []
    status = ranks.rank_status(str(tmp_path), "tiny-0a1b2c3d", 0, 0)
    assert status["state"] == "starting" and status["progress"] == [] and status["exit"] is None


def test_a_run_id_is_a_valid_job_key_on_a_node_and_a_path_is_not():
    from coordinator.jobs.core import new_run_id

    run_id = new_run_id("x" * 64)
    assert ranks.rank_dir("/w", run_id, 0, 0).endswith(f"/.coord/jobs/{run_id}/attempt-0/rank-0")
    for bad in ("../etc", "a/b", "", ".hidden"):
        try:
            ranks.rank_dir("/w", bad, 0, 0)
        except Exception as exc:  # noqa: BLE001
            assert "bad job" in str(exc)
        else:
            raise AssertionError(f"{bad!r} was accepted")


@pytest.mark.parametrize("pass_output", [True, False])
def test_a_prepared_rank_passes_its_output_on_only_when_asked(tmp_path, monkeypatch, pass_output):
    """coord's own launches keep the output on the node (read through the agent); a launch the
    user runs with `coord prepare` shows it in mlx.launch's output."""
    from agent.launch import prepare_rank

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    reply = prepare_rank("out-0a1b2c3d", 0, str(tmp_path), sys.executable,
                         ["python", "-c", "print('step 1 loss 2.5')"], {}, attempt=0, pass_output=pass_output)
    shown = subprocess.run([reply["script"]], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "HOME": str(tmp_path / "home")})
    assert shown.returncode == 0, shown.stderr
    assert ("step 1 loss 2.5" in shown.stdout) == pass_output, shown.stdout
    assert b"step 1 loss 2.5" in ranks.read_log(str(tmp_path), "out-0a1b2c3d", 0, 0)["data"]


def test_a_running_rank_reports_the_cpu_time_of_its_whole_process_tree(tmp_path):
    """The hang watch tells a rank that works from one that is stuck by this (before its first step):
    a worker in a session of its own (as torchrun starts them) counts, and a sleeping rank adds nothing."""
    worker = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass\ntime.sleep(600)\n"
    script = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {worker!r}], "
              "start_new_session=True); time.sleep(600)")
    proc = _runner(tmp_path, "j7", [sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        status = ranks.rank_status(str(tmp_path), "j7", 0, 0)
        while (status.get("cpu_s") or 0.0) < 1.0 and time.monotonic() < deadline:
            time.sleep(0.1)
            status = ranks.rank_status(str(tmp_path), "j7", 0, 0)
        assert status["state"] == "running" and (status.get("cpu_s") or 0.0) >= 1.0, status
        time.sleep(1.0)  # the worker is asleep by now (its last tenth of a second aside): nothing more is used
        status = ranks.rank_status(str(tmp_path), "j7", 0, 0)
        time.sleep(1.0)
        later = ranks.rank_status(str(tmp_path), "j7", 0, 0)
        assert later["cpu_s"] is not None and later["cpu_s"] - status["cpu_s"] < 0.05, (status, later)
    finally:
        assert ranks.stop_rank(str(tmp_path), "j7", 0, 0, grace=1.0)["stopped"]
        proc.wait(10)
    assert "cpu_s" not in ranks.rank_status(str(tmp_path), "j7", 0, 0)  # ended: not measured
