"""The per-rank gauges of the watch of stragglers in /metrics (coordinator/observe/metrics/prometheus.py),
read from a running job's record: each rank's compute time and its score, labelled with its node; and
the gauges of a job's checkpoint store, read from the record's durability."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from coordinator.jobs.record import Durability, JobRecord
from coordinator.observe.metrics.prometheus import cluster_registry, metrics_text

STORE_METRICS = ("coord_job_durable_step", "coord_job_durability_lag_seconds", "coord_job_durability_lag_steps",
                 "coord_job_store_bytes_per_second")


def _one_job(record: JobRecord, state: str = "running") -> tuple[SimpleNamespace, SimpleNamespace, SimpleNamespace]:
    """A job named "tiny" whose newest run has ``record``: the runner, the job manager and the cluster."""
    runner = SimpleNamespace(record=record, spec=SimpleNamespace(total_steps=None), state=state,
                             run_id=record.run_id)
    jobs = SimpleNamespace(jobs={"tiny": runner}, runs={record.run_id: runner})
    return runner, jobs, SimpleNamespace(sessions={}, config=SimpleNamespace(name="lab"))


def _samples(record: JobRecord, state: str = "running") -> dict[str, list[tuple[dict[str, str], float]]]:
    _, jobs, cluster = _one_job(record, state)
    text, _ = metrics_text(cluster_registry(cluster, jobs, SimpleNamespace(latest={})))
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def test_each_running_rank_has_its_compute_time_and_straggler_score():
    record = JobRecord(run_id="tiny-1", order=["n1", "n2", "n3"], rank_compute={"0": 0.1, "1": 0.1, "2": 0.6},
                       rank_scores={"0": 1.0, "1": 1.0, "2": 6.0})
    runner, jobs, cluster = _one_job(record)
    text, _ = metrics_text(cluster_registry(cluster, jobs, SimpleNamespace(latest={})))
    samples = {(s.name, s.labels.get("rank"), s.labels.get("node")): s.value
               for family in text_string_to_metric_families(text.decode()) for s in family.samples}
    assert samples[("coord_rank_compute_seconds", "2", "n3")] == 0.6
    assert samples[("coord_rank_straggler_score", "2", "n3")] == 6.0
    assert samples[("coord_rank_straggler_score", "0", "n1")] == 1.0
    runner.state = "succeeded"  # a finished run's ranks are not shown
    text, _ = metrics_text(cluster_registry(cluster, jobs, SimpleNamespace(latest={})))
    assert b"coord_rank_straggler_score{" not in text


def test_a_job_with_a_checkpoint_store_has_its_durable_step_lag_and_upload_speed():
    record = JobRecord(run_id="tiny-1", step=57, durability=Durability(
        store="s3://bucket/coord/tiny-1", durable_step=40, lag_steps=10, lag_seconds=73.5, bytes_per_s=12.5e6,
        error=None))
    samples = _samples(record)
    assert samples["coord_job_durable_step"] == [({"job": "tiny"}, 40.0)]
    assert samples["coord_job_durability_lag_seconds"] == [({"job": "tiny"}, 73.5)]
    assert samples["coord_job_durability_lag_steps"] == [({"job": "tiny"}, 10.0)]
    assert samples["coord_job_store_bytes_per_second"] == [({"job": "tiny"}, 12.5e6)]
    # A finished run keeps what it left in the store: still shown, as its other gauges are.
    assert _samples(record, "succeeded")["coord_job_durable_step"] == [({"job": "tiny"}, 40.0)]


def test_nothing_committed_yet_has_a_lag_but_no_durable_step_nor_speed():
    record = JobRecord(run_id="tiny-1", step=20, durability=Durability(
        store="file:///mnt/nas/coord/tiny-1", durable_step=None, lag_steps=20, lag_seconds=310.0, bytes_per_s=None,
        error="[Errno 111] Connection refused"))
    samples = _samples(record)
    assert samples["coord_job_durability_lag_seconds"] == [({"job": "tiny"}, 310.0)]
    assert samples["coord_job_durability_lag_steps"] == [({"job": "tiny"}, 20.0)]
    assert "coord_job_durable_step" not in samples and "coord_job_store_bytes_per_second" not in samples


def test_a_job_without_a_checkpoint_store_has_none_of_its_gauges():
    samples = _samples(JobRecord(run_id="tiny-1", step=20))
    assert samples["coord_job_step"] == [({"job": "tiny"}, 20.0)]
    assert not set(STORE_METRICS) & set(samples)
