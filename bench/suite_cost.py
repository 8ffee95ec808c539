"""Where the test suite's CPU goes: every process it starts, its CPU from the kernel's own accounting.

    sudo .venv/bin/python bench/suite_cost.py                       # the whole suite, as CI runs it
    sudo .venv/bin/python bench/suite_cost.py -- tests/unit -q      # any pytest arguments
    sudo .venv/bin/python bench/suite_cost.py --json -- tests/integration/test_demo.py

The suite is timed against a goal in minutes on 2 cores, and no share of it can be cut without knowing
which processes cost what. A profiler sees one process; ``ps`` misses the thousands that live a few
seconds. BSD process accounting (``acct(2)``, Linux's ``CONFIG_BSD_PROCESS_ACCT``) writes one record for
every process that exits, with its user and system CPU; a sampler reads ``/proc`` every 0.3 s for each
new process's command line, so that a record (pid, start second) is named by what it ran. Processes are
grouped by what they are (``CATEGORIES``); what matches none is "other", with its largest commands listed.

It prints the wall time, the machine's CPU (``/proc/stat``) and the table, and what the figures bound:
the tests' own CPU (all of it but the fault-schedule batch, which runs at the lowest priority on idle
cycles) over the machine's cores is the least wall time any split of the work could reach.

Needs root (``acct(2)`` takes CAP_SYS_PACCT) and Linux."""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: (category, pattern over the command line), the first that matches wins.
CATEGORIES: list[tuple[str, str]] = [
    ("fault-schedule batch (lowest priority, idle cycles)", r"tests\.simulation\.batch"),
    ("MLX ranks, mlx.launch and calibration",
     r"agent\.train\b|agent\.mlx_lm_train|mlx\.launch|mlx_launch|agent\.calibrate|busy_first_step"),
    ("MLX's CPU kernels compiled by ranks (c++)", r"/\.coord/tmp/mlx/|cc1plus.*mlx/include"),
    ("PyTorch: workers, torchrun/Accelerate/DeepSpeed, standbys, facts",
     r"torch|ddp\.py|acc\.py|ds_train|hf\.py|accelerate|deepspeed|agent\.preload|straggler_hog"
     r"|^\S+ -c import json, sys"),
    ("pytest workers (unit tests, in-process daemons)", r"pytest|exec\(eval\(sys\.stdin"),
    ("coordd", r"cli\.main daemon|coordd"),
    ("agents", r"-m agent\s*$"),
    ("coord commands", r"cli\.main|/coord "),
    ("rank wrappers, standbys, ssh, sshd", r"agent\.rank_runner|agent\.standby_runner|^ssh |^sshd"),
    ("programs of the command launcher's tests", r"plain\.py|sockets\.py|slow\.py|jaxprog\.py|tfprog\.py"),
]

_ACCT_V3 = struct.Struct("<BBHIIIIIIf8H16s")  # linux/acct.h: struct acct_v3, 64 bytes
_AHZ = 100  # ticks per second of ac_utime and ac_stime


def _comp_t(value: int) -> int:
    """A ``comp_t`` (13-bit mantissa, 3-bit base-8 exponent) as an integer."""
    return (value & 0x1FFF) << (3 * ((value >> 13) & 0x7))


def read_acct(path: Path) -> list[dict]:
    """Every record of an acct_v3 file: pid, start (epoch seconds), CPU seconds, comm."""
    data = path.read_bytes()
    records = []
    for offset in range(0, len(data) - _ACCT_V3.size + 1, _ACCT_V3.size):
        (_flag, version, _tty, _exit, _uid, _gid, pid, _ppid, btime, _etime, utime, stime,
         *_rest, comm) = _ACCT_V3.unpack_from(data, offset)
        if version & 0x0F != 3:
            raise SystemExit(f"{path}: not an acct_v3 record at byte {offset} (version {version})")
        records.append({"pid": pid, "start": btime, "cpu_s": (_comp_t(utime) + _comp_t(stime)) / _AHZ,
                        "comm": comm.split(b"\0", 1)[0].decode(errors="replace")})
    return records


