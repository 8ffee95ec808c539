"""The per-rank gauges of the watch of stragglers in /metrics (coordinator/observe/metrics/prometheus.py),
read from a running job's record: each rank's compute time and its score, labelled with its node."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from coordinator.jobs.record import JobRecord
from coordinator.observe.metrics.prometheus import cluster_registry, metrics_text


def test_each_running_rank_has_its_compute_time_and_straggler_score():
    record = JobRecord(run_id="tiny-1", order=["n1", "n2", "n3"], rank_compute={"0": 0.1, "1": 0.1, "2": 0.6},
                       rank_scores={"0": 1.0, "1": 1.0, "2": 6.0})
    runner = SimpleNamespace(record=record, spec=SimpleNamespace(total_steps=None), state="running", run_id="tiny-1")
    cluster = SimpleNamespace(sessions={}, config=SimpleNamespace(name="lab"))
    jobs = SimpleNamespace(jobs={"tiny": runner}, runs={"tiny-1": runner})
    text, _ = metrics_text(cluster_registry(cluster, jobs, SimpleNamespace(latest={})))
    samples = {(s.name, s.labels.get("rank"), s.labels.get("node")): s.value
               for family in text_string_to_metric_families(text.decode()) for s in family.samples}
    assert samples[("coord_rank_compute_seconds", "2", "n3")] == 0.6
    assert samples[("coord_rank_straggler_score", "2", "n3")] == 6.0
    assert samples[("coord_rank_straggler_score", "0", "n1")] == 1.0
    runner.state = "succeeded"  # a finished run's ranks are not shown
    text, _ = metrics_text(cluster_registry(cluster, jobs, SimpleNamespace(latest={})))
    assert b"coord_rank_straggler_score{" not in text
