"""`coord sync` with large files, through a real daemon and three local nodes: the large files
go through the relay (head -> a -> b -> c), the small ones in batches, and every node ends up
with the source's tree, proven by its hash."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal

import pytest

from tests.integration.daemon_harness import (DaemonProcess, all_up, coord, environment, short_tempdir,
                                              write_local_cluster)

@pytest.fixture
def three_local_nodes():
    root = short_tempdir()
    config = write_local_cluster(root, ("a", "b", "c"), name="relay-test", keepalive_s=0.5)
    daemon = DaemonProcess(config, env=environment()).start()
    try:
        daemon.wait_for(all_up, 30, "all nodes up")
        yield daemon, root
    finally:
        daemon.stop(signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sync(daemon, source) -> dict:
    result = coord("sync", "--json", "--config", str(daemon.config), "--source", str(source), env=daemon.env,
                   timeout=120)
    return json.loads(result.stdout)


def test_large_files_are_relayed_node_to_node_and_small_ones_batched(three_local_nodes):
    daemon, root = three_local_nodes
    source = root / "project"
    (source / "model").mkdir(parents=True)
    weights = source / "model" / "weights.safetensors"
    weights.write_bytes(os.urandom(20 << 20))
    (source / "train.py").write_text("print('hi')\n")
    (source / "model" / "config.json").write_text("{}\n")

    first = _sync(daemon, source)
    assert first["status"] == "ok", first
    for name in ("a", "b", "c"):
        node = first["nodes"][name]
        assert node["status"] == "synced"
        assert node["relay"]["files"] == 1 and node["relay"]["bytes"] == 20 << 20 and not node["relay"]["failed"]
        assert "fallback" not in node
        assert _sha(root / name / "model" / "weights.safetensors") == _sha(weights)
        assert (root / name / "train.py").read_text() == "print('hi')\n"
        assert not [p for p in (root / name).rglob("*") if ".coord-relay-" in p.name]

    # Only the large file changed: it alone is relayed again; nothing changed: nothing moves.
    weights.write_bytes(os.urandom(12 << 20))
    second = _sync(daemon, source)
    assert second["status"] == "ok", second
    assert all(second["nodes"][n]["relay"]["files"] == 1 for n in ("a", "b", "c"))
    assert all(_sha(root / n / "model" / "weights.safetensors") == _sha(weights) for n in ("a", "b", "c"))
    third = _sync(daemon, source)
    assert third["status"] == "ok" and all(e["status"] == "unchanged" for e in third["nodes"].values()), third
