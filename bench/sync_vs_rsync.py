"""Benchmark: coord sync vs rsync -a over SSH, and coord's hashing vs sha256sum.

Runs on the multi-host test cluster (network namespaces, one sshd, user and venv
per node; needs root on Linux), every host's link capped at 1 Gbit/s each way
with tc (as a user's LAN is), with a generated tree of 10,000 files plus one
32 MiB file. In one run:

* first sync, no-op sync and one-file-changed sync: `coord sync` (all nodes at
  once, through the daemon, the CLI's own start included) vs `rsync -a` over SSH
  to the same nodes, started in parallel (the fastest a hand-written script
  would do). The first sync runs twice on a settled disk, each tool first once
  (the mean is reported); the no-op and one-file cases are run three times each,
  coord and rsync alternating, and the median is reported;
* cold hashing (no cache) on one thread vs `sha256sum` (one process) over the
  small-file tree, and the warm re-check (the hash cache) vs the cold one;
* the same re-check on a tree of large files: a 1 GiB model in four files and a
  data set of 60,000 JSONL lines (cold: hash cache empty, page cache warm).

    sudo python bench/sync_vs_rsync.py [--files 10000] [--model-mib 1024]

``--many-small`` measures the other case instead: many small files (20,000 of 1 KiB by default),
a cold sync to the three nodes (fresh workdirs, a fresh daemon: the head's hash cache cold too)
against ``rsync -a`` to each node in turn, three in a row, and against them started in parallel;
then the no-op sync of the same tree. Rounds alternate which goes first. ``--before CHECKOUT``
adds another checkout's coord (its daemon, CLI and agent) to every round, measured beside this
one, so a change is judged in one run, on the same machine state:

    sudo python bench/sync_vs_rsync.py --many-small [--files 20000] [--before /path/to/old/checkout]

COORD_NETNS_USER_SUFFIX (as the cluster tests take it) gives the cluster's users a suffix, so the
bench runs beside another checkout's test cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shared.ignore import IgnoreRules  # noqa: E402
from shared.manifest import HashCache, scan_tree  # noqa: E402
from tests.cluster.netns import DEFAULT_NODES, NetnsCluster  # noqa: E402
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, installed_environment, short_tempdir  # noqa: E402

LINK_RATE = "1gbit"
#: ext4 without a journal (this machine's disk) passes over inodes freed in the last 60 s, or 360 s while
#: their inode table block is dirty (which a create makes it), whenever it allocates one
#: (``recently_deleted``: perf shows it as most of the nodes' CPU in a first sync started soon after the
#: cluster's set-up, and gone 370 s later). Whoever creates files first after a deletion (the last run's
#: clean-up, the set-up's) pays a scan of the inode table per file. So the bench flushes and waits that
#: out before the first sync, reads the source back into the page cache (the machine's proactive
#: reclaim drops it while idle; a user syncs a tree just edited), and from then on moves copies aside
#: instead of deleting them. A fresh Mac's disk has none of this.
SETTLE_S = 370


def settle(source: Path, seconds: float) -> None:
    subprocess.run(["sync"], check=True)
    if seconds > 0:
        print(f"waiting {seconds:.0f} s for the disk to settle before the first sync (see SETTLE_S; "
              "--settle-s 0 for a quick try)", file=sys.stderr, flush=True)
        time.sleep(seconds)
    for path in source.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                while handle.read(1 << 20):
                    pass


REPEATS = 3
# The goals, and the figures before the change that set them (ba9abe9, same bench without link caps).
GOALS = {"first sync": ("<= 1.00x", "2.18x"), "no-op sync": ("<= 0.50x", "1.56x"),
         "one file changed": ("<= 1.00x", "3.24x")}


def make_tree(root: Path, files: int) -> int:
    total = 0
    for i in range(files):
        path = root / f"d{i % 100:02d}" / f"f{i:05d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        body = (f"# file {i}\n" + "x = 1\n" * (i % 300)).encode()
        path.write_bytes(body)
        total += len(body)
    big = root / "weights.bin"
    big.write_bytes(os.urandom(32 << 20))
    return total + (32 << 20)


def make_large_tree(root: Path, model_mib: int, lines: int) -> int:
    """A model of model_mib MiB in four safetensors-like files, its config, and a JSONL data set."""
    model = root / "model"
    model.mkdir(parents=True)
    parts = 4
    per_part = (model_mib << 20) // parts
    block = 64 << 20  # written in blocks: the bench never holds a whole model in memory
    for part in range(parts):
        with open(model / f"model-{part + 1:05d}-of-{parts:05d}.safetensors", "wb") as handle:
            left = per_part
            while left:
                handle.write(os.urandom(min(block, left)))
                left -= min(block, left)
    (model / "config.json").write_text('{"model_type": "llama", "hidden_size": 2048}\n')
    data = root / "data"
    data.mkdir()
    with open(data / "train.jsonl", "w") as handle:
        for i in range(lines):
            handle.write(json.dumps({"text": f"example {i}: " + "the quick brown fox " * (i % 20)}) + "\n")
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cluster_nodes():
    """The default nodes, their users suffixed as the cluster tests do with COORD_NETNS_USER_SUFFIX."""
    suffix = os.environ.get("COORD_NETNS_USER_SUFFIX", "")
    if not suffix:
        return DEFAULT_NODES
    if not suffix.isalnum() or len(suffix) > 6:
        sys.exit(f"COORD_NETNS_USER_SUFFIX must be up to 6 letters or digits, got {suffix!r}")
    return tuple(dataclasses.replace(n, user=n.user + suffix, home=n.home + suffix,
                                     venv=n.venv.replace(n.home, n.home + suffix)) for n in DEFAULT_NODES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--many-small", action="store_true",
                        help="the many-small-files case: cold and no-op sync vs rsync -a to each node in turn")
    parser.add_argument("--file-bytes", type=int, default=1024, help="--many-small: each file's size")
    parser.add_argument("--rounds", type=int, default=3, help="--many-small: rounds (the median is reported)")
    parser.add_argument("--own-disks", action="store_true",
                        help="--many-small: each node its own fresh ext4 file system (a loop image), as real nodes "
                             "have")
    parser.add_argument("--before", type=Path, help="--many-small: another checkout's coord, measured beside")
    parser.add_argument("--files", type=int, default=None, help="files in the tree (10,000; 20,000 --many-small)")
    parser.add_argument("--model-mib", type=int, default=1024)
    parser.add_argument("--lines", type=int, default=60_000)
    parser.add_argument("--settle-s", type=float, default=SETTLE_S,
                        help="seconds to wait before the first sync (see SETTLE_S; 0 for a quick try)")
    args = parser.parse_args()
    if args.many_small:
        from bench.sync_many_small import many_small

        args.files = args.files or 20_000
        many_small(args, cluster_nodes(), settle, LINK_RATE)
        return
    args.files = args.files or 10_000
    root = short_tempdir("coord-bench-sync-")
    root.chmod(0o755)
    source = root / "project"
    size = make_tree(source, args.files)
    rows = []
    last_report: dict = {}
    with NetnsCluster(cluster_nodes()) as cluster:
        cluster.cap_links(LINK_RATE)
        config = cluster.write_cluster_toml(root / "cluster.toml", state_dir=root / "state")
        with config.open("a") as handle:
            handle.write(f'\n[sync]\nsource = "{source}"\n')
        daemon = DaemonProcess(config, env=installed_environment(), prefix=["ip", "netns", "exec", cluster.head_ns]).start()
        try:
            daemon.wait_for(all_up, 60, "all nodes up")

            def coord_sync() -> None:
                result = coord("sync", "--json", "--config", str(config), env=daemon.env, timeout=1800)
                report = json.loads(result.stdout)
                assert report["status"] == "ok", report["detail"]
                last_report.clear()
                last_report.update(report)

            def rsync_all() -> None:
                procs = [cluster.popen_in("head", ["rsync", "-a", "-e", f"ssh -F {cluster.ssh_config}",
                                                   f"{source}/", f"{n.name}:rsync-copy/"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                         for n in cluster.nodes]
                for proc in procs:
                    _, err = proc.communicate(timeout=1800)
                    assert proc.returncode == 0, err

            def median_pair(before=None) -> tuple[float, float]:
                ours, theirs = [], []
                for i in range(REPEATS):
                    if before:
                        before(i)
                    ours.append(timed(coord_sync))
                    theirs.append(timed(rsync_all))
                return statistics.median(ours), statistics.median(theirs)

            def change_one(i: int) -> None:
                (source / "d07" / f"f{7 + i * 100:05d}.py").write_text(f"# changed {i}\n")

            def move_copies_aside(suffix: str) -> None:
                """Both copies out of the way on every node, renamed, not deleted (see SETTLE_S); coord's
                own state in .coord/ stays where it is."""
                for n in cluster.nodes:
                    aside = Path(f"{n.workdir}.{suffix}")
                    aside.mkdir()
                    for entry in Path(n.workdir).iterdir():
                        if entry.name != ".coord":
                            entry.rename(aside / entry.name)
                    (Path(n.home) / "rsync-copy").rename(Path(n.home) / f"rsync-copy.{suffix}")

            nodes = len(cluster.nodes)
            # The first sync twice, each tool first once: a tree's first copy creates 30,000 inodes on
            # one disk, and neither tool should be the one that always goes first.
            settle(source, args.settle_s)
            first_rounds = [(timed(coord_sync), timed(rsync_all))]
            first_timing = dict(last_report.get("timing", {}))
            move_copies_aside("round1")
            theirs = timed(rsync_all)
            first_rounds.append((timed(coord_sync), theirs))
            first = (statistics.mean(r[0] for r in first_rounds), statistics.mean(r[1] for r in first_rounds))
            noop = median_pair()
            noop_timing = dict(last_report.get("timing", {}))
            one = median_pair(change_one)
            one_timing = dict(last_report.get("timing", {}))
            rows += [("first sync", *first), ("no-op sync", *noop), ("one file changed", *one)]
        finally:
            daemon.stop()
        throughput = (size * nodes / first[0] / 2**20, size * nodes / first[1] / 2**20)

    rules = IgnoreRules()
    cache_path = str(root / "bench-cache.json")
    cold = timed(lambda: scan_tree(str(source), rules, cache=HashCache(cache_path), threads=1))
    warm = timed(lambda: scan_tree(str(source), rules, cache=HashCache(cache_path), threads=1))
    listing = root / "files.txt"
    listing.write_text("\n".join(str(p) for p in source.rglob("*") if p.is_file()) + "\n")
    sha = timed(lambda: subprocess.run(f"xargs -a {listing} -d '\\n' sha256sum > /dev/null", shell=True,
                                       check=True))
    shutil.rmtree(source, ignore_errors=True)

    large = root / "large"
    large_size = make_large_tree(large, args.model_mib, args.lines)
    large_cache = str(root / "bench-cache-large.json")
    large_cold = timed(lambda: scan_tree(str(large), rules, cache=HashCache(large_cache)))
    large_warm = min(timed(lambda: scan_tree(str(large), rules, cache=HashCache(large_cache))) for _ in range(3))
    large_listing = root / "large.txt"
    large_listing.write_text("\n".join(str(p) for p in large.rglob("*") if p.is_file()) + "\n")
    large_sha = timed(lambda: subprocess.run(f"xargs -a {large_listing} -d '\\n' -P {os.cpu_count()} -n 1 "
                                             f"sha256sum > /dev/null", shell=True, check=True))
    shutil.rmtree(root, ignore_errors=True)

    print(f"\n{args.files} files + one 32 MiB file ({size / 2**20:.0f} MiB), {nodes} nodes, {os.cpu_count()} cores, "
          f"every link capped at {LINK_RATE}/s each way (tc tbf); no-op and one-file rows: median of {REPEATS}\n")
    print("| case | goal (coord / rsync) | before | coord sync (s) | rsync -a over ssh, nodes in parallel (s) "
          "| coord / rsync |")
    print("|---|---|---:|---:|---:|---:|")
    for name, ours, theirs in rows:
        goal, before = GOALS[name]
        print(f"| {name} | {goal} | {before} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f}x |")
    print(f"| first-sync throughput (MiB/s, all nodes) | >= 1.00x | 0.46x | {throughput[0]:.0f} | "
          f"{throughput[1]:.0f} | {throughput[0] / throughput[1]:.2f}x |")
    print(f"\nfirst sync, coord then rsync: {first_rounds[0][0]:.2f} s and {first_rounds[0][1]:.2f} s; rsync then coord: "
          f"{first_rounds[1][1]:.2f} s and {first_rounds[1][0]:.2f} s (the table gives their means)")
    print(f"\ncoord's phases (daemon side, s): first {first_timing}; no-op {noop_timing}; one file {one_timing}")
    print("\n| hashing | coord (s) | sha256sum (s) | ratio | goal | before |")
    print("|---|---:|---:|---:|---|---:|")
    print(f"| small files: cold, one thread | {cold:.2f} | {sha:.2f} | speed {sha / cold:.2f}x of sha256sum | - | - |")
    print(f"| small files: warm re-check (cache) | {warm:.3f} | - | {warm / cold * 100:.1f}% of cold | - | 32% |")
    print(f"| large files ({large_size / 2**30:.2f} GiB: {args.model_mib} MiB model in 4 files, {args.lines:,} "
          f"JSONL lines): cold | {large_cold:.2f} | {large_sha:.2f} ({os.cpu_count()} processes) | "
          f"speed {large_sha / large_cold:.2f}x of sha256sum | - | - |")
    print(f"| large files: warm re-check (cache) | {large_warm:.4f} | - | {large_warm / large_cold * 100:.2f}% of cold "
          f"| <= 5% | - |")


if __name__ == "__main__":
    main()