class Sampler(threading.Thread):
    """Each new process's command line, by (pid, start second since the epoch)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.seen: dict[tuple[int, int], str] = {}
        self.stopping = threading.Event()
        boot = next(line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime"))
        self.boot = int(boot.split()[1])
        self.hz = os.sysconf("SC_CLK_TCK")

    def run(self) -> None:
        while not self.stopping.wait(0.3):
            for entry in os.scandir("/proc"):
                if not entry.name.isdigit():
                    continue
                try:
                    cmdline = Path(entry.path, "cmdline").read_bytes()
                    stat = Path(entry.path, "stat").read_text()
                except OSError:
                    continue  # gone already, or a kernel thread
                if not cmdline:
                    continue
                start = self.boot + int(stat.rsplit(")", 1)[1].split()[19]) // self.hz
                key = (int(entry.name), start)
                if key not in self.seen:
                    self.seen[key] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()[:300]


def _named(record: dict, seen: dict[tuple[int, int], str]) -> str:
    for skew in (0, -1, 1, -2, 2):  # the two clocks round a start to the second apart
        command = seen.get((record["pid"], record["start"] + skew))
        if command is not None:
            return command
    return f"[{record['comm']}]"  # lived less than a sample: its name in the kernel's record


def _short(command: str) -> str:
    command = re.sub(r"\S*/(?=[^/\s]+)", "", command)  # paths to their last part
    return re.sub(r"\d+", "N", command)[:80]


def _machine_cpu_s() -> float:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")  # user nice system irq softirq


def measure(pytest_args: list[str]) -> dict:
    libc = ctypes.CDLL(None, use_errno=True)
    workdir = Path(tempfile.mkdtemp(prefix="coord-suite-cost-"))
    accounting = workdir / "pacct"
    accounting.touch()
    if libc.acct(str(accounting).encode()) != 0:
        errno = ctypes.get_errno()
        raise SystemExit(f"acct({accounting}) failed: {os.strerror(errno)} (run as root, on Linux)")
    sampler = Sampler()
    sampler.start()
    started, cpu_before = time.monotonic(), _machine_cpu_s()
    try:
        env = {**os.environ, "CI": os.environ.get("CI", "true")}
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *pytest_args],
                              cwd=ROOT, env=env)
    finally:
        wall, cpu = time.monotonic() - started, _machine_cpu_s() - cpu_before
        libc.acct(None)
        sampler.stopping.set()
        sampler.join()
    totals: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    others: collections.Counter[str] = collections.Counter()
    for record in read_acct(accounting):
        command = _named(record, sampler.seen)
        category = next((name for name, pattern in CATEGORIES if re.search(pattern, command)), "other")
        totals[category] += record["cpu_s"]
        counts[category] += 1
        if category == "other":
            others[_short(command)] += record["cpu_s"]
    batch = CATEGORIES[0][0]
    tests_cpu = sum(v for k, v in totals.items() if k != batch)
    cores = os.cpu_count() or 1
    return {"pytest_exit": done.returncode, "wall_s": round(wall), "machine_cpu_s": round(cpu), "cores": cores,
            "accounted_cpu_s": round(sum(totals.values())), "tests_cpu_s": round(tests_cpu),
            "least_wall_s": round(tests_cpu / cores),
            "categories": [{"category": k, "cpu_s": round(v), "processes": counts[k]}
                           for k, v in sorted(totals.items(), key=lambda kv: -kv[1])],
            "other_largest": [{"command": k, "cpu_s": round(v, 1)} for k, v in others.most_common(8)]}


def render(result: dict) -> str:
    total = result["accounted_cpu_s"] or 1
    lines = [f"pytest exit {result['pytest_exit']}; wall {result['wall_s']} s; the machine's CPU "
             f"{result['machine_cpu_s']} s on {result['cores']} cores; every exited process "
             f"{result['accounted_cpu_s']} s", "",
             "| processes | CPU-s | share | count |", "|---|---:|---:|---:|"]
    lines += [f"| {c['category']} | {c['cpu_s']} | {100 * c['cpu_s'] / total:.0f}% | {c['processes']} |"
              for c in result["categories"]]
    lines += ["", f"The tests' own processes (all but the batch): {result['tests_cpu_s']} CPU-s, so no split of "
              f"the work on {result['cores']} cores takes less than {result['least_wall_s']} s "
              f"({result['least_wall_s'] / 60:.1f} min)."]
    if result["other_largest"]:
        lines += ["", "Largest of \"other\": " + "; ".join(f"{o['command']} ({o['cpu_s']} s)"
                                                         for o in result["other_largest"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default: the whole suite)")
    args = parser.parse_args(argv)
    if sys.platform != "linux":
        parser.error("process accounting is read from Linux's acct(2)")
    result = measure(args.pytest_args or ["-q"])
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0 if result["pytest_exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
