"""The shapes of the agent's RPC requests and replies, for type checking both ends.

Each method the agent serves (``agent.server.build_dispatcher``) takes the arguments of
its ``...Request`` here and answers a ``...Reply``. These are ``TypedDict``s: at run
time they are the plain dicts that msgpack carries, so naming them changes nothing on
the wire. A request's required keys are those of the dispatcher's ``required`` table,
its optional keys those of ``optional`` (``REQUESTS`` maps each method to its request,
and a test holds the two together).

An optional key is declared in a ``total=False`` subclass rather than with
``NotRequired``: this module is imported on nodes whose Python may be 3.10.

Where a value is data nobody here gives a shape to (a training script's progress
records, a program's JSON output before it is checked), it is a ``JsonObject``.
Standard library only: the agent runs with the node's Python.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

#: A JSON (or msgpack) object whose fields are free-form: checked field by field where it is
#: read, or passed on as it came.
JsonObject = dict[str, Any]


# --- session ---------------------------------------------------------------------------


class _HelloRequest(TypedDict):
    protocol: int


class HelloRequest(_HelloRequest, total=False):
    client: str


class HelloReply(TypedDict):
    protocol: int
    agent_version: str
    bundle: str  # the installed bundle's digest, or "source" in a checkout
    pid: int
    python: str


class PingReply(TypedDict):
    time: float


class EmptyRequest(TypedDict):
    pass


# --- facts -----------------------------------------------------------------------------


class FactsRequest(TypedDict, total=False):
    workdir: str | None


class PowerSettings(TypedDict):
    """``pmset -g`` on a Mac: the system sleep timer and what holds sleep off."""

    sleep_minutes: int | None
    sleep_disabled: bool | None
    sleep_prevented_by: list[str]


class HardwareFacts(TypedDict):
    """``system_profiler SPHardwareDataType`` on a Mac."""

    chip: str | None
    model: str | None
    memory_bytes: int | None
    cores: int | None
    performance_cores: int | None
    efficiency_cores: int | None


class CpuInfo(TypedDict):
    chip: str | None
    cores: int | None


class SystemFacts(TypedDict):
    os: str | None
    os_version: str | None
    os_build: str | None
    os_pretty: str | None
    chip: str | None
    cores: int | None
    performance_cores: int | None
    efficiency_cores: int | None
    memory_bytes: int | None
    power: PowerSettings | None


class PythonFacts(TypedDict):
    python_version: str | None
    mlx_version: str | None
    mlx_lm_version: str | None


class FactsReply(SystemFacts, PythonFacts):
    hostname: str | None
    user: str | None
    home: str | None
    arch: str | None
    workdir: str | None
    disk_free_bytes: int | None
    python_executable: str
    mlx_env: dict[str, str]  # the MLX_* environment variables ranks inherit
    gpu: str | None  # "metal", "cuda", "none", or None when MLX could not say
    gpu_detail: str


# --- usage -----------------------------------------------------------------------------


class GpuStatistics(TypedDict):
    gpu_utilization: float | None
    gpu_memory_bytes: int | None


class UsageSources(TypedDict):
    """Where each reading came from, or why there is none."""

    memory: str
    gpu: str
    power: str
    temperature: str


class UsageSample(TypedDict):
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    gpu_utilization: float | None
    gpu_memory_bytes: int | None
    power_watts: float | None
    temperature_c: float | None
    sources: UsageSources


class UsageReply(UsageSample):
    time: float


# --- sync ------------------------------------------------------------------------------

#: A manifest row: [path, size, mode, sha256].
ManifestRow = list[Any]
#: A small file sent whole: [path, mode, sha256, data], each field checked by the agent.
PutFileRow = list[Any]
#: A mode to set: [path, mode].
ModeRow = list[Any]


class ScanStatsReport(TypedDict):
    files: int
    bytes: int
    hashed_files: int
    hashed_bytes: int
    skipped: list[str]  # the first 50
    skipped_count: int
    seconds: float


class ManifestRequest(TypedDict):
    root: str
    patterns: list[str]


class ManifestReply(TypedDict):
    files: list[ManifestRow]
    tree_hash: str
    stats: ScanStatsReport


class PutFilesRequest(TypedDict):
    root: str
    files: list[PutFileRow]


class PutFilesReply(TypedDict):
    files: int
    bytes: int


class SyncStateRequest(ManifestRequest, total=False):
    known: list[str] | None  # tree hashes whose manifest the head holds


class _SyncStateReply(TypedDict):
    tree_hash: str
    count: int
    flushed: int  # files made durable by this call
    flush: str  # how: "nothing", "syncfs", "fsync" or "fsync+F_FULLFSYNC"
    stats: ScanStatsReport


class SyncStateReply(_SyncStateReply, total=False):
    files: list[ManifestRow]  # only when ``known`` was given and the tree's hash is not in it


class UploadBeginRequest(TypedDict):
    root: str
    path: str
    size: int
    mode: int
    sha256: str


class UploadBeginReply(TypedDict):
    upload: int


class UploadChunkRequest(TypedDict):
    upload: int
    offset: int
    data: bytes


class UploadChunkReply(TypedDict):
    offset: int


class UploadRequest(TypedDict):
    upload: int


class UploadFinishReply(TypedDict):
    bytes: int


class UploadAbortReply(TypedDict):
    aborted: int


class PathsRequest(TypedDict):
    root: str
    paths: list[str]


class DeleteFilesReply(TypedDict):
    deleted: int


class SetModesRequest(TypedDict):
    root: str
    modes: list[ModeRow]


class SetModesReply(TypedDict):
    changed: int


class InspectFilesRequest(PathsRequest, total=False):
    count_lines: bool


class _FileInfo(TypedDict):
    size: int
    mode: int
    sha256: str


class FileInfo(_FileInfo, total=False):
    lines: int  # with count_lines


class InspectFilesReply(TypedDict):
    files: dict[str, FileInfo | None]  # None: missing, or not a regular file


class CheckWritableRequest(TypedDict):
    root: str
    subdir: str


class CheckWritableReply(TypedDict):
    writable: bool
    detail: str
    free_bytes: int
    path: str


# --- relay -----------------------------------------------------------------------------


class RelayReceiveRequest(TypedDict):
    transfer: str
    token: str
    root: str
    path: str
    size: int
    mode: int
    sha256: str
    chunk_bytes: int
    chunks: list[bytes]  # the SHA256 of each chunk


class RelayReceiveReply(TypedDict):
    port: int


class _RelaySourceRequest(TypedDict):
    transfer: str
    token: str
    workdir: str
    path: str
    size: int
    sha256: str


class RelaySourceRequest(_RelaySourceRequest, total=False):
    chunk_bytes: int


class RelaySourceReply(TypedDict):
    port: int
    chunks: list[bytes]


class RelayForwardRequest(TypedDict):
    transfer: str
    targets: list[list[Any]]  # [host, port] pairs, checked by the agent


class TransferRequest(TypedDict):
    transfer: str


class RelayWaitRequest(TransferRequest, total=False):
    timeout: float
    have: int


class ForwardState(TypedDict):
    host: str
    port: int
    sent: int
    error: str | None
    done: bool


class TransferState(TypedDict):
    transfer: str
    have: int
    chunks: int
    size: int
    bytes: int
    done: bool
    error: str | None
    upstream_error: str | None
    upstream_error_at: int
    connections: int
    path: str
    upstream: str | None
    seconds: float
    forwards: list[ForwardState]


class _RelayCloseReply(TypedDict):
    closed: bool


class RelayCloseReply(_RelayCloseReply, total=False):
    done: bool  # when it was open


# The data plane's frames (``shared.relay``), node to node.


class RelayHello(TypedDict):
    transfer: str
    token: str


class RelayWant(TypedDict):
    want: int


class RelayRefusal(TypedDict):
    error: str | None


class RelayDone(TypedDict):
    done: bool


RelayFrame = RelayHello | RelayWant | RelayRefusal | RelayDone


# --- topology --------------------------------------------------------------------------


class AddressInfo(TypedDict):
    family: str  # "ipv4" or "ipv6"
    address: str
    prefixlen: int | None
    scope: str | None


class ParsedInterface(TypedDict):
    """An interface as ``ip -j addr`` or ``ifconfig`` describe it."""

    name: str
    up: bool
    flags: list[str]
    mac: str | None
    addresses: list[AddressInfo]


class IpInterface(ParsedInterface):
    state: str | None
    link_type: str | None
    master: str | None


class IfconfigInterface(ParsedInterface):
    status: str | None
    members: list[str]


class IbvPort(TypedDict):
    port: int | None
    state: str | None
    link_layer: str | None
    active_mtu: int | None
    max_mtu: int | None


class _IbvDevice(TypedDict):
    name: str
    transport: str | None
    node_guid: str | None
    phys_port_cnt: int | None
    ports: list[IbvPort]


class IbvDevice(_IbvDevice, total=False):
    netdevs: list[str]  # read under /sys on Linux


class SysfsPort(TypedDict):
    state: str | None
    link_layer: str | None


class SysfsDevice(TypedDict):
    ports: dict[str, SysfsPort]
    netdevs: list[str]


class HardwarePort(TypedDict):
    """One entry of ``networksetup -listallhardwareports``."""

    port: str | None
    device: str | None
    mac: str | None


class Receptacle(TypedDict):
    port: str
    interface: str
    rdma_device: str | None


class ThunderboltHost(TypedDict):
    domain_uuid: str
    name: str | None
    model: str | None
    vendor: str | None
    ip_service: bool


class ThunderboltDevice(TypedDict):
    name: str | None
    vendor: str | None
    mode: str | None
    link_gbps: int | float | None
    depth: int


class ThunderboltBus(TypedDict):
    bus: str
    domain_uuid: str | None
    receptacle: int | None
    connected: bool
    link_speed: str | None
    link_gbps: int | float | None
    generation: int | None
    capability_gbps: int | float | None
    peer: ThunderboltHost | None
    devices: list[ThunderboltDevice]
    indirect_peers: list[str]


class ThunderboltPeer(TypedDict):
    bus: str
    receptacle: int | None
    domain_uuid: str
    link_gbps: int | float | None
    generation: int | None


class ThunderboltInfo(TypedDict):
    buses: list[ThunderboltBus]
    own_domain_uuids: dict[str, str]
    peers: list[ThunderboltPeer]


class PortNames(TypedDict):
    """What networksetup says about a Thunderbolt bus's port (None where it does not)."""

    port_name: str | None
    interface: str | None
    rdma_device: str | None


