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
from typing import Any

from coordinator.plan.inputs import PlanInputs
from coordinator.plan.options import resolve_options
from coordinator.plan.sections.checkpoint import checkpoint_section
from coordinator.plan.sections.distributed import distributed_section, rdma_section
from coordinator.plan.sections.readiness import (
    checklist_section,
    chunking_section,
    consistency_section,
    pre_rdma_sync_section,
)
from coordinator.plan.sections.training import (
    batch_section,
    hardware_section,
    performance_section,
    strategy_section,
    verification_steps,
)

VERSION = "2.0.0"
SECTIONS = ("strategy", "batch_configuration", "distributed_config", "rdma_config", "checkpoint_strategy",
            "performance_targets", "verification_steps", "pre_rdma_sync", "hardware_calibration",
            "worker_consistency", "coordinator_chunking", "pre_flight_checklist")


def build_plan(inputs: PlanInputs) -> dict[str, Any]:
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


def load_schema(name: str = "plan-v2.0.0") -> dict[str, Any]:
    """A JSON Schema shipped with coord: plan-v2.0.0, orchestration-input, orchestration-output."""
    text = resources.files("coordinator.plan").joinpath("schemas", f"{name}.schema.json").read_text("utf-8")
    return json.loads(text)
