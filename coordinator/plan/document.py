"""The version 2.0.0 training plan: what coord would run, derived from what it measured.

``build_plan(inputs)`` is a pure function of plain data the daemon already holds (node
facts, calibration records, the backend chosen from the measured links, the consistency
report, the pre-flight result, the launch command, past job timings) and the job's
options. The sections and field names follow the format (``../shared/formats``); coord
adds to every section:

- ``"sources"``: ``{field: where its value comes from}``: a measurement (which node,
  when, what was measured) or a stated rule (``"rule: total = per-rank × ranks × ..."``);
- ``"missing"``: ``{field: why it is not filled}``, for a format field coord cannot fill.

A section that cannot be filled at all is ``{"enabled": false, "reason": ...}``, and the
reason names the command that fills it. Nothing is guessed: no value without a source.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any, NotRequired, TypedDict

from coordinator.jobs.diagnosis import Diagnosis
from coordinator.plan.datasets import DatasetReport
from coordinator.plan.inputs import PlanInputs
from coordinator.plan.options import resolve_options
from coordinator.plan.provenance import DisabledSection
from coordinator.plan.sections.checkpoint import CheckpointSection, checkpoint_section
from coordinator.plan.sections.distributed import (
    DistributedSection,
    RdmaSection,
    distributed_section,
    rdma_section,
)
from coordinator.plan.sections.readiness import (
    ChecklistSection,
    ChunkingSection,
    ConsistencySection,
    PreRdmaSyncSection,
    checklist_section,
    chunking_section,
    consistency_section,
    pre_rdma_sync_section,
)
from coordinator.plan.sections.training import (
    BatchSection,
    HardwareSection,
    PerformanceSection,
    StrategySection,
    batch_section,
    hardware_section,
    performance_section,
    strategy_section,
    verification_steps,
)
from coordinator.plan.sizing import FitPlan
from coordinator.plan.torch_configs import TorchPlanSection

#: A JSON Schema document, as its file holds it: free-form JSON, read by jsonschema.
JsonSchema = dict[str, Any]

VERSION = "2.0.0"
SECTIONS = ("strategy", "batch_configuration", "distributed_config", "rdma_config", "checkpoint_strategy",
            "performance_targets", "verification_steps", "pre_rdma_sync", "hardware_calibration",
            "worker_consistency", "coordinator_chunking", "pre_flight_checklist")


class PlanDocument(TypedDict):
    """The version 2.0.0 plan (``schemas/plan-v2.0.0.schema.json``), with coord's additions."""

    version: str
    strategy: StrategySection
    batch_configuration: BatchSection
    distributed_config: DistributedSection
    rdma_config: RdmaSection
    checkpoint_strategy: CheckpointSection
    performance_targets: PerformanceSection
    verification_steps: list[str]
    pre_rdma_sync: PreRdmaSyncSection
    hardware_calibration: HardwareSection
    worker_consistency: ConsistencySection
    coordinator_chunking: ChunkingSection
    pre_flight_checklist: ChecklistSection
    # Added by the daemon (coordinator/commands/plan.py), which holds what they are made from:
    memory_sizing: NotRequired[FitPlan | DisabledSection]  # the model's memory estimate, per node
    data_validation: NotRequired[DatasetReport | DisabledSection]  # the data set, line by line
    known_failures: NotRequired[list[Diagnosis]]  # coordinator.jobs.diagnosis's, each with its fix
    pytorch: NotRequired[TorchPlanSection | DisabledSection]  # coord plan --launcher accelerate|deepspeed


def build_plan(inputs: PlanInputs) -> PlanDocument:
    """The version 2.0.0 plan document; raises PlanInputError for unusable job options."""
    options = resolve_options(inputs.options, [node.name for node in inputs.nodes], inputs.sizing)
    return {
        "version": VERSION,
        "strategy": strategy_section(inputs, options),
        "batch_configuration": batch_section(inputs, options),
        "distributed_config": distributed_section(inputs, options),
        "rdma_config": rdma_section(inputs),
        "checkpoint_strategy": checkpoint_section(inputs, options),
        "performance_targets": performance_section(inputs, options),
        "verification_steps": verification_steps(inputs, options),
        "pre_rdma_sync": pre_rdma_sync_section(inputs, options),
        "hardware_calibration": hardware_section(inputs, options),
        "worker_consistency": consistency_section(inputs),
        "coordinator_chunking": chunking_section(inputs),
        "pre_flight_checklist": checklist_section(inputs, options),
    }


def load_schema(name: str = "plan-v2.0.0") -> JsonSchema:
    """A JSON Schema shipped with coord: plan-v2.0.0, orchestration-input, orchestration-output."""
    text = resources.files("coordinator.plan").joinpath("schemas", f"{name}.schema.json").read_text("utf-8")
    schema: JsonSchema = json.loads(text)
    return schema
