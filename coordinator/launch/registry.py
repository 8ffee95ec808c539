"""Every launcher coord knows, by the name a job gives (``coord run --launcher NAME``), with what each
declares about itself (``coordinator.launch.seam.Capabilities``).

A launcher is registered here by its name, where it lives and its capabilities; its module is imported
the first time a job asks for it, so that checking a job's spec (which only needs the names and the
capabilities) does not load every launcher and what it uses (asyncssh, structlog: a third of a second
of `coord run`'s start). Everything outside ``coordinator/launch/`` that differs by launcher reads the
capabilities; nothing there asks for a launcher by name."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, NamedTuple

from coordinator.launch.kinds import Capabilities, PlanKind
from coordinator.launch.torch_plan_kinds import ACCELERATE_PLAN, DEEPSPEED_PLAN

if TYPE_CHECKING:
    from coordinator.launch.kinds import JobCommand
    from coordinator.launch.seam import Launcher

DEFAULT_LAUNCHER = "mlx"


class Registered(NamedTuple):
    module: str
    cls: str
    capabilities: Capabilities


_TORCH = Capabilities(runs_on="nodes", preflight=("pytorch",), node_facts="torch_facts", checkpoint_parts=True,
                      standby=True,
                      options=frozenset({"procs_per_node", "global_batch", "micro_batch"}), own_program=True,
                      command_check="coordinator.launch.torch_command:check_command",
                      frameworks=frozenset({"pytorch", "torch"}))
_CONFIGURED = _TORCH.options | {"launcher_config"}  # a PyTorch plan writes its settings (coord run --plan)

#: name -> where it lives and what it declares
REGISTERED: dict[str, Registered] = {
    "mlx": Registered("coordinator.launch.mlx", "MlxLauncher",
                      Capabilities(runs_on="head",
                                   preflight=("mlx_launch_on_head", "mlx_versions", "mlx_memory", "mlx_backend"),
                                   options=frozenset({"backend"}), plan="per_node",
                                   frameworks=frozenset({"mlx", "mlx-lm", "mlx_lm"}))),
    "torchrun": Registered("coordinator.launch.torch_launchers", "TorchrunLauncher", _TORCH),
    "accelerate": Registered("coordinator.launch.torch_launchers", "AccelerateLauncher",
                             _TORCH._replace(options=_CONFIGURED, needs=frozenset({"accelerate"}), plan="per_gpu",
                                           gpu_plan=ACCELERATE_PLAN)),
    "deepspeed": Registered("coordinator.launch.torch_launchers", "DeepSpeedLauncher",
                            _TORCH._replace(options=_CONFIGURED, needs=frozenset({"deepspeed", "c++"}),
                                            plan="per_gpu", gpu_plan=DEEPSPEED_PLAN)),
    "command": Registered("coordinator.launch.command", "CommandLauncher",
                          Capabilities(runs_on="nodes", checkpoint_parts=True, own_program=True,
                                       options=frozenset({"procs_per_node", "env_style"}),
                                       frameworks=frozenset({"jax", "tensorflow", "horovod"}))),
}
LAUNCHERS = tuple(REGISTERED)
#: The launchers ``coord plan --launcher`` plans per GPU for.
GPU_PLANNERS = tuple(name for name, entry in REGISTERED.items() if entry.capabilities.gpu_plan is not None)
_made: dict[str, Launcher] = {}


def capabilities(name: str) -> Capabilities:
    """What the launcher a job names declares (KeyError names the ones there are)."""
    if name not in REGISTERED:
        raise KeyError(f"unknown launcher {name!r} (one of {', '.join(sorted(REGISTERED))})")
    return REGISTERED[name].capabilities


def launcher_named(name: str) -> Launcher:
    """The launcher a job names (one instance each); KeyError names the ones there are."""
    found = capabilities(name)
    if name not in _made:
        module, cls = REGISTERED[name].module, REGISTERED[name].cls
        made = getattr(importlib.import_module(module), cls)()
        made.capabilities = found
        _made[name] = made
    return _made[name]


def check_command(name: str, job: JobCommand) -> None:
    """The launcher's own check of a job's command (``Capabilities.command_check``), if it has one;
    CommandError says what cannot be run as given."""
    where = capabilities(name).command_check
    if where is None:
        return
    module, function = where.split(":")
    getattr(importlib.import_module(module), function)(job, name)


def launcher_for(named: str, command: list[str]) -> str:
    """The launcher a job runs: the one it named, or, where it named the default (as every job does that
    names none), the one its command names itself (``-- torchrun ...``, ``-- accelerate launch ...``)."""
    own = named_in(command)
    return own if own is not None and named == DEFAULT_LAUNCHER else named


def chosen(launcher: str | None) -> str:
    """The launcher a request names, or the default where it names none (``coord plan`` and ``coord
    preflight`` without ``--launcher``): resolved once where a request comes in, so that what follows
    always has a name to read capabilities by."""
    return launcher or DEFAULT_LAUNCHER


def planned(launcher: str | None) -> str:
    """How ``coord plan`` sizes a job of this launcher (``Capabilities.plan``); a plan that names none is
    the default launcher's. KeyError says which launchers it plans for."""
    found = capabilities(launcher or DEFAULT_LAUNCHER).plan
    if found is None:
        planners = [name for name in LAUNCHERS if capabilities(name).plan is not None]
        raise KeyError(f"coord plan plans for --launcher {', '.join(planners)}, not {launcher}")
    return found


def gpu_plan_of(launcher: str) -> PlanKind:
    """What ``coord plan --launcher`` plans for this launcher per GPU (``Capabilities.gpu_plan``); KeyError
    names the launchers it plans that way for."""
    found = capabilities(launcher).gpu_plan if launcher in REGISTERED else None
    if found is None:
        raise KeyError(f"launcher must be one of {', '.join(GPU_PLANNERS)} for a PyTorch plan, got {launcher!r}")
    return found


def planners_of(framework: str) -> list[str]:
    """The launchers whose jobs run this model framework (``Capabilities.frameworks``, any case) and
    that coord plan plans for, the default first."""
    wanted = framework.lower()
    return [name for name in LAUNCHERS
            if wanted in capabilities(name).frameworks and capabilities(name).plan is not None]


def named_in(command: list[str]) -> str | None:
    """The launcher a command names itself (``torchrun ...``, ``accelerate launch ...``), or None."""
    from coordinator.launch.torch_command import launcher_in

    return launcher_in(command)


__all__ = ["DEFAULT_LAUNCHER", "GPU_PLANNERS", "LAUNCHERS", "REGISTERED", "capabilities", "check_command", "chosen",
           "gpu_plan_of", "launcher_for", "launcher_named", "named_in", "planned", "planners_of"]
