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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MLX_LM_FORMS = (["-m", "mlx_lm", "lora"], ["-m", "mlx_lm.lora"], ["-m", "agent.train"])
TRAINERS = ("mlx_lm", "coord")
REPLICA_HEAD, REPLICA_NONE = "head", "none"
MLX_LM_BATCH_SIZE = 4  # mlx-lm's default --batch-size


class JobSpecError(ValueError):
    pass


@dataclass
class JobSpec:
    name: str
    command: list[str]
    save_every: int = 10
    max_restarts: int = 3
    hang_timeout: float | None = None  # None: ten times the observed step time, at least 60 s
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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobSpec:
        return cls(**data)


def validate(spec: JobSpec) -> JobSpec:
    """``spec`` checked, in this order, by each of the checks below; the first problem raises
    JobSpecError. Two checks fill fields in: the trainer a command names, an mlx_lm run's total."""
    for check in (_check_name_and_command, _check_counts, _check_trainer, _check_nodes_and_replica,
                  _check_total_steps, _check_node_list, _check_priority, _check_mlx_lm_iters):
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
    if spec.hang_timeout is not None and spec.hang_timeout <= 0:
        raise JobSpecError("hang-timeout must be greater than 0 seconds")


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


def _whole_number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_JOB_FILE_KEYS = {"name": str, "command": list, "save_every": int, "max_restarts": int,
                  "hang_timeout": (int, float), "keep": int, "force": bool, "source": str, "backend": str,
                  "trainer": str, "replica": str, "min_nodes": int, "node_timeout": (int, float),
                  "total_steps": int, "nodes": list, "priority": int}


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


def is_mlx_lm(command: list[str]) -> bool:
    return _mlx_lm_split(command) is not None


def _mlx_lm_split(command: list[str]) -> int | None:
    """Index where mlx_lm lora's own options start, or None if this is not mlx_lm lora."""
    if command[:1] in (["mlx_lm.lora"],):
        return 1
    if command and command[0].split("/")[-1].startswith("python"):
        for form in MLX_LM_FORMS:
            if command[1:1 + len(form)] == form:
                return 1 + len(form)
    return None


def mlx_lm_args(command: list[str]) -> list[str]:
    start = _mlx_lm_split(command)
    return command[start:] if start is not None else []


def option_value(args: list[str], option: str) -> str | None:
    for i, word in enumerate(args):
        if word == option and i + 1 < len(args):
            return args[i + 1]
        if word.startswith(option + "="):
            return word.split("=", 1)[1]
    return None


def without_options(args: list[str], options: set[str]) -> list[str]:
    out, skip = [], False
    for word in args:
        if skip:
            skip = False
            continue
        if word in options:
            skip = True
            continue
        if any(word.startswith(o + "=") for o in options):
            continue
        out.append(word)
    return out


def batch_split(spec: JobSpec, ranks: int):
    """The job's own batch (mlx-lm's --batch-size across all ranks, and its accumulation) on ``ranks`` ranks.

    Resolved as mlx-lm resolves it: the command line, then the ``-c`` config file, then
    mlx-lm's defaults. The config file is read from the job's source on the head (what was
    synced to the nodes), or as given when absolute."""
    from coordinator.jobs.elastic import BatchSplit

    args = mlx_lm_args(spec.command)
    from_file = _mlx_lm_config(spec, args)
    batch_size = option_value(args, "--batch-size") or from_file.get("batch_size") or MLX_LM_BATCH_SIZE
    accumulation = option_value(args, "--grad-accumulation-steps") or from_file.get("grad_accumulation_steps") or 1
    try:
        return BatchSplit(_whole(batch_size), _whole(accumulation), ranks)
    except ValueError:
        raise JobSpecError(f"batch_size ({batch_size!r}) and grad_accumulation_steps ({accumulation!r}) must be "
                           "whole numbers") from None


def _whole(value) -> int:
    if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
        raise ValueError(value)
    return int(value)


def _mlx_lm_config(spec: JobSpec, args: list[str]) -> dict:
    name = option_value(args, "-c") or option_value(args, "--config")
    if name is None:
        return {}
    path = Path(name).expanduser()
    if not path.is_absolute():
        if not spec.source:
            raise JobSpecError(f"the config file {name} is relative and the job has no source to find it in")
        path = Path(spec.source) / path
    try:
        import yaml  # mlx-lm's own dependency
    except ImportError:
        raise JobSpecError(f"reading the config file {path} needs PyYAML (pip install pyyaml)") from None
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise JobSpecError(f"cannot read the config file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise JobSpecError(f"the config file {path} is not valid YAML: {exc}") from None
    if not isinstance(loaded, dict):
        raise JobSpecError(f"the config file {path} is not a mapping of options")
    return loaded


def attempt_command(spec: JobSpec, *, adapter_path: str, resume_file: str | None, start_step: int,
                    batch=None) -> list[str]:
    """The command one node runs for one attempt (the adapter path is that node's own).

    ``batch`` (an elastic.BatchSplit) replaces the job's own batch size and accumulation when
    the attempt runs on fewer ranks than the job was written for.
    """
    if not is_mlx_lm(spec.command):
        return list(spec.command)
    args = mlx_lm_args(spec.command)
    owned = {"--adapter-path", "--save-every", "--resume-adapter-file", "--iters"}
    if batch is not None:
        owned |= {"--batch-size", "--grad-accumulation-steps"}
    kept = without_options(args, owned)
    if spec.trainer == "coord":
        # coord's trainer resumes its own step from the checkpoint: it is given the job's total.
        out = ["python", "-m", "agent.train", *kept, "--iters", str(spec.total_steps)]
    else:
        out = ["python", "-m", "agent.mlx_lm_train", *kept, "--iters", str(spec.total_steps - start_step)]
    out += ["--adapter-path", adapter_path, "--save-every", str(spec.save_every)]
    if batch is not None:
        out += ["--batch-size", str(batch.batch_size), "--grad-accumulation-steps", str(batch.accumulation)]
    if option_value(args, "--fine-tune-type") == "full" and option_value(args, "--num-layers") is None:
        out += ["--num-layers", "-1"]  # mlx-lm's default of 16 would train only the top layers
    if option_value(args, "--steps-per-report") is None:
        out += ["--steps-per-report", "1"]  # progress every step keeps hang detection tight
    if resume_file:
        out += ["--resume-adapter-file", resume_file]
    return out