class NamedThunderboltBus(ThunderboltBus, PortNames):
    pass


class NamedThunderboltPeer(ThunderboltPeer):
    interface: str | None
    rdma_device: str | None


class NamedThunderboltInfo(TypedDict):
    buses: list[NamedThunderboltBus]
    own_domain_uuids: dict[str, str]
    peers: list[NamedThunderboltPeer]


class ActiveRdmaPort(TypedDict):
    device: str | None
    port: int | None
    state: str | None
    link_layer: str | None
    active_mtu: int | None


class RdmaPortInfo(TypedDict):
    device: str
    port: int | None
    state: str | None
    link_layer: str | None
    interface: str | None


class RdmaInfo(TypedDict):
    state: str | None  # "enabled", "disabled", or None when unknown
    devices: list[str] | None
    active_ports: list[ActiveRdmaPort] | None
    ports: list[RdmaPortInfo] | None


class BridgeInfo(TypedDict):
    enabled: bool | None
    interface: str | None
    members: list[str]


class InterfaceInfo(TypedDict):
    name: str
    kind: str  # thunderbolt, ethernet, wifi, loopback, other
    addresses: list[AddressInfo]
    up: bool
    port: str | None  # the hardware port's name (macOS)


class TopologyReply(TypedDict):
    platform: str | None
    os_version: str | None
    rdma: RdmaInfo
    thunderbolt: NamedThunderboltInfo | None
    thunderbolt_bridge: BridgeInfo
    interfaces: list[InterfaceInfo] | None
    detail: dict[str, str]  # source: why it could not be read


