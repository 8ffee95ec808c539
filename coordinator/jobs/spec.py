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

import math
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypedDict, cast

from coordinator.config.cluster_file import NODE_NAME
from coordinator.config.store_url import StoreUrlError, parse_store_url
from coordinator.jobs.limits import MAX_SECONDS, NODE_WAIT_S, STORE_FROM, STRAGGLER_POLICIES, WHOLE
from coordinator.jobs.training_health import ON_DIVERGENCE, ON_SPIKE
from coordinator.launch.command_env import ENV_STYLES
from coordinator.launch.kinds import OPTIONS
from coordinator.launch.mlx_backend import BACKENDS
from coordinator.launch.mlx_lm_command import CommandError, is_mlx_lm, mlx_lm_args, option_value
from coordinator.launch.registry import DEFAULT_LAUNCHER, LAUNCHERS, capabilities, check_command, launcher_for
from coordinator.launch.trainers import DEFAULT_TRAINER, TRAINERS, trainer_named_in
from shared.text import unprintable

JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
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
    follow_outside_links: bool
    node_wait: float
    first_step_timeout: float | None
    procs_per_node: int | None
    global_batch: int | None
    micro_batch: int | None
    launcher_config: dict[str, Any] | None  # free-form: a launcher's own settings, from a plan (see JobSpec)
    env_style: str | None
    on_divergence: str
    max_rollbacks: int
    skip_on_rollback: int
    on_spike: str
    straggler_policy: str
    straggler_grace: float
    checkpoint_store: str | None
    store_keep: int
    store_keep_every: int | None
    durability_lag_alert: float
    store_bandwidth: float | None
    store_from: str


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
    trainer: str = DEFAULT_TRAINER  # or "coord": agent.train, an exact resume (launch/trainers.py)
    replica: str = REPLICA_HEAD  # where each checkpoint is copied: the head, a node's name, or "none"
    min_nodes: int | None = None  # None: every node (no elastic shrink)
    node_timeout: float = 60.0  # how long a lost node is waited for before it may be left out
    total_steps: int | None = field(default=None)
    nodes: list[str] | None = None  # the nodes the job holds (None: every node of the cluster)
    priority: int = 0  # a queued job with a higher priority starts first
    launcher: str = DEFAULT_LAUNCHER  # what starts the ranks (coordinator/launch/registry.py)
    follow_outside_links: bool = False  # the source's sync copies what links leading out of it point to
    node_wait: float = NODE_WAIT_S  # how long an attempt waits for its nodes to be up before the job fails
    first_step_timeout: float | None = None  # None: from the model, the disk and the previous attempt
    # A torch launcher's processes per node (None: the command's own --nproc-per-node, else one per GPU,
    # one on a CPU node).
    procs_per_node: int | None = None
    global_batch: int | None = None  # a torch job's examples per optimizer step, kept on a shrink
    micro_batch: int | None = None  # a torch job's examples per process per micro-step (default 1)
    # The launcher's own settings from a PyTorch plan (coord run --plan): Accelerate's config keys, or
    # DeepSpeed's JSON; free-form, as the launcher reads it, under coord's own keys (docs/pytorch.md).
    launcher_config: dict[str, Any] | None = None
    # --launcher command: a framework's own variables beside coord's (jax, tf; None: coord's alone).
    env_style: str | None = None
    # When the training diverges (a NaN or infinite loss or gradient norm; docs/recovery.md): roll back
    # to the checkpoint before it, or stop; how many rollbacks before the run fails; how many batches
    # after the checkpoint a rollback skips; and whether a loss spike is only said or rolled back from.
    on_divergence: str = "rollback"
    max_rollbacks: int = 3
    skip_on_rollback: int = 0
    on_spike: str = "warn"
    # A rank named a straggler (docs/observe.md#stragglers): only said (tell), or, once it has been one
    # for straggler_grace seconds, its node shrunk out (drop: the elastic shrink, within --min-nodes).
    straggler_policy: str = "tell"
    straggler_grace: float = 120.0
    # Where every validated checkpoint is uploaded (docs/checkpoint-storage.md): s3://, gs://, az:// or
    # file:// (None: the cluster file's checkpoint_store, if any); how many the store keeps (the newest N,
    # and every one whose step is a multiple of store_keep_every); and after how many seconds of a
    # checkpoint not yet in the store an alert says so.
    checkpoint_store: str | None = None
    store_keep: int = 3
    store_keep_every: int | None = None
    durability_lag_alert: float = 1800.0
    # Bytes per second each node (or the head) may put to the store (--store-bandwidth; None: no cap).
    store_bandwidth: float | None = None
    # Who puts a checkpoint's bytes: "nodes" (each node with a copy a share, through signed URLs; the
    # head where the store cannot sign or the nodes cannot reach it) or "head" (nodes that cannot reach
    # the store at all: a private network).
    store_from: str = "nodes"

    def as_dict(self) -> JobSpecFields:
        return cast(JobSpecFields, asdict(self))  # the fields above, in order (a test holds the two together)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobSpec:
        """From a stored spec, whose fields are checked only by their use (the store's JSON)."""
        return cls(**data)


