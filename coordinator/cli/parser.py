"""`coord`'s argument parser: every command's subparser, with the function that runs it."""

from __future__ import annotations

import argparse

from coordinator.cli.bench_commands import cmd_bench_scaling
from coordinator.cli.cluster_commands import (
    cmd_calibrate,
    cmd_checkpoints,
    cmd_doctor,
    cmd_hostfile,
    cmd_plan,
    cmd_preflight,
    cmd_status,
    cmd_sync,
)
from coordinator.cli.drill import STEPS_BEFORE_FAULT as DRILL_STEPS
from coordinator.cli.drill import cmd_drill
from coordinator.cli.job_commands import cmd_cancel, cmd_logs, cmd_resize, cmd_run, cmd_stop, cmd_wait
from coordinator.cli.launcher_options import add_launcher_options
from coordinator.cli.setup_commands import cmd_agent_bundle, cmd_daemon, cmd_demo, cmd_init, cmd_trust
from coordinator.config.daemon_options import add_daemon_arguments
from coordinator.config.option_values import (
    CLUSTER_FILE,
    JOB_NAME,
    JOB_OR_RUN,
    NODE_NAME,
    DirToMake,
    ExistingDir,
    ExistingFile,
    FileToWrite,
    Names,
    Number,
    Rate,
    SocketPath,
    StoreUrl,
    Text,
    Whole,
    Wholes,
)
from coordinator.jobs.limits import MAX_SECONDS, NODE_WAIT_S, WHOLE
from coordinator.launch.registry import GPU_PLANNERS, LAUNCHERS
from coordinator.launch.trainers import TRAINERS

# The values options take (coordinator/config/option_values.py): each refused at once, naming the option.
JOB = Text(JOB_NAME, "a job name (letters, digits, '.', '_' or '-', at most 64)")
JOB_OR_RUN_ID = Text(JOB_OR_RUN, "a job name or run id")
REPLICA = Text(rf"^(head|none|{NODE_NAME[1:-1]})$", "head, none or a node's name")
SECONDS = Number(0, MAX_SECONDS, unit="seconds")
HISTORY_SECONDS = Number(0, 10 * 365 * 24 * 3600.0, unit="seconds")
BACKENDS = ["ring", "jaccl", "jaccl-ring"]


class Hosts(Text):
    """coord init --hosts: the list as cmd_init reads it (the onboarding module, imported only when given)."""

    kind = "hosts"

    def __call__(self, text: str) -> str:
        super().__call__(text)
        from coordinator.nodes.onboarding import OnboardingError, name_nodes, parse_hosts

        try:
            name_nodes(parse_hosts(text))
        except OnboardingError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text


HOSTS = Hosts()


def job_whole(key: str) -> Whole:
    """A job's whole-number field, in the range the job spec takes (coordinator/jobs/limits.py)."""
    return Whole(*WHOLE[key])


