"""A PyTorch job's command, read as coord runs it: which launcher it names, the launcher options the
user gave, and the program each worker runs.

A job is written either with its launcher (``coord run -- torchrun --nproc-per-node 2 train.py
--lr 1e-4``, ``-- accelerate launch --config_file acc.yaml train.py``, ``-- deepspeed train.py
--deepspeed_config ds.json``) or as a plain program with ``--launcher`` (``coord run --launcher
torchrun -- python train.py``, ``-- python -m pkg.train``). Either way coord fills in the options
that make one launcher per node into one job (how many nodes, this node's rank, where rank 0 is,
the port) and turns off the launcher's own restarts: those options are coord's, and a command that
gives one is refused, naming it. Everything else the user gave is kept as given.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.launch.kinds import CommandError, JobCommand

#: How each launcher is written on a command line: its own command, or ``python -m`` its module.
FORMS: dict[str, tuple[tuple[str, ...], ...]] = {
    "torchrun": (("torchrun",), ("-m", "torch.distributed.run")),
    "accelerate": (("accelerate", "launch"), ("accelerate-launch",), ("-m", "accelerate.commands.launch")),
    "deepspeed": (("deepspeed",), ("-m", "deepspeed.launcher.runner")),
}

#: The module coord runs each launcher as, with the node's Python.
MODULES = {"torchrun": "torch.distributed.run", "accelerate": "accelerate.commands.launch",
           "deepspeed": "deepspeed.launcher.runner"}

#: Options each launcher takes without a value (read from the launchers' own argument parsers:
#: torch 2.13, Accelerate 1.15, DeepSpeed 0.19). Any other option takes one.
FLAGS: dict[str, frozenset[str]] = {
    "torchrun": frozenset({"--module", "-m", "--no-python", "--no_python", "--run-path", "--run_path", "--standalone",
                           "--virtual-local-rank", "--virtual_local_rank"}),
    "accelerate": frozenset({
        "--cpu", "--debug", "--downcast-bf16", "--downcast_bf16", "--dynamo-use-dynamic", "--dynamo-use-fullgraph",
        "--dynamo-use-regional-compilation", "--dynamo_use_dynamic", "--dynamo_use_fullgraph",
        "--dynamo_use_regional_compilation", "--enable-cpu-affinity", "--enable_cpu_affinity",
        "--fp8-use-autocast-during-eval", "--fp8_use_autocast_during_eval", "--module", "--multi-gpu", "--multi_gpu",
        "--no-python", "--no-tpu-cluster", "--no_python", "--no_tpu_cluster", "--quiet", "--same-network",
        "--same_network", "--tpu", "--tpu-cluster", "--tpu-use-sudo", "--tpu_cluster", "--tpu_use_sudo",
        "--use-deepspeed", "--use-fsdp", "--use-megatron-lm", "--use-parallelism-config", "--use_deepspeed",
        "--use_fsdp", "--use_megatron_lm", "--use_parallelism_config", "-m", "-q", "--ipex", "--use_xpu",
        "--use-xpu"}),
    "deepspeed": frozenset({"--module", "--no_python", "--no_local_rank", "--no_ssh", "--no_ssh_check",
                            "--force_multi", "--save_pid", "--enable_each_rank_log", "--bind_cores_to_rank",
                            "--elastic_training", "--ssh_port"}),
}

#: The options coord sets for every launcher, and why a command may not give them.
OWNED: dict[str, dict[str, str]] = {
    "torchrun": {
        **dict.fromkeys(("--nnodes",), "coord gives the number of nodes (the job's nodes that are up)"),
        **dict.fromkeys(("--node-rank", "--node_rank"), "coord gives each node its rank"),
        **dict.fromkeys(("--master-addr", "--master_addr", "--master-port", "--master_port"),
                        "coord chooses rank 0's address and the run's own port"),
        **dict.fromkeys(("--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id",
                         "--rdzv_id", "--rdzv-conf", "--rdzv_conf", "--standalone"),
                        "coord runs a static rendezvous at rank 0's node"),
        **dict.fromkeys(("--max-restarts", "--max_restarts"),
                        "coord owns restarts (coord run --max-restarts), the launcher's are off"),
        **dict.fromkeys(("--log-dir", "--log_dir"), "coord keeps the workers' error files in the rank's directory"),
    },
    "accelerate": {
        **dict.fromkeys(("--num_machines", "--num-machines"), "coord gives the number of nodes"),
        **dict.fromkeys(("--machine_rank", "--machine-rank"), "coord gives each node its rank"),
        **dict.fromkeys(("--num_processes", "--num-processes"),
                        "coord gives the total from the nodes (coord run --procs-per-node N per node)"),
        **dict.fromkeys(("--main_process_ip", "--main-process-ip", "--main_process_port", "--main-process-port"),
                        "coord chooses rank 0's address and the run's own port"),
        **dict.fromkeys(("--rdzv_backend", "--rdzv-backend", "--rdzv_conf", "--rdzv-conf", "--same_network",
                         "--same-network"), "coord runs a static rendezvous at rank 0's node"),
        **dict.fromkeys(("--max_restarts", "--max-restarts"),
                        "coord owns restarts (coord run --max-restarts), the launcher's are off"),
    },
    "deepspeed": {
        **dict.fromkeys(("--num_nodes",), "coord gives the number of nodes"),
        **dict.fromkeys(("--node_rank",), "coord gives each node its rank"),
        **dict.fromkeys(("--num_gpus", "--num_accelerators"),
                        "coord gives the processes per node (coord run --procs-per-node N)"),
        **dict.fromkeys(("--master_addr", "--master_port"), "coord chooses rank 0's address and the run's own port"),
        **dict.fromkeys(("--hostfile", "-H", "--include", "-i", "--exclude", "-e", "--launcher", "--no_ssh",
                         "--no_ssh_check", "--force_multi", "--ssh_port"),
                        "coord chooses the nodes and starts DeepSpeed's runner on each one itself"),
        **dict.fromkeys(("--elastic_training", "--min_elastic_nodes", "--max_elastic_nodes"),
                        "coord owns restarts and the elastic shrink (coord run --min-nodes)"),
    },
}

#: Options that say how many processes a node runs, by launcher (kept out of the options passed on:
#: coord passes its own count).
PROCS_OPTIONS = {"torchrun": ("--nproc-per-node", "--nproc_per_node")}


@dataclass(frozen=True)
class TorchCommand:
    """A job's command as a torch launcher runs it."""

    form: str | None  # the launcher the command itself names, or None for a plain program
    options: tuple[str, ...]  # the launcher options the user gave, as given (coord's own refused)
    program: tuple[str, ...]  # what each worker runs: (script, *args), ("-m", module, *args), or an executable
    procs_per_node: str | None  # the command's own processes per node (torchrun's --nproc-per-node), as given

    def option(self, *names: str) -> str | None:
        """The value of the first of ``names`` among the user's options."""
        return option_value(self.options, names)