def validate(spec: JobSpec) -> JobSpec:
    """``spec`` checked, in this order, by each of the checks below; the first problem raises
    JobSpecError. Two checks fill fields in: the trainer a command names, an mlx_lm run's total."""
    check_fields(spec.as_dict())
    for check in (_check_name_and_command, _check_source, _check_trainer, _check_node_list, _check_straggler_policy,
                  _check_launcher, _check_mlx_lm_iters):
        check(spec)
    return spec


def option_label(key: str) -> str:
    """A field as `coord run` names it: ``save_every`` is ``--save-every``."""
    return "--" + key.replace("_", "-")


def check_fields(fields: Mapping[str, object], label: Callable[[str], str] = option_label) -> None:
    """Each field on its own: its type, and a number in its range (finite: NaN and infinities are
    refused, as are numbers past limits.py's, which only a typo or a safety check switched off
    would set). ``label`` names a field in the message (an option, or a job file's key)."""
    for key, value in fields.items():
        check = _FIELD_CHECKS.get(key)
        if check is None:
            raise JobSpecError(f"unknown field {key!r} (expected one of: {', '.join(_FIELD_CHECKS)})")
        problem = check(value)
        if problem:
            raise JobSpecError(f"{label(key)} {problem}")


#: What every job is given, however it comes: over the control socket or in a job file.
REQUIRED_FIELDS = ("name", "command")


def _missing(fields: Mapping[str, object]) -> str | None:
    """The required fields ``fields`` lacks, as a message says them ("name and command"); None: none."""
    return " and ".join(key for key in REQUIRED_FIELDS if key not in fields) or None


def spec_from_fields(fields: Mapping[str, object]) -> JobSpec:
    """A job as it came over the control socket (free-form: any keys, any types), checked field by
    field and as a whole before anything of it is used."""
    if missing := _missing(fields):
        raise JobSpecError(f"a job needs {missing}")
    check_fields(fields)
    return validate(JobSpec(**cast(dict[str, Any], fields)))


