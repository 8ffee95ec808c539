"""mlx-lm's ``lora`` command as coord runs it: recognised, its options read (batch, iters, config
file), and rewritten for one attempt (the node's own adapter path, the resume file, the steps
left, the batch of a shrunken world)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coordinator.launch.batch import BatchSplit
from coordinator.launch.kinds import CommandError, JobCommand
from coordinator.launch.trainers import trainer_declared

MLX_LM_FORMS = (["-m", "mlx_lm", "lora"], ["-m", "mlx_lm.lora"], ["-m", "agent.train"])
MLX_LM_BATCH_SIZE = 4  # mlx-lm's default --batch-size


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
    out: list[str] = []
    skip = False
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


def batch_split(job: JobCommand, ranks: int) -> BatchSplit:
    """The job's own batch (mlx-lm's --batch-size across all ranks, and its accumulation) on ``ranks`` ranks.

    Resolved as mlx-lm resolves it: the command line, then the ``-c`` config file, then
    mlx-lm's defaults. The config file is read from the job's source on the head (what was
    synced to the nodes), or as given when absolute."""
    args = mlx_lm_args(list(job.command))
    from_file = _mlx_lm_config(job, args)
    batch_size = option_value(args, "--batch-size") or from_file.get("batch_size") or MLX_LM_BATCH_SIZE
    accumulation = option_value(args, "--grad-accumulation-steps") or from_file.get("grad_accumulation_steps") or 1
    try:
        return BatchSplit(_whole(batch_size), _whole(accumulation), ranks)
    except ValueError:
        raise CommandError(f"batch_size ({batch_size!r}) and grad_accumulation_steps ({accumulation!r}) must be "
                           "whole numbers") from None


def _whole(value: Any) -> int:
    if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
        raise ValueError(value)
    return int(value)


def _mlx_lm_config(job: JobCommand, args: list[str]) -> dict[str, Any]:  # mlx-lm's YAML: free-form
    name = option_value(args, "-c") or option_value(args, "--config")
    if name is None:
        return {}
    path = Path(name).expanduser()
    if not path.is_absolute():
        if not job.source:
            raise CommandError(f"the config file {name} is relative and the job has no source to find it in")
        path = Path(job.source) / path
    try:
        import yaml  # mlx-lm's own dependency
    except ImportError:
        raise CommandError(f"reading the config file {path} needs PyYAML (pip install pyyaml)") from None
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as exc:
        raise CommandError(f"cannot read the config file {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise CommandError(f"the config file {path} is not valid YAML: {exc}") from None
    if not isinstance(loaded, dict):
        raise CommandError(f"the config file {path} is not a mapping of options")
    return loaded


def attempt_command(spec: JobCommand, *, adapter_path: str, resume_file: str | None, start_step: int,
                    batch: BatchSplit | None = None) -> list[str]:
    """The command one node runs for one attempt (the adapter path is that node's own).

    ``batch`` (an elastic.BatchSplit) replaces the job's own batch size and accumulation when
    the attempt runs on fewer ranks than the job was written for.
    """
    if not is_mlx_lm(list(spec.command)):
        return list(spec.command)
    args = mlx_lm_args(list(spec.command))
    owned = {"--adapter-path", "--save-every", "--resume-adapter-file", "--iters"}
    if batch is not None:
        owned |= {"--batch-size", "--grad-accumulation-steps"}
    kept = without_options(args, owned)
    declared = trainer_declared(spec.trainer)
    if declared.exact_resume:
        # coord's trainer resumes its own step from the checkpoint: it is given the job's total.
        out = ["python", "-m", declared.program, *kept, "--iters", str(spec.total_steps)]
    else:
        out = ["python", "-m", declared.program, *kept, "--iters", str((spec.total_steps or 0) - start_step)]
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
