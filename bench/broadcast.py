"""Benchmark: one large file to every node, `coord sync` (the relay) vs `rsync -a` to each node in parallel.

On the multi-host test cluster (network namespaces, one OpenSSH sshd, user and venv per
node; needs root on Linux), every host's link (the head's too) capped at 1 Gbit/s each way
with `tc tbf`, as on a user's LAN. A file of random bytes (1 GiB by default: a model's
weights) is sent to 3 nodes, then to 6. In one run, per size:

* `coord sync` through the daemon: the head reads the file once, sends it to the first node,
  and each node passes the verified chunks on to the next while it receives the rest;
* `rsync -a` over ssh from the head to every node, all started at once (the best a
  hand-written script does): the head's uplink carries the file once per node.

Both write to fresh directories; each node's copy is checked against the source's SHA256.

    sudo python bench/broadcast.py [--size-mib 1024] [--nodes 3,6] [--rate 1gbit]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.cluster.netns import NetnsCluster, NodeSpec  # noqa: E402
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, installed_environment, short_tempdir  # noqa: E402


def nodes_for(count: int) -> list[NodeSpec]:
    """Users of the benchmark's own (a test cluster may be up beside it)."""
    return [NodeSpec(f"n{i}", f"coordbench{i}", f"/home/coordbench{i}", f"/home/coordbench{i}/venv")
            for i in range(1, count + 1)]


def make_file(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        left = size
        while left:
            block = os.urandom(min(left, 16 << 20))
            digest.update(block)
            handle.write(block)
            left -= len(block)
    path.chmod(0o644)
    return digest.hexdigest()


def sha_of(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def run_size(count: int, args, source: Path, sha: str, root: Path) -> dict:
    with NetnsCluster(nodes_for(count)) as cluster:
        cluster.cap_links(args.rate)
        config = cluster.write_cluster_toml(root / f"cluster-{count}.toml", state_dir=root / f"state-{count}")
        daemon = DaemonProcess(config, env=installed_environment(), prefix=["ip", "netns", "exec", cluster.head_ns]).start()
        try:
            daemon.wait_for(all_up, 120, "all nodes up")
            started = time.perf_counter()
            result = coord("sync", "--json", "--config", str(config), "--source", str(source.parent),
                           env=daemon.env, timeout=3600)
            coord_s = time.perf_counter() - started
            report = json.loads(result.stdout)
            assert report["status"] == "ok", report.get("detail")
            reroutes = sum(e.get("relay", {}).get("reroutes", 0) for e in report["nodes"].values())
        finally:
            daemon.stop()
        for n in cluster.nodes:
            assert sha_of(Path(n.workdir) / source.name) == sha, f"coord's copy on {n.name} differs"

        started = time.perf_counter()
        procs = [cluster.popen_in("head", ["rsync", "-a", "-e", f"ssh -F {cluster.ssh_config}", str(source),
                                           f"{n.name}:rsync-copy/"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE) for n in cluster.nodes]
        for proc in procs:
            _, err = proc.communicate(timeout=3600)
            assert proc.returncode == 0, err
        rsync_s = time.perf_counter() - started
        for n in cluster.nodes:
            assert sha_of(Path(n.home) / "rsync-copy" / source.name) == sha, f"rsync's copy on {n.name} differs"
    return {"nodes": count, "coord": coord_s, "rsync": rsync_s, "reroutes": reroutes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--nodes", default="3,6", help="node counts, comma-separated")
    parser.add_argument("--rate", default="1gbit", help="every link's cap each way (tc tbf rate)")
    args = parser.parse_args()
    root = short_tempdir("coord-bench-bcast-")
    root.chmod(0o755)
    (root / "project").mkdir(mode=0o755)
    source = root / "project" / "model.safetensors"
    sha = make_file(source, args.size_mib << 20)
    rows = []
    try:
        for count in (int(n) for n in args.nodes.split(",")):
            rows.append(run_size(count, args, source, sha, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"\n{args.size_mib} MiB of random bytes to every node, every link capped at {args.rate} each way "
          f"(tc tbf), {os.cpu_count()} cores; largest process {peak_mib:.0f} MiB\n")
    print("| nodes | coord sync (s) | rsync -a over ssh, nodes in parallel (s) | coord / rsync | coord's rate into "
          "the nodes (MB/s, all nodes) |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        rate = args.size_mib * 2**20 * row["nodes"] / row["coord"] / 1e6
        print(f"| {row['nodes']} | {row['coord']:.1f} | {row['rsync']:.1f} | {row['coord'] / row['rsync']:.2f}x | "
              f"{rate:.0f} |")


if __name__ == "__main__":
    main()
