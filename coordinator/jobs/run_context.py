"""What every part of one run's supervisor shares, and nothing more: the effects, the spec, the
run's identity and record, saving it, its events, its state and a stop asked for.

The parts (rank watching, checkpoint keeping, replication, node health) each take this and
the little else they use; none reaches into another's state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
import structlog

from coordinator.jobs.effects import JobEffects
from coordinator.jobs.record import JobRecord
from coordinator.jobs.spec import JobSpec
from coordinator.jobs.states import FINISHED, JobState, check_transition

log = structlog.get_logger("job")


@dataclass(frozen=True)
class Waiting:
    """What a run waits for before its next attempt (coordinator.jobs.node_wait), as coord shows it."""

    nodes: list[str]  # the nodes not up
    reasons: dict[str, str]  # node -> why it is not up (its session's last error)
    why: str  # what the wait needs: every node, or enough of them
    since: float  # wall clock
    limit_s: float  # the job's --node-wait


class RunContext:
    def __init__(self, fx: JobEffects, spec: JobSpec, *, run_id: str, record: JobRecord | None,
                 state: str):
        self.fx = fx
        self.spec = spec
        self.run_id = run_id
        self._spec_fields = spec.as_dict()  # saved with every progress record: made once
        self.record = record or JobRecord(run_id=run_id, total_steps=spec.total_steps, started=fx.now())
        self.record.run_id = run_id
        self.state = JobState(state)
        self.log = log.bind(job=spec.name, run=run_id)
        self.stop_requested = False
        self.stop_asked = anyio.Event()  # wakes a restart's backoff or a wait for nodes at once
        self.waiting: Waiting | None = None  # while the nodes of the next attempt are waited for
        if self.record.stop_requested and self.state not in FINISHED:
            self.stop_requested = True
            self.stop_asked.set()

    def save(self) -> None:
        self.fx.save_run(self.run_id, self.spec.name, self._spec_fields, self.state, self.record.to_json())

    def event(self, kind: str, message: str, **data: Any) -> None:
        self.log.info(kind, message=message, **data)
        self.fx.event(f"job.{kind}", f"{self.spec.name}: {message}", {"run": self.run_id, **data})

    def set_state(self, state: str) -> None:
        """The one place a run's state changes: checked against the table (coordinator/jobs/states.py), then saved."""
        self.state = check_transition(self.state, state)
        self.save()

    def request_stop(self) -> None:
        """coord stop: kept with the run, so that a daemon restarted before it took effect still honours it."""
        self.stop_requested = True
        self.stop_asked.set()
        self.record.stop_requested = True
        self.save()

    async def pause(self, seconds: float) -> None:
        """Sleep between attempts or polls, cut short by a stop."""
        with anyio.move_on_after(seconds):
            await self.stop_asked.wait()

    def job_nodes(self) -> list[str]:
        """The nodes this job holds: the ones it names (coord run --nodes), else every node."""
        return list(self.spec.nodes) if self.spec.nodes else self.fx.node_names()
