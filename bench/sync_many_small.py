"""``sync_vs_rsync.py --many-small``: many small files, a cold sync to every node against ``rsync -a`` to
each node in turn, and the no-op sync after it; another checkout's coord measured beside, if asked.

Every round makes fresh copies: each coord (this checkout's, and ``--before``'s) syncs into a workdir
of its own for the round with a daemon of its own, started for the round with an empty state directory
(so the head's hash cache is cold, as on a first sync of a tree), and rsync copies into a directory of
its own. Nothing is deleted between rounds (see ``SETTLE_S`` in sync_vs_rsync.py); the order of the
tools turns round by round. Times are wall-clock, the ``coord`` CLI's own start included; CPU seconds
are those of every process on the head (daemon and CLI, or rsync and ssh) and of every process of the
nodes' users with their sshd (the nodes' agents, or rsync's receivers), read from /proc.
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from tests.cluster.netns import NetnsCluster
from tests.integration.daemon_harness import DaemonProcess, all_up, short_tempdir

NOOPS = 3  # no-op syncs after each cold one (their median is the round's)
TICK = os.sysconf("SC_CLK_TCK")


def make_small_tree(root: Path, files: int, size: int) -> int:
    """``files`` files of ``size`` bytes in 100 directories."""
    for i in range(files):
        path = root / f"d{i % 100:02d}" / f"f{i:05d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes((f"{i:08d}\n" * (size // 9 + 1)).encode()[:size])
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return files * size


def _cpu_of(pid: str | int, children: bool = True) -> float:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if children else 0)
    return ticks / TICK


class Checkout:
    """One coord checkout: its daemon (one per round, fresh state) and its CLI, both run from its own tree."""

    def __init__(self, label: str, repo: Path) -> None:
        self.label, self.repo = label, repo.resolve()
        import compileall

        for package in ("agent", "coordinator", "shared"):  # compiled, as an installed package is
            compileall.compile_dir(str(self.repo / package), quiet=1)
        self.env = {k: v for k, v in os.environ.items() if k not in ("COORD_SOCKET", "COORD_CONFIG",
                                                                       "PYTHONDONTWRITEBYTECODE")}
        self.env["PYTHONPATH"] = str(self.repo)

    def start(self, cluster: NetnsCluster, root: Path, name: str, source: Path, under: str = "") -> DaemonProcess:
        config = cluster.write_cluster_toml(
            root / f"{name}.toml", state_dir=root / f"{name}-state",
            extra_node_fields={n.name: {"workdir": f"{n.home}/{under}{name}"} for n in cluster.nodes})
        with config.open("a") as handle:
            handle.write(f'\n[sync]\nsource = "{source}"\n')
        daemon = DaemonProcess(config, env=self.env, prefix=["ip", "netns", "exec", cluster.head_ns])
        argv = daemon.prefix + [daemon.python, "-m", "coordinator.cli.main", "daemon", "--config", str(config),
                                "--log-file", str(daemon.log_file)]
        daemon.proc = subprocess.Popen(argv, cwd=self.repo, env=self.env, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, text=True)
        daemon.wait_for(all_up, 120, "all nodes up")
        return daemon

    def sync(self, daemon: DaemonProcess) -> dict[str, Any]:
        done = subprocess.run([daemon.python, "-m", "coordinator.cli.main", "sync", "--json", "--config",
                               str(daemon.config)], cwd=self.repo, env=self.env, capture_output=True, text=True,
                              timeout=3600)
        report = json.loads(done.stdout)
        if report["status"] != "ok":
            raise SystemExit(f"{self.label}: sync failed: {report['detail']}")
        return report


class Meter:
    """Wall and CPU seconds of what runs during ``run``: on the head (this process's children, once waited
    for, plus a daemon's own) and on the nodes (each node's sshd and everything under it: the SSH sessions,
    the agents, rsync's receivers). sshd does not pass its sessions' times on to its own (they are lost when
    a session ends), so the nodes' processes are sampled every 50 ms while it runs, each one's own time
    kept: a process that ends between two looks loses at most that much."""

    PERIOD_S = 0.05

    def __init__(self, cluster: NetnsCluster) -> None:
        self.sshd = {proc.pid for proc in cluster._sshd.values()}

    def _node_processes(self) -> dict[int, float]:
        """Each live process under a node's sshd: its own CPU seconds so far."""
        parents: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as handle:
                        parents[int(entry)] = int(handle.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    pass
        found: dict[int, float] = {}
        for pid in parents:
            ancestor = pid
            while ancestor not in self.sshd and ancestor > 1:
                ancestor = parents.get(ancestor, 0)
            if ancestor in self.sshd:
                found[pid] = _cpu_of(pid, children=False)
        return found

    @staticmethod
    def children_cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    def quiet(self, daemon: DaemonProcess, seconds: float = 1.0, timeout: float = 60.0) -> float:
        """Wait until the daemon and the nodes' processes used under 5% of a core for ``seconds`` (a daemon
        just started goes on with work of its own after its nodes are up: facts, usage, the agents' first
        imports), so that the sync is measured alone. Returns the seconds waited."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            before = self._node_processes()
            daemon0 = _cpu_of(daemon.proc.pid, children=False) if daemon.proc else 0.0
            time.sleep(seconds)
            after = self._node_processes()
            used = sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())
            used += (_cpu_of(daemon.proc.pid, children=False) if daemon.proc else 0.0) - daemon0
            if used < 0.05 * seconds:
                break
        return time.monotonic() - started

    def run(self, fn, daemon: DaemonProcess | None = None) -> tuple[float, float, float, Any]:
        """(wall s, head CPU s, nodes CPU s, what fn returned)."""
        daemon_cpu = (lambda: _cpu_of(daemon.proc.pid, children=False)) if daemon and daemon.proc else lambda: 0.0
        before = self._node_processes()
        seen = dict(before)
        done = threading.Event()

        def sample() -> None:
            while not done.wait(self.PERIOD_S):
                seen.update(self._node_processes())

        sampler = threading.Thread(target=sample, daemon=True)
        head0, daemon0 = self.children_cpu(), daemon_cpu()
        sampler.start()
        started = time.perf_counter()
        try:
            out = fn()
        finally:
            wall = time.perf_counter() - started
            done.set()
            sampler.join()
        seen.update(self._node_processes())
        head = self.children_cpu() - head0 + daemon_cpu() - daemon0
        nodes = sum(cpu - before.get(pid, 0.0) for pid, cpu in seen.items())
        return wall, head, nodes, out


DISK = "bench-disk"  # --own-disks: each node's own file system, mounted here in its home


@contextmanager
def own_disks(cluster: NetnsCluster, gib: int = 4):
    """Each node its own fresh ext4 file system (a loop image of ``gib`` GiB, journaled, as a Linux
    node's disk is) at ``~/bench-disk``, mounted in the node's own mount namespace (where its sshd, and so
    its agents and rsync's receivers, see it) and owned by the node's user. Without it the nodes' workdirs
    share the one file system of this machine, and each cold sync's 60,000 new inodes pass over what any
    other work freed on it lately (see bench/README.md)."""
    images = []
    try:
        for node in cluster.nodes:
            image = Path(f"/var/tmp/coord-bench-disk-{node.name}.img")
            image.unlink(missing_ok=True)
            subprocess.run(["truncate", "-s", f"{gib}G", str(image)], check=True)
            # An inode per 4 KiB (mkfs's default is one per 16 KiB: 262,144 here, which rounds of 20,000 files
            # for each tool fill in four rounds, with most of the bytes still free).
            subprocess.run(["mkfs.ext4", "-q", "-F", "-i", "4096", str(image)], check=True)
            images.append(image)
            mount = f"{node.home}/{DISK}"
            cluster.exec_in(node.name, ["mkdir", "-p", mount], user=node.user)
            done = cluster.in_node_mounts(node.name, ["mount", "-o", "loop", str(image), mount])
            if done.returncode != 0:
                raise SystemExit(f"cannot mount {image} on {node.name}: {done.stderr}")
            cluster.in_node_mounts(node.name, ["chown", f"{node.user}:", mount], check=True)
        yield DISK + "/"
    finally:
        for node in cluster.nodes:
            cluster.in_node_mounts(node.name, ["umount", "-l", f"{node.home}/{DISK}"])
        for image in images:
            image.unlink(missing_ok=True)


def rsync_each(cluster: NetnsCluster, source: Path, dest: str, parallel: bool) -> None:
    argv = ["rsync", "-a", "-e", f"ssh -F {cluster.ssh_config}", f"{source}/"]
    procs: list[subprocess.Popen] = []
    for node in cluster.nodes:
        procs.append(cluster.popen_in("head", [*argv, f"{node.name}:{dest}/"], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE))
        if not parallel:
            _wait(procs[-1])
    for proc in procs:
        _wait(proc)


def _wait(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"rsync failed: {err}")


def _phases(report: dict[str, Any]) -> str:
    nodes = report["nodes"].values()
    verify = [e.get("verify_seconds") for e in nodes if e.get("verify_seconds") is not None]
    flush = [e.get("flush_seconds") for e in nodes if e.get("flush_seconds") is not None]
    sent = [e["result"]["seconds"] for e in nodes if "result" in e]
    return (f"scan {report['timing'].get('scan', 0):.2f}, send+verify {report['timing'].get('send_verify', 0):.2f} "
            f"(per node: send {max(sent, default=0):.2f}, verify {max(verify, default=0):.2f} of which flush "
            f"{max(flush, default=0):.2f}); daemon total {report.get('seconds', 0):.2f}")


def many_small(args, nodes, settle, link_rate: str) -> None:
    root = short_tempdir("coord-bench-small-")
    root.chmod(0o755)
    source = root / "project"
    size = make_small_tree(source, args.files, args.file_bytes)
    here = Path(__file__).resolve().parents[1]
    checkouts = [Checkout("coord (this checkout)", here)]
    if args.before:
        checkouts.append(Checkout(f"coord before ({args.before})", args.before))
    results: Runs = {}
    noops: dict[str, list[float]] = {}
    notes: list[str] = []
    with NetnsCluster(nodes) as cluster, (own_disks(cluster) if args.own_disks else _shared_disk()) as under:
        cluster.cap_links(link_rate)
        meter = Meter(cluster)
        settle(source, args.settle_s)
        tools = [*(c.label for c in checkouts), "rsync -a, nodes in turn", "rsync -a, nodes in parallel"]
        for round_ in range(args.rounds):
            order = tools[round_ % len(tools):] + tools[:round_ % len(tools)]
            for tool in order:
                subprocess.run(["sync"], check=True)  # each tool starts with nothing of the last one's unflushed
                checkout = next((c for c in checkouts if c.label == tool), None)
                if checkout is None:
                    dest = f"{under}rsync-r{round_}-{'seq' if 'turn' in tool else 'par'}"
                    wall, head, nodes_cpu, _ = meter.run(partial(rsync_each, cluster, source, dest, "parallel" in tool))
                    results.setdefault(tool, []).append((wall, head, nodes_cpu))
                    print(f"round {round_}: {tool}: {wall:.2f} s (head CPU {head:.2f}, nodes {nodes_cpu:.2f})",
                          file=sys.stderr, flush=True)
                    continue
                name = f"bench-r{round_}-{checkouts.index(checkout)}"
                daemon = checkout.start(cluster, root, name, source, under)
                try:
                    waited = meter.quiet(daemon)
                    subprocess.run(["sync"], check=True)
                    wall, head, nodes_cpu, report = meter.run(partial(checkout.sync, daemon), daemon)
                    results.setdefault(tool, []).append((wall, head, nodes_cpu))
                    notes.append(f"round {round_}, {tool}: {_phases(report)}; quiet after {waited:.1f} s")
                    print(f"round {round_}: {tool}: {wall:.2f} s (head CPU {head:.2f}, nodes {nodes_cpu:.2f}); "
                          f"{_phases(report)}; quiet after {waited:.1f} s", file=sys.stderr, flush=True)
                    walls = []
                    for _ in range(NOOPS):
                        wall, _, _, again = meter.run(partial(checkout.sync, daemon), daemon)
                        assert all(e["status"] == "unchanged" for e in again["nodes"].values()), again
                        walls.append(wall)
                    noops.setdefault(tool, []).append(statistics.median(walls))
                finally:
                    daemon.stop()
        rsync_noop = [meter.run(partial(rsync_each, cluster, source, f"{under}rsync-r0-seq", False))[0]
                      for _ in range(NOOPS)]
        _report(args, nodes, size, link_rate, tools, results, noops, rsync_noop, notes)  # before the clean-up: minutes


@contextmanager
def _shared_disk():
    yield ""


Runs = dict[str, list[tuple[float, float, float]]]  # tool -> (wall, head CPU, nodes CPU) of each round


def _report(args, nodes, size: int, link_rate: str, tools: list[str], results: Runs, noops: dict[str, list[float]],
            rsync_noop: list[float], notes: list[str]) -> None:
    print(f"\n{args.files:,} files of {args.file_bytes} bytes ({size / 2**20:.1f} MiB) in 100 directories, "
          f"{len(nodes)} nodes, {os.cpu_count()} cores, links capped at {link_rate}/s each way; median of "
          f"{args.rounds} rounds (no-op: of {NOOPS} per round); "
          f"{'each node its own ext4 file system' if args.own_disks else 'the nodes share one file system'}\n")
    print("| cold sync to every node | wall (s) | head CPU (s) | nodes CPU (s) | vs rsync -a in turn |")
    print("|---|---:|---:|---:|---:|")
    base = statistics.median(r[0] for r in results["rsync -a, nodes in turn"])
    for tool in tools:
        runs = results[tool]
        wall = statistics.median(r[0] for r in runs)
        print(f"| {tool} | {wall:.2f} | {statistics.median(r[1] for r in runs):.2f} | "
              f"{statistics.median(r[2] for r in runs):.2f} | {wall / base:.2f}x |")
    print("\n| no-op sync (nothing changed) | wall (s) |")
    print("|---|---:|")
    for tool, walls in noops.items():
        print(f"| {tool} | {statistics.median(walls):.2f} |")
    print(f"| rsync -a, nodes in turn | {statistics.median(rsync_noop):.2f} |")
    print("\nevery round (wall, head CPU, nodes CPU):")
    for tool in tools:
        print(f"  {tool}: " + "; ".join(f"{w:.2f}, {h:.2f}, {n:.2f}" for w, h, n in results[tool]))
    print("coord's phases (daemon side, s):")
    for note in notes:
        print(f"  {note}")
    print(f"\nrun: {shlex.join(sys.argv)}")
