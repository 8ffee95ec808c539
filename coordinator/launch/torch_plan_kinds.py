"""What ``coord plan --launcher NAME`` plans for each PyTorch launcher that takes a plan's settings:
the strategies it tries, smallest first; the one that offloads to the host; whether it can offload
to NVMe; and the file its settings are written to, and in which format. Each is part of its launcher's
declaration (``Capabilities.gpu_plan``, coordinator/launch/registry.py); the planning itself
(coordinator/plan/) reads it from there, never by the launcher's name."""

from __future__ import annotations

from coordinator.launch.kinds import PlanKind

ACCELERATE_PLAN = PlanKind(("DDP", "FSDP-SHARD_GRAD_OP", "FSDP-FULL_SHARD"), "FSDP-FULL_SHARD+offload", False, "yaml",
                           "accelerate-{node}.yaml")
DEEPSPEED_PLAN = PlanKind(("DDP", "ZeRO-2", "ZeRO-3"), "ZeRO-3+offload", True, "json", "ds_config.json")
