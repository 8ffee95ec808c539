"""The pure parts of bench/hang_recovery.py (the bench itself runs on the multi-host cluster)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "bench" / "hang_recovery.py"
spec = importlib.util.spec_from_file_location("hang_recovery", PATH)
assert spec is not None and spec.loader is not None
bench = importlib.util.module_from_spec(spec)
sys.modules["hang_recovery"] = bench  # its dataclass looks its module up
spec.loader.exec_module(bench)


def test_train_records_skip_what_is_not_a_whole_train_record():
    text = "\n".join([json.dumps({"kind": "heartbeat", "phase": "training", "time": 1.0}),
                      json.dumps({"kind": "train", "step": 1, "time": 10.0}),
                      json.dumps({"kind": "train", "step": 2, "time": 10.5}),
                      '{"kind": "train", "step": 3, "ti'])
    assert [r["step"] for r in bench.train_records(text)] == [1, 2]


def test_the_step_time_is_the_median_per_step_and_a_record_is_found_by_its_step():
    records = [{"step": 1, "time": 0.0}, {"step": 2, "time": 0.5}, {"step": 4, "time": 1.5}, {"step": 5, "time": 9.0}]
    assert bench.step_seconds(records) == 0.5
    assert bench.step_seconds(records[:1]) is None
    assert bench.record_time(records, 4) == 1.5 and bench.record_time(records, 3) is None


def test_the_goal_is_twenty_seconds_or_five_steps_plus_a_recovery():
    assert bench.goal_s(0.1, 6.0) == 26.0
    assert bench.goal_s(10.0, 6.0) == 56.0


def test_the_table_sets_each_hang_beside_the_plain_recovery_and_its_goal():
    measures = [bench.Measure("kill", 2, 0.1, 0.3, 6.0), bench.Measure("stop", 2, 0.1, 5.5, 12.0, "rank 1 on b"),
                bench.Measure("collective", 2, 0.1, 18.0, 30.0), bench.Measure("stop", 3, 0.1, 5.0, 11.0)]
    lines = bench.table(measures).splitlines()
    assert lines[2].startswith("| 2 | SIGKILL (the plain recovery) | 0.100 | 0.30 | 6.00 |")
    assert lines[3] == "| 2 | SIGSTOP of one rank | 0.100 | 5.50 | 12.00 | 26.00 | yes | rank 1 on b |"
    assert "| 30.00 | 26.00 | no |" in lines[4]
    assert lines[5].endswith("| - | - | - |")  # no plain recovery measured at 3 nodes: no goal


def test_the_bench_runs_each_scenario():
    assert bench.SCENARIOS == ("kill", "stop", "collective") and bench.HANG_AFTER < bench.ITERS
    argv, sys.argv = sys.argv, ["hang_recovery.py", "--nodes", "5"]  # refused before any cluster is made
    try:
        with pytest.raises(SystemExit):
            bench.main()
    finally:
        sys.argv = argv
