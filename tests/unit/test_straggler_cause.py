"""A straggler's cause: the node signals' parsers (agent/signal_parsers.py, on fixture files and
synthetic text), the cause they make (coordinator/jobs/straggler_cause.py, pure), and the agent's
sampler (agent/rank_signals.py) on this machine's real processes: a busy process of another pid is
named with its command, and, where the test may make a cgroup, a CPU quota is found and its
throttling measured."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent import rank_signals, signal_parsers
from coordinator.jobs.straggler_cause import cause_kind, straggler_cause

FIXTURES = Path(__file__).parents[1] / "fixtures" / "macos-synthetic"


def signals(**changes):
    base = {"seconds": 1.0, "rank_pids": [100], "cores": 8, "rank_cpu": 1.0, "others": [], "quota": None,
            "speed_limit": None, "memory_pressure": None, "swapins_per_s": None, "gpu_utilization": None}
    return {**base, **changes}


def test_pmset_therm_gives_the_cpu_speed_limit_or_nothing_when_none_was_recorded():
    throttled = signal_parsers.parse_pmset_therm((FIXTURES / "macmini.pmset-g-therm.throttled.txt").read_text())
    assert throttled == {"CPU_Scheduler_Limit": 100, "CPU_Available_CPUs": 10, "CPU_Speed_Limit": 55}
    full = signal_parsers.parse_pmset_therm((FIXTURES / "macstudio.pmset-g-therm.full-speed.txt").read_text())
    assert full["CPU_Speed_Limit"] == 100
    assert signal_parsers.parse_pmset_therm((FIXTURES / "macstudio.pmset-g-therm.none-recorded.txt").read_text()) == {}
    assert signal_parsers.parse_pmset_therm("CPU_Speed_Limit = fast\n") == {}


def test_cgroup_quotas_and_their_throttling_in_both_versions():
    assert signal_parsers.parse_cpu_max("20000 100000\n") == pytest.approx(0.2)
    assert signal_parsers.parse_cpu_max("max 100000") is None
    assert signal_parsers.parse_cpu_max("garbage") is None
    assert signal_parsers.parse_cfs_quota("50000\n", "100000\n") == pytest.approx(0.5)
    assert signal_parsers.parse_cfs_quota("-1", "100000") is None
    v2 = signal_parsers.parse_cpu_stat("usage_usec 10\nnr_periods 5\nnr_throttled 3\nthrottled_usec 4500\n")
    v1 = signal_parsers.parse_cpu_stat("nr_periods 5\nnr_throttled 3\nthrottled_time 4500000\n")
    assert signal_parsers.throttled_usec(v2) == signal_parsers.throttled_usec(v1) == 4500
    assert signal_parsers.throttled_usec({}) is None
    paths = signal_parsers.parse_cgroup_paths("4:memory:/a\n1:cpu,cpuacct:/jobs/x\n0::/user.slice\nbad line\n")
    assert paths == {"memory": "/a", "cpu,cpuacct": "/jobs/x", "": "/user.slice"}


def test_memory_processes_and_gpu_readings():
    assert signal_parsers.parse_psi_some_avg10("some avg10=12.50 avg60=3.00 avg300=1.00 total=5\n"
                                               "full avg10=1.00 avg60=0 avg300=0 total=1\n") == 12.5
    assert signal_parsers.parse_psi_some_avg10("") is None
    assert signal_parsers.parse_vmstat_swapins("pgpgin 5\npswpin 42\npswpout 7\n") == 42
    vm_stat = (FIXTURES / "macstudio.vm_stat.training.txt").read_text()
    assert isinstance(signal_parsers.parse_vmstat_swapins(vm_stat), int)
    top = signal_parsers.parse_ps_top("  812 bob       98,5 /usr/bin/python3 hog.py --spin\n  bad\n"
                                      " 9 root 0.0 launchd\n")
    assert top == [(812, "bob", 98.5, "/usr/bin/python3 hog.py --spin"), (9, "root", 0.0, "launchd")]
    assert signal_parsers.parse_nvidia_utilization("35\n87\n") == 87.0
    # A process's own CPU, not its reaped children's (a shell whose commands end would look busy).
    stat = "4242 (bash (x)) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 9000 3000 20 0 1 0 5 0 0"
    assert signal_parsers.parse_stat_own_ticks(stat) == 300
    assert signal_parsers.parse_stat_own_ticks("garbage") is None
    assert signal_parsers.parse_nvidia_utilization("[N/A]\n") is None


def test_a_quota_that_holds_the_rank_is_its_cause():
    quota = {"source": "cgroup v1", "cores": 0.1, "group": "/sys/fs/cgroup/cpu/slow", "throttled_share": 0.6}
    said = straggler_cause(signals(rank_cpu=0.1, quota=quota))
    assert said.startswith("CPU throttled by a quota: cgroup v1 allows 0.10 CPU (/sys/fs/cgroup/cpu/slow), "
                           "held 60% of the time"), said
    assert "the rank used 0.10 CPU over 1.0 s of wall time" in said
    assert cause_kind(signals(rank_cpu=0.1, quota=quota)) == "quota"
    # A quota the rank is far from, and that never held it, is not the cause.
    loose = {**quota, "cores": 4.0, "throttled_share": 0.0}
    assert cause_kind(signals(quota=loose)) == "unknown"


def test_heat_swap_and_memory_pressure_are_causes():
    assert straggler_cause(signals(speed_limit=55)).startswith("CPU throttled by heat: pmset -g therm "
                                                               "CPU_Speed_Limit 55%")
    assert cause_kind(signals(speed_limit=100)) == "unknown"
    assert straggler_cause(signals(swapins_per_s=900.0)).startswith("swapping: 900 pages swapped in a second")
    assert straggler_cause(signals(memory_pressure=35.0)).startswith("memory pressure")
    assert cause_kind(signals(memory_pressure=2.0, swapins_per_s=0.0)) == "unknown"


def test_a_busy_process_is_named_by_pid_user_and_command_when_the_rank_was_short_of_cpu():
    hog = {"pid": 4242, "user": "bob", "cpu": 0.95, "command": "python3 hog.py"}
    said = straggler_cause(signals(cores=2, rank_cpu=0.5, others=[hog]))
    assert said.startswith("another process takes the CPU: pid 4242 (bob: python3 hog.py) 0.95 CPU"), said
    # On a big machine where the rank had all the CPU it wanted, a busy neighbour is not the cause.
    assert cause_kind(signals(cores=64, rank_cpu=1.0, others=[hog])) == "unknown"


def test_the_link_hook_and_an_unreachable_node():
    assert straggler_cause(signals(), link_cause="its link below baseline: 2.1 of 25 Gbit/s").startswith(
        "its link below baseline")
    assert straggler_cause(None) == "not known: its node could not be asked"
    said = straggler_cause(signals(gpu_utilization=97.0))
    assert said.startswith("no cause seen on its node: the rank used 1.00 CPU") and "GPU 97% busy" in said


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_the_agents_sample_names_a_busy_process_and_leaves_the_rank_out(tmp_path, monkeypatch):
    monkeypatch.setattr(rank_signals, "TOP", 1000)  # a shared machine's other work may be busier than the hog
    rank = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"], start_new_session=True)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass", "straggler-hog-marker"])
    try:
        directory = Path(rank_signals.rank_dir(str(tmp_path), "job", 0, 0))
        directory.mkdir(parents=True)
        (directory / "pid").write_text(str(rank.pid))
        time.sleep(0.3)
        found = rank_signals.rank_signals(str(tmp_path), "job", 0, 0, seconds=1.0)
    finally:
        for process in (rank, hog):
            process.kill()
            process.wait()
    assert found["rank_pids"] == [rank.pid]
    assert found["rank_cpu"] is not None and found["rank_cpu"] < 0.2
    named = {p["pid"]: p for p in found["others"]}
    assert hog.pid in named and "straggler-hog-marker" in named[hog.pid]["command"], found["others"]
    assert rank.pid not in named and named[hog.pid]["cpu"] > 0.05


def _cgroup_v1_cpu() -> Path | None:
    root = Path("/sys/fs/cgroup/cpu")
    return root if os.geteuid() == 0 and (root / "cpu.cfs_quota_us").exists() else None


def _cgroup_v2_cpu() -> Path | None:
    root = Path("/sys/fs/cgroup")
    controllers = root / "cgroup.controllers"
    if os.geteuid() != 0 or not controllers.exists() or "cpu" not in controllers.read_text().split():
        return None
    return root


@pytest.mark.skipif(_cgroup_v1_cpu() is None and _cgroup_v2_cpu() is None,
                    reason="needs root and a cgroup CPU controller")
def test_the_agents_sample_finds_a_cpu_quota_and_its_throttling(tmp_path):
    v2 = _cgroup_v2_cpu()
    group = (v2 or _cgroup_v1_cpu()) / f"coord-test-{os.getpid()}"
    group.mkdir()
    rank = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        if v2 is not None:
            (group / "cpu.max").write_text("10000 100000")
        else:
            (group / "cpu.cfs_period_us").write_text("100000")
            (group / "cpu.cfs_quota_us").write_text("10000")
        (group / "cgroup.procs").write_text(str(rank.pid))
        directory = Path(rank_signals.rank_dir(str(tmp_path), "job", 0, 0))
        directory.mkdir(parents=True)
        (directory / "pid").write_text(str(rank.pid))
        found = rank_signals.rank_signals(str(tmp_path), "job", 0, 0, seconds=1.0)
    finally:
        rank.kill()
        rank.wait()
        time.sleep(0.1)
        group.rmdir()
    quota = found["quota"]
    assert quota is not None and quota["cores"] == pytest.approx(0.1) and quota["group"] == str(group), found
    assert quota["throttled_share"] is not None and quota["throttled_share"] > 0.3, found
    assert found["rank_cpu"] is not None and found["rank_cpu"] < 0.2, found
    assert straggler_cause(found).startswith("CPU throttled by a quota"), straggler_cause(found)


def test_a_link_coord_doctor_found_wrong_is_the_cause_when_the_node_shows_none():
    from coordinator.jobs.straggler_cause import link_findings

    last = {("n1", "n2"): {"verdict": "ok"},
            ("n2", "n3"): {"verdict": "slow", "cause": "940 Mbit/s against a baseline of 9.4 Gbit/s"},
            ("n3", "n1"): {"verdict": "wrong-route", "cause": "n3 reaches n1's address over en0, not en2"}}
    assert link_findings(last, "n1") == ["its link n3 - n1 was wrong-route when coord doctor last measured it "
                                         "(n3 reaches n1's address over en0, not en2)"]
    assert link_findings(last, "n2") == ["its link n2 - n3 was slow when coord doctor last measured it "
                                         "(940 Mbit/s against a baseline of 9.4 Gbit/s)"]
    assert link_findings({("n1", "n2"): {"verdict": "ok"}}, "n1") == []
    assert link_findings({}, "n1") == []
