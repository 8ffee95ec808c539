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

Needs root (``acct(2)`` takes CAP_SYS_PACCT) and Linux. Accounting goes to a file of its own and is
switched off at the end: on a machine whose own accounting was on (``accton``, psacct), switch that
back on afterwards."""

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
from typing import TextIO

ROOT = Path(__file__).resolve().parent.parent

#: (category, pattern over the command line), the first that matches wins.
CATEGORIES: list[tuple[str, str]] = [
    ("fault-schedule batch (lowest priority, idle cycles)", r"tests\.simulation\.batch"),
    ("MLX ranks, mlx.launch and calibration",
     r"agent\.train\b|agent\.mlx_lm_train|mlx\.launch|mlx_launch|agent\.calibrate|busy_first_step"),
    ("C++ compiles of MLX's CPU kernels, in each fresh node's .coord/tmp",
     r"/\.coord/tmp/mlx/|cc1plus.*mlx/include|^\[(cc1plus|as|ld|collect2|g\+\+|c\+\+)\]"),
    ("PyTorch: workers, torchrun/Accelerate/DeepSpeed, standbys, facts",
     r"torch|ddp\.py|acc\.py|ds_train|hf\.py|accelerate|deepspeed|agent\.preload|straggler_hog"
     r"|^\S+ -c import json, sys"),
    ("pytest workers (unit tests, in-process daemons)", r"pytest|exec\(eval\(sys\.stdin"),
    ("coordd", r"cli\.main daemon|coordd"),
    ("agents", r"-m agent\s*$"),
    ("coord commands", r"cli\.main|/coord "),
    ("rank wrappers, standbys, ssh, sshd", r"agent\.rank_runner|agent\.standby_runner|(^|/)ssh |(^|/)sshd|^\[sshd?\]"),
    ("the test clusters' set-up (venvs, users, keys)", r"pip_compileall|uv pip |uv venv|useradd|ssh-keygen"),
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
        (_flag, version, _tty, _exit, _uid, _gid, pid, _ppid, btime, etime, utime, stime,
         *_rest, comm) = _ACCT_V3.unpack_from(data, offset)
        if version & 0x0F != 3:
            raise SystemExit(f"{path}: not an acct_v3 record at byte {offset} (version {version})")
        records.append({"pid": pid, "start": btime, "elapsed_s": etime / _AHZ,
                        "cpu_s": (_comp_t(utime) + _comp_t(stime)) / _AHZ,
                        "comm": comm.split(b"\0", 1)[0].decode(errors="replace")})
    return records


class Sampler(threading.Thread):
    """Each new process's command line, by (pid, start second since the epoch), written to ``names``
    as it is seen (a line each: pid, start, the command line as a JSON string)."""

    def __init__(self, names: Path) -> None:
        super().__init__(daemon=True)
        self.names = names
        self.stopping = threading.Event()
        boot = next(line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime"))
        self.boot = int(boot.split()[1])
        self.hz = os.sysconf("SC_CLK_TCK")

    def run(self) -> None:
        seen: set[tuple[int, int]] = set()
        with self.names.open("a", encoding="utf-8") as out:
            while not self.stopping.wait(0.3):
                for pid, start, command in self._new(seen):
                    out.write(f"{pid}\t{start}\t{json.dumps(command)}\n")

    def _new(self, seen: set[tuple[int, int]]) -> list[tuple[int, int, str]]:
        found = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                cmdline = Path(entry.path, "cmdline").read_bytes()
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue  # gone already
            if not cmdline:
                continue  # a kernel thread
            key = (int(entry.name), self.boot + int(stat.rsplit(")", 1)[1].split()[19]) // self.hz)
            if key not in seen:
                seen.add(key)
                found.append((*key, cmdline.replace(b"\0", b" ").decode(errors="replace").strip()[:300]))
        return found


def read_names(path: Path) -> dict[int, list[tuple[int, str]]]:
    names: dict[int, list[tuple[int, str]]] = collections.defaultdict(list)
    for line in path.read_text(encoding="utf-8").splitlines():
        pid, start, command = line.split("\t", 2)
        names[int(pid)].append((int(start), json.loads(command)))
    return names


def clock_offset(records: list[dict], names: dict[int, list[tuple[int, str]]]) -> int:
    """Seconds to add to a record's start to get the sampler's. The kernel dates a record by the
    wall clock less the process's monotonic age, the sampler by the boot time plus its boot-clock
    start, and the two clocks part by however long the machine was paused since boot (31 s on this
    VM): the median difference of the pids seen once by both."""
    diffs = sorted(entries[0][0] - record["start"] for record in records
                   if len(entries := names.get(record["pid"], [])) == 1 and abs(entries[0][0] - record["start"]) < 3600)
    return diffs[len(diffs) // 2] if diffs else 0


def _named(record: dict, names: dict[int, list[tuple[int, str]]], offset: int) -> str:
    """The command line sampled for the record's pid that started within 2 s of it."""
    start = record["start"] + offset
    near = [(abs(sampled - start), command) for sampled, command in names.get(record["pid"], [])]
    best = min(near, default=None)
    if best is not None and best[0] <= 2:
        return best[1]
    return f"[{record['comm']}]"  # lived less than a sample: its name in the kernel's record (or a thread's)