def parse_command_line(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line read. `coord run`'s (and `coord bench`'s) words after the first ``--`` are the job's command
    (``args.command``, None without ``--``): everything before it is coord's, options in any order
    with at most a job file among them, so that an option is understood wherever it sits, never
    passed to the command by mistake."""
    import sys

    words = list(sys.argv[1:] if argv is None else argv)
    command = None
    if words[:1] in (["run"], ["bench"]) and "--" in words:
        cut = words.index("--")
        words, command = words[:cut], words[cut + 1:]
    parser = build_parser()
    args = parser.parse_args(words)
    if getattr(args, "command_name", None) in ("run", "bench"):
        args.command = command
    if getattr(args, "command_name", None):
        _refuse_swallowed_values(parser, args)
    return args


def _refuse_swallowed_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Python 3.11's argparse reads ``--option=--`` as the option given no value at all (an empty
    list, which every command would take for "not given"): refused here, naming the option."""
    chosen = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command_name]
    for action in chosen._actions:
        if action.option_strings and action.nargs is None and getattr(args, action.dest, None) == []:
            chosen.error(f"argument {'/'.join(action.option_strings)}: expected one value, got '--'")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coord",
        description="Turn a handful of Macs into one MLX training cluster and keep a training run alive on it.",
        epilog="The daemon (coord daemon / coordd) holds a session to every node; the other commands ask it "
               "over its control socket, found from --socket, $COORD_SOCKET, --config or $COORD_CONFIG.")
    sub = parser.add_subparsers(dest="command_name", metavar="COMMAND")

    def client_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", "-c", type=CLUSTER_FILE, help="cluster file, to find the daemon's socket")
        p.add_argument("--socket", type=SocketPath(), help="the daemon's control socket")

    p = sub.add_parser("status", help="nodes (up/down, chip, memory, versions) and recent events",
                       description="Ask the daemon what the cluster is doing.")
    client_options(p)
    p.add_argument("--json", action="store_true", help="print the status document as JSON")
    p.add_argument("--watch", "-w", action="store_true", help="refresh until interrupted")
    p.add_argument("--all", action="store_true", help="every run of every job, not only each job's newest run")
    p.add_argument("--interval", type=Number(0.1, 3600, low_open=False, unit="seconds"),
                   help="seconds between refreshes with --watch (default 1)")
    p.add_argument("--events", type=Whole(0, 10_000), default=10, help="how many recent events to show (default "
                   "10; the daemon keeps them all, up to 10,000 are shown)")
    p.add_argument("--check", action="store_true", help="exit 1 unless every node is up")
    p.add_argument("--history", action="store_true",
                   help="add the metrics history: each run's curves (loss, learning rate, tokens/s, validation "
                        "loss, each rank's memory) across its attempts with each restart, and each node's memory "
                        "and GPU use (with --json: the whole series)")
    p.add_argument("--run", metavar="RUN", type=JOB_OR_RUN_ID, help="with --history: this run (or job name) only")
    p.add_argument("--since", type=HISTORY_SECONDS, metavar="SECONDS",
                   help="with --history: only what is newer than this many seconds ago")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("sync", help="send the project tree to every node (only what each lacks)",
                       description="Hash the source tree on the head and each node's copy under its workdir, "
                                   "send only the files a node lacks or holds with other content, then check "
                                   "that every node agrees. Ignores .git, __pycache__, virtualenvs, checkpoints "
                                   "and what .coordignore (gitignore syntax) lists.")
    client_options(p)
    p.add_argument("--source", type=ExistingDir(), help="the project directory on this machine (default: "
                   "sync.source)")
    p.add_argument("--delete", action="store_true", help="remove files on nodes that the source does not have")
    p.add_argument("--dry-run", action="store_true", help="say what would be sent or deleted, change nothing")
    p.add_argument("--follow-outside-links", action="store_true",
                   help="copy what a symlink that leads out of the source points to (a file or a directory) "
                        "to the nodes under the link's name; without it such a link stops the sync, named "
                        "(links inside the source arrive as links)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_sync)

    p = sub.add_parser("calibrate", help="measure every node: matmul rate, memory bandwidth, training steps",
                       description="Measure every node at once with its own training Python: MLX matmul rate "
                                   "(float32, bfloat16), memory bandwidth, memory available, and a short "
                                   "training-step rate. Results are kept until --refresh or a node's chip, OS or "
                                   "MLX changes; the workload share per node follows from them.")
    client_options(p)
    p.add_argument("--refresh", action="store_true", help="measure again even if nothing changed")
    p.add_argument("--quick", action="store_true", help="a shorter, rougher measurement")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("checkpoints", help="what a checkpoint store holds: runs, steps, sizes, committed or not",
                       description="List the checkpoints in a checkpoint store (asked through coordd, whose "
                                   "environment holds the store's credentials): each run's checkpoints, newest "
                                   "first, with their size and whether they are committed (their manifest written "
                                   "last: only a committed checkpoint is ever resumed from). URL: the store "
                                   "(s3://BUCKET/PREFIX, file:///PATH, ...), one run's prefix, or one checkpoint's. "
                                   "Continue a run from it with coord run --resume-from URL.")
    client_options(p)
    p.add_argument("--store", type=StoreUrl(), required=True, metavar="URL", help="the checkpoint store")
    p.add_argument("--json", action="store_true", help="print the listing as JSON")
    p.set_defaults(func=cmd_checkpoints)

    p = sub.add_parser("doctor", help="measure every link the job will use against its baseline",
                       description="Measure each link the job's backend will use (ring neighbours, or every pair "
                                   "with --all-pairs) over the interface and address coord puts in the hostfile: "
                                   "throughput each way, round-trip latency, the MTU at both ends, the route the "
                                   "kernel takes to the peer. Each link gets a verdict (ok, slow, down, "
                                   "wrong-route) against its baseline (its first healthy measurement, or what "
                                   "--set-baseline keeps) and what its kind should carry, with the cause and the "
                                   "fix. The RDMA devices a saved hostfile or MLX_IBV_DEVICES names are checked "
                                   "against each node's. Cost: at most --bytes each way per link (default 64 MiB; "
                                   "4 MiB with --quick), the links one after another (all at once with "
                                   "--quick), all within --seconds (default 30; 6 with --quick). It refuses "
                                   "to run while a job trains, since it would take the job's bandwidth, unless "
                                   "--while-training. Exits 1 unless every link is ok.")
    client_options(p)
    p.add_argument("--all-pairs", action="store_true", help="every pair of nodes, not only ring neighbours")
    p.add_argument("--bytes", type=Whole(0, 8 * 2**30), help="bytes sent each way per link, at most "
                   "(default 67108864; 0: latency only; on links of 10 Gbit/s or more give about a second's worth, "
                   "e.g. 1073741824)")
    p.add_argument("--seconds", type=Number(0, 600, unit="seconds"), help="the whole run's time limit, shared "
                   "by its links (default 30)")
    p.add_argument("--quick", action="store_true", help="latency and a short burst (4 MiB, 6 s), as pre-flight runs")
    p.add_argument("--set-baseline", action="store_true", help="keep this run's figures as each link's baseline")
    p.add_argument("--while-training", action="store_true", help="measure even while a job trains on the nodes "
                   "(the job loses bandwidth meanwhile)")
    p.add_argument("--ibv-devices", type=ExistingFile(), help="an MLX_IBV_DEVICES matrix to check against the "
                   "nodes' RDMA devices (default: the file $MLX_IBV_DEVICES names, when set)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("preflight", help="every check a launch must pass, on all nodes at once",
                       description="Run the pre-flight checks on all nodes: reachability, agent, Python/mlx/mlx-lm "
                                   "and OS versions, code, script, data and model consistency, disk and checkpoint "
                                   "directory, memory, calibration, sync hook, RDMA and backend, hostfile. "
                                   "Exits 1 when any check fails.")
    client_options(p)
    p.add_argument("--backend", choices=BACKENDS, help="check this backend instead of the "
                   "one chosen from the measured links")
    p.add_argument("--torch", dest="launcher", action="store_const", const="torchrun",
                   help="check for a PyTorch job (the same as --launcher torchrun): torch/CUDA/NCCL versions, GPUs, "
                   "the rendezvous port from every node, the NCCL environment, /dev/shm, instead of the MLX "
                   "launch's checks")
    p.add_argument("--launcher", choices=list(LAUNCHERS),
                   help="check for a job of this launcher: torchrun, accelerate or deepspeed imply --torch (Accelerate "
                        "and DeepSpeed must then be installed on every node); command checks only what every job "
                        "needs")
    p.add_argument("--master-port", type=Whole(1, 65535), help="the rendezvous port to check (default 29500)")
    p.add_argument("--checkpoint-store", type=StoreUrl(), metavar="URL",
                   help="probe this checkpoint store (write, list, read back, remove a test object) instead of the "
                        "cluster file's checkpoint_store")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=cmd_preflight)

    p = sub.add_parser("hostfile", help="write the mlx.launch hostfile chosen from the measured links",
                       description="Write the JSON hostfile mlx.launch reads: backend (jaccl for a full RDMA mesh, "
                                   "jaccl-ring for an RDMA ring, ring over TCP otherwise), each node's address on "
                                   "its best link, RDMA devices. Without -o it is printed on stdout (the advice on "
                                   "stderr). Each node's ssh entry is written as your own ssh reaches it: "
                                   "user@host, or your ~/.ssh/config alias as is, so `mlx.launch --hostfile FILE "
                                   "...` works from your shell wherever `ssh <entry>` does. A node that needs "
                                   "settings your ssh config lacks (the cluster file's port, identity_file, "
                                   "known_hosts, or an alias only its [ssh] config knows) is named by a Host "
                                   "entry coord writes to <state_dir>/ssh/coord_hosts.conf; coord prints the one "
                                   "Include line to add at the top of ~/.ssh/config and never edits that file. "
                                   "coord run does not need the line (its launches carry their own ssh config).")
    client_options(p)
    p.add_argument("-o", "--output", type=FileToWrite(), help="write it here")
    p.add_argument("--backend", choices=BACKENDS, help="force a backend (checked against "
                   "the links)")
    p.add_argument("--json", action="store_true", help="print the hostfile, the backend choice, each node's ssh "
                   "entry and what it needs, the include file and its Include line (null when none is needed)")
    p.set_defaults(func=cmd_hostfile)

    p = sub.add_parser("plan", help="how to train a model on this cluster, from what coord measured",
                       description="A training plan (format version 2.0.0, or an orchestration document with "
                                   "--schema orchestration) from this cluster's facts, calibration, links, "
                                   "consistency, pre-flight and past launch and recovery times, the model's size "
                                   "(--model) and the data set (--data). Every value says where it comes from; a "
                                   "section that cannot be filled says why and what fills it.")
    client_options(p)
    p.add_argument("--model", type=ExistingDir(), help="the model directory on this machine (config.json, "
                   "*.safetensors)")
    p.add_argument("--data", type=ExistingDir(), help="the data directory on this machine (train.jsonl, "
                   "valid.jsonl)")
    p.add_argument("--fine-tune-type", choices=["lora", "dora", "full"])
    p.add_argument("--batch-size", type=Whole(1, 1 << 20), help="examples per rank per micro-step")
    p.add_argument("--grad-accumulation-steps", type=Whole(1, 1 << 20))
    p.add_argument("--learning-rate", type=Number(0, 10), help="the base learning rate, before scaling to the "
                   "total batch")
    p.add_argument("--optimizer", choices=["adam", "adamw", "muon", "sgd", "adafactor"])
    p.add_argument("--lr-scaling", choices=["linear", "sqrt"], help="rule to scale the learning rate to the "
                   "total batch (default linear; sqrt for the Adam family)")
    p.add_argument("--warmup-steps", type=Whole(0, 10**9))
    p.add_argument("--max-seq-length", type=Whole(1, 1 << 24), default=2048, help="sequence length for the "
                   "memory estimate")
    p.add_argument("--save-every", type=job_whole("save_every"))
    p.add_argument("--keep", type=job_whole("keep"))
    p.add_argument("--trainer", choices=list(TRAINERS))
    p.add_argument("--replica", type=REPLICA, metavar="head|none|NODE")
    p.add_argument("--min-nodes", type=job_whole("min_nodes"))
    p.add_argument("--name", type=JOB, default="job", help="the job name the launch command and hostfile path use")
    p.add_argument("--launcher", choices=list(GPU_PLANNERS), help="a PyTorch plan for this launcher: "
                   "bytes per GPU under DDP, FSDP and ZeRO, the strategy, precision, batch and learning rate chosen "
                   "from the nodes' GPUs, and the launcher's config files (with --model)")
    p.add_argument("--global-batch-size", type=Whole(1, 1 << 30), help="the target global batch (PyTorch plan: "
                   "the gradient accumulation reaches it)")
    p.add_argument("--base-batch-size", type=Whole(1, 1 << 30), help="the batch the base learning rate was tuned for")
    p.add_argument("--master-port", type=Whole(1, 65535), help="the rendezvous port the PyTorch plan checks and writes "
                   "(default 29500)")
    p.add_argument("--config-dir", type=DirToMake(), metavar="DIR", help="where the PyTorch plan writes the "
                   "launcher's files (default ./coord-LAUNCHER)")
    p.add_argument("--schema", choices=["v2", "orchestration"], default="v2")
    p.add_argument("--input", type=ExistingFile(), metavar="FILE", help="an orchestration input document "
                   "(modelConfig, dataConfig, clusterConfig, trainingConfig)")
    p.add_argument("--json", action="store_true", help="print the whole document as JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("run", help="launch a distributed job with mlx.launch and keep it running",
                       description="Run pre-flight (stopping on a failure unless --force), sync (with --source), "
                                   "write the hostfile and start `mlx.launch`, one rank per node, each in its "
                                   "node's workdir with its node's Python. A failed rank, a lost node or a hang "
                                   "stops the job everywhere and resumes it from the newest valid checkpoint. "
                                   "`python -m mlx_lm lora ...` is understood (adapter path, --save-every, "
                                   "resume); any other command gets the COORD_* environment contract. Each "
                                   "run gets its own run id: a name run again starts a new run from step 0 (the "
                                   "earlier one stays readable), and only --resume NAME continues one. "
                                   "Everything before -- is coord's (options, or a job file whose fields the "
                                   "options given override); everything after it is the command.",
                       usage="coord run [options] -- COMMAND...  |  coord run [options] JOB.toml")
    client_options(p)
    # The job's own fields default to None here: the job spec's defaults (coordinator/jobs/spec.py)
    # fill what is not given, and an option given is known as given (it overrides a job file's field,
    # and a resumed run keeps its own fields but those given again).
    p.add_argument("--name", type=JOB, help="job name (default: job-DATE-TIME)")
    p.add_argument("--source", type=ExistingDir(), help="sync this project directory to every node first")
    p.add_argument("--follow-outside-links", action="store_true", default=None,
                   help="with --source: copy what a symlink leading out of it points to (as coord sync's option)")
    p.add_argument("--save-every", type=job_whole("save_every"), help="checkpoint every N steps (default 10)")
    p.add_argument("--max-restarts", type=job_whole("max_restarts"), help="restarts before the job fails "
                   "(default 3)")
    p.add_argument("--hang-timeout", type=SECONDS, help="seconds without progress that count as a hang, in every "
                   "phase that should make progress, before the first step too (default: four times the time "
                   "between steps, at least 15)")
    p.add_argument("--first-step-timeout", type=SECONDS, help="seconds a rank may spend loading before its first "
                   "step (default: from the previous attempt, the model's size and the disk's read rate; 600 when "
                   "nothing is known)")
    p.add_argument("--keep", type=job_whole("keep"), help="checkpoints to keep (default 3)")
    p.add_argument("--force", action="store_true", default=None, help="launch even if pre-flight fails")
    p.add_argument("--backend", choices=BACKENDS, help="force a backend")
    add_launcher_options(p, "a PyTorch job's examples per optimizer step, kept when a node is left out: each "
                         "worker gets COORD_GRAD_ACCUM and COORD_MICRO_BATCH")
    p.add_argument("--plan", type=ExistingDir(), metavar="DIR", help="run with a PyTorch plan: the directory "
                   "`coord plan --launcher accelerate|deepspeed` wrote (its launcher, nodes, processes per node, "
                   "global and micro-batch, and its Accelerate config or DeepSpeed JSON, edited or not); options "
                   "given too win over the plan's")
    p.add_argument("--trainer", choices=list(TRAINERS),
                   help="for `python -m mlx_lm lora ...`: mlx-lm's own trainer (default; a resume restores the "
                        "weights only) or coord's (agent.train: same options, and a resume restores the optimizer, "
                        "the learning-rate schedule, the RNG and the data order exactly)")
    p.add_argument("--replica", type=REPLICA, metavar="head|none|NODE",
                   help="copy each validated checkpoint here, off rank 0's machine, SHA256-checked "
                        "(default: the head's state directory)")
    p.add_argument("--min-nodes", type=job_whole("min_nodes"), help="let the job go on with at least this many "
                   "nodes when one is down longer than --node-timeout (same global batch; default: wait for every "
                   "node)")
    p.add_argument("--node-timeout", type=SECONDS,
                   help="seconds coord waits for nodes it lost while their ranks may still train: a head whose own "
                        "network blinked keeps the job running and re-attaches within it; with --min-nodes, a node "
                        "down longer is left out (default 60)")
    p.add_argument("--on-divergence", choices=["rollback", "stop"],
                   help="when a reported loss or gradient norm is NaN or infinite: roll back to the newest checkpoint "
                        "saved before that step (default), or stop the job failed")
    p.add_argument("--max-rollbacks", type=job_whole("max_rollbacks"), help="rollbacks after a divergence before the "
                   "job fails (default 3; they do not use up --max-restarts)")
    p.add_argument("--skip-on-rollback", type=job_whole("skip_on_rollback"), metavar="N", help="a rollback skips the "
                   "N batches after its checkpoint (the data where the loss went wrong): mlx_lm lora and --trainer "
                   "coord do, a script reads COORD_SKIP_BATCHES or coord_script.skip_batches() (default 0)")
    p.add_argument("--on-spike", choices=["warn", "rollback"],
                   help="a loss spike (above 1.5x the median of the last 50 losses, and above the highest of them): an "
                        "event and an alert (warn, default), or a rollback as after a NaN")
    p.add_argument("--straggler-policy", choices=["tell", "drop"],
                   help="a rank whose compute time stays 1.5x the ranks' median is named a straggler with its likely "
                        "cause: only tell (default), or drop: once it has been one for --straggler-grace seconds, "
                        "relaunch from the last checkpoint without its node (needs --min-nodes; the global batch kept)")
    p.add_argument("--straggler-grace", type=SECONDS,
                   help="seconds a straggler is borne before --straggler-policy drop shrinks its node out "
                        "(default 120)")
    p.add_argument("--checkpoint-store", type=StoreUrl(), metavar="URL",
                   help="upload every validated checkpoint there, in the background, its manifest last: "
                        "s3://BUCKET/PREFIX (AWS, R2, B2, MinIO: the endpoint from AWS_ENDPOINT_URL), gs://, az:// or "
                        "file:///PATH (a NAS the head mounts); credentials from coordd's environment (default: the "
                        "cluster file's checkpoint_store; docs/checkpoint-storage.md)")
    p.add_argument("--store-keep", type=job_whole("store_keep"), metavar="N",
                   help="committed checkpoints the store keeps: the newest N (default 3), never fewer than one")
    p.add_argument("--store-keep-every", type=job_whole("store_keep_every"), metavar="K",
                   help="the store also keeps every checkpoint whose step is a multiple of K")
    p.add_argument("--store-bandwidth", type=Rate(), metavar="RATE",
                   help="cap each node's uploads to the store, e.g. 50MB/s or 400Mbit/s (default: no cap; uploads "
                        "already run at a lower priority than the ranks)")
    p.add_argument("--store-from", choices=["nodes", "head"],
                   help="who puts each checkpoint into the store: nodes (default: every node with a copy a share, "
                        "through URLs the head signs; the head itself where the nodes cannot reach the store) or head "
                        "(the nodes never try: they cannot reach the store)")
    p.add_argument("--durability-lag-alert", type=SECONDS, metavar="SECONDS",
                   help="alert when a checkpoint has waited this long to reach the store (default 1800)")
    p.add_argument("--resume-from", type=StoreUrl(), metavar="STORE_URL",
                   help="start from the newest committed checkpoint in the store: a run's prefix "
                        "(s3://BUCKET/PREFIX/RUN_ID) or one checkpoint's; works on a cluster and a head that never "
                        "saw the run (coord checkpoints --store URL lists what is there)")
    p.add_argument("--node-wait", type=SECONDS,
                   help=f"seconds an attempt waits for its nodes to be up (each one, or with --min-nodes enough of "
                        f"them) before the job fails (default {NODE_WAIT_S:g}); coord run shows what it waits for")
    p.add_argument("--total-steps", type=job_whole("total_steps"), help="for a script of your own: its length in "
                   "steps (it gets COORD_TOTAL_STEPS; coord shows step/total and an ETA, and an attempt whose ranks "
                   "all exit 0 before it is restarted); mlx_lm lora's is its --iters")
    p.add_argument("--nodes", type=Names(), metavar="N1,N2", help="run on these nodes only (default: every node); "
                   "the job holds them while it runs, and jobs on disjoint nodes run side by side")
    p.add_argument("--priority", type=job_whole("priority"), help="a job waiting for busy nodes starts before "
                   "those of a lower priority (default 0; first in, first out within a priority)")
    p.add_argument("--detach", action="store_true", help="return once submitted instead of following the job")
    p.add_argument("--resume", type=JOB, metavar="NAME", help="continue the newest run of job NAME (finished, "
                   "failed or stopped) from its newest valid checkpoint instead of starting a new run from step 0, "
                   "with its own options but those given again; with -- COMMAND (e.g. a larger --iters) the run "
                   "goes on with that command, else with its own")
    p.add_argument("job_file", nargs="?", metavar="JOB.toml",
                   type=ExistingFile(".toml", other="a command goes after --: coord run [options] -- python train.py"),
                   help="a job file (name, command and the options as fields); a command goes after --")
    p.set_defaults(func=cmd_run, command=None)

    p = sub.add_parser("bench", help="measure how a job scales over 1, 2, ... N of the cluster's nodes",
                       description="coord bench scaling -- COMMAND: run the same short job (no checkpoints, no "
                                   "restarts) on the first 1, 2, ... N of the nodes, one after the other, and give "
                                   "for each size its steps/s, its throughput (samples/s the job reports, or steps/s "
                                   "times --samples-per-step), its speedup and scaling efficiency (speedup / nodes, "
                                   "against the smallest size) and the share of a step spent in its gradient "
                                   "exchange (comm_seconds, which coord's trainer reports and a script may with "
                                   "coord_script.report). The first fifth of each run's steps is left out as "
                                   "warm-up. Use a job that keeps its global batch whatever the number of nodes.",
                       usage="coord bench scaling [options] -- COMMAND...")
    client_options(p)
    p.add_argument("kind", choices=["scaling"], help="what to measure")
    p.add_argument("--nodes", type=Names(), metavar="N1,N2", help="the nodes, in the order they are added (default: "
                   "every node, in the cluster file's order)")
    p.add_argument("--sizes", type=Wholes(1, 4096), metavar="1,2,4", help="the numbers of nodes to run on (default: "
                   "1, 2, ... all)")
    p.add_argument("--samples-per-step", type=Whole(1, 1 << 30), help="examples per optimizer step, for a job that "
                   "does not report samples_per_second (default: --global-batch when given)")
    p.add_argument("--svg", type=FileToWrite(), metavar="FILE", help="also draw throughput and efficiency per size "
                   "as an SVG chart")
    p.add_argument("--json", action="store_true", help="print the runs and the rows as JSON")
    p.add_argument("--source", type=ExistingDir(), help="sync this project directory to every node first")
    p.add_argument("--follow-outside-links", action="store_true", default=None,
                   help="with --source: copy what a symlink leading out of it points to")
    p.add_argument("--save-every", type=job_whole("save_every"), help="checkpoint every N steps (default: none)")
    p.add_argument("--total-steps", type=job_whole("total_steps"), help="for a script of your own: its length "
                   "in steps")
    p.add_argument("--backend", choices=BACKENDS, help="force a backend (MLX)")
    p.add_argument("--trainer", choices=list(TRAINERS), help="for `python -m mlx_lm lora ...`, as for coord "
                   "run (coord's trainer reports samples/s and its gradient exchange's time)")
    add_launcher_options(p, "a PyTorch job's examples per optimizer step, the same at every size "
                         "(COORD_GRAD_ACCUM makes it up)")
    p.add_argument("--hang-timeout", type=SECONDS, help="as for coord run")
    p.add_argument("--first-step-timeout", type=SECONDS, help="as for coord run")
    p.add_argument("--node-wait", type=SECONDS, help="as for coord run")
    p.set_defaults(func=cmd_bench_scaling, command=None)

    p = sub.add_parser("drill", help="a fire drill: a short job, a rank killed and one stopped, recovery timed",
                       description="Run the demo's tiny model as a real job on this cluster's nodes (its files in a "
                                   "coord-drill-* directory of each workdir), SIGKILL its last rank once it trained "
                                   f"{DRILL_STEPS} steps, then SIGSTOP its rank 0 once it trains again, and report "
                                   "for each fault how long coord took to see it and to train again, and the steps "
                                   "done twice, beside the step time and the cold launch. Then the job is stopped "
                                   "and forgotten: no job record, event or file of it is left on the head or the "
                                   "nodes. Costs about a minute of the nodes; refused while a job trains on them.")
    client_options(p)
    p.add_argument("--nodes", type=Names(), metavar="N1,N2", help="drill on these nodes (default: every node up; "
                   "at least 2)")
    p.add_argument("--iters", type=Whole(200, WHOLE["total_steps"][1]), default=100_000,
                   help="the job's length in steps: it is stopped once the second fault is recovered from, "
                        "so only a run shorter than the drill needs this (default 100000)")
    p.add_argument("--timeout", type=Number(0, MAX_SECONDS, unit="seconds"), default=900.0,
                   help="give up (and clean up) after this long (default 900)")
    p.add_argument("--cut-node", action="store_true", help="then take the last node's link down for --cut-seconds "
                   "and bring it back: needs root on that node by sudo without a password for ip (Linux) or "
                   "ifconfig (macOS); refused, named, where there is none")
    p.add_argument("--cut-seconds", type=Number(1, 600, unit="seconds", low_open=False), default=20.0,
                   help="how long --cut-node keeps the link down (default 20)")
    p.add_argument("--while-training", action="store_true", help="drill even while a job trains on the nodes "
                   "(it waits for them in the queue, then takes their time)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_drill)

    p = sub.add_parser("wait", help="block until a job ends; exit 0 only if it succeeded",
                       description="Follow a job until it succeeds, fails or is stopped.")
    client_options(p)
    p.add_argument("job", type=JOB_OR_RUN_ID)
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing while waiting")
    p.add_argument("--json", action="store_true", help="print the final job document as JSON")
    p.set_defaults(func=cmd_wait)

    p = sub.add_parser("stop", help="stop every rank of a job on every node",
                       description="Stop a job: every rank on every node is stopped and confirmed gone.")
    client_options(p)
    p.add_argument("job", type=JOB_OR_RUN_ID)
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("cancel", help="remove a queued job from the queue",
                       description="A job waiting for its nodes (queued) leaves the queue without ever starting. "
                                   "A running job is stopped with coord stop.")
    client_options(p)
    p.add_argument("job", type=JOB_OR_RUN_ID)
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("resize", help="bring nodes that are back into a running job at its next checkpoint",
                       description="A job that left out a lost node (--min-nodes) runs on fewer ranks. Once the "
                                   "node is back, resize relaunches the job on every node that is up, right after "
                                   "its next checkpoint, with the job's own batch again: nothing is redone.")
    client_options(p)
    p.add_argument("job", type=JOB_OR_RUN_ID)
    p.add_argument("--json", action="store_true", help="print the job document as JSON")
    p.set_defaults(func=cmd_resize)

    p = sub.add_parser("logs", help="a rank's output, per attempt, kept on the head",
                       description="Print a rank's output (kept on the head per attempt and per rank).")
    client_options(p)
    p.add_argument("job", type=JOB_OR_RUN_ID)
    p.add_argument("--rank", type=Whole(0, WHOLE["min_nodes"][1] - 1), default=0, help="which rank (default 0)")
    p.add_argument("--attempt", type=Whole(0, 10**6), help="which attempt (default: the current one)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing as the rank writes")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("init", help="write the cluster file: found on the hosts, or a commented example",
                       description="With --hosts: connect to each host as the daemon will (your ssh config, "
                                   "known_hosts and keys; key authentication only), find a Python with mlx and "
                                   "mlx-lm there (the login shell's python3, venvs and conda envs under the home, "
                                   "Homebrew's and the system's), propose a workdir under that user's home, check "
                                   "its free disk, and write a cluster file with a comment per node saying what "
                                   "was found. Nothing is written unless every host is ready; each one that is "
                                   "not says how to fix it. A host key not yet trusted is shown with its "
                                   "fingerprint and added only if you type yes (see: coord trust). "
                                   "Without --hosts: write a commented example to edit.",
                       usage="coord init --hosts [NAME=][USER@]HOST[:PORT],... [-o FILE] [options]  |  "
                             "coord init [PATH]")
    p.add_argument("path", nargs="?", type=FileToWrite(), help="where to write the example (default: coord.toml)")
    p.add_argument("--hosts", metavar="HOSTS", type=HOSTS, help="comma-separated [NAME=][USER@]HOST[:PORT]: an "
                   "address or a Host alias of your ssh config, e.g. alice@10.0.0.2,bob@mac-studio.local")
    p.add_argument("-o", "--output", type=FileToWrite(), help="write the cluster file here (default: coord.toml)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    # The options below shape what --hosts finds; they default to None so that one given without
    # --hosts is refused rather than ignored (cmd_init fills the defaults).
    p.add_argument("--name", type=Text(), help="with --hosts: the cluster's name (default: cluster)")
    p.add_argument("--workdir", type=Text(), help="with --hosts: each node's workdir: relative to that user's "
                   "home, or absolute (default: coord-work, e.g. /Users/alice/coord-work)")
    p.add_argument("--known-hosts", type=FileToWrite(), help="with --hosts: verify host keys against this file, "
                   "and write it into the cluster file (default: ~/.ssh/known_hosts)")
    p.add_argument("--identity-file", "-i", type=ExistingFile(), help="with --hosts: log in with this key, and "
                   "write it into the cluster file (default: your ssh config and default keys)")
    p.add_argument("--ssh-config", type=ExistingFile(), help="with --hosts: read this ssh config instead of "
                   "~/.ssh/config, and write it into the cluster file")
    p.add_argument("--timeout", type=Number(0, 600, unit="seconds"), help="with --hosts: seconds to wait for "
                   "each SSH connection (default 10)")
    p.add_argument("--json", action="store_true", help="with --hosts: print what was found on each host as JSON")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("trust", help="show a node's host key fingerprint and add it to known_hosts if you agree",
                       description="Fetch the host key NODE (a node of the cluster file) or HOST presents, show "
                                   "its SHA256 fingerprint as ssh does, and add it to the known_hosts the "
                                   "cluster uses ([ssh] known_hosts of the cluster file, else ~/.ssh/known_hosts) "
                                   "only when you type yes, or paste the fingerprint. Without a terminal it "
                                   "trusts nothing unless --fingerprint names the key: scripts must say which key "
                                   "they expect (there is no blind --yes). A key that differs from one already "
                                   "recorded for the host is refused.",
                       usage="coord trust NODE|HOST[:PORT] [--config FILE] [--fingerprint SHA256:...]")
    p.add_argument("host", metavar="NODE|HOST", type=Text(r"^[^\s-][^\s]*$", "a node name or host"),
                   help="a node name of the cluster file, or a host (address or ssh alias, optionally user@ and "
                        ":PORT)")
    p.add_argument("--config", "-c", type=CLUSTER_FILE, help="the cluster file (default: $COORD_CONFIG): its "
                   "node names, ssh settings and known_hosts")
    p.add_argument("--fingerprint", metavar="SHA256:...", type=Text(r"^(?i:SHA256:)?[A-Za-z0-9+/]{43}=?$",
                                                                   "a SHA256 fingerprint (SHA256: and 43 base64 "
                                                                   "characters, as ssh-keygen -l prints it)"),
                   help="trust the key only if it has this fingerprint (compare with `ssh-keygen -lf "
                        "/etc/ssh/ssh_host_ed25519_key.pub` on the node); for scripts, no question asked")
    p.add_argument("--port", "-p", type=Whole(1, 65535), help="the host's SSH port (default: the ssh config's, "
                   "or 22)")
    p.add_argument("--known-hosts", type=FileToWrite(), help="add the key to this file instead")
    p.add_argument("--ssh-config", type=ExistingFile(), help="read this ssh config instead of ~/.ssh/config")
    p.set_defaults(func=cmd_trust)

    p = sub.add_parser("daemon", help="run coordd in the foreground",
                       description="Run the daemon in the foreground (launchd and systemd run `coordd`, the same).")
    add_daemon_arguments(p)
    p.set_defaults(func=cmd_daemon)

    p = sub.add_parser("demo", help="start a local cluster on this machine and show its status",
                       description="Start coordd with two local nodes (no SSH needed), wait until they are up, "
                                   "and print `coord status`.")
    p.add_argument("--dir", type=DirToMake(), default="demo-state", help="where the demo's cluster file, state "
                   "and logs go")
    p.add_argument("--keep", action="store_true", help="leave the daemon running afterwards")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("agent-bundle", help="write the agent bundle zip (for deploy/install-agent.sh)",
                       description="Write the zip the daemon installs on nodes, to install it by hand.")
    p.add_argument("--output", "-o", type=FileToWrite(), default="coord-agent.zip", help="where to write it "
                   "(default: coord-agent.zip)")
    p.set_defaults(func=cmd_agent_bundle)
    return parser
