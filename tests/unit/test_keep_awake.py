"""Keeping a Mac awake while its rank runs: the caffeinate decision, and the rank runner's use of
it with a stand-in ``caffeinate`` (this is Linux; the stand-in lives in these unit tests only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from agent import keep_awake, ranks
from tests.integration.daemon_harness import REPO


def test_only_a_mac_with_caffeinate_holds_an_assertion_tied_to_the_rank():
    assert keep_awake.keep_awake_argv("darwin", "/usr/bin/caffeinate", 4242) == [
        "/usr/bin/caffeinate", "-i", "-s", "-w", "4242"]
    assert keep_awake.keep_awake_argv("darwin", None, 4242) is None  # no caffeinate on this Mac
    assert keep_awake.keep_awake_argv("linux", "/usr/bin/caffeinate", 4242) is None


def stand_in_caffeinate(tmp_path: Path) -> tuple[str, Path]:
    """An executable that records how it was called, then, like ``caffeinate -w PID``, waits for
    PID to exit (a zombie has exited) and says so."""
    record = tmp_path / "caffeinate.json"
    script = tmp_path / "caffeinate"
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""\
        import json, os, sys, time
        record = {str(record)!r}
        pid = int(sys.argv[-1])
        with open(record + ".tmp", "w") as handle:
            json.dump({{"argv": sys.argv[1:], "pid": os.getpid(), "pgid": os.getpgrp()}}, handle)
        os.replace(record + ".tmp", record)
        def exited():
            try:
                with open(f"/proc/{{pid}}/stat") as handle:
                    return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                return True
        while not exited():
            time.sleep(0.02)
        with open(record + ".released", "w") as handle:
            handle.write("watched process exited")
        """))
    script.chmod(0o755)
    return str(script), record


def read_record(record: Path, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while not record.exists():
        assert time.monotonic() < deadline, f"the stand-in caffeinate never ran ({record})"
        time.sleep(0.02)
    return json.loads(record.read_text())


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_on_linux_nothing_is_started_even_where_a_caffeinate_exists(tmp_path):
    caffeinate, record = stand_in_caffeinate(tmp_path)
    assert keep_awake.hold_awake(os.getpid(), caffeinate=caffeinate) is None
    assert keep_awake.hold_awake(os.getpid(), platform="darwin", caffeinate=str(tmp_path / "missing")) is None
    time.sleep(0.2)
    assert not record.exists()


def test_the_assertion_watches_the_rank_and_ends_when_the_rank_exits(tmp_path):
    caffeinate, record = stand_in_caffeinate(tmp_path)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    holder = keep_awake.hold_awake(rank.pid, platform="darwin", caffeinate=caffeinate)
    try:
        assert read_record(record)["argv"] == ["-i", "-s", "-w", str(rank.pid)]
        time.sleep(0.2)
        assert holder.poll() is None  # held while the rank lives
        rank.kill()
        rank.wait()
        assert holder.wait(10) == 0  # and let go by itself once it is gone
        assert Path(f"{record}.released").exists()
    finally:
        rank.kill()
        keep_awake.release(holder)


def start_runner(tmp_path: Path, caffeinate: str, job: str, command: list[str]) -> subprocess.Popen:
    """The real rank runner, told it is on a Mac whose caffeinate is the stand-in."""
    bootstrap = ("import sys; from agent import keep_awake, rank_runner; keep_awake.PLATFORM = 'darwin'; "
                 "keep_awake.CAFFEINATE = sys.argv[1]; sys.exit(rank_runner.main(sys.argv[2:]))")
    rank_dir = ranks.rank_dir(str(tmp_path), job, 0, 0)
    return subprocess.Popen([sys.executable, "-c", bootstrap, caffeinate, "--dir", rank_dir, "--", *command],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_rank_kept_awake_keeps_its_pid_exit_status_and_memory_reading(tmp_path):
    caffeinate, record = stand_in_caffeinate(tmp_path)
    rank = "import time; b = bytearray(64 << 20); print('hello', flush=True); time.sleep(1.5); raise SystemExit(3)"
    proc = start_runner(tmp_path, caffeinate, "awake1", [sys.executable, "-c", rank])
    called = read_record(record)
    status = ranks.rank_status(str(tmp_path), "awake1", 0, 0)
    deadline = time.monotonic() + 30
    while not (status["rss_bytes"] or 0) > 64 << 20 and time.monotonic() < deadline:
        time.sleep(0.05)
        status = ranks.rank_status(str(tmp_path), "awake1", 0, 0)
    # caffeinate watches the rank itself: the pid (process group) coord kills and measures.
    assert called["argv"] == ["-i", "-s", "-w", str(status["pid"])]
    assert status["state"] == "running" and status["rss_bytes"] > 64 << 20
    assert called["pgid"] != status["pid"]  # outside the rank's process group
    assert proc.wait(30) == 3
    assert b"hello" in ranks.read_log(str(tmp_path), "awake1", 0, 0)["data"]
    status = ranks.rank_status(str(tmp_path), "awake1", 0, 0)
    assert status["state"] == "exited" and status["exit"] == 3
    assert gone(called["pid"])  # the runner reaped it: no caffeinate left behind


def test_stopping_a_rank_kept_awake_stops_its_group_and_records_its_exit(tmp_path):
    caffeinate, record = stand_in_caffeinate(tmp_path)
    proc = start_runner(tmp_path, caffeinate, "awake2", [sys.executable, "-c", "import time; time.sleep(600)"])
    called = read_record(record)
    result = ranks.stop_rank(str(tmp_path), "awake2", 0, 0, grace=2.0)
    assert result["stopped"] and result["left"] == []
    assert proc.wait(10) == 128 + 15  # SIGTERM, as without caffeinate
    assert ranks.rank_status(str(tmp_path), "awake2", 0, 0)["exit"] == 128 + 15
    assert gone(called["pid"])
