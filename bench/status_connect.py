"""Benchmark: `coord status` latency, connect-all time and what Prometheus /metrics costs the
daemon, at 4, 16 and 64 nodes.

Nodes are local agents (one real agent process per node, over the local
transport), or with --ssh many SSH sessions to one OpenSSH sshd this script
starts on 127.0.0.1 with its own host key. For each size a real coordd is
started as a subprocess; connect-all is read from the daemon's own events (from
its start to the moment the last node went up), and status latency is measured from a
client that does what `coord status --json` does: connect to the control socket,
call status, read the whole document. /metrics is scraped as Prometheus does (one HTTP GET,
the whole body read) ``--calls`` times; the daemon's CPU per scrape is its /proc CPU time over
those scrapes, divided by their number. Idle CPU is the daemon's share of a core over 30 s with
nothing asked of it (keepalive pings, the node sampler every 10 s).

    python bench/status_connect.py [--sizes 4,16,64] [--calls 300] [--ssh]
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from coordinator.control.server import DaemonNotRunning, call_daemon  # noqa: E402


def write_cluster(root: Path, size: int, ssh: dict | None) -> Path:
    lines = [f'[cluster]\nname = "bench-{size}"\nstate_dir = "{root}/state"\n',
             '[dashboard]\nlisten = "127.0.0.1:0"\n']
    if ssh:
        lines.append(f'[ssh]\nknown_hosts = "{ssh["known_hosts"]}"\nidentity_file = "{ssh["key"]}"\n'
                     f'config = "{ssh["config"]}"\n')
    for i in range(size):
        if ssh:
            lines.append(f'[[nodes]]\nname = "n{i}"\nhost = "127.0.0.1"\nport = {ssh["port"]}\n'
                         f'user = "{getpass.getuser()}"\npython = "{sys.executable}"\nworkdir = "{root}/w{i}"\n')
        else:
            lines.append(f'[[nodes]]\nname = "n{i}"\nhost = "local"\nworkdir = "{root}/w{i}"\n')
    path = root / "cluster.toml"
    path.write_text("\n".join(lines))
    return path


async def wait_all_up(socket: Path, size: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            doc = await call_daemon(socket, "status", {"events": 1000})
            if doc["summary"]["up"] == size:
                return doc
        except DaemonNotRunning:
            pass
        await asyncio.sleep(0.25)
    raise RuntimeError(f"not all {size} nodes up within {timeout} s")


async def status_latencies(socket: Path, calls: int) -> list[float]:
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        await call_daemon(socket, "status", {"events": 10})
        samples.append(time.perf_counter() - start)
    return samples


def cli_latency(config: Path, runs: int) -> float:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "coordinator.cli.main", "status", "--json", "--config", str(config)],
                       check=True, stdout=subprocess.DEVNULL, cwd=REPO)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def scrape_costs(url: str, calls: int, pid: int) -> dict:
    """Latency of each /metrics scrape, the daemon's CPU per scrape, and the body's size."""
    import urllib.request

    samples, size = [], 0
    cpu_before = cpu_seconds(pid)
    for _ in range(calls):
        start = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as answer:
            size = len(answer.read())
        samples.append(time.perf_counter() - start)
    cpu = (cpu_seconds(pid) - cpu_before) / calls
    return {"metrics_p50_ms": percentile(samples, 0.5) * 1000, "metrics_p99_ms": percentile(samples, 0.99) * 1000,
            "metrics_cpu_ms": cpu * 1000, "metrics_bytes": size}


def page_costs(base: str, calls: int, pid: int, stream_seconds: float = 30.0) -> dict:
    """The dashboard: each /api/dashboard document (latency, the daemon's CPU, size), and what
    one open page costs the daemon: its event stream read for ``stream_seconds``, the daemon's
    CPU over that time (idle included; compare with the idle column)."""
    import urllib.request

    samples, size = [], 0
    cpu_before = cpu_seconds(pid)
    for _ in range(calls):
        start = time.perf_counter()
        with urllib.request.urlopen(base + "api/dashboard", timeout=10) as answer:
            size = len(answer.read())
        samples.append(time.perf_counter() - start)
    cpu = (cpu_seconds(pid) - cpu_before) / calls
    events = 0
    cpu_before = cpu_seconds(pid)
    deadline = time.monotonic() + stream_seconds
    with urllib.request.urlopen(base + "api/stream", timeout=10) as stream:
        while time.monotonic() < deadline:
            if stream.readline().startswith(b"data: "):
                events += 1
    stream_cpu = (cpu_seconds(pid) - cpu_before) / stream_seconds
    return {"page_p50_ms": percentile(samples, 0.5) * 1000, "page_p99_ms": percentile(samples, 0.99) * 1000,
            "page_cpu_ms": cpu * 1000, "page_bytes": size, "stream_cpu": stream_cpu, "stream_events": events}


def idle_cpu(pid: int, seconds: float = 30.0) -> float:
    """The daemon's share of one core while nothing is asked of it."""
    before = cpu_seconds(pid)
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / seconds


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def measure(size: int, calls: int, ssh: dict | None) -> dict:
    root = Path(tempfile.mkdtemp(prefix="coord-bench-", dir="/tmp"))
    config = write_cluster(root, size, ssh)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    daemon = subprocess.Popen([sys.executable, "-m", "coordinator.cli.main", "daemon", "--config", str(config),
                               "--log-file", str(root / "coordd.log")], cwd=REPO, env=env)
    try:
        socket = root / "state" / "coord.sock"
        doc = asyncio.run(wait_all_up(socket, size, timeout=300))
        # From the daemon's start to the moment its last node went up, by the daemon's clock.
        connect_all = max(node["since"] for node in doc["nodes"]) - doc["daemon"]["started"]
        daemon_cpu = cpu_seconds(daemon.pid)
        samples = asyncio.run(status_latencies(socket, calls))
        row = {"nodes": size, "connect_all_s": connect_all, "daemon_cpu_s": daemon_cpu,
               "status_p50_ms": percentile(samples, 0.5) * 1000, "status_p99_ms": percentile(samples, 0.99) * 1000,
               "cli_median_ms": cli_latency(config, 5) * 1000}
        row.update(scrape_costs(doc["dashboard"]["metrics"], calls, daemon.pid))
        row.update(page_costs(doc["dashboard"]["url"], calls, daemon.pid))
        row["idle_cpu"] = idle_cpu(daemon.pid)
        return row
    finally:
        daemon.terminate()
        daemon.wait(30)
        shutil.rmtree(root, ignore_errors=True)


def start_sshd(root: Path) -> tuple[subprocess.Popen, dict]:
    """One sshd on 127.0.0.1 with a fresh host key, accepting a fresh client key for this user."""
    import socket as socketlib

    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "host_key")], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "client_key")], check=True)
    (root / "authorized_keys").write_text((root / "client_key.pub").read_text())
    os.chmod(root / "authorized_keys", 0o600)
    with socketlib.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (root / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {root}/host_key\nPidFile {root}/sshd.pid\n"
        f"AuthorizedKeysFile {root}/authorized_keys\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "UsePAM no\nPermitRootLogin prohibit-password\nStrictModes no\nMaxStartups 200\nMaxSessions 200\n")
    Path("/run/sshd").mkdir(exist_ok=True)
    sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(root / "sshd_config")],
                            stderr=open(root / "sshd.log", "w"))
    host_pub = (root / "host_key.pub").read_text().split()
    (root / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
    (root / "ssh_config").write_text("")
    time.sleep(0.5)
    return sshd, {"port": port, "known_hosts": root / "known_hosts", "key": root / "client_key",
                  "config": root / "ssh_config"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4,16,64")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--ssh", action="store_true", help="SSH sessions to one local sshd instead of local agents")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    sshd = None
    ssh = None
    ssh_root = Path(tempfile.mkdtemp(prefix="coord-bench-ssh-", dir="/tmp"))
    if args.ssh:
        sshd, ssh = start_sshd(ssh_root)
    try:
        rows = [measure(size, args.calls, ssh) for size in sizes]
    finally:
        if sshd:
            sshd.terminate()
        shutil.rmtree(ssh_root, ignore_errors=True)
    transport = "SSH sessions to one sshd" if args.ssh else "local agents"
    print(f"\ncoord status and connect-all, {transport}, {os.cpu_count()} cores, {args.calls} status calls per size\n")
    print("| nodes | connect-all (s) | vs 4 nodes | daemon CPU to connect (s) | status p50 (ms) | status p99 (ms) "
          "| `coord status --json` CLI (ms) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    base = rows[0]["connect_all_s"]
    for row in rows:
        print(f"| {row['nodes']} | {row['connect_all_s']:.2f} | {row['connect_all_s'] / base:.2f}x | "
              f"{row['daemon_cpu_s']:.2f} | "
              f"{row['status_p50_ms']:.1f} | {row['status_p99_ms']:.1f} | {row['cli_median_ms']:.0f} |")
    print(f"\n/metrics, {args.calls} scrapes per size\n")
    print("| nodes | /metrics p50 (ms) | /metrics p99 (ms) | daemon CPU per scrape (ms) | body (bytes) "
          "| idle daemon CPU (% of a core) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['nodes']} | {row['metrics_p50_ms']:.1f} | {row['metrics_p99_ms']:.1f} | "
              f"{row['metrics_cpu_ms']:.2f} | {row['metrics_bytes']} | {row['idle_cpu'] * 100:.1f} |")
    print(f"\nthe dashboard, {args.calls} documents per size, then one page's event stream for 30 s\n")
    print("| nodes | /api/dashboard p50 (ms) | p99 (ms) | daemon CPU per document (ms) | document (bytes) "
          "| daemon CPU with one page open (% of a core) | idle daemon CPU (% of a core) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['nodes']} | {row['page_p50_ms']:.1f} | {row['page_p99_ms']:.1f} | {row['page_cpu_ms']:.2f} | "
              f"{row['page_bytes']} | {row['stream_cpu'] * 100:.1f} | {row['idle_cpu'] * 100:.1f} |")


if __name__ == "__main__":
    main()
