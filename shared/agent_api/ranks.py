"""A rank's life through its agent: prepared, polled, its log read, stacks dumped, stopped; its
checkpoints listed, removed, hashed and read."""

from __future__ import annotations

from typing import TypedDict

from shared.agent_api.common import JsonObject
from shared.checkpoint_dirs import DirFile, NonFinite


class _PrepareRankRequest(TypedDict):
    job: str
    rank: int
    workdir: str
    python: str
    argv: list[str]
    env: dict[str, str]


class PrepareRankRequest(_PrepareRankRequest, total=False):
    attempt: int
    pass_output: bool  # the rank's output also goes to mlx.launch (default); False keeps it on the node
    files: dict[str, str]  # {name: text} written in the rank's directory (a launcher's per-node config)
    free_ports: list[int]  # TCP ports the rank will listen on, checked free first (a coordinator's)


class PrepareRankReply(TypedDict):
    script: str
    tmpdir: str
    rank_dir: str


class RankRequest(TypedDict):
    workdir: str
    job: str
    attempt: int
    rank: int


class StartRankRequest(RankRequest, total=False):
    # A launcher run as ``python -m MODULE``: run it in a warm standby of the job when one fits, and
    # start one beside it for the job's next rank here (agent.standby)
    standby: bool


class _StartRankReply(TypedDict):
    pid: int  # the rank's runner, in a session of its own


class StartRankReply(_StartRankReply, total=False):
    warm: bool  # run by a standby whose launcher was imported already
    cleared_locks: list[str]  # stale locks of torch's extension builds removed first (agent/torch_locks.py)


class RetireStandbysRequest(TypedDict):
    workdir: str
    job: str


class RetireStandbysReply(TypedDict):
    retired: int


class RankStatusRequest(RankRequest, total=False):
    progress_offset: int
    log_offset: int  # 0 or more: the rank's output since then comes with the reply
    wait_s: float  # answer once the rank has ended, or after this many seconds (at most 10)


class _RankStatusReply(TypedDict):
    state: str  # starting, running, exited, vanished
    pid: int | None
    exit: int | None
    rss_bytes: int | None
    # The lines the rank appended to $COORD_PROGRESS_FILE since progress_offset, as it wrote them:
    # coord's trainers write ProgressRecords, a script of the user's may write anything.
    progress: list[JsonObject]
    progress_offset: int
    log_size: int
    time: float
    exited_at: float | None


class WorkerError(TypedDict):
    """An error a torch launcher's worker wrote to its TORCHELASTIC_ERROR_FILE (``@record``)."""

    local_rank: int  # the worker's rank on its node (-1: not known)
    message: str  # "RuntimeError: ...", the exception it died of
    time: float | None


class RankStatusReply(_RankStatusReply, total=False):
    log: bytes  # with log_offset: the rank's output from there on, up to 256 KiB
    log_offset: int  # where the next read of its output starts
    # Its processes while it runs: "stopped" (one is in state T), "uninterruptible" (one is in D,
    # or U on macOS), "running"; absent or None when not known.
    process: str | None
    # The CPU time (user and system, seconds) its processes have used together while it runs, each
    # with its children that ended; absent or None when not known. It grows while the rank works.
    cpu_s: float | None
    worker_errors: list[WorkerError]  # once exited: what a torch launcher's workers died of, oldest first
    # A digest of the stats of the attempt's checkpoints on the node (agent.ranks.checkpoints_mark): the
    # head lists them again when it changed. "" or absent when not told.
    checkpoints_mark: str


class ReadLogRequest(RankRequest, total=False):
    offset: int


class DataReply(TypedDict):
    data: bytes
    offset: int  # where the next read starts


class DumpStacksReply(TypedDict):
    sent: bool
    detail: str


class StopRankRequest(RankRequest, total=False):
    grace: float


class _StopRankReply(TypedDict):
    stopped: bool
    left: list[int]  # processes still running
    detail: str


class StopRankReply(_StopRankReply, total=False):
    states: list[str]  # the state of each process in ``left`` (D: uninterruptible), "?" when not known


