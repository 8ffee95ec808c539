"""coord drill's pure figures (coordinator/observe/drill_report.py) and the agent's two drill calls
(agent/drill.py) on real processes and directories."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from agent.drill import remove_run, signal_rank
from coordinator.observe.drill_report import drill_figures, fault_figures, step_seconds, table
from shared.rpc import RemoteError

RUN = "drill-1a2b3c4d-00ff00ff"


def event(ts, kind, message="", **data):
    return {"ts": ts, "kind": f"job.{kind}", "message": f"drill: {message}", "data": {"run": RUN, **data}}


EVENTS = [
    event(100.0, "submitted"),
    event(100.1, "launched", attempt=0, start_step=0),
    event(106.4, "first_step", attempt=0, step=1),
    event(110.0, "drill_fault", fault="kill"),
    event(110.2, "attempt_ended", "attempt 0: rank_failed: rank 1 on b exited with status 137 (SIGKILL)",
          outcome="rank_failed", attempt=0, step=47),
    event(110.5, "launched", attempt=1, start_step=40),
    event(121.0, "first_step", attempt=1, step=41),
    event(125.0, "drill_fault", fault="stop"),
    event(132.0, "attempt_ended", "attempt 1: hung: a rank's process is stopped", outcome="hung", attempt=1,
          step=63),
    event(132.4, "launched", attempt=2, start_step=60),
    event(148.0, "first_step", attempt=2, step=61),
]
KILL = {"fault": "kill", "rank": 1, "node": "b", "time": 110.0, "step": 45}
STOP = {"fault": "stop", "rank": 0, "node": "a", "time": 125.0, "step": 63}


def test_each_fault_is_timed_from_its_signal_to_its_end_and_to_the_next_attempts_first_step():
    kill = fault_figures(KILL, EVENTS)
    assert kill == {"fault": "kill", "signal": "SIGKILL", "rank": 1, "node": "b", "at_step": 47,
                    "detected_seconds": 0.2, "resumed_seconds": 11.0, "steps_lost": 7,
                    "how": "rank_failed: rank 1 on b exited with status 137 (SIGKILL)"}
    stop = fault_figures(STOP, EVENTS)
    assert (stop["detected_seconds"], stop["resumed_seconds"], stop["steps_lost"]) == (7.0, 23.0, 3)


def test_a_fault_never_seen_to_end_or_resume_says_so_rather_than_a_number():
    never = fault_figures({**STOP, "time": 200.0}, EVENTS)
    assert never["detected_seconds"] is None and never["resumed_seconds"] is None and never["steps_lost"] is None
    assert never["how"] == "the attempt never ended"
    # Ended, but the run never trained again (it failed, or the drill stopped it first).
    cut = fault_figures(STOP, EVENTS[:9])
    assert cut["detected_seconds"] == 7.0 and cut["resumed_seconds"] is None and cut["steps_lost"] is None


def test_the_step_time_is_the_slope_of_the_steps_seen_and_needs_two_steps_of_them():
    assert step_seconds([(0.0, 10), (0.5, 10), (1.0, 20), (3.0, 40)]) == pytest.approx(0.1)
    # The ranks loading (step 0 for 25 s) is not training: the slope starts where the steps move.
    assert step_seconds([(0.0, 0), (25.0, 0), (26.0, 30), (27.0, 40), (29.0, 60)]) == pytest.approx(0.1)
    assert step_seconds([(0.0, 10), (1.0, 11)]) is None
    assert step_seconds([]) is None


def test_the_whole_report_and_its_table():
    figures = drill_figures([KILL, STOP], EVENTS, [(0.0, 0), (0.5, 5), (1.0, 15), (3.0, 35)])
    assert figures["cold_launch_seconds"] == 6.4 and figures["step_seconds"] == 0.1
    lines = table(figures)
    assert lines[0].split() == ["fault", "rank", "(node)", "at", "step", "detected", "after", "first", "step",
                                "again", "after", "steps", "lost"]
    assert lines[1].split() == ["SIGKILL", "1", "(b)", "47", "0.2", "s", "11.0", "s", "7"]
    assert lines[-2:] == ["step time 0.100 s", "cold launch (submitted to first step) 6.4 s"]


def _rank(tmp_path, job=RUN, attempt=0, rank=0):
    """A real process in a group of its own, recorded as a rank's is (its pid file)."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    directory = tmp_path / ".coord" / "jobs" / job / f"attempt-{attempt}" / f"rank-{rank}"
    directory.mkdir(parents=True)
    (directory / "pid").write_text(str(proc.pid))
    return proc


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process state from /proc")
def test_signal_rank_stops_then_kills_the_ranks_group(tmp_path):
    proc = _rank(tmp_path)
    try:
        answer = signal_rank(str(tmp_path), RUN, 0, 0, "stop")
        assert answer["pid"] == proc.pid and abs(answer["time"] - time.time()) < 5
        deadline = time.monotonic() + 5
        stat = Path(f"/proc/{proc.pid}/stat")
        while stat.read_text().split()[2] != "T" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stat.read_text().split()[2] == "T"
        signal_rank(str(tmp_path), RUN, 0, 0, "kill")
        assert proc.wait(5) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()


