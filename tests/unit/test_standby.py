"""Warm launchers (agent.standby, agent.standby_runner, agent.preload), with real processes: a rank whose
launcher is ``python -m MODULE`` leaves a standby that imported the module; the job's next rank on the
node runs in it, exactly as a cold start would run it; a standby that does not fit, is stale, or does
not take its go in time is never used, and none is left behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent import launch, ranks, standby
from tests.processes import running_under

# The launcher stands for torchrun: its import is slow and says so, its run prints what it was given.
LAUNCHER = """\
import json, os, sys, time
time.sleep(float(os.environ.get("IMPORT_S", "0")))
print("imported in", os.getpid(), flush=True)
def main():
    time.sleep(float(os.environ.get("PROGRESS_AFTER_S", "0")))
    with open(os.environ["COORD_PROGRESS_FILE"], "a") as progress:
        progress.write('{"kind": "train", "step": 1}\\n')
    print("ran", json.dumps({"args": sys.argv[1:], "cwd": os.getcwd(), "x": os.environ.get("X"),
                             "attempt": os.environ.get("COORD_ATTEMPT"), "tmpdir": os.environ.get("TMPDIR"),
                             "gone": os.environ.get("ONLY_FIRST"), "name": __name__, "pid": os.getpid()}), flush=True)
    time.sleep(float(sys.argv[1]))
    sys.exit(int(sys.argv[2]))
if __name__ == "__main__":
    main()
