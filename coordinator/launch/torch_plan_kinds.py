"""What ``coord plan --launcher NAME`` plans for each PyTorch launcher that takes a plan's settings:
the strategies it tries, smallest first; the one that offloads to the host; whether it can offload
to NVMe; and the file its settings are written to, and in which format. The planning itself
(coordinator/plan/) reads these, never the launcher's name."""

from __future__ import annotations

from typing import Literal, NamedTuple


class PlanKind(NamedTuple):
    ladder: tuple[str, ...]  # the strategies tried, the least sharded first
    offload: str  # the strategy that offloads parameters and optimizer state to the host
    nvme_offload: bool  # it can offload to NVMe when the host's memory is short too
    config: Literal["json", "yaml"]  # the format of its settings file
    config_name: str  # the file's name; {node} is the first node's name (a file per node)

    def config_file(self, first_node: str) -> str:
        return self.config_name.format(node=first_node)


PLAN_KINDS: dict[str, PlanKind] = {
    "accelerate": PlanKind(("DDP", "FSDP-SHARD_GRAD_OP", "FSDP-FULL_SHARD"), "FSDP-FULL_SHARD+offload", False, "yaml",
                           "accelerate-{node}.yaml"),
    "deepspeed": PlanKind(("DDP", "ZeRO-2", "ZeRO-3"), "ZeRO-3+offload", True, "json", "ds_config.json"),
}
