"""Prometheus metrics of the daemon, read from its memory when scraped (nothing is counted as
events happen): a custom prometheus_client collector over the node sessions, the runs and
the latest node samples.

Names follow prometheus.io/docs/practices/naming: the ``coord_`` prefix, base units
(``_seconds``, ``_bytes``, a ratio for the GPU's utilisation), ``_total`` on counters,
``_info`` for constant labels. Job metrics carry ``job`` (the name people type); their
newest run is the one described, and ``coord_job_info`` maps a job to its run id and state.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from coordinator.nodes.session import UP
from shared.version import COORD_VERSION

if TYPE_CHECKING:
    from coordinator.jobs.manager import JobManager
    from coordinator.nodes.cluster import Cluster
    from coordinator.observe.metrics.history import MetricsHistory

RECOVERY_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ClusterCollector(Collector):
    """The cluster's nodes and runs, read when scraped."""

    def __init__(self, cluster: Cluster, jobs: JobManager, history: MetricsHistory) -> None:
        self.cluster = cluster
        self.jobs = jobs
        self.history = history

    def collect(self) -> Iterator[Metric]:
        yield from self._nodes()
        yield from self._jobs()
        yield self._recoveries()
        info = InfoMetricFamily("coord", "The coord daemon: its version and cluster")
        info.add_metric([], {"version": COORD_VERSION, "cluster": self.cluster.config.name})
        yield info

    def _nodes(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("coord_node_up", "1 when the node's agent is connected and answering, else 0",
                               labels=["node"])
        used = GaugeMetricFamily("coord_node_memory_used_bytes", "Memory in use on the node (latest sample)",
                                 labels=["node"])
        total = GaugeMetricFamily("coord_node_memory_total_bytes", "The node's physical memory", labels=["node"])
        gpu = GaugeMetricFamily("coord_node_gpu_utilization_ratio",
                                "The node's GPU utilisation, 0 to 1 (macOS ioreg; latest sample)", labels=["node"])
        power = GaugeMetricFamily("coord_node_power_watts", "The node's power draw (Macs with a battery only)",
                                  labels=["node"])
        latest = self.history.latest
        for name, session in self.cluster.sessions.items():
            up.add_metric([name], 1.0 if session.state == UP else 0.0)
            sample = latest.get(name)
            for family, key, scale in ((used, "memory_used_bytes", 1), (total, "memory_total_bytes", 1),
                                       (gpu, "gpu_utilization", 0.01), (power, "power_watts", 1)):
                value = sample.get(key) if sample else None
                if isinstance(value, (int, float)):
                    family.add_metric([name], value * scale)
        yield from (up, used, total, gpu, power)

    def _jobs(self) -> Iterator[Metric]:
        now = time.time()
        step = GaugeMetricFamily("coord_job_step", "The job's global step (its newest run)", labels=["job"])
        total = GaugeMetricFamily("coord_job_total_steps", "The job's total steps, when known", labels=["job"])
        loss = GaugeMetricFamily("coord_job_loss", "The job's latest training loss", labels=["job"])
        val_loss = GaugeMetricFamily("coord_job_validation_loss", "The job's latest validation loss", labels=["job"])
        speed = GaugeMetricFamily("coord_job_tokens_per_second", "The job's latest training throughput",
                                  labels=["job"])
        restarts = CounterMetricFamily("coord_job_restarts", "Restarts of the job's newest run", labels=["job"])
        age = GaugeMetricFamily("coord_checkpoint_age_seconds", "Seconds since the job's newest valid checkpoint",
                                labels=["job"])
        memory = GaugeMetricFamily("coord_rank_memory_bytes", "Resident memory of each running rank",
                                   labels=["job", "rank", "node"])
        compute = GaugeMetricFamily("coord_rank_compute_seconds", "Each running rank's compute time per step (outside "
                                    "its collectives), its median over the straggler window",
                                    labels=["job", "rank", "node"])
        score = GaugeMetricFamily("coord_rank_straggler_score", "Each running rank's compute time over the ranks' "
                                  "median (1: as fast as the median; a straggler is named at 1.5)",
                                  labels=["job", "rank", "node"])
        durable = GaugeMetricFamily("coord_job_durable_step", "The newest step of the job's checkpoints committed "
                                    "to its checkpoint store", labels=["job"])
        lag_s = GaugeMetricFamily("coord_job_durability_lag_seconds", "How long the job's oldest checkpoint not yet "
                                  "in its checkpoint store has waited (0: the store is caught up)", labels=["job"])
        lag_steps = GaugeMetricFamily("coord_job_durability_lag_steps", "The job's newest valid checkpoint's step "
                                      "over the newest in its checkpoint store", labels=["job"])
        store_speed = GaugeMetricFamily("coord_job_store_bytes_per_second", "The speed of the last upload of the "
                                        "job's checkpoints to its checkpoint store", labels=["job"])
        info = InfoMetricFamily("coord_job", "The job's newest run and its state", labels=["job"])
        for name, runner in self.jobs.jobs.items():
            record = runner.record
            step.add_metric([name], float(record.step or 0))
            if runner.spec.total_steps is not None:
                total.add_metric([name], float(runner.spec.total_steps))
            for family, value in ((loss, record.loss), (val_loss, record.val_loss), (speed, record.tokens_per_second)):
                if isinstance(value, (int, float)):
                    family.add_metric([name], float(value))
            restarts.add_metric([name], float(record.restarts or 0))
            last = record.last_checkpoint
            if last and last.get("time"):
                age.add_metric([name], max(0.0, now - float(last["time"])))
            if runner.state == "running":
                order = record.order or []
                for rank, value in sorted((record.rank_memory or {}).items(), key=lambda kv: int(kv[0])):
                    node = order[int(rank)] if int(rank) < len(order) else ""
                    memory.add_metric([name, str(rank), node], float(value))
                for family, values in ((compute, record.rank_compute), (score, record.rank_scores)):
                    for rank, value in sorted(values.items(), key=lambda kv: int(kv[0])):
                        family.add_metric([name, rank, order[int(rank)] if int(rank) < len(order) else ""],
                                          float(value))
            # Only a run with a checkpoint store has these; one with nothing committed yet has no durable
            # step (not 0, which would read as a checkpoint of step 0), and no speed before its first upload.
            durability = record.durability
            if durability is not None:
                if durability["durable_step"] is not None:
                    durable.add_metric([name], float(durability["durable_step"]))
                lag_s.add_metric([name], float(durability["lag_seconds"]))
                lag_steps.add_metric([name], float(durability["lag_steps"]))
                if durability["bytes_per_s"] is not None:
                    store_speed.add_metric([name], float(durability["bytes_per_s"]))
            info.add_metric([name], {"run_id": runner.run_id, "state": runner.state})
        yield from (step, total, loss, val_loss, speed, restarts, age, memory, compute, score, durable, lag_s,
                    lag_steps, store_speed, info)

    def _recoveries(self) -> Metric:
        """Every recovery of every run this cluster has had (kept with each run, so it survives restarts)."""
        seconds = [s for runner in self.jobs.runs.values() for s in runner.record.recoveries or []]
        buckets = [(_bound(b), float(sum(s <= b for s in seconds))) for b in RECOVERY_BUCKETS]
        buckets.append(("+Inf", float(len(seconds))))
        return HistogramMetricFamily("coord_recovery_seconds", "From a failed attempt's end to the next attempt's "
                                     "first step", buckets=buckets, sum_value=float(sum(seconds)))


def _bound(value: float) -> str:
    return f"{value:g}" if value != int(value) else f"{value:.1f}"


def metrics_text(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The exposition text of ``registry`` and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


def cluster_registry(cluster: Cluster, jobs: JobManager, history: MetricsHistory) -> CollectorRegistry:
    """A registry of the cluster's collector alone (not the process metrics of the default one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterCollector(cluster, jobs, history))
    return registry