# --- ranks -----------------------------------------------------------------------------


class _PrepareRankRequest(TypedDict):
    job: str
    rank: int
    workdir: str
    python: str
    argv: list[str]
    env: dict[str, str]


class PrepareRankRequest(_PrepareRankRequest, total=False):
    attempt: int


class PrepareRankReply(TypedDict):
    script: str
    tmpdir: str
    rank_dir: str


class RankRequest(TypedDict):
    workdir: str
    job: str
    attempt: int
    rank: int


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


class RankStatusReply(_RankStatusReply, total=False):
    log: bytes  # with log_offset: the rank's output from there on, up to 256 KiB
    log_offset: int  # where the next read of its output starts


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


class StopRankReply(TypedDict):
    stopped: bool
    left: list[int]  # processes still running
    detail: str


class _CheckpointsRequest(TypedDict):
    workdir: str
    job: str
    attempt: int


class ListCheckpointsRequest(_CheckpointsRequest, total=False):
    known: list[str]  # names already listed: not hashed again


class CheckpointInfo(TypedDict):
    name: str
    iteration: int
    path: str
    valid: bool
    detail: str
    size: int
    sha256: str | None  # None for an invalid file


class ListCheckpointsReply(TypedDict):
    dir: str
    checkpoints: list[CheckpointInfo]


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


# --- progress records (what coord's trainers append to $COORD_PROGRESS_FILE) -----------


class _Timed(TypedDict, total=False):
    time: float  # seconds since the epoch, when it was written


class TrainRecord(_Timed):
    kind: Literal["train"]
    step: int
    loss: float
    tokens_per_second: float
    learning_rate: float
    peak_memory_gb: float


class ValRecord(_Timed):
    kind: Literal["val"]
    step: int
    val_loss: float


class CheckpointRecord(_Timed):
    kind: Literal["checkpoint"]
    step: int
    file: str
    bytes: int
    blocking_seconds: float  # training held while the arrays were copied
    write_seconds: float


class FingerprintRecord(_Timed):
    kind: Literal["fingerprint"]
    step: int
    rank: int
    sha256: str  # of the rank's trainable weights