class SignalRankRequest(RankRequest):
    fault: str  # "kill" (SIGKILL) or "stop" (SIGSTOP)


class _RemoveRunRequest(TypedDict):
    workdir: str
    job: str  # the run id


class RemoveRunRequest(_RemoveRunRequest, total=False):
    tree: str  # a drill's own project directory in the workdir (coord-drill-STAMP)


class CutLinkRequest(TypedDict):
    host: str  # the node's address as the cluster file gives it: its interface is the one taken down
    seconds: float


class CutLinkReply(TypedDict):
    interface: str
    time: float  # when it goes down, by the node's clock
    seconds: float


class SignalRankReply(TypedDict):
    """coord drill's fault: the rank's process group and when the signal went."""

    pid: int
    time: float


class RemoveRunReply(TypedDict):
    removed: list[str]  # relative to the workdir


class _CheckpointsRequest(TypedDict):
    workdir: str
    job: str
    attempt: int


class ListCheckpointsRequest(_CheckpointsRequest, total=False):
    known: list[str]  # names already listed: not hashed again


class _CheckpointInfo(TypedDict):
    name: str
    iteration: int
    path: str
    valid: bool
    detail: str
    size: int
    sha256: str | None  # None for an invalid file


class CheckpointInfo(_CheckpointInfo, total=False):
    # A file whose tensors hold a NaN or an infinity (``valid`` is False): the first one found.
    nonfinite: NonFinite
    # A checkpoint directory (0000040/): what this node holds of it. ``valid`` says only that it could
    # be read; whether it is complete is the head's to judge, with the other nodes' parts.
    kind: str  # "dir"
    files: list[DirFile]
    notes: dict[str, str]  # marker files read whole: DeepSpeed's "latest"
    references: dict[str, list[str] | None]  # each .metadata -> the files it names (None: unreadable)


class CheckpointFilesReply(TypedDict):
    path: str
    files: list[DirFile]
    size: int
    sha256: str


class _ListCheckpointsReply(TypedDict):
    dir: str
    checkpoints: list[CheckpointInfo]


class ListCheckpointsReply(_ListCheckpointsReply, total=False):
    free_bytes: int  # what the checkpoints' filesystem has left (so the head sees a disk filling)


class _RemoveCheckpointsRequest(_CheckpointsRequest):
    names: list[str]


class RemoveCheckpointsRequest(_RemoveCheckpointsRequest, total=False):
    replica: bool


class RemoveCheckpointsReply(TypedDict):
    removed: int


class FileRequest(TypedDict):
    workdir: str
    path: str


class HashFileReply(TypedDict):
    size: int
    sha256: str


class ReadFileRequest(FileRequest, total=False):
    offset: int


class ReadFileReply(DataReply):
    size: int


class RankSignalsRequest(RankRequest, total=False):
    seconds: float  # how long to sample (0.2 to 5 s; 1 s by default)


class BusyProcess(TypedDict):
    pid: int
    user: str
    cpu: float  # cores it used over the sample (macOS: ps's decaying average)
    command: str


class CpuQuota(TypedDict):
    source: str  # cgroup v2 or cgroup v1
    cores: float | None  # the tightest quota on the rank's cgroup or above it; None: no quota
    group: str  # the cgroup directory it is set on (or the rank's own)
    throttled_share: float | None  # the share of the sample that group was held by its quota


class RankSignalsReply(TypedDict):
    """What may slow a straggler down on its node, over ``seconds`` (agent/rank_signals.py)."""

    seconds: float
    rank_pids: list[int]
    cores: int  # the node's CPUs
    rank_cpu: float | None  # cores the rank's processes used over the sample
    others: list[BusyProcess]  # the busiest other processes, most first
    quota: CpuQuota | None  # None: no cgroup CPU controller read (macOS)
    speed_limit: int | None  # macOS pmset -g therm CPU_Speed_Limit (percent); None elsewhere
    memory_pressure: float | None  # Linux PSI memory "some avg10" (percent)
    swapins_per_s: float | None  # pages swapped in per second over the sample
    gpu_utilization: float | None  # percent, where readable (ioreg, nvidia-smi)
