"""Benchmark: coord sync vs rsync -a over SSH, and coord's hashing vs sha256sum.

Runs on the multi-host test cluster (network namespaces, one sshd, user and venv
per node; needs root on Linux) with a generated tree of 10,000 files. In one run:

* first sync, no-op sync and one-file-changed sync: `coord sync` (all nodes at
  once, through the daemon) vs `rsync -a` over SSH to the same nodes, started in
  parallel (the fastest a hand-written script would do);
* cold hashing (no cache) on one thread vs `sha256sum` (one process) over the
  same files, and the warm re-check (the hash cache) vs the cold one.

    sudo python bench/sync_vs_rsync.py [--files 10000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shared.ignore import IgnoreRules  # noqa: E402
from shared.manifest import HashCache, scan_tree  # noqa: E402
from tests.cluster.netns import NetnsCluster  # noqa: E402
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir  # noqa: E402


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


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=10_000)
    args = parser.parse_args()
    root = short_tempdir("coord-bench-sync-")
    root.chmod(0o755)
    source = root / "project"
    size = make_tree(source, args.files)
    rows = []
    with NetnsCluster() as cluster:
        config = cluster.write_cluster_toml(root / "cluster.toml", state_dir=root / "state")
        with config.open("a") as handle:
            handle.write(f'\n[sync]\nsource = "{source}"\n')
        daemon = DaemonProcess(config, env=environment(), prefix=["ip", "netns", "exec", cluster.head_ns]).start()
        try:
            daemon.wait_for(all_up, 60, "all nodes up")

            def coord_sync() -> None:
                result = coord("sync", "--json", "--config", str(config), env=daemon.env, timeout=1800)
                report = json.loads(result.stdout)
                assert report["status"] == "ok", report["detail"]

            def rsync_all() -> None:
                procs = [cluster.popen_in("head", ["rsync", "-a", "-e", f"ssh -F {cluster.ssh_config}",
                                                   f"{source}/", f"{n.name}:rsync-copy/"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                         for n in cluster.nodes]
                for proc in procs:
                    _, err = proc.communicate(timeout=1800)
                    assert proc.returncode == 0, err

            nodes = len(cluster.nodes)
            first = (timed(coord_sync), timed(rsync_all))
            noop = (timed(coord_sync), timed(rsync_all))
            changed = source / "d07" / "f00007.py"
            changed.write_text("# changed\n")
            one = (timed(coord_sync), timed(rsync_all))
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
    shutil.rmtree(root, ignore_errors=True)

    print(f"\n{args.files} files + one 32 MiB file ({size / 2**20:.0f} MiB), {nodes} nodes, {os.cpu_count()} cores\n")
    print("| case | coord sync (s) | rsync -a over ssh, nodes in parallel (s) | coord / rsync |")
    print("|---|---:|---:|---:|")
    for name, ours, theirs in rows:
        print(f"| {name} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f}x |")
    print(f"| first-sync throughput (MiB/s, all nodes) | {throughput[0]:.0f} | {throughput[1]:.0f} | "
          f"{throughput[0] / throughput[1]:.2f}x |")
    print("\n| hashing | coord (s) | sha256sum (s) | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| cold, one thread | {cold:.2f} | {sha:.2f} | speed {sha / cold:.2f}x of sha256sum |")
    print(f"| warm re-check (cache) | {warm:.3f} | - | {warm / cold * 100:.1f}% of cold |")


if __name__ == "__main__":
    main()