def test_signal_rank_refuses_a_fault_it_does_not_know_and_a_rank_that_is_not_running(tmp_path):
    with pytest.raises(RemoteError, match="fault must be one of kill, stop"):
        signal_rank(str(tmp_path), RUN, 0, 0, "term")
    with pytest.raises(RemoteError, match="not running here"):
        signal_rank(str(tmp_path), RUN, 0, 1, "kill")


def test_remove_run_takes_the_runs_files_and_the_drills_tree_and_nothing_else(tmp_path):
    _rank(tmp_path).kill()
    (tmp_path / "checkpoints" / RUN / "attempt-0").mkdir(parents=True)
    (tmp_path / "checkpoints" / RUN / "attempt-0" / "0000010_adapters.safetensors").write_bytes(b"x")
    (tmp_path / "checkpoints" / "other-run").mkdir()  # another run's: kept, and so is checkpoints/
    (tmp_path / "coord-drill-1a2b3c4d" / "model").mkdir(parents=True)
    (tmp_path / "model").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    answer = remove_run(str(tmp_path), RUN, "coord-drill-1a2b3c4d")
    assert sorted(answer["removed"]) == sorted([f".coord/jobs/{RUN}", f"checkpoints/{RUN}", "coord-drill-1a2b3c4d"])
    assert sorted(os.listdir(tmp_path)) == [".coord", "checkpoints", "model", "notes.txt"]
    assert os.listdir(tmp_path / "checkpoints") == ["other-run"]
    assert not (tmp_path / ".coord" / "jobs").exists()  # empty once the run went
    assert remove_run(str(tmp_path), RUN)["removed"] == []  # a second time: nothing left to remove


@pytest.mark.parametrize("tree", ["model", "coord-drill-", "coord-drill-../x", "../coord-drill-1a2b3c4d",
                                  "coord-drill-1a2b3c4d/../../etc"])
def test_remove_run_refuses_a_tree_that_is_not_a_drills(tmp_path, tree):
    with pytest.raises(RemoteError, match="not a drill's directory"):
        remove_run(str(tmp_path), RUN, tree)


@pytest.mark.parametrize("job", ["../x", "", "a/b"])
def test_remove_run_refuses_a_run_id_that_is_not_one(tmp_path, job):
    with pytest.raises(RemoteError, match="bad job"):
        remove_run(str(tmp_path), job)


def test_cut_link_refuses_a_time_out_of_range_and_an_address_no_interface_holds():
    from agent.drill import cut_link

    with pytest.raises(RemoteError, match="seconds must be from 1 to 600"):
        cut_link("192.0.2.77", 0.5)
    # TEST-NET-1: held by no interface here, so nothing is asked of sudo and nothing goes down.
    with pytest.raises(RemoteError, match="no interface of this node holds 192.0.2.77"):
        cut_link("192.0.2.77", 5)
