"""The pure parts of bench/suite_cost.py: the kernel's acct_v3 records read, named and grouped (the
bench itself switches process accounting on, which takes root and a whole run of the suite)."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path

PATH = Path(__file__).resolve().parents[2] / "bench" / "suite_cost.py"
spec = importlib.util.spec_from_file_location("suite_cost", PATH)
assert spec is not None and spec.loader is not None
bench = importlib.util.module_from_spec(spec)
sys.modules["suite_cost"] = bench
spec.loader.exec_module(bench)


def _record(pid: int, start: int, utime: int, stime: int, comm: bytes, elapsed: float = 100.0) -> bytes:
    # linux/acct.h struct acct_v3: flag, version 3, tty, exitcode, uid, gid, pid, ppid, btime, etime,
    # then eight comp_t (utime, stime, mem, io, rw, minflt, majflt, swaps) and comm[16]
    return struct.pack("<BBHIIIIIIf8H16s", 0, 3, 0, 0, 0, 0, pid, 1, start, elapsed, utime, stime,
                       0, 0, 0, 0, 0, 0, comm)


def test_comp_t_is_a_13_bit_mantissa_with_a_base_8_exponent():
    assert bench._comp_t(287) == 287
    assert bench._comp_t((2 << 13) | 100) == 100 * 64  # exponent 2: times 8 squared


def test_records_are_read_in_seconds_with_their_pid_start_and_name(tmp_path):
    (tmp_path / "pacct").write_bytes(_record(41, 1_000, 287, 25, b"python") + _record(42, 1_005, 3, 0, b"cc1plus"))
    first, second = bench.read_acct(tmp_path / "pacct")
    assert first == {"pid": 41, "start": 1_000, "elapsed_s": 1.0, "cpu_s": 3.12, "comm": "python"}
    assert second["comm"] == "cc1plus" and second["cpu_s"] == 0.03


def test_records_are_named_across_the_two_clocks_and_grouped(tmp_path):
    # the sampler's clock runs 31 s ahead of the kernel's record (a VM paused since boot); pid 7 was
    # used twice, and pid 9 lived too briefly to be sampled
    (tmp_path / "pacct").write_bytes(b"".join([
        _record(5, 1_000, 5_000, 0, b"python"), _record(6, 1_010, 700, 0, b"python"),
        _record(7, 1_020, 300, 0, b"python"), _record(7, 1_400, 100, 0, b"python"),
        _record(9, 1_030, 150, 0, b"cc1plus")]))
    names = [(5, 1_031, "/v/bin/python -m tests.simulation.batch --first 0"),
             (6, 1_041, "/v/bin/python -m agent.train --model m"),
             (7, 1_051, "/v/bin/python -m coordinator.cli.main daemon --config c.toml"),
             (7, 1_431, "/v/bin/python -u ddp.py --steps 4")]
    (tmp_path / "names.tsv").write_text("".join(f"{p}\t{s}\t{json.dumps(c)}\n" for p, s, c in names))
    (tmp_path / "run.json").write_text(json.dumps({"pytest_exit": 0, "wall_s": 60, "machine_cpu_s": 70, "cores": 2}))
    result = bench.group(tmp_path)
    by = {c["category"].split(" ")[0]: c["cpu_s"] for c in result["categories"]}
    assert by == {"fault-schedule": 50, "MLX": 7, "coordd": 3, "PyTorch:": 1, "C++": 1.5}
    assert result["tests_cpu_s"] == 12 and result["least_wall_s"] == 6  # the batch is on idle cycles
    assert "no split of the work on 2 cores takes less than 6 s" in bench.render(result)