ProgressRecord = TrainRecord | ValRecord | CheckpointRecord | FingerprintRecord


# --- calibration -----------------------------------------------------------------------


class _CalibrateRequest(TypedDict):
    python: str
    workdir: str


class CalibrateRequest(_CalibrateRequest, total=False):
    quick: bool
    timeout: float


class CalibrationProgress(TypedDict):
    """An event of a ``calibrate`` call (a line the calibration printed on stderr)."""

    progress: str  # the stage
    fraction: float


class TrainModel(TypedDict):
    kind: str
    layers: int
    dim: int
    heads: int
    vocab: int
    seq_len: int
    batch: int


class CalibrationReply(TypedDict, total=False):
    """What ``python -m agent.calibrate`` printed, with what the agent adds; ``ok`` says which half.

    Measurements that failed are None, with the reason in ``errors``. A calibration that
    could not run has ``ok`` False and ``error_kind`` (timeout, mlx_missing, spawn_failed,
    exit_status, bad_output), ``error``, ``exit_code`` and ``stderr_tail``.
    """

    ok: bool
    calibration_version: int
    quick: bool
    mlx_version: str | None
    python_version: str
    cpu_count: int | None
    device: str | None
    device_kind: str | None  # "gpu" or "cpu"
    matmul_gflops: dict[str, float | None]  # by dtype
    matmul_sizes: dict[str, int]
    memory_bandwidth_gbps: float | None
    memory_bandwidth_method: str | None
    peak_memory_bytes: int | None
    peak_memory_source: str | None
    train_samples_per_s: float | None
    train_step_ms: float | None
    train_steps: int | None
    train_model: TrainModel
    mlx_peak_used_bytes: int | None
    errors: dict[str, str]  # measurement: why it failed
    duration_s: float
    mlx_import_s: float
    python_executable: str
    error_kind: str
    error: str
    exit_code: int | None
    stderr_tail: list[str]
    wall_s: float  # added by the agent: the whole run, start to exit


#: Each method's request, by name: its required keys are the dispatcher's required arguments,
#: its optional keys the optional ones.
REQUESTS: dict[str, type] = {
    "hello": HelloRequest,
    "facts": FactsRequest,
    "ping": EmptyRequest,
    "usage": EmptyRequest,
    "manifest": ManifestRequest,
    "put_files": PutFilesRequest,
    "sync_state": SyncStateRequest,
    "upload_begin": UploadBeginRequest,
    "upload_chunk": UploadChunkRequest,
    "upload_finish": UploadRequest,
    "upload_abort": UploadRequest,
    "delete_files": PathsRequest,
    "set_modes": SetModesRequest,
    "inspect_files": InspectFilesRequest,
    "relay_receive": RelayReceiveRequest,
    "relay_source": RelaySourceRequest,
    "relay_forward": RelayForwardRequest,
    "relay_wait": RelayWaitRequest,
    "relay_close": TransferRequest,
    "topology": EmptyRequest,
    "check_writable": CheckWritableRequest,
    "prepare_rank": PrepareRankRequest,
    "rank_status": RankStatusRequest,
    "read_log": ReadLogRequest,
    "dump_stacks": RankRequest,
    "stop_rank": StopRankRequest,
    "list_checkpoints": ListCheckpointsRequest,
    "remove_checkpoints": RemoveCheckpointsRequest,
    "hash_file": FileRequest,
    "read_file": ReadFileRequest,
    "calibrate": CalibrateRequest,
}

#: Each method's reply, by name.
REPLIES: dict[str, type] = {
    "hello": HelloReply,
    "facts": FactsReply,
    "ping": PingReply,
    "usage": UsageReply,
    "manifest": ManifestReply,
    "put_files": PutFilesReply,
    "sync_state": SyncStateReply,
    "upload_begin": UploadBeginReply,
    "upload_chunk": UploadChunkReply,
    "upload_finish": UploadFinishReply,
    "upload_abort": UploadAbortReply,
    "delete_files": DeleteFilesReply,
    "set_modes": SetModesReply,
    "inspect_files": InspectFilesReply,
    "relay_receive": RelayReceiveReply,
    "relay_source": RelaySourceReply,
    "relay_forward": TransferState,
    "relay_wait": TransferState,
    "relay_close": RelayCloseReply,
    "topology": TopologyReply,
    "check_writable": CheckWritableReply,
    "prepare_rank": PrepareRankReply,
    "rank_status": RankStatusReply,
    "read_log": DataReply,
    "dump_stacks": DumpStacksReply,
    "stop_rank": StopRankReply,
    "list_checkpoints": ListCheckpointsReply,
    "remove_checkpoints": RemoveCheckpointsReply,
    "hash_file": HashFileReply,
    "read_file": ReadFileReply,
    "calibrate": CalibrationReply,
}
