"""Which files of a sync go through the relay: the large ones, once per file for every node lacking it."""

from __future__ import annotations

from coordinator.readiness.relay_sync import RELAY_MIN_BYTES, take_large_files
from coordinator.readiness.push import plan_sync


def test_large_files_leave_the_plans_and_are_wanted_once_by_every_node_lacking_them():
    big, small = RELAY_MIN_BYTES, RELAY_MIN_BYTES - 1
    source = {"model/w.safetensors": [big, 0o644, "a" * 64], "data/train.jsonl": [big * 2, 0o644, "b" * 64],
              "train.py": [small, 0o755, "c" * 64]}
    plans = {"n1": plan_sync(source, {}, delete=False),
             "n2": plan_sync(source, {"model/w.safetensors": [big, 0o644, "a" * 64]}, delete=False)}
    wanted = take_large_files(source, plans)
    assert wanted == {"model/w.safetensors": ["n1"], "data/train.jsonl": ["n1", "n2"]}
    assert plans["n1"].send == ["train.py"] and plans["n1"].bytes_to_send == small
    assert plans["n2"].send == ["train.py"] and plans["n2"].bytes_to_send == small
