"""The daemon's side of alerts: its events in, its runs and nodes as plain facts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from coordinator.nodes.session import UP
from coordinator.observe.alerts.delivery import AlertDispatcher
from coordinator.observe.alerts.rules import NodeFacts, RunFacts

if TYPE_CHECKING:
    from coordinator.jobs.manager import JobManager
    from coordinator.jobs.supervisor import JobRunner
    from coordinator.nodes.cluster import Cluster


def attach_alerts(cluster: Cluster, jobs: JobManager) -> AlertDispatcher:
    """An AlertDispatcher that hears every event the cluster records; the daemon runs it."""
    dispatcher = AlertDispatcher(
        cluster.config.name, cluster.config.alerts, record_event=cluster.record_event,
        run_facts=lambda run_id: run_facts(jobs.runs.get(run_id)),
        facts=lambda: ([_facts_of(runner) for runner in list(jobs.runs.values())], node_facts(cluster)))
    cluster.listeners.append(dispatcher.on_event)
    return dispatcher


def run_facts(runner: JobRunner | None) -> RunFacts | None:
    """A job supervisor (coordinator.jobs.supervisor.JobRunner) as an alert sees it."""
    if runner is None:
        return None
    return _facts_of(runner)


def _facts_of(runner: JobRunner) -> RunFacts:
    record = runner.record
    return RunFacts(run_id=runner.run_id, name=runner.spec.name, state=runner.state, step=record.step,
                    total_steps=runner.spec.total_steps, restarts=record.restarts,
                    max_restarts=runner.spec.max_restarts, error=record.error,
                    last_progress=record.last_progress, launched_at=record.launched_at,
                    started=record.started)


def node_facts(cluster: Cluster) -> list[NodeFacts]:
    return [NodeFacts(name, session.state == UP, session.view.reason)
            for name, session in cluster.sessions.items()]
