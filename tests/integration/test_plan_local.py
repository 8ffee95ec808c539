"""`coord plan` through the daemon on a local cluster: both documents validate against the schemas
that ship with coord, and a bad orchestration input is refused with the field named."""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest

from coordinator.plan.document import load_schema
from coordinator.cli.tinymodel import write_project
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir
from tests.integration.test_jobs_local import CLUSTER


@pytest.fixture(scope="module")
def cluster():
    root = short_tempdir()
    write_project(root / "project")
    config = root / "cluster.toml"
    config.write_text(CLUSTER.format(root=root))
    daemon = DaemonProcess(config, env=environment()).start()
    daemon.wait_for(all_up, 30, "all nodes up")
    yield daemon, root
    daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


def plan(daemon, *args):
    result = coord("plan", "--config", str(daemon.config), *args, env=daemon.env, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def test_the_plan_validates_and_says_where_its_values_come_from(cluster):
    daemon, root = cluster
    doc = json.loads(plan(daemon, "--json", "--model", str(root / "project" / "model"),
                          "--data", str(root / "project" / "data"), "--batch-size", "2",
                          "--learning-rate", "1e-4").stdout)
    jsonschema.validate(doc, load_schema("plan-v2.0.0"))
    assert doc["version"] == "2.0.0"
    batch = doc["batch_configuration"]
    assert batch["total_batch_size"] == 2 * 2 * batch["gradient_accumulation_steps"]
    assert "rule" in batch["sources"]["total_batch_size"]
    # a section coord cannot fill says why and what fills it, rather than inventing values
    assert doc["hardware_calibration"] == {"enabled": False, "reason": doc["hardware_calibration"]["reason"]}
    assert "coord calibrate" in doc["hardware_calibration"]["reason"]
    assert str(daemon.config.parent / "state" / "jobs" / "job" / "attempt-0" / "hostfile.json") in \
        doc["distributed_config"]["mlx_launch_command"]
    sizing = doc["memory_sizing"]  # the tiny model fits every node, with the rule behind each number
    assert sizing["recommendation"]["kind"] == "data_parallel"
    assert all(component["rule"] for component in sizing["estimate"]["components"])
    chunking = doc["coordinator_chunking"]  # 200 examples: below the 50,000 that are read in chunks
    assert chunking["enabled"] is False and chunking["examples"] == 200 and "50,000" in chunking["reason"]
    human = plan(daemon).stdout
    assert "hardware_calibration" in human and "coord plan --json" in human


def test_the_orchestration_document_validates_and_reads_its_input_form(cluster, tmp_path):
    daemon, _ = cluster
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"modelConfig": {"framework": "mlx"}, "dataConfig": {}, "clusterConfig": {"numNodes": 2},
                                   "trainingConfig": {"batchSize": 8, "epochs": 1}}))
    doc = json.loads(plan(daemon, "--json", "--schema", "orchestration", "--input", str(request)).stdout)
    jsonschema.validate(doc, load_schema("orchestration-output"))
    assert any("batchSize 8" in note for note in doc["requestNotes"])
    request.write_text(json.dumps({"modelConfig": {}, "dataConfig": {}, "clusterConfig": {},
                                   "trainingConfig": {"batchSize": "eight"}}))
    refused = coord("plan", "--config", str(daemon.config), "--schema", "orchestration", "--input", str(request),
                    env=daemon.env)
    assert refused.returncode == 2 and "batchSize" in refused.stderr


def test_a_data_set_with_a_bad_line_is_reported_in_the_plan_with_its_line_number(cluster, tmp_path):
    daemon, root = cluster
    data = tmp_path / "data"
    data.mkdir()
    good = (root / "project" / "data" / "train.jsonl").read_text().splitlines()
    (data / "train.jsonl").write_text("\n".join([good[0], good[1], '{"text": "cut off', good[2]]) + "\n")
    doc = json.loads(plan(daemon, "--json", "--data", str(data)).stdout)
    jsonschema.validate(doc, load_schema("plan-v2.0.0"))
    report = doc["data_validation"]
    assert report["ok"] is False and report["splits"]["train"]["bad_count"] == 1
    assert report["splits"]["train"]["bad_lines"][0]["line"] == 3
    assert "train.jsonl: 1 bad line(s), the first at line 3" in report["problems"][0]
    human = plan(daemon, "--data", str(data)).stdout
    assert "train.jsonl line 3:" in human
    assert json.loads(plan(daemon, "--json").stdout)["data_validation"]["enabled"] is False


def test_paths_in_an_orchestration_input_are_relative_to_the_file_and_sizes_are_explained(cluster):
    daemon, root = cluster
    request = root / "project" / "request.json"
    request.write_text(json.dumps({"modelConfig": {"path": "model", "size": "7B"},
                                   "dataConfig": {"path": "data", "size": "1GB"}, "clusterConfig": {},
                                   "trainingConfig": {"batchSize": 4, "epochs": 1}}))
    doc = json.loads(plan(daemon, "--json", "--schema", "orchestration", "--input", str(request)).stdout)
    jsonschema.validate(doc, load_schema("orchestration-output"))
    notes = " | ".join(doc["requestNotes"])
    assert "modelConfig.size '7B' is not used: the model is sized from its config.json" in notes
    assert "dataConfig.size '1GB' is not used: the data set is counted from its files" in notes
    assert "trainingConfig.epochs 1 = --iters 50" in notes  # 200 examples of the project's data / 4
    request.write_text(json.dumps({"modelConfig": {"path": "no-such-model"}, "dataConfig": {}, "clusterConfig": {},
                                   "trainingConfig": {}}))
    refused = coord("plan", "--config", str(daemon.config), "--schema", "orchestration", "--input", str(request),
                    env=daemon.env)
    assert refused.returncode == 2 and f"{root / 'project' / 'no-such-model'} (from {request})" in refused.stderr
