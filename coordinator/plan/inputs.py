"""What a plan is made from, as the daemon holds it (:class:`PlanInputs`), and the readings of it that
several sections share: the rank order, the usable calibrations, the trainer, the expected recovery."""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from coordinator.config.cluster_file import NodeConfig
from coordinator.jobs.policy import restart_delay
from coordinator.launch.mlx_backend import BackendChoice
from coordinator.launch.mlx_lm_command import is_mlx_lm
from coordinator.launch.trainers import TrainerFacts, trainer_declared, trainer_named_in
from coordinator.plan.options import JobOptions, ResolvedOptions
from coordinator.plan.sizing import PlanSizing
from coordinator.readiness.calibration import is_stale, train_rate

if TYPE_CHECKING:
    from coordinator.plan.datasets import DatasetReport
    from coordinator.readiness.consistency import ConsistencyReport
    from coordinator.readiness.preflight import PreflightReport
    from coordinator.store.state import StoredCalibration

CALIBRATION_MODEL = "coord's calibration model, a 2-layer width-64 transformer at sequence length 32"


@dataclass(frozen=True)
class MeasuredTimings:
    """Seconds measured on this cluster (see :func:`timings_from_events`); empty: none yet."""

    launch_to_first_step_s: tuple[float, ...] = ()
    recovery_s: tuple[float, ...] = ()  # a failed attempt seen → the next attempt's first step
    stop_s: tuple[float, ...] = ()  # stopping every rank of an attempt, confirmed
    checkpoint_place_s: tuple[float, ...] = ()  # copying the resume checkpoint to every node
    step_s: float | None = None  # seconds per optimizer step of this job, from its record
    checkpoint_save_s: float | None = None  # seconds one checkpoint write costs a step


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan is made from, as the daemon holds it. Only ``nodes`` is required:
    each input left out makes the sections that need it say why they are empty."""

    nodes: tuple[NodeConfig, ...]
    # What each node's agent reports: read key by key, as the nodes' versions differ in what they report.
    facts: Mapping[str, Mapping[str, Any] | None] = field(default_factory=dict)
    calibrations: Mapping[str, StoredCalibration | None] = field(default_factory=dict)  # StateStore.calibration
    backend: BackendChoice | None = None  # choose_backend() / plan_backend()'s choice
    backend_error: str | None = None
    hostfile: Mapping[str, Any] | None = None  # coordinator.launch.hostfile.build_hostfile() document
    hostfile_path: str | None = None
    launch_argv: Sequence[str] | None = None  # the exact mlx.launch argv
    launch_env: Mapping[str, str] | None = None  # what coord adds to mlx.launch's environment
    training_command: Sequence[str] | None = None  # the job's command, as each rank runs it
    job_name: str | None = None
    consistency: ConsistencyReport | None = None  # coordinator.readiness.consistency.compare_nodes() of the code
    preflight: PreflightReport | None = None  # run_preflight()'s result
    sync_hook: str | None = None  # the cluster file's sync.hook
    keepalive_s: float | None = None  # the cluster file's ssh.keepalive_s
    timings: MeasuredTimings = MeasuredTimings()
    sizing: PlanSizing | None = None
    dataset: DatasetReport | None = None  # validate_data_dir()'s report
    options: JobOptions = JobOptions()
    # A job's replica checks (coordinator.jobs.fingerprints.comparison_summary) and its name
    replica_check: Mapping[str, Any] | None = None


# --- measured timings -------------------------------------------------------------------------

_FAILED_OUTCOMES = ("rank_failed", "node_lost", "hung", "launch_failed")


def timings_from_events(events: Sequence[Mapping[str, Any]]) -> MeasuredTimings:
    """Launch, recovery, stop and checkpoint-placement seconds from the daemon's job events
    (``StateStore.recent_events``, oldest first). A recovery runs from an attempt that
    ended in failure to the first step of that job's next attempt. Events name their job
    in the message prefix (``"JOB: ..."``; job names cannot hold ``": "``)."""
    launch, recovery, stopping, placing, held, steps = [], [], [], [], [], []
    failed_at: dict[str, float] = {}
    for event in events:
        kind, data = event.get("kind", ""), event.get("data") or {}
        job = str(event.get("message", "")).split(": ", 1)[0]
        if kind == "job.first_step":
            if isinstance(data.get("seconds"), (int, float)):
                launch.append(float(data["seconds"]))
            if job in failed_at:
                recovery.append(round(event["ts"] - failed_at.pop(job), 3))
        elif kind == "job.attempt_ended" and data.get("outcome") in _FAILED_OUTCOMES:
            failed_at[job] = event["ts"]
        elif kind in ("job.failed", "job.stopped", "job.succeeded"):
            failed_at.pop(job, None)
        elif kind == "job.stopped_ranks" and isinstance(data.get("seconds"), (int, float)):
            stopping.append(float(data["seconds"]))
        elif kind == "job.checkpoint_placed" and isinstance(data.get("seconds"), (int, float)):
            placing.append(float(data["seconds"]))
        elif kind == "job.checkpoint_saved" and isinstance(data.get("blocking_seconds"), (int, float)):
            # coord's trainer: what a save held training, and the step time when it did
            held.append(float(data["blocking_seconds"]))
            if isinstance(data.get("step_seconds"), (int, float)) and data["step_seconds"] > 0:
                steps.append(float(data["step_seconds"]))
    return MeasuredTimings(tuple(launch), tuple(recovery), tuple(stopping), tuple(placing),
                           step_s=statistics.median(steps) if steps else None,
                           checkpoint_save_s=statistics.median(held) if held else None)


# --- what several sections share --------------------------------------------------------------


def rank_order(inputs: PlanInputs) -> tuple[list[str], str]:
    """The nodes in rank order, and why that order."""
    choice = inputs.backend
    if choice and choice.get("ok") and choice.get("order"):
        return list(choice["order"]), f"rank order of the {choice['backend']} backend chosen from the measured links"
    return [node.name for node in inputs.nodes], "cluster file order (no backend chosen yet)"


def usable_calibrations(inputs: PlanInputs, order: Sequence[str]) -> tuple[dict[str, StoredCalibration],
                                                                           dict[str, str]]:
    """({node: current calibration record with a training rate}, {node: why it has none})."""
    usable: dict[str, StoredCalibration] = {}
    lacking: dict[str, str] = {}
    for name in order:
        record, facts = inputs.calibrations.get(name), inputs.facts.get(name)
        if not record:
            lacking[name] = "no calibration yet"
            continue
        if facts is None:
            lacking[name] = "its facts are unknown, so its calibration cannot be checked: is the node up?"
            continue
        stale, why = is_stale(record, facts, refresh=False)
        if stale:
            lacking[name] = why
        elif train_rate(record) is None:
            lacking[name] = "its calibration has no training-step rate"
        else:
            usable[name] = record
    return usable, lacking


def usable_rate(record: StoredCalibration) -> float:
    """The training-step rate of a calibration :func:`usable_calibrations` kept (it keeps only those with one)."""
    rate = train_rate(record)
    assert rate is not None, "not a usable calibration"
    return rate


def calibration_source(name: str, record: StoredCalibration) -> str:
    result = record.get("result") or {}
    return (f"calibration {utc(record.get('measured_at'))} on {name}: {train_rate(record):.4g} samples/s "
            f"({result.get('device') or 'device unknown'})")


def expected_recovery(inputs: PlanInputs) -> tuple[float | None, str]:
    """Seconds from a failure being seen to training again, and how that was found."""
    timings = inputs.timings
    if timings.recovery_s:
        return (round(statistics.median(timings.recovery_s), 1),
                f"measured: median of {_count(timings.recovery_s, 'recovery', 'recoveries')} on this cluster "
                "(failed attempt seen → first step of the next attempt)")
    if not timings.launch_to_first_step_s:
        return None, ("no job has reached its first step on this cluster yet; run one (coord run, or coord demo "
                      "on this machine) and the plan uses the measured launch and recovery times")
    total = restart_delay(0)
    parts = ["first restart at once (coord's restart policy)" if not total else
             f"first restart backoff {total:g} s (coord's restart policy)"]
    for measured, what in ((timings.stop_s, "stopping every rank"), (timings.checkpoint_place_s,
                                                                     "copying the checkpoint to every node"),
                           (timings.launch_to_first_step_s, "launch to first step")):
        if measured:
            total += statistics.median(measured)
            parts.append(f"{what} {statistics.median(measured):.1f} s (median of {_count(measured, 'run', 'runs')})")
        else:
            parts.append(f"{what} not included (not measured yet)")
    return round(total, 1), "estimate: " + " + ".join(parts)


def trainer_of(inputs: PlanInputs, options: ResolvedOptions) -> tuple[TrainerFacts | None, str]:
    """(what the plan says of the trainer the ranks run, ``Trainer.plan``, and why that one); None for a
    script of the user's own."""
    command = list(inputs.training_command or [])
    if command and not is_mlx_lm(command):
        return None, "the training command is a script of its own, not mlx_lm lora"
    named = trainer_named_in(command)
    if named is not None:
        declared = trainer_declared(named)
        return declared.plan, f"the training command runs {declared.program}"
    trainer, source = options["trainer"]
    facts = trainer_declared(trainer).plan
    if not command:
        source += "; no training command given, so mlx_lm lora's options are assumed"
    return facts, f"{facts['name']}; {source}"


def utc(timestamp: Any) -> str:
    if not isinstance(timestamp, (int, float)):
        return "(time unknown)"
    return time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime(timestamp))


def _count(items: Sequence[Any], one: str, many: str) -> str:
    return f"{len(items)} {one if len(items) == 1 else many}"