def _short(command: str) -> str:
    command = re.sub(r"\s+", " ", command)
    command = re.sub(r"\S*/(?=[^/\s]+)", "", command)  # paths to their last part
    return re.sub(r"\d+", "N", command)[:80]


def _machine_cpu_s() -> float:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")  # user nice system irq softirq


def measure(pytest_args: list[str], workdir: Path, output: TextIO) -> None:
    """Run pytest with accounting on, its output to ``output``; ``workdir`` gets ``pacct``, ``names.tsv``
    and ``run.json`` (written even when the run is interrupted, so that ``--again`` can group it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    accounting = workdir / "pacct"
    accounting.touch()
    if libc.acct(str(accounting).encode()) != 0:
        errno = ctypes.get_errno()
        raise SystemExit(f"acct({accounting}) failed: {os.strerror(errno)} (run as root, on Linux)")
    sampler = Sampler(workdir / "names.tsv")
    sampler.start()
    started, cpu_before = time.monotonic(), _machine_cpu_s()
    exit_code = -1
    try:
        env = {**os.environ, "CI": os.environ.get("CI", "true")}
        exit_code = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *pytest_args],
                                   cwd=ROOT, env=env, stdout=output).returncode
    finally:
        wall, cpu = time.monotonic() - started, _machine_cpu_s() - cpu_before
        libc.acct(None)  # never left on: the kernel would go on writing a record per process
        sampler.stopping.set()
        sampler.join()
        (workdir / "run.json").write_text(json.dumps({"pytest_exit": exit_code, "wall_s": round(wall),
                                                      "machine_cpu_s": round(cpu), "cores": os.cpu_count() or 1}))


def group(workdir: Path) -> dict:
    """The processes of a measured run, grouped (``CATEGORIES``), with what the figures bound."""
    names = read_names(workdir / "names.tsv")
    totals: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    others: collections.Counter[str] = collections.Counter()
    records = read_acct(workdir / "pacct")
    offset = clock_offset(records, names)
    for record in records:
        command = _named(record, names, offset)
        category = next((name for name, pattern in CATEGORIES if re.search(pattern, command)), "other")
        totals[category] += record["cpu_s"]
        counts[category] += 1
        if category == "other":
            others[_short(command)] += record["cpu_s"]
    run = json.loads((workdir / "run.json").read_text())
    batch = CATEGORIES[0][0]
    tests_cpu = sum(v for k, v in totals.items() if k != batch)
    return {**run, "directory": str(workdir), "accounted_cpu_s": round(sum(totals.values())),
            "tests_cpu_s": round(tests_cpu), "least_wall_s": round(tests_cpu / run["cores"]),
            "categories": [{"category": k, "cpu_s": round(v, 1), "processes": counts[k]}
                           for k, v in sorted(totals.items(), key=lambda kv: -kv[1])],
            "other_largest": [{"command": k, "cpu_s": round(v, 1)} for k, v in others.most_common(8)]}


def render(result: dict) -> str:
    total = result["accounted_cpu_s"] or 1
    lines = [f"{result['directory']}: pytest exit {result['pytest_exit']}; wall {result['wall_s']} s; "
             f"the machine's CPU {result['machine_cpu_s']} s on {result['cores']} cores; every exited process "
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
    parser.add_argument("--again", metavar="DIR", type=Path,
                        help="group an earlier run's processes again (the directory it printed) instead of running")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default: the whole suite)")
    args = parser.parse_args(argv)
    if args.again is None:
        if sys.platform != "linux":
            parser.error("process accounting is read from Linux's acct(2)")
        workdir = Path(tempfile.mkdtemp(prefix="coord-suite-cost-"))
        print(f"recording every process's CPU in {workdir} (--again {workdir} groups it again)", file=sys.stderr)
        # with --json, stdout is the JSON alone: pytest's own lines go to stderr
        measure(args.pytest_args or ["-q"], workdir, sys.stderr if args.json else sys.stdout)
    elif not (args.again / "pacct").is_file() or not (args.again / "names.tsv").is_file():
        parser.error(f"{args.again}: no pacct and names.tsv there (a directory this script printed)")
    result = group(args.again or workdir)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0 if result["pytest_exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