def launcher_in(command: Sequence[str]) -> str | None:
    """The torch launcher a command names itself (``torchrun ...``, ``python -m torch.distributed.run ...``,
    ``accelerate launch ...``, ``deepspeed ...``), or None."""
    return _split(command)[0]


def _split(command: Sequence[str]) -> tuple[str | None, int]:
    """(the launcher the command names, where its options start)."""
    words = list(command)
    first = words[0].rsplit("/", 1)[-1] if words else ""
    for name, forms in FORMS.items():
        for form in forms:
            if form[0] == "-m":
                if first.startswith("python") and tuple(words[1:1 + len(form)]) == form:
                    return name, 1 + len(form)
            elif (first, *words[1:len(form)]) == form:
                return name, len(form)
    return None, 0


def check_command(job: JobCommand, launcher: str) -> None:
    """A torch launcher's check of a job (``Capabilities.command_check``): its command read as it will be
    run (coord's own options refused, the program found); CommandError says what is wrong."""
    read_command(job.command, launcher)


def read_command(command: Sequence[str], launcher: str) -> TorchCommand:
    """The command of a job whose launcher is ``launcher``; CommandError when it names another launcher,
    gives an option coord sets itself, or has no program."""
    words = list(command)
    form, start = _split(words)
    if form is not None and form != launcher:
        raise CommandError(f"the command runs {form} but the job's launcher is {launcher}: give "
                           f"--launcher {form}, or the command without its launcher")
    if form is None:
        # A plain program: ``python train.py ...`` or ``python -m pkg ...`` (the node's Python runs it).
        if words and words[0].rsplit("/", 1)[-1].startswith("python"):
            words = words[1:]
        if not words:
            raise CommandError("give the training script after the interpreter, e.g. -- python train.py")
        if words[0] == "-m":
            if len(words) < 2:
                raise CommandError("give the module to run after -m, e.g. -- python -m pkg.train")
            return TorchCommand(None, (), tuple(words), None)
        if words[0].startswith("-"):
            raise CommandError(f"{words[0]}: coord runs the script with the launcher's own interpreter; give the "
                               "script first, e.g. -- python train.py --lr 1e-4")
        return TorchCommand(None, (), tuple(words), None)
    options, program = _options_and_program(words[start:], FLAGS[launcher])
    for word in options:
        name = word.split("=", 1)[0]
        why = OWNED[launcher].get(name)
        if why is not None:
            raise CommandError(f"{name}: {why}; remove it from the command")
    if not program:
        example = " ".join(FORMS[launcher][0])
        raise CommandError(f"{launcher}: give the training script after its options, e.g. -- {example} train.py")
    procs = option_value(options, PROCS_OPTIONS.get(launcher, ()))
    kept = without(options, PROCS_OPTIONS.get(launcher, ()))
    return TorchCommand(form, tuple(kept), tuple(program), procs)


def _options_and_program(words: list[str], flags: frozenset[str]) -> tuple[list[str], list[str]]:
    """Split a launcher's words into its options and the program after them: the program starts at the
    first word that is neither an option nor an option's value."""
    options: list[str] = []
    index = 0
    while index < len(words):
        word = words[index]
        if word == "--":
            return options, words[index + 1:]
        if not word.startswith("-") or word == "-":
            break
        options.append(word)
        if "=" not in word and word not in flags:
            if index + 1 >= len(words):
                raise CommandError(f"{word} needs a value")
            options.append(words[index + 1])
            index += 1
        index += 1
    program = words[index:]
    # ``-m module``: the module is the program's first word, the flag stays with the launcher's options.
    return options, program


def option_value(options: Sequence[str], names: Sequence[str]) -> str | None:
    for index, word in enumerate(options):
        for name in names:
            if word == name and index + 1 < len(options):
                return options[index + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
    return None


def without(options: Sequence[str], names: Sequence[str]) -> list[str]:
    """``options`` less each of ``names`` and its value."""
    out: list[str] = []
    skip = False
    for word in options:
        if skip:
            skip = False
            continue
        if word in names:
            skip = True
            continue
        if any(word.startswith(name + "=") for name in names):
            continue
        out.append(word)
    return out