"""


@pytest.fixture
def node(tmp_path, monkeypatch):
    monkeypatch.setattr(standby, "IDLE_CORES", -1e9)  # whatever the load of the machine running the tests
    home = tmp_path / "home"
    work = tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / "fakelaunch.py").write_text(LAUNCHER)
    monkeypatch.setenv("HOME", str(home))
    yield work
    for pid in _standby_processes(tmp_path):
        with contextlib.suppress(ProcessLookupError):  # it ended between the listing and now
            os.kill(pid, signal.SIGKILL)


def _standby_processes(root: Path) -> list[int]:
    names = (b"agent.standby_runner", b"agent.preload", b"fakelaunch")
    return [p.pid for p in running_under(root) if any(name in p.words for name in names)]


def _start(work: Path, attempt: int, *, sleep: str = "0.2", code: str = "3", env: dict | None = None,
           module: str = "fakelaunch") -> dict:
    base = {"COORD_ATTEMPT": str(attempt), "X": f"x{attempt}", "COORD_PROGRESS_FILE": "{rank_dir}/progress.jsonl"}
    launch.prepare_rank("job-0a1b2c3d", 0, str(work), sys.executable, ["python", "-m", module, sleep, code],
                        {**base, **(env or {})}, attempt=attempt, pass_output=False)
    return launch.start_rank(str(work), "job-0a1b2c3d", attempt, 0, standby=True)


def _ended(work: Path, attempt: int, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while not ranks.rank_ended(str(work), "job-0a1b2c3d", attempt, 0):
        assert time.monotonic() < deadline, f"attempt {attempt} did not end"
        time.sleep(0.05)
    return ranks.rank_status(str(work), "job-0a1b2c3d", attempt, 0, log_offset=0)


def _ran(status: dict) -> list[dict]:
    lines = status["log"].decode().splitlines()
    return [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("ran ")]


def _ready(timeout: float = 30) -> Path:
    jobs = Path(os.environ["HOME"]) / ".coord" / "jobs" / "job-0a1b2c3d"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [d for d in jobs.glob("standby-*") if (d / "ready").exists() and (d / "open").exists()]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError("no standby became ready")


def test_the_next_rank_runs_in_the_standby_exactly_as_a_cold_start_runs_it(node):
    first = _start(node, 0, env={"ONLY_FIRST": "yes"})
    assert first["warm"] is False
    cold = _ended(node, 0)
    _ready()
    second = _start(node, 1)
    assert second["warm"] is True
    warm = _ended(node, 1)
    assert cold["exit"] == warm["exit"] == 3
    (ran_cold,), (ran_warm,) = _ran(cold), _ran(warm)
    assert ran_warm["pid"] == warm["pid"]  # the rank's recorded process is the one that ran it
    for record in (ran_cold, ran_warm):
        record.pop("pid")
    # Same arguments, directory, environment and name as python -m gives; the first attempt's own
    # variables are not the second's.
    assert ran_cold == {**ran_warm, "x": "x0", "attempt": "0", "gone": "yes"}
    assert ran_warm["x"] == "x1" and ran_warm["gone"] is None and ran_warm["name"] == "__main__"
    assert ran_warm["cwd"] == str(node) and ran_warm["tmpdir"] == str(node / ".coord" / "tmp")
    assert b"imported in" in warm["log"]  # what the import printed before the go is the rank's output


def test_a_standby_that_does_not_fit_is_retired_and_the_rank_starts_cold(node):
    _start(node, 0)
    _ended(node, 0)
    old = _ready()
    second = _start(node, 1, env={"PYTHONHASHSEED": "7"})  # an interpreter setting its import did not see
    assert second["warm"] is False
    assert _ran(_ended(node, 1))[0]["x"] == "x1"
    deadline = time.monotonic() + 10
    while old.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not old.exists()


def test_a_stale_import_is_not_run_and_the_rank_starts_cold(node):
    _start(node, 0)
    _ended(node, 0)
    _ready()
    (node / "fakelaunch.py").write_text(LAUNCHER.replace('print("ran"', 'print("new"); print("ran"'))  # reinstalled
    second = _start(node, 1)
    assert second["warm"] is False
    status = _ended(node, 1)
    assert b"new\n" in status["log"] and len(_ran(status)) == 1


def test_a_claim_not_taken_in_time_ends_the_standby_and_runs_the_rank_once(node, monkeypatch):
    _start(node, 0)
    _ended(node, 0)
    directory = _ready()
    runner, child = (int(w) for w in (directory / "standby.pid").read_text().split())
    os.kill(runner, signal.SIGSTOP)  # it cannot take its go
    monkeypatch.setattr(standby, "HANDOVER_READY_S", 1.0)
    second = _start(node, 1)
    assert second["warm"] is False
    status = _ended(node, 1)
    assert len(_ran(status)) == 1
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in (runner, child)):
        assert time.monotonic() < deadline, "the standby that missed its go is still there"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def test_a_warm_rank_is_stopped_whole_and_retired_standbys_leave_nothing(node, tmp_path):
    _start(node, 0)
    _ended(node, 0)
    _ready()
    assert _start(node, 1, sleep="600")["warm"] is True
    _ready()  # the one beside the warm rank
    stopped = ranks.stop_rank(str(node), "job-0a1b2c3d", 1, 0, grace=2)
    assert stopped["stopped"], stopped
    assert _ended(node, 1)["exit"] == 128 + signal.SIGTERM
    assert launch.retire_standbys(str(tmp_path), "job-0a1b2c3d") == {"retired": 0}  # another node's workdir
    assert launch.retire_standbys(str(node), "job-0a1b2c3d") == {"retired": 1}
    deadline = time.monotonic() + 10
    while _standby_processes(tmp_path):
        assert time.monotonic() < deadline, f"left: {_standby_processes(tmp_path)}"
        time.sleep(0.05)
    assert not list((Path(os.environ["HOME"]) / ".coord" / "jobs" / "job-0a1b2c3d").glob("standby-*"))


def test_the_import_waits_until_the_rank_trains(node):
    """A launch's own imports come first: the standby's child starts once its rank reports progress."""
    _start(node, 0, sleep="600", env={"PROGRESS_AFTER_S": "3"})
    jobs = Path(os.environ["HOME"]) / ".coord" / "jobs" / "job-0a1b2c3d"
    deadline = time.monotonic() + 10
    while not list(jobs.glob("standby-*/standby.pid")):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (pid_file,) = jobs.glob("standby-*/standby.pid")
    time.sleep(1.0)
    assert pid_file.read_text().split()[1] == "0"  # no child yet: the rank has not reported a step
    _ready()
    ranks.stop_rank(str(node), "job-0a1b2c3d", 0, 0, grace=2)


def test_beside_ranks_that_use_every_core_the_import_waits_for_the_relaunch(node, monkeypatch):
    """Where the node has no core to spare (its ranks train on its CPUs), the import starts only once
    the relaunch claims the standby."""
    monkeypatch.setattr(standby, "IDLE_CORES", 1e9)
    _start(node, 0, sleep="3")
    jobs = Path(os.environ["HOME"]) / ".coord" / "jobs" / "job-0a1b2c3d"
    time.sleep(1.5)  # the rank has reported its progress
    (pid_file,) = jobs.glob("standby-*/standby.pid")
    assert pid_file.read_text().split()[1] == "0"
    _ended(node, 0)
    time.sleep(1.0)
    assert pid_file.read_text().split()[1] == "0"  # a job that ended here costs no import
    assert _start(node, 1)["warm"] is True  # claimed: it imports now, whatever the load, and runs the rank
    assert _ran(_ended(node, 1))[0]["x"] == "x1"


def test_a_standby_goes_by_itself_once_its_rank_has_been_gone_a_while(node, tmp_path):
    sleeper = subprocess.Popen(["sleep", "1"])
    directory = tmp_path / "home" / "sb"
    directory.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(launch.bundle_root()))}
    proc = subprocess.Popen([sys.executable, "-m", "agent.standby_runner", "--dir", str(directory), "--module",
                             "fakelaunch", "--watch", str(sleeper.pid), "--linger", "1"], cwd=node, env=env)
    sleeper.wait()
    assert proc.wait(timeout=30) == 0
    assert not directory.exists() and not _standby_processes(tmp_path)


def test_only_a_python_module_launcher_gets_a_standby():
    assert standby.launcher_module(["/py", "-m", "torch.distributed.run", "x.py"], "/py") == \
        ("torch.distributed.run", ["x.py"])
    assert standby.launcher_module(["/py", "train.py"], "/py") is None
    assert standby.launcher_module(["/other/py", "-m", "m"], "/py") is None
    env = standby.launcher_env({"PATH": "/bin", "PYTHONPATH": "/user"}, tmpdir="/t", root="/coord",
                               env={"A": "1"})
    assert env == {"PATH": "/bin", "PYTHONPATH": "/coord:/user", "TMPDIR": "/t", "A": "1"}
