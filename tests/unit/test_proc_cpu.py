"""The CPU time of a rank's processes (agent/proc_cpu.py): /proc and ps output parsed, and real
processes measured."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from agent import proc_cpu


def test_proc_stat_gives_user_system_and_the_ended_childrens_ticks():
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime ...
    line = "4242 (py (thon) x) R 1 4242 4242 0 -1 4194304 900 0 0 0 150 30 700 20 20 0 3 0 100"
    assert proc_cpu.parse_stat_ticks(line) == 150 + 30 + 700 + 20
    assert proc_cpu.parse_stat_ticks("4242 (x) R 1 4242") is None
    assert proc_cpu.parse_stat_ticks("4242 (x) R 1 4242 4242 0 -1 0 0 0 0 0 a b c d") is None
    assert proc_cpu.parse_stat_ticks("") is None


@pytest.mark.parametrize(("text", "seconds"), [
    ("0:00.03", 0.03),  # macOS: minutes:seconds.hundredths
    ("75:03.12", 75 * 60 + 3.12),  # macOS writes minutes past 59
    ("00:01:15", 75.0),  # procps: hh:mm:ss
    ("2-01:00:00", 2 * 86400 + 3600.0),  # days
    ("1:02,50", 62.5),  # a decimal comma
])
def test_ps_cpu_times_are_read_in_every_form_ps_writes_them(text, seconds):
    assert proc_cpu.parse_cputime(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "12", "a:b", "1:2:3:4", "x-1:00", "-"])
def test_a_cpu_time_that_does_not_parse_is_none(text):
    assert proc_cpu.parse_cputime(text) is None


def test_ps_lines_that_do_not_parse_are_left_out():
    assert proc_cpu.parse_ps_times("  501   0:01.50\n  502 1:00:00\njunk\n  503\n 504 ?\n") == {501: 1.5, 502: 3600.0}


def _busy_then_sleeping() -> subprocess.Popen:
    """A process that burns a second of CPU in a child that ends (a compiler, say), then sleeps."""
    script = ("import subprocess, sys, time\n"
              "subprocess.run([sys.executable, '-c', 'import time\\nt = time.process_time()\\n"
              "while time.process_time() - t < 1.0: pass'])\n"
              "print('done', flush=True)\ntime.sleep(60)\n")
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)


def test_the_time_of_a_child_that_ended_counts_and_a_sleeping_process_adds_none():
    proc = _busy_then_sleeping()
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "done"
        first = proc_cpu.cpu_seconds([proc.pid])
        assert first is not None and first >= 1.0  # the child's second, passed to its parent when it was reaped
        time.sleep(1.5)
        later = proc_cpu.cpu_seconds([proc.pid])
        assert later is not None and later - first < 0.05  # asleep
    finally:
        proc.kill()
        proc.wait()
    assert proc_cpu.cpu_seconds([proc.pid]) is None  # gone
    assert proc_cpu.cpu_seconds([]) is None


def test_without_proc_the_time_is_read_from_ps(monkeypatch):
    """macOS has no /proc: ps says the same. (procps here writes whole seconds, and leaves out the
    time of ended children that macOS's ps -S adds: the process burns its second itself.)"""
    script = ("import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass\n"
              "print('done', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "done"
        from_proc = proc_cpu.cpu_seconds([proc.pid])
        real_isdir = os.path.isdir
        monkeypatch.setattr(proc_cpu.os.path, "isdir", lambda path: False if path == "/proc/self" else real_isdir(path))
        from_ps = proc_cpu.cpu_seconds([proc.pid, 999_999_999])  # one gone: the other still counts
        assert from_proc is not None and from_ps is not None and abs(from_ps - from_proc) < 1.0
        assert from_ps >= 1.0
        assert proc_cpu.cpu_seconds([999_999_999]) is None
    finally:
        proc.kill()
        proc.wait()
