"""What a job is, and how its command becomes each attempt's command.

An ``mlx_lm`` fine-tune (``python -m mlx_lm lora ...``) is understood: coord runs
it through ``agent.mlx_lm_train`` (mlx-lm's own trainer plus a progress
callback), sets the adapter path inside each node's workdir (one directory per
attempt, so a resume never overwrites an earlier checkpoint), ``--save-every``,
``--num-layers -1`` for full fine-tunes, and on a resume the checkpoint and the
remaining iterations. Any other command is run as given, with the environment
contract of ``COORD_*`` variables (see docs/script-contract.md).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypedDict, cast

from coordinator.launch.mlx_lm_command import CommandError, is_mlx_lm, mlx_lm_args, option_value
from coordinator.launch.registry import DEFAULT_LAUNCHER, LAUNCHERS

JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
TRAINERS = ("mlx_lm", "coord")
REPLICA_HEAD, REPLICA_NONE = "head", "none"


class JobSpecError(CommandError):
    pass


class JobSpecFields(TypedDict):
    """A job's spec as plain data (``JobSpec.as_dict``): what the store keeps with its runs."""

    name: str
    command: list[str]
    save_every: int
    max_restarts: int
    hang_timeout: float | None
    keep: int
    force: bool
    source: str | None
    backend: str | None
    trainer: str
    replica: str
    min_nodes: int | None
    node_timeout: float
    total_steps: int | None
    nodes: list[str] | None
    priority: int
    launcher: str
    first_step_timeout: float | None


@dataclass
class JobSpec:
    name: str
    command: list[str]
    save_every: int = 10
    max_restarts: int = 3
    hang_timeout: float | None = None  # None: from the measured step time (coordinator/jobs/hang.py)
    keep: int = 3
    force: bool = False
    source: str | None = None
    backend: str | None = None
    trainer: str = "mlx_lm"  # or "coord": agent.train, which resumes optimizer, schedule, RNG and data order
    replica: str = REPLICA_HEAD  # where each checkpoint is copied: the head, a node's name, or "none"
    min_nodes: int | None = None  # None: every node (no elastic shrink)
    node_timeout: float = 60.0  # how long a lost node is waited for before it may be left out
    total_steps: int | None = field(default=None)
    nodes: list[str] | None = None  # the nodes the job holds (None: every node of the cluster)
    priority: int = 0  # a queued job with a higher priority starts first
    launcher: str = DEFAULT_LAUNCHER  # what starts the ranks (coordinator/launch/registry.py)
    first_step_timeout: float | None = None  # None: from the model, the disk and the previous attempt

    def as_dict(self) -> JobSpecFields:
        return cast(JobSpecFields, asdict(self))  # the fields above, in order (a test holds the two together)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobSpec:
        """From a stored spec, whose fields are checked only by their use (the store's JSON)."""
        return cls(**data)


def validate(spec: JobSpec) -> JobSpec:
    """``spec`` checked, in this order, by each of the checks below; the first problem raises
    JobSpecError. Two checks fill fields in: the trainer a command names, an mlx_lm run's total."""
    for check in (_check_name_and_command, _check_counts, _check_trainer, _check_nodes_and_replica,
                  _check_total_steps, _check_node_list, _check_priority, _check_launcher, _check_mlx_lm_iters):
        check(spec)
    return spec


def _check_name_and_command(spec: JobSpec) -> None:
    if not JOB_NAME.match(spec.name):
        raise JobSpecError(f"job name {spec.name!r} must be letters, digits, '.', '_' or '-' (at most 64)")
    if not spec.command or not all(isinstance(word, str) and word for word in spec.command):
        raise JobSpecError("the command must be given after --, e.g. coord run -- python -m mlx_lm lora ...")


