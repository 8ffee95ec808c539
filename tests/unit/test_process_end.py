"""The agent learns that a process it did not start has ended from the kernel, not by looking."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

from agent import process_end, ranks, server
from tests.integration.daemon_harness import REPO


def _orphan(seconds: float) -> int:
    """A process that is not ours: started by a shell that exits at once (as a rank's runner is
    started by mlx.launch, not by the agent)."""
    out = subprocess.run(["sh", "-c", f"sleep {seconds} >/dev/null 2>&1 & echo $!"], capture_output=True, text=True,
                         check=True)
    return int(out.stdout)


def test_the_end_of_a_process_that_is_not_ours_is_seen_at_once():
    pid = _orphan(0.5)
    started = time.monotonic()
    assert asyncio.run(process_end.wait_exit(pid, 10)) is True
    assert 0.3 < time.monotonic() - started < 3


def test_a_process_that_goes_on_runs_out_the_time_and_one_already_gone_has_ended():
    pid = _orphan(30)
    try:
        started = time.monotonic()
        assert asyncio.run(process_end.wait_exit(pid, 0.3)) is False
        assert time.monotonic() - started < 2
    finally:
        os.kill(pid, 9)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert asyncio.run(process_end.wait_exit(pid, 5)) is True


def test_a_held_status_request_answers_when_its_rank_ends_without_looking_ten_times_a_second(tmp_path, monkeypatch):
    rank_dir = ranks.rank_dir(str(tmp_path), "held", 0, 0)
    subprocess.Popen(["sh", "-c", f'"{sys.executable}" -m agent.rank_runner --dir "{rank_dir}" --keep-output -- '
                      f'"{sys.executable}" -c "import time; time.sleep(2.5)" >/dev/null 2>&1 &'],
                     cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}).wait()
    deadline = time.monotonic() + 30
    while ranks.runner_pid(str(tmp_path), "held", 0, 0) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    looks = []
    real = ranks.rank_ended
    monkeypatch.setattr(ranks, "rank_ended", lambda *args: looks.append(1) or real(*args))
    started = time.monotonic()
    status = asyncio.run(server.rank_status(str(tmp_path), "held", 0, 0, wait_s=8.0))
    waited = time.monotonic() - started
    assert status["state"] == "exited" and status["exit"] == 0, status
    assert waited < 5, waited  # answered when the rank ended (about 2.5 s), not after the 8 s asked
    assert len(looks) <= 6, len(looks)  # a look a second at most, where polling took 25
