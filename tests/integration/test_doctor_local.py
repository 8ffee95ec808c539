"""`coord doctor` against a real coordd with three local nodes: every ring link measured over
loopback by the real agents, the first healthy figures kept as baselines, the cost bounded."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest

from tests.integration.daemon_harness import (
    DaemonProcess,
    all_up,
    coord,
    environment,
    short_tempdir,
    write_local_cluster,
)


@pytest.fixture
def three_nodes():
    root = short_tempdir()
    config = write_local_cluster(root, ("a", "b", "c"))
    env = environment()
    daemon = DaemonProcess(config, env=env).start()
    daemon.wait_for(all_up, 60, "every node up")
    yield config, env, root
    daemon.stop(signal.SIGKILL)
    shutil.rmtree(root, ignore_errors=True)


def test_doctor_measures_each_ring_link_and_keeps_the_first_as_baseline(three_nodes) -> None:
    config, env, root = three_nodes
    first = coord("doctor", "--config", str(config), "--json", "--bytes", str(4 * 2**20), "--seconds", "20",
                  env=env, timeout=90)
    assert first.returncode == 0, first.stderr + first.stdout
    report = json.loads(first.stdout)
    pairs = sorted((link["a"], link["b"]) for link in report["links"])
    assert pairs == [("a", "b"), ("b", "c"), ("c", "a")]
    for link in report["links"]:
        assert set(link) >= {"a", "b", "interface", "kind", "bits_per_second", "reverse_bits_per_second",
                             "latency_ms", "baseline_bits_per_second", "verdict", "cause", "fix"}
        assert link["verdict"] == "ok", link
        assert link["interface"] == "lo" and link["kind"] == "loopback"
        assert link["bits_per_second"] > 1e8 and link["reverse_bits_per_second"] > 1e8
        assert link["latency_ms"] is not None and link["mtu"] and link["mtu"] == link["peer_mtu"]
        assert link["baseline_bits_per_second"] == link["bits_per_second"]  # its first healthy figures
    assert sorted(report["baselines_set"]) == ["a ↔ b", "b ↔ c", "c ↔ a"]
    assert report["seconds"] < 20 + 10

    again = json.loads(coord("doctor", "--config", str(config), "--json", "--quick", env=env, timeout=60).stdout)
    assert again["baselines_set"] == [] and again["bytes"] == 4 * 2**20
    assert all(link["baseline_bits_per_second"] == first_link["bits_per_second"]
               for link, first_link in zip(again["links"], report["links"], strict=True))

    shown = coord("doctor", "--config", str(config), "--bytes", "0", env=env, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "a ↔ b" in shown.stdout and "ok: 3 links (ring" in shown.stdout


def test_doctor_refuses_bad_values_with_a_message(three_nodes) -> None:
    config, env, _ = three_nodes
    bad = coord("doctor", "--config", str(config), "--seconds", "0", env=env)
    assert bad.returncode != 0 and "--seconds" in bad.stderr
    bad = coord("doctor", "--config", str(config), "--bytes", "-5", env=env)
    assert bad.returncode != 0 and "--bytes" in bad.stderr


def test_doctor_help_states_its_cost() -> None:
    shown = coord("doctor", "--help", env=environment())
    assert shown.returncode == 0
    text = " ".join(shown.stdout.split())
    assert "Cost: at most --bytes each way per link" in text and "--while-training" in text


def test_preflight_takes_a_quick_look_at_each_link_and_keeps_nothing(three_nodes) -> None:
    config, env, root = three_nodes
    shown = coord("preflight", "--config", str(config), "--json", env=env, timeout=120)
    report = json.loads(shown.stdout)
    quick = [c for c in report["checks"] if c["name"] == "links.quick"]
    assert len(quick) == 1 and quick[0]["status"] == "pass", quick
    assert "a↔b" in quick[0]["detail"] and "c↔a" in quick[0]["detail"]
    doctor = json.loads(coord("doctor", "--config", str(config), "--json", "--bytes", "0", env=env, timeout=60).stdout)
    assert all(link["baseline_bits_per_second"] is None for link in doctor["links"])  # pre-flight kept no baseline


def test_all_ring_links_of_eight_nodes_take_at_most_thirty_seconds() -> None:
    root = short_tempdir()
    names = tuple(f"n{i}" for i in range(8))
    config = write_local_cluster(root, names)
    env = environment()
    daemon = DaemonProcess(config, env=env).start()
    try:
        daemon.wait_for(all_up, 120, "every node up")
        done = coord("doctor", "--config", str(config), "--json", env=env, timeout=120)  # the defaults: 64 MiB, 30 s
        report = json.loads(done.stdout)
        assert len(report["links"]) == 8 and report["bytes"] == 64 * 2**20 and report["seconds_limit"] == 30
        assert report["seconds"] <= 30, report["seconds"]
        assert {(link["a"], link["b"]) for link in report["links"]} == {
            (names[i], names[(i + 1) % 8]) for i in range(8)}
        assert all(link["verdict"] == "ok" for link in report["links"]), report["links"]
    finally:
        daemon.stop(signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


def test_doctor_refuses_while_a_job_trains_unless_asked(three_nodes) -> None:
    from tests.integration.test_jobs_local import PLAIN

    config, env, root = three_nodes
    (root / "project").mkdir()
    (root / "project" / "plain.py").write_text(PLAIN)
    submitted = coord("run", "--config", str(config), "--name", "long", "--source", str(root / "project"),
                      "--detach", "--", "python", "plain.py", "--steps", "100000", "--sleep", "0.2", env=env)
    assert submitted.returncode == 0, submitted.stderr
    daemon = DaemonProcess(config, env=env)  # the fixture's daemon, asked through the CLI

    def training(doc: dict) -> bool:
        job = next((j for j in doc["jobs"] if j["name"] == "long"), None)
        return job is not None and job["state"] == "running" and job["step"] >= 1

    try:
        daemon.wait_for(training, 300, "the job training")
        refused = coord("doctor", "--config", str(config), "--bytes", "0", env=env, timeout=60)
        assert refused.returncode != 0
        said = " ".join(refused.stderr.split())
        assert "a job trains on a (long), b (long), c (long)" in said and "--while-training" in said
        asked = coord("doctor", "--config", str(config), "--json", "--bytes", "0", "--while-training",
                      env=env, timeout=60)
        assert asked.returncode == 0, asked.stderr
        assert len(json.loads(asked.stdout)["links"]) == 3
    finally:
        coord("stop", "--config", str(config), "long", env=env, timeout=120)


def test_rdma_devices_a_saved_matrix_names_are_checked_against_each_nodes(three_nodes, tmp_path) -> None:
    config, env, root = three_nodes
    infiniband = Path("/sys/class/infiniband")
    if infiniband.is_dir() and any(infiniband.iterdir()):
        pytest.skip("this machine has RDMA devices: the test needs a machine without")
    matrix = tmp_path / "ibv.json"
    matrix.write_text(json.dumps([[None, "rdma_en5", "rdma_en6"], ["rdma_en5", None, None],
                                  ["rdma_en6", None, None]]))
    done = coord("doctor", "--config", str(config), "--json", "--bytes", "0", "--ibv-devices", str(matrix),
                 env=env, timeout=60)
    report = json.loads(done.stdout)
    # These local nodes are one Linux machine without RDMA devices: every device named is missing.
    assert done.returncode == 1 and report["status"] == "down"
    assert [(p["node"], p["device"]) for p in report["rdma"]] == [
        ("a", "rdma_en5"), ("a", "rdma_en6"), ("b", "rdma_en5"), ("c", "rdma_en6")]
    assert all("MLX_IBV_DEVICES names" in p["cause"] for p in report["rdma"])
    unreadable = tmp_path / "bad.json"
    unreadable.write_text("{not json")
    bad = coord("doctor", "--config", str(config), "--ibv-devices", str(unreadable), env=env, timeout=60)
    assert bad.returncode != 0 and "cannot read it as JSON" in bad.stderr