def _check_counts(spec: JobSpec) -> None:
    for key in ("save_every", "keep"):
        if getattr(spec, key) < 1:
            raise JobSpecError(f"{key.replace('_', '-')} must be at least 1")
    if spec.max_restarts < 0:
        raise JobSpecError("max-restarts must be 0 or more")
    for key in ("hang_timeout", "first_step_timeout"):
        value = getattr(spec, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise JobSpecError(f"{key.replace('_', '-')} must be greater than 0 seconds, got {value!r}")


def _check_trainer(spec: JobSpec) -> None:
    if is_mlx_lm(spec.command) and "agent.train" in spec.command[:3]:
        spec.trainer = "coord"  # the command names coord's trainer itself
    if spec.trainer not in TRAINERS:
        raise JobSpecError(f"trainer must be one of {', '.join(TRAINERS)}, got {spec.trainer!r}")
    if spec.trainer == "coord" and not is_mlx_lm(spec.command):
        raise JobSpecError("--trainer coord runs mlx_lm lora's options: give the command as "
                           "python -m mlx_lm lora --model ... --train --data ... --iters N")


def _check_nodes_and_replica(spec: JobSpec) -> None:
    if spec.min_nodes is not None and spec.min_nodes < 1:
        raise JobSpecError("min-nodes must be at least 1")
    if spec.node_timeout <= 0:
        raise JobSpecError("node-timeout must be greater than 0 seconds")
    if not spec.replica:
        raise JobSpecError("replica must be 'head', 'none' or a node's name")


def _check_total_steps(spec: JobSpec) -> None:
    if spec.total_steps is not None and (not _whole_number(spec.total_steps) or spec.total_steps < 1):
        raise JobSpecError(f"total-steps must be a whole number of at least 1, got {spec.total_steps!r}")


def _check_node_list(spec: JobSpec) -> None:
    if spec.nodes is None:
        return
    if not spec.nodes or not all(isinstance(n, str) and n for n in spec.nodes):
        raise JobSpecError("nodes must name at least one node, e.g. --nodes n1,n2")
    if len(set(spec.nodes)) != len(spec.nodes):
        raise JobSpecError(f"nodes names a node twice: {', '.join(spec.nodes)}")
    if spec.min_nodes is not None and spec.min_nodes > len(spec.nodes):
        raise JobSpecError(f"min-nodes {spec.min_nodes} is more than the job's {len(spec.nodes)} nodes")


def _check_priority(spec: JobSpec) -> None:
    if not _whole_number(spec.priority):
        raise JobSpecError(f"priority must be a whole number, got {spec.priority!r}")


def _check_launcher(spec: JobSpec) -> None:
    if spec.launcher not in LAUNCHERS:
        raise JobSpecError(f"launcher must be one of {', '.join(sorted(LAUNCHERS))}, got {spec.launcher!r}")


def _check_mlx_lm_iters(spec: JobSpec) -> None:
    """An mlx_lm run's total is its --iters, which must be given."""
    if not is_mlx_lm(spec.command):
        return
    iters = option_value(mlx_lm_args(spec.command), "--iters")
    if iters is None:
        raise JobSpecError("give the mlx_lm fine-tune its length with --iters N (coord resumes toward it)")
    try:
        total = int(iters)
    except ValueError:
        raise JobSpecError(f"--iters must be a whole number, got {iters!r}") from None
    if spec.total_steps is not None and spec.total_steps != total:
        raise JobSpecError(f"total-steps {spec.total_steps} differs from mlx_lm's --iters {total}: for mlx_lm "
                           "lora the total is its --iters")
    spec.total_steps = total


def reports_progress(spec: JobSpec) -> bool:
    """Whether the job's ranks are known to write progress records before they are seen to: coord's
    trainers do (mlx_lm lora run by coord, and --trainer coord); a script of one's own may not."""
    return is_mlx_lm(spec.command)


#: The one line a script of one's own adds to be watched for hangs (docs/script-contract.md).
PROGRESS_LINE = ('open(os.environ["COORD_PROGRESS_FILE"], "a").write(json.dumps({"kind": "train", '
                 '"step": step}) + "\\n")')


def progress_note(spec: JobSpec) -> str | None:
    """What coord says at submission of a job it cannot watch for hangs until its ranks report."""
    if reports_progress(spec):
        return None
    return ("no hang watchdog until the script appends to $COORD_PROGRESS_FILE (a script that never does is "
            f"never killed as hung); after each step add (with import json, os): {PROGRESS_LINE}")


def _whole_number(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_JOB_FILE_KEYS: dict[str, type | tuple[type, ...]] = {
    "name": str, "command": list, "save_every": int, "max_restarts": int, "hang_timeout": (int, float), "keep": int,
    "force": bool, "source": str, "backend": str, "trainer": str, "replica": str, "min_nodes": int,
    "node_timeout": (int, float), "total_steps": int, "nodes": list, "priority": int,
    "first_step_timeout": (int, float)}


def load_job_file(path: Path) -> JobSpec:
    """A job file: the same fields as `coord run`'s options, with the command as a list."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise JobSpecError(f"{path}: no such job file") from None
    except tomllib.TOMLDecodeError as exc:
        raise JobSpecError(f"{path}: not valid TOML: {exc}") from None
    job = raw.get("job", raw)
    for key, value in job.items():
        kind = _JOB_FILE_KEYS.get(key)
        if kind is None:
            raise JobSpecError(f"{path}: unknown key {key!r} (expected one of: {', '.join(_JOB_FILE_KEYS)})")
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise JobSpecError(f"{path}: {key} has the wrong type ({type(value).__name__})")
    if "name" not in job or "command" not in job:
        raise JobSpecError(f"{path}: a job file needs name and command")
    if job.get("source"):
        source = Path(job["source"]).expanduser()
        job["source"] = str(source if source.is_absolute() else (path.parent / source).resolve())
    return validate(JobSpec(**job))
