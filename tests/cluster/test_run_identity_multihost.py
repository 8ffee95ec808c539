"""Every run its own identity, on the multi-host cluster: a name run twice, a daemon on a new
state dir beside an earlier run's files, and rank 0's node lost for good while a restart is
already under way. None of these may resume from what another run left, or end in an
internal error."""

from __future__ import annotations

import json

import pytest

from tests.cluster.jobs import TOTAL_STEPS, TRAIN, events, finish, submit, tiny_project_and_daemon, wait_event
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment

pytestmark = pytest.mark.cluster


@pytest.fixture
def running(netns_cluster):
    with tiny_project_and_daemon(netns_cluster) as holder:
        yield holder


def run_events(daemon, run_id: str) -> list[dict]:
    return [e for e in events(daemon) if (e.get("data") or {}).get("run") == run_id]


def assert_trained_from_scratch(daemon, final: dict) -> None:
    found = run_events(daemon, final["run_id"])
    story = "\n".join(f"{e['kind']}: {e['message']}" for e in found)
    assert not any(e["kind"] == "job.resume_from" for e in found), story
    first = [e for e in found if e["kind"] == "job.first_step"]
    assert first and first[0]["data"]["step"] < TOTAL_STEPS // 2, story
    assert final["restarts"] == 0 and final["attempt"] == 0, story
    assert not any("internal error" in e["message"] for e in found), story


@pytest.mark.timeout(900)
def test_a_job_name_run_twice_trains_twice_and_the_first_run_stays_readable(running):
    daemon = running["daemon"]
    submit(daemon, running["project"], "twice")
    first = finish(daemon, "twice")
    submit(daemon, running["project"], "twice")
    second = finish(daemon, "twice")
    assert first["run_id"] != second["run_id"]
    assert_trained_from_scratch(daemon, second)
    every = json.loads(coord("status", "--json", "--all", "--config", str(daemon.config), env=daemon.env).stdout)
    runs = [j["run_id"] for j in every["jobs"] if j["name"] == "twice"]
    assert runs == [first["run_id"], second["run_id"]], runs
    newest_only = json.loads(coord("status", "--json", "--config", str(daemon.config), env=daemon.env).stdout)
    assert [j["run_id"] for j in newest_only["jobs"] if j["name"] == "twice"] == [second["run_id"]]
    old_log = coord("logs", "--config", str(daemon.config), first["run_id"], env=daemon.env)
    assert old_log.returncode == 0 and old_log.stdout.strip(), old_log.stderr


@pytest.mark.timeout(900)
def test_a_daemon_on_a_new_state_dir_never_reads_an_earlier_runs_files_on_the_nodes(netns_cluster, running):
    daemon, root = running["daemon"], running["root"]
    submit(daemon, running["project"], "stale")
    first = finish(daemon, "stale")
    daemon.stop()
    # Same nodes, same workdirs (they keep .coord/jobs and checkpoints of the first run), new state.
    config = netns_cluster.write_cluster_toml(root / "fresh.toml", state_dir=root / "fresh-state")
    fresh = DaemonProcess(config, env=environment(), prefix=["ip", "netns", "exec", netns_cluster.head_ns])
    running["daemon"] = fresh  # stopped by the fixture
    fresh.start()
    fresh.wait_for(all_up, 30, "all nodes up under the new daemon")
    submit(fresh, running["project"], "stale")
    second = finish(fresh, "stale")
    assert second["run_id"] != first["run_id"]
    assert_trained_from_scratch(fresh, second)


@pytest.mark.timeout(900)
def test_rank_0s_node_lost_for_good_with_min_nodes_ends_as_an_outcome_not_an_internal_error(netns_cluster,
                                                                                             running):
    daemon = running["daemon"]
    # batch 6: 3 or 2 ranks; long enough that the replica of step 20 lands on the head before the cut
    # (a node lost before the daemon has catalogued its checkpoints takes them along: tested in
    # the simulator) and the run is still going when it does.
    steps = 400
    command = [{"3": "6", str(TOTAL_STEPS): str(steps)}.get(w, w) for w in TRAIN]
    submit(daemon, running["project"], "gone", "--min-nodes", "2", "--node-timeout", "5", "--trainer", "coord",
           "--hang-timeout", "300", command=command)
    wait_event(daemon, "gone", "job.replicated", 600, "the replica of step 20",
               where=lambda e: (e.get("data") or {}).get("step", 0) >= 20)
    doc = json.loads(coord("status", "--json", "--config", str(daemon.config), env=daemon.env).stdout)
    job = next(j for j in doc["jobs"] if j["name"] == "gone")
    assert job["state"] == "running" and job["step"] < steps, job
    lost = job["nodes"][0]
    netns_cluster.cut_link(lost)
    try:
        final = finish(daemon, "gone", steps=steps)
    finally:
        netns_cluster.restore_link(lost)
    found = run_events(daemon, final["run_id"])
    story = "\n".join(f"{e['kind']}: {e['message']}" for e in found)
    assert lost not in final["nodes"] and len(final["nodes"]) == 2, story
    assert not any("internal error" in e["message"] or "ExceptionGroup" in e["message"] for e in found), story
    resumed = [e for e in found if e["kind"] == "job.resume_from"]
    assert resumed and resumed[-1]["data"]["step"] >= 20, story


@pytest.mark.timeout(900)
def test_a_second_run_with_a_model_check_passes_preflight(netns_cluster, running):
    """The agent keeps its hash cache in <model>/.coord/; a model check that hashed it blocked every
    second run with 'model.files: insufficient consensus'."""
    daemon, root = running["daemon"], running["root"]
    daemon.stop()
    config = netns_cluster.write_cluster_toml(root / "model.toml", state_dir=root / "model-state")
    with open(config, "a") as handle:
        handle.write('\n[sync]\nmodel = "model"\ndata = ["data/train.jsonl", "data/valid.jsonl"]\n')
    checked = DaemonProcess(config, env=environment(), prefix=["ip", "netns", "exec", netns_cluster.head_ns])
    running["daemon"] = checked  # stopped by the fixture
    checked.start()
    checked.wait_for(all_up, 30, "all nodes up")
    submit(checked, running["project"], "modeled")
    first = finish(checked, "modeled")
    preflight = coord("preflight", "--json", "--config", str(config), env=checked.env, timeout=300)
    model = next(c for c in json.loads(preflight.stdout)["checks"] if c["name"] == "model.files")
    assert model["status"] == "pass", model
    submit(checked, running["project"], "modeled")
    second = finish(checked, "modeled")
    assert second["run_id"] != first["run_id"]
    passed = [e for e in run_events(checked, second["run_id"]) if e["kind"] == "job.preflight_passed"]
    assert passed, "\n".join(e["message"] for e in run_events(checked, second["run_id"]))
