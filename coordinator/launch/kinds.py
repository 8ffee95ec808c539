"""What a launcher declares about itself (``Capabilities``), and what of a job it reads (``JobCommand``).

Light on purpose: the job's spec check and the CLI's start read these, and import nothing else of the
launchers (the seam itself, coordinator/launch/seam.py, brings the links' types and what they need).
Plain tuples and protocols: no dataclasses, which `coord sync`'s start does without.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, Protocol


class CommandError(ValueError):
    """The job's command, or an option of it, cannot be run as given; the message says why."""


class JobCommand(Protocol):
    """What of a job a launcher reads (``coordinator.jobs.spec.JobSpec`` is one)."""

    @property
    def command(self) -> Sequence[str]: ...
    @property
    def source(self) -> str | None: ...
    @property
    def trainer(self) -> str: ...
    @property
    def total_steps(self) -> int | None: ...
    @property
    def save_every(self) -> int: ...
    @property
    def procs_per_node(self) -> int | None: ...  # processes per node (None: the launcher's own rule)
    @property
    def global_batch(self) -> int | None: ...  # examples per optimizer step, kept on a shrink
    @property
    def micro_batch(self) -> int | None: ...  # examples per process per micro-step
    @property
    def launcher_config(self) -> dict[str, Any] | None: ...  # a plan's settings for the launcher (free-form)
    @property
    def env_style(self) -> str | None: ...  # a framework's own variables beside coord's (--env-style)


#: The job options that only some launchers take, by the JobSpec field that holds each.
OPTIONS = ("procs_per_node", "global_batch", "micro_batch", "launcher_config", "env_style", "backend")


class PlanKind(NamedTuple):
    """What ``coord plan --launcher NAME`` plans for a launcher that sizes its jobs per GPU and takes a
    plan's settings (coordinator/plan/torch_plan.py reads it, never the launcher's name)."""

    ladder: tuple[str, ...]  # the strategies tried, the least sharded first
    offload: str  # the strategy that offloads parameters and optimizer state to the host
    nvme_offload: bool  # it can offload to NVMe when the host's memory is short too
    config: Literal["json", "yaml"]  # the format of its settings file
    config_name: str  # the file's name; {node} is the first node's name (a file per node)

    def config_file(self, first_node: str) -> str:
        return self.config_name.format(node=first_node)


class Capabilities(NamedTuple):
    """What a launcher declares about itself, so that nothing outside the seam asks which one a job has."""

    # Where an attempt starts: "head" (one process on the head starts every rank over SSH: ``start``),
    # or "nodes" (each node's agent starts its own rank once its script is prepared).
    runs_on: Literal["head", "nodes"]
    # The framework check sets pre-flight runs for its jobs, in this order, besides the checks every job
    # gets (their names: CHECK_SETS in coordinator/readiness/preflight.py); none: only those.
    preflight: tuple[str, ...] = ()
    # What a plan reads from every node besides its links (``NodeReadings.facts``): the agent call that
    # answers it (shared/agent_api/methods.py), asked once per session of each node; None: the links alone.
    node_facts: str | None = None
    # Each node of an attempt may hold a part of a checkpoint directory (its processes' own files, their
    # shards), so every node is listed and the parts joined; else a checkpoint is whole where it lies.
    checkpoint_parts: bool = False
    # The options of OPTIONS its jobs may give; any other is refused when the job is checked.
    options: frozenset[str] = frozenset()
    # The job's command is a program of the user's own (a script, a binary): mlx-lm's fine-tune and
    # coord's own trainer are not for this launcher.
    own_program: bool = False
    # A node whose rank runs ``python -m MODULE`` keeps a warm standby with MODULE imported, for the next
    # attempt to claim (agent/standby.py): only for a launcher's own module, whose import does nothing
    # else; never for a user's program, whose import might start its work.
    standby: bool = False
    # What it needs on every node besides its framework, for pre-flight to check: distributions by name
    # ("accelerate"), and "c++" for a C++ compiler and Python's headers (ops built on the node).
    needs: frozenset[str] = frozenset()
    # Where the launcher's check of a job's command lives ("module:function", imported only when a job
    # names this launcher): called with the job; raises CommandError when it cannot be run as given.
    command_check: str | None = None
    # How ``coord plan`` sizes its jobs: "per_node" (one rank per node holding the whole model: the plan's
    # memory_sizing and batch), "per_gpu" (the plan's pytorch section, by ``gpu_plan``); None: coord plan
    # does not plan for it.
    plan: Literal["per_node", "per_gpu"] | None = None
    # A "per_gpu" plan's strategies and settings file (coordinator/launch/torch_plan_kinds.py).
    gpu_plan: PlanKind | None = None
    # The model frameworks its jobs run, as an orchestration input names them (modelConfig.framework,
    # any case), so that a plan can say which launcher plans one it does not.
    frameworks: frozenset[str] = frozenset()