def resumed_fields(previous: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """A resumed run's fields (coord run --resume): its own, but those given again. --force is
    not carried over (it launches once past a failed pre-flight, when asked for); no command given
    is its own command, and a new mlx_lm command brings its own total (its --iters)."""
    fields = {**previous, "force": False, **given}
    if not given.get("command"):
        fields["command"] = previous["command"]
    elif "total_steps" not in given and _command(given["command"]) is None and is_mlx_lm(given["command"]):
        fields["total_steps"] = None
    return fields


FieldCheck = Callable[[object], str | None]  # a value -> what is wrong with it (None: nothing)


def _whole(key: str) -> FieldCheck:
    low, high = WHOLE[key]

    def check(value: object) -> str | None:
        if _whole_number(value) and low <= cast(int, value) <= high:
            return None
        return f"must be a whole number from {low} to {high}, got {value!r}"
    return check


def _seconds(value: object) -> str | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= MAX_SECONDS:
        return None  # NaN fails both comparisons, infinities the second
    return f"must be a number of seconds greater than 0 and at most {MAX_SECONDS:.0f} (30 days), got {value!r}"


def _optional(check: FieldCheck) -> FieldCheck:
    return lambda value: None if value is None else check(value)


def _text(value: object) -> str | None:
    if not isinstance(value, str) or not value:
        return f"must be a non-empty string, got {value!r}"
    bad = unprintable(value)
    return f"holds the control character {bad}: {value!r}" if bad else None


def _flag(value: object) -> str | None:
    return None if isinstance(value, bool) else f"must be true or false, got {value!r}"


def _choice(options: tuple[str, ...]) -> FieldCheck:
    return lambda value: None if value in options else f"must be one of {', '.join(options)}, got {value!r}"


def _command(value: object) -> str | None:
    # A command's own arguments are its business (a newline in `python -c` is fine): only what
    # cannot reach a process at all is refused.
    if not isinstance(value, list) or not all(isinstance(word, str) and word and "\0" not in word
                                              for word in value):
        return f"must be a list of non-empty strings without NUL, got {value!r}"
    if value and value[0].startswith("-"):  # `coord run -- -- python train.py`: no program is named "--"
        return f"must start with the program to run, got {value[0]!r} first (one -- goes before the command)"
    return None


def _rate(value: object) -> str | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf"):
        return None
    return f"must be a number of bytes per second greater than 0, got {value!r}"


def _store_url(value: object) -> str | None:
    if not isinstance(value, str):
        return f"must be a store URL (s3://BUCKET/PREFIX, file:///PATH, ...), got {value!r}"
    try:
        parse_store_url(value)
    except StoreUrlError as exc:
        return f"is not a checkpoint store: {exc}"
    return None


def _node_names(value: object) -> str | None:
    if not isinstance(value, list) or not all(isinstance(n, str) and NODE_NAME.match(n) for n in value):
        return f"must be a list of node names (letters, digits, '.', '_' or '-'), got {value!r}"
    return None


#: A launcher's config from a plan: what it may hold (it comes over the control socket, and is written
#: on every node as the launcher's YAML or JSON).
MAX_LAUNCHER_CONFIG_BYTES = 64 * 1024
MAX_LAUNCHER_CONFIG_DEPTH = 8


def _launcher_config(value: object) -> str | None:
    if not isinstance(value, dict):
        return f"must be a mapping of the launcher's settings, got {type(value).__name__}"
    problem = _json_problem(value, 0)
    if problem:
        return problem
    import json

    if len(json.dumps(value)) > MAX_LAUNCHER_CONFIG_BYTES:
        return f"is larger than {MAX_LAUNCHER_CONFIG_BYTES // 1024} KiB"
    return None


def _json_problem(value: object, depth: int) -> str | None:
    """What in ``value`` is not plain JSON (strings without control characters, finite numbers)."""
    if depth > MAX_LAUNCHER_CONFIG_DEPTH:
        return f"is nested deeper than {MAX_LAUNCHER_CONFIG_DEPTH} levels"
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or not key or unprintable(key):
                return f"has a key that is not a plain name: {key!r}"
            problem = _json_problem(item, depth + 1)
            if problem:
                return problem
        return None
    if isinstance(value, list):
        return next((p for item in value if (p := _json_problem(item, depth + 1))), None)
    if isinstance(value, str):
        return f"holds the control character {bad} in {value!r}" if (bad := unprintable(value)) else None
    if isinstance(value, float) and not math.isfinite(value):
        return f"holds a number that is not finite: {value!r}"
    if value is None or isinstance(value, (bool, int, float)):
        return None
    return f"holds a {type(value).__name__}, which is not JSON"


_FIELD_CHECKS: dict[str, FieldCheck] = {
    "name": _text, "command": _command, "save_every": _whole("save_every"),
    "max_restarts": _whole("max_restarts"), "hang_timeout": _optional(_seconds), "keep": _whole("keep"),
    "force": _flag, "source": _optional(_text), "backend": _optional(_choice(BACKENDS)),
    "trainer": _choice(tuple(TRAINERS)), "replica": _text, "min_nodes": _optional(_whole("min_nodes")),
    "node_timeout": _seconds, "total_steps": _optional(_whole("total_steps")), "nodes": _optional(_node_names),
    "priority": _whole("priority"), "launcher": _text, "node_wait": _seconds, "follow_outside_links": _flag,
    "first_step_timeout": _optional(_seconds), "procs_per_node": _optional(_whole("procs_per_node")),
    "global_batch": _optional(_whole("global_batch")), "micro_batch": _optional(_whole("micro_batch")),
    "launcher_config": _optional(_launcher_config), "env_style": _optional(_choice(ENV_STYLES)),
    "on_divergence": _choice(ON_DIVERGENCE),
    "max_rollbacks": _whole("max_rollbacks"), "skip_on_rollback": _whole("skip_on_rollback"),
    "on_spike": _choice(ON_SPIKE), "straggler_policy": _choice(STRAGGLER_POLICIES),
    "straggler_grace": _seconds, "checkpoint_store": _optional(_store_url),
    "store_keep": _whole("store_keep"), "store_keep_every": _optional(_whole("store_keep_every")),
    "durability_lag_alert": _seconds, "store_bandwidth": _optional(_rate),
    "store_from": _choice(STORE_FROM)}


def _check_name_and_command(spec: JobSpec) -> None:
    if not JOB_NAME.match(spec.name):
        raise JobSpecError(f"job name {spec.name!r} must be letters, digits, '.', '_' or '-' (at most 64)")
    if not spec.command:
        raise JobSpecError("the command must be given after --, e.g. coord run -- python -m mlx_lm lora ...")


def source_problem(source: str) -> str | None:
    """What is wrong with a job's source directory on the head (None: it is one); each case says so
    in its own words, since a file given for the directory is a different mistake from a typo."""
    path = Path(source)
    if not path.is_absolute():
        return f"--source must be an absolute path on the head, got {source}"
    if not path.exists():
        return f"--source {source}: no such directory on the head"
    if not path.is_dir():
        return f"--source {source}: not a directory (the project directory to sync, not a file in it)"
    return None


def _check_source(spec: JobSpec) -> None:
    problem = source_problem(spec.source) if spec.source is not None else None
    if problem:
        raise JobSpecError(problem)


def _check_trainer(spec: JobSpec) -> None:
    named = trainer_named_in(spec.command)
    if is_mlx_lm(spec.command) and named is not None:
        spec.trainer = named  # the command names a trainer's program itself
    if spec.trainer not in TRAINERS:
        raise JobSpecError(f"--trainer must be one of {', '.join(TRAINERS)}, got {spec.trainer!r}")
    if spec.trainer != DEFAULT_TRAINER and not is_mlx_lm(spec.command):
        raise JobSpecError(f"--trainer {spec.trainer} runs mlx_lm lora's options: give the command as "
                           "python -m mlx_lm lora --model ... --train --data ... --iters N")


def _check_node_list(spec: JobSpec) -> None:
    if spec.nodes is None:
        return
    if not spec.nodes:
        raise JobSpecError("--nodes must name at least one node, e.g. --nodes n1,n2")
    if len(set(spec.nodes)) != len(spec.nodes):
        raise JobSpecError(f"--nodes names a node twice: {', '.join(spec.nodes)}")
    if spec.min_nodes is not None and spec.min_nodes > len(spec.nodes):
        raise JobSpecError(f"--min-nodes {spec.min_nodes} is more than the job's {len(spec.nodes)} nodes")


def _check_straggler_policy(spec: JobSpec) -> None:
    if spec.straggler_policy == "drop" and spec.min_nodes is None:
        raise JobSpecError("--straggler-policy drop shrinks a straggler's node out, which needs --min-nodes (the "
                           "fewest nodes the job may go on with), e.g. --min-nodes 2")


def _check_launcher(spec: JobSpec) -> None:
    """The launcher a job names, or the one its command names itself (``-- torchrun ...``); the options
    only some launchers take, given to one that does; the command read as its launcher will run it."""
    spec.launcher = launcher_for(spec.launcher, spec.command)
    if spec.launcher not in LAUNCHERS:
        raise JobSpecError(f"--launcher must be one of {', '.join(sorted(LAUNCHERS))}, got {spec.launcher!r}")
    declared = capabilities(spec.launcher)
    for key in OPTIONS:
        if getattr(spec, key) is not None and key not in declared.options:
            takers = [name for name in LAUNCHERS if key in capabilities(name).options]
            raise JobSpecError(f"{option_label(key)}: for --launcher {' or '.join(takers)}, not {spec.launcher}")
    if declared.own_program and (spec.trainer != DEFAULT_TRAINER or is_mlx_lm(spec.command)):
        raise JobSpecError(f"--launcher {spec.launcher} runs a program of your own: give it as -- python train.py "
                           "... (mlx_lm and --trainer coord run with --launcher mlx)")
    if spec.micro_batch is not None and spec.global_batch is None:
        raise JobSpecError("--micro-batch goes with --global-batch (the examples per optimizer step coord keeps)")
    try:
        check_command(spec.launcher, spec)
    except CommandError as exc:
        raise JobSpecError(str(exc)) from None


def _check_mlx_lm_iters(spec: JobSpec) -> None:
    """An mlx_lm run's total is its --iters, which must be given."""
    if not is_mlx_lm(spec.command):
        return
    iters = option_value(mlx_lm_args(spec.command), "--iters")
    if iters is None:
        raise JobSpecError("give the mlx_lm fine-tune its length with --iters N (coord resumes toward it)")
    low, high = WHOLE["total_steps"]
    try:
        total = int(iters)
    except ValueError:
        total = low - 1
    if not low <= total <= high:
        raise JobSpecError(f"mlx_lm's --iters must be a whole number from {low} to {high}, got {iters!r}")
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
#: The same with coord's helper, which every rank finds on its path (coord_script).
HELPER_LINE = "coord_script.report(step, loss=loss)"


def progress_note(spec: JobSpec) -> str | None:
    """What coord says at submission of a job it cannot watch for hangs until its ranks report."""
    if reports_progress(spec):
        return None
    return ("no hang watchdog until the script reports its steps (a script that never does is never killed as "
            f"hung); after each step add (with import coord_script): {HELPER_LINE}, or (with import json, os): "
            f"{PROGRESS_LINE}")


def _whole_number(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: A job file's keys: the spec's fields.
JOB_FILE_KEYS = tuple(JobSpecFields.__annotations__)


def load_job_file(path: Path) -> JobSpec:
    """A job file: the same fields as `coord run`'s options, with the command as a list. Each
    mistake names the file and the key."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise JobSpecError(f"job file {path}: no such file") from None
    except IsADirectoryError:
        raise JobSpecError(f"job file {path}: a directory, not a file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise JobSpecError(f"job file {path}: cannot read it: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise JobSpecError(f"job file {path}: not valid TOML: {exc}") from None
    job = raw.get("job", raw)
    if not isinstance(job, dict):
        raise JobSpecError(f"job file {path}: job must be a table ([job])")
    unknown = [key for key in job if key not in JOB_FILE_KEYS]
    if unknown:
        raise JobSpecError(f"job file {path}: unknown key {unknown[0]!r} (expected one of: "
                           f"{', '.join(JOB_FILE_KEYS)})")
    if missing := _missing(job):
        raise JobSpecError(f"job file {path}: a job needs {missing}")
    try:
        check_fields(job, label=lambda key: key)
        if isinstance(job.get("source"), str):  # relative to the job file
            source = Path(job["source"]).expanduser()
            job["source"] = str(source if source.is_absolute() else (path.parent / source).resolve())
        return validate(JobSpec(**job))
    except JobSpecError as exc:
        raise JobSpecError(f"job file {path}: {exc}") from None
