"""Run and keep running, on the multi-host cluster: a real mlx_lm fine-tune over three nodes
(different users, homes and venvs), one rank SIGKILLed midway."""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.cluster.jobs import at_step, events, finish, rank_pid, ranks_left, submit, tiny_project_and_daemon
from tests.integration.daemon_harness import coord

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def running(netns_cluster):
    with tiny_project_and_daemon(netns_cluster) as holder:
        yield holder["daemon"], holder["project"]


def test_a_killed_rank_resumes_from_the_newest_checkpoint_on_three_nodes(netns_cluster, running):
    daemon, project = running
    submit(daemon, project, "tiny3", "--hang-timeout", "120")
    _, killed_at = at_step(netns_cluster, daemon, "tiny3", 25,
                           lambda job: os.kill(rank_pid(netns_cluster, job, 1), signal.SIGKILL))
    final = finish(daemon, "tiny3")
    assert final["restarts"] == 1, final["story"]
    found = events(daemon, "tiny3")
    resumed = [e for e in found if e["kind"] == "job.resume_from"]
    assert resumed, found
    resume_step = resumed[-1]["data"]["step"]
    assert killed_at - resume_step <= 10  # at most one checkpoint interval redone
    ended = [e for e in found if e["kind"] == "job.attempt_ended" and "exited with status 137 (SIGKILL)" in e["message"]]
    assert ended, found
    # the exit was seen by a poll (every 0.5 s) soon after it happened; a generous bound, against hangs
    assert ended[0]["data"]["seconds"] < 3, ended
    left = ranks_left(netns_cluster)  # no rank is left running anywhere
    assert left == {}, (left, [f"{e['kind']}: {e['message']}" for e in events(daemon, "tiny3")][-30:])
    # each rank's output is kept on the head, per attempt and per rank
    logs = coord("logs", "--config", str(daemon.config), "--rank", "0", "--attempt", "1", "tiny3", env=daemon.env)
    assert logs.returncode == 0 and logs.stdout


def test_the_plan_of_this_cluster_validates_and_traces_to_what_was_measured(netns_cluster, running):
    """After a real run (launch and recovery measured) and a calibration: coord plan --json."""

    import jsonschema

    from coordinator.plan.document import load_schema

    daemon, project = running
    calibrated = coord("calibrate", "--json", "--config", str(daemon.config), env=daemon.env, timeout=600)
    assert calibrated.returncode == 0, calibrated.stderr
    result = coord("plan", "--json", "--config", str(daemon.config), "--model", str(project / "model"), "--data",
                   str(project / "data"), "--fine-tune-type", "full", "--batch-size", "1", "--learning-rate", "1e-4",
                   "--trainer", "coord", "--name", "tiny3", env=daemon.env, timeout=600)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    if os.environ.get("COORD_PLAN_EXAMPLE"):  # how docs/plan-example.json is made
        with open(os.environ["COORD_PLAN_EXAMPLE"], "w") as handle:
            json.dump(doc, handle, indent=2, sort_keys=True)
    jsonschema.validate(doc, load_schema("plan-v2.0.0"))
    assert doc["strategy"]["total_gpus"] == 3
    assert set(doc["hardware_calibration"]["measured_performance"]) == {"n1", "n2", "n3"}
    assert doc["worker_consistency"]["agreement_ratio"] == 1.0
    assert doc["rdma_config"]["enabled"] is False and doc["rdma_config"]["reason"]
    recovery = doc["checkpoint_strategy"]
    assert recovery["expected_recovery_time"] and "measured" in recovery["sources"]["expected_recovery_time"]
    assert doc["memory_sizing"]["recommendation"]["kind"] == "data_parallel"
    assert doc["memory_sizing"]["by_fine_tune_type"]["lora"]["replicas"] == ["n1", "n2", "n3"]
    assert doc["data_validation"]["ok"] is True and doc["data_validation"]["splits"]["train"]["bad_count"] == 0
    # every value says where it comes from, or the section why it is empty (coord's own two
    # reports, sizing and the data check, state their rules inside)
    for name, section in doc.items():
        if isinstance(section, dict) and section.get("enabled") is not False and \
                name not in ("memory_sizing", "data_validation"):
            filled = [k for k in section if k not in ("sources", "missing", "enabled")]
            assert all(k in section.get("sources", {}) for k in filled), (name, filled, section.get("sources"))
