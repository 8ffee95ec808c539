"""The relay on the multi-host cluster: `coord sync` of a large file goes head -> n1 -> n2 -> n3,
each node passing on verified chunks; the middle relay's link is cut mid-transfer, the node
after it is fed by the one before it from the first chunk it lacks, and no node ever holds the
file under its name with other bytes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.jobs import tiny_project_and_daemon
from tests.integration.daemon_harness import REPO, all_up, coord

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

SIZE = 40 << 20


def _sha(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _relay_temporaries(workdir: str) -> list[Path]:
    return [p for p in Path(workdir).glob(".weights.bin.coord-relay-*")]


def test_a_relay_cut_mid_transfer_is_routed_around_and_every_copy_is_verified(netns_cluster):
    cluster = netns_cluster
    cluster.cap_links("100mbit")  # 40 MiB take about 3.5 s a hop: time to cut one mid-way
    try:
        with tiny_project_and_daemon(cluster) as holder:
            daemon, project = holder["daemon"], holder["project"]
            weights = project / "weights.bin"
            weights.write_bytes(os.urandom(SIZE))
            weights.chmod(0o644)
            sha = _sha(weights)
            argv = ["ip", "netns", "exec", cluster.head_ns, sys.executable, "-m", "coordinator.cli.main", "sync",
                    "--json", "--config", str(daemon.config), "--source", str(project)]
            sync = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=daemon.env, cwd=REPO)
            n3 = cluster.node("n3").workdir
            deadline = time.monotonic() + 60
            while not any(p.stat().st_size > 0 for p in _relay_temporaries(n3) if p.exists()):
                assert sync.poll() is None, f"sync ended before n3 received anything: {sync.communicate()}"
                assert time.monotonic() < deadline, "n3 never started receiving"
                time.sleep(0.02)
            cluster.cut_link("n2")  # n3's sender, and n1's receiver
            out, err = sync.communicate(timeout=300)
            assert out.strip(), f"coord sync exited {sync.returncode} with no report: {err}\n{daemon.log_tail(60)}"
            report = json.loads(out)
            nodes = report["nodes"]
            assert nodes["n1"]["status"] == "synced" and nodes["n3"]["status"] == "synced", (report, err)
            assert nodes["n2"]["status"] in ("failed", "skipped") and report["status"] == "failed"
            assert nodes["n3"]["relay"]["reroutes"] >= 1 and nodes["n3"]["relay"]["files"] == 1
            assert "fallback" not in nodes["n3"]  # the relay brought it, not the node's SSH session
            for name in ("n1", "n3"):
                assert _sha(Path(cluster.node(name).workdir) / "weights.bin") == sha
            held = Path(cluster.node("n2").workdir) / "weights.bin"
            assert not held.exists() or _sha(held) == sha  # never other bytes under the name
            events = json.loads(coord("status", "--json", "--events", "200", "--config", str(daemon.config),
                                      env=daemon.env, prefix=["ip", "netns", "exec", cluster.head_ns]).stdout)
            rerouted = [e["message"] for e in events["events"] if e["kind"] == "relay.rerouted"]
            assert any("n3 now receives from n1" in text for text in rerouted), rerouted

            # n2 back: the next sync brings it the file, verified, and leaves no temporary behind.
            cluster.restore_link("n2")
            daemon.wait_for(all_up, 60, "n2 back up")
            again = coord("sync", "--json", "--config", str(daemon.config), "--source", str(project),
                          env=daemon.env, prefix=["ip", "netns", "exec", cluster.head_ns], timeout=300)
            second = json.loads(again.stdout)
            assert second["status"] == "ok", second
            assert _sha(held) == sha
            assert second["nodes"]["n1"]["status"] == "unchanged"
            for name in ("n1", "n3"):
                assert _relay_temporaries(cluster.node(name).workdir) == []
    finally:
        cluster.restore_link("n2")
        cluster.cap_links(None)
