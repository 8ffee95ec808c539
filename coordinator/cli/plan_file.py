"""`coord run --plan PLAN`: a PyTorch plan (what `coord plan --launcher accelerate|deepspeed` wrote) read
back as the job's fields: its launcher, nodes, processes per node, global and micro-batch, and the
launcher's own settings from the files the plan wrote (edited or not) for coord to write on every node
under its own keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coordinator.cli.client import EXIT_USAGE, CliError
from coordinator.launch.registry import gpu_plan_of

#: What `coord plan --launcher L` writes beside the launcher's files: the plan's pytorch section.
PLAN_FILE = "plan.json"


def plan_fields(given: str) -> dict[str, Any]:
    """The job fields a plan gives. ``given``: the directory `coord plan` wrote (``coord-accelerate``)."""
    file = Path(given) / PLAN_FILE
    try:
        document = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CliError(f"--plan {given}: no {PLAN_FILE} there (write one with coord plan --launcher "
                       "accelerate|deepspeed --model DIR --config-dir DIR)", EXIT_USAGE) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"--plan {given}: cannot read {file}: {exc}", EXIT_USAGE) from None
    except json.JSONDecodeError as exc:
        raise CliError(f"--plan {given}: {file} is not JSON ({exc})", EXIT_USAGE) from None
    try:
        return _fields(document, file.parent, given)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CliError(f"--plan {given}: {file} is not a PyTorch plan of coord plan --launcher ({type(exc).__name__}: "
                       f"{exc})", EXIT_USAGE) from None


def _fields(section: Any, directory: Path, given: str) -> dict[str, Any]:
    launcher = section["launcher"]
    gpu_plan_of(launcher)  # KeyError: not a launcher coord plan plans per GPU for
    if not section.get("strategy"):
        raise CliError(f"--plan {given}: the plan found no strategy that fits, so there is nothing to run: "
                       f"{section.get('reason', 'see coord plan')}", EXIT_USAGE)
    processes = {int(node["processes"]) for node in section["nodes"]}
    if len(processes) != 1:
        raise CliError(f"--plan {given}: its nodes run {', '.join(map(str, sorted(processes)))} processes each; "
                       "coord starts the same number on every node: plan on nodes alike, or leave --plan out and "
                       "give --procs-per-node", EXIT_USAGE)
    batch = section["batch"]
    return {"launcher": launcher, "nodes": [str(node["node"]) for node in section["nodes"]],
            "procs_per_node": processes.pop(), "global_batch": int(batch["global_batch"]),
            "micro_batch": int(batch["micro_batch"]),
            "launcher_config": _launcher_config(launcher, section, directory, given)}


def _launcher_config(launcher: str, section: dict[str, Any], directory: Path, given: str) -> dict[str, Any]:
    """The launcher's file as the plan wrote it (or as the user edited it since), read back."""
    first = str(section["nodes"][0]["node"])
    kind = gpu_plan_of(launcher)
    name = kind.config_file(first)
    try:
        text = (directory / name).read_text(encoding="utf-8")
    except OSError as exc:
        raise CliError(f"--plan {given}: cannot read the plan's {name} in {directory}: {exc.strerror or exc}",
                       EXIT_USAGE) from None
    if kind.config == "json":
        loaded = json.loads(text)
    else:
        import yaml  # mlx-lm's own dependency, on the head

        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise CliError(f"--plan {given}: {name} is not valid YAML: {exc}", EXIT_USAGE) from None
    if not isinstance(loaded, dict):
        raise CliError(f"--plan {given}: {name} is not a mapping of settings", EXIT_USAGE)
    return loaded
