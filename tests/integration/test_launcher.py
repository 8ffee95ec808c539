"""coord's launcher is mlx.launch's own main(): the ranks start, talk and print as under mlx.launch."""

from __future__ import annotations

import subprocess
import sys

from coordinator.launch.mlx_launch import launcher_argv

RANK = ("import mlx.core as mx; g = mx.distributed.init(); "
        "print('rank', g.rank(), 'of', g.size(), 'sum', mx.distributed.all_sum(mx.ones(1) * (g.rank() + 1)).item(),"
        " flush=True)")


def test_the_daemon_uses_its_own_python_to_run_mlx_launchs_main():
    assert launcher_argv() == (sys.executable, "-m", "coordinator.launch.mlx_launch")


def test_two_ring_ranks_start_all_reduce_and_both_outputs_come_back():
    result = subprocess.run([*launcher_argv(), "--backend", "ring", "-n", "2", "--", sys.executable, "-c", RANK],
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0 of 2 sum 3.0" in result.stdout and "rank 1 of 2 sum 3.0" in result.stdout, result.stdout


def test_a_failing_rank_is_reported_as_mlx_launch_reports_it():
    failing = "import mlx.core as mx, sys; g = mx.distributed.init(); sys.exit(3 if g.rank() == 1 else 0)"
    result = subprocess.run([*launcher_argv(), "--backend", "ring", "-n", "2", "--", sys.executable, "-c", failing],
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert "rank 1 exited with code 3" in result.stdout + result.stderr
