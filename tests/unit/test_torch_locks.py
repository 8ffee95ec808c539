"""Stale locks of torch's extension builds (agent/torch_locks.py): a lock left by a killed process
goes before a rank starts; one a live build holds open, or one just made, stays."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from agent.torch_locks import MIN_AGE_S, clear_stale_locks, extension_roots

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd") and sys.platform != "darwin",
                                reason="reads open files from /proc or lsof")

# A process that takes the lock as torch's FileBaton does (O_CREAT | O_EXCL, held open) and waits.
HOLDER = """\
import os, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)
print("held", flush=True)
time.sleep(60)
"""


def _lock(root, name, age_s):
    directory = root / "py311_cpu" / name
    directory.mkdir(parents=True)
    path = directory / "lock"
    path.touch()
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_only_an_old_lock_no_process_holds_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale = _lock(tmp_path, "deepspeed_shm_comm", MIN_AGE_S + 30)
    young = _lock(tmp_path, "fused_adam", 1)
    held_dir = tmp_path / "py311_cpu" / "cpu_adam"
    held_dir.mkdir()
    held = held_dir / "lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(held)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        os.utime(held, (time.time() - 600, time.time() - 600))  # a long build, still going
        assert str(tmp_path) in extension_roots()
        assert clear_stale_locks() == [os.path.realpath(stale)]
        assert not stale.exists() and young.exists() and held.exists()
    finally:
        holder.kill()
        holder.wait()
    assert clear_stale_locks(now=time.time() + 600) == sorted([os.path.realpath(young), os.path.realpath(held)])


def test_nothing_to_do_without_an_extensions_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "absent"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert extension_roots() == []
    assert clear_stale_locks() == []
