"""The agent's view of its node's rank: status, progress, log, stacks, stop, checkpoints.

Everything a rank leaves lives under ``<workdir>/.coord/jobs/<job>/attempt-<A>/rank-<R>``
(written by ``agent.rank_runner``); checkpoints under ``<workdir>/checkpoints/<job>``.
Paths are built here from validated names, never taken from the wire.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import time
from typing import TYPE_CHECKING

from agent import proc_cpu, proc_state
from agent.launch import JOB_NAME
from shared import checkpoint_dirs
from shared import protocol as p
from shared.checkpoint_dirs import describe_nonfinite, describe_values_read
from shared.manifest import sha256_file
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from agent.tensor_scan import Scan
    from shared.agent_api.common import JsonObject
    from shared.agent_api.ranks import (
        CheckpointFilesReply,
        CheckpointInfo,
        DataReply,
        DumpStacksReply,
        HashFileReply,
        ListCheckpointsReply,
        RankStatusReply,
        ReadFileReply,
        RemoveCheckpointsReply,
        StopRankReply,
        WorkerError,
    )
    from shared.checkpoint_dirs import DirFile, NonFinite

CHECKPOINT_NAME = re.compile(r"^(\d{7})_adapters\.safetensors$")
MAX_READ = 4 << 20
LOG_INLINE = 256 << 10  # output sent with a status reply; more is read with read_log
MAX_HEADER = 100 << 20
MAX_ERROR_FILE = 1 << 20
RUNNER_GRACE_S = 2.0
MARK_ENTRIES_AT_MOST = 4096  # beyond this, no mark: the head lists the node's checkpoints at every poll


def rank_dir(workdir: str, job: str, attempt: int, rank: int) -> str:
    if not JOB_NAME.match(job) or not 0 <= attempt < 100000 or not 0 <= rank < 4096:
        raise RemoteError(p.BAD_ARGS, f"bad job {job!r}, attempt {attempt} or rank {rank}")
    if not os.path.isabs(workdir):
        raise RemoteError(p.BAD_ARGS, f"workdir must be absolute, got {workdir!r}")
    return os.path.join(workdir, ".coord", "jobs", job, f"attempt-{attempt}", f"rank-{rank}")


def checkpoint_dir(workdir: str, job: str, attempt: int, replica: bool = False) -> str:
    """Where rank 0 writes an attempt's checkpoints, or where this node keeps replicas of them."""
    if not JOB_NAME.match(job) or not 0 <= attempt < 100000 or not os.path.isabs(workdir):
        raise RemoteError(p.BAD_ARGS, f"bad job {job!r} or attempt {attempt}")
    if replica:
        return os.path.join(workdir, "checkpoints", job, "replica", f"attempt-{attempt}")
    return os.path.join(workdir, "checkpoints", job, f"attempt-{attempt}")


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return int(handle.read().strip())
    except (OSError, ValueError):
        return None


def _rss_bytes(pid: int | None) -> int | None:
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/statm", encoding="utf-8") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None  # Linux: the process is gone
    except (OSError, ValueError, IndexError):
        return None
    # macOS has no /proc: ps reports the resident size in KiB.
    try:
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True, timeout=5)
        return int(out.stdout.strip()) * 1024 if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def _rank_members(pgid: int, runner: int | None) -> list[int]:
    """Live processes of a rank: its process group, and whatever lives below its runner (a launcher
    such as torchrun puts each worker in a session of its own; the runner adopts them when that
    launcher dies). Zombies and the runner itself are left out."""
    procs = proc_state.rank_processes(pgid, runner if proc_state.alive(runner) else None)
    return [pid for pid, state in procs.items() if state not in ("Z", "X") and pid != runner]


def _signal_all(pgid: int, members: list[int], sig: int) -> None:
    """``sig`` to the rank's group and to each member's own group (a worker in a session of its own)."""
    groups = {pgid}
    for pid in members:
        with contextlib.suppress(OSError):
            groups.add(os.getpgid(pid))
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, sig)


def rank_ended(workdir: str, job: str, attempt: int, rank: int) -> bool:
    """Whether the rank is over (its exit status written, or neither it nor its runner alive): a
    few stats, cheap enough to ask ten times a second while a status request waits."""
    directory = rank_dir(workdir, job, attempt, rank)
    if os.path.exists(os.path.join(directory, "exit")):
        return True
    pid = _read_int(os.path.join(directory, "pid"))
    runner = _read_int(os.path.join(directory, "runner.pid"))
    return pid is not None and not proc_state.alive(pid) and not proc_state.alive(runner)


def runner_pid(workdir: str, job: str, attempt: int, rank: int) -> int | None:
    """The pid of the rank's runner, once it has started."""
    return _read_int(os.path.join(rank_dir(workdir, job, attempt, rank), "runner.pid"))


def rank_status(workdir: str, job: str, attempt: int, rank: int, progress_offset: int = 0,
                log_offset: int = -1) -> RankStatusReply:
    """The rank's state, its progress records since ``progress_offset`` and, with ``log_offset`` of
    0 or more, its output since then (up to LOG_INLINE bytes): one call where there were two."""
    directory = rank_dir(workdir, job, attempt, rank)
    pid = _read_int(os.path.join(directory, "pid"))
    runner = _read_int(os.path.join(directory, "runner.pid"))
    alive = proc_state.alive(pid)
    runner_alive = proc_state.alive(runner)
    # Read the exit status after the liveness checks: the runner writes it just after its
    # child ends, so a dead child with a live runner is a rank that is finishing, not lost.
    code = _read_int(os.path.join(directory, "exit"))
    exited_at = None
    if code is not None:
        state, alive = "exited", False
        with contextlib.suppress(OSError):
            exited_at = os.stat(os.path.join(directory, "exit")).st_mtime
    elif alive or runner_alive:
        state = "running"
    else:
        state = "starting" if pid is None else "vanished"
    progress, offset = _read_progress(os.path.join(directory, "progress.jsonl"), progress_offset)
    try:
        log_size = os.path.getsize(os.path.join(directory, "output.log"))
    except OSError:
        log_size = 0
    reply: RankStatusReply = {
        "state": state, "pid": pid, "exit": code, "rss_bytes": _rss_bytes(pid) if alive else None,
        "progress": progress, "progress_offset": offset, "log_size": log_size, "time": time.time(),
        "exited_at": exited_at, "checkpoints_mark": checkpoints_mark(workdir, job, attempt)}
    if state == "exited":
        errors = worker_errors(directory)
        if errors:
            reply["worker_errors"] = errors
    if log_offset >= 0:
        piece = read_log(workdir, job, attempt, rank, log_offset, limit=LOG_INLINE)
        reply["log"], reply["log_offset"] = piece["data"], piece["offset"]
    if alive and pid is not None:
        # Read last: a rank stopped (SIGSTOP) or stuck in the kernel is named by the hang watch, and
        # one whose processes use CPU before its first step is working, not hung.
        processes = proc_state.rank_processes(pid, runner if runner_alive else None)
        reply["process"] = proc_state.summarize(processes)
        reply["cpu_s"] = proc_cpu.cpu_seconds(processes)
    return reply


def worker_errors(directory: str) -> list[WorkerError]:
    """The errors a torch launcher's workers wrote (``TORCHELASTIC_ERROR_FILE``, under the rank's
    ``torchrun/`` log directory: ``<run>/attempt_<n>/<local rank>/error.json``), oldest first: the
    exception a worker decorated with ``@record`` died of."""
    found: list[WorkerError] = []
    root = os.path.join(directory, "torchrun")
    for base, _dirs, names in os.walk(root):
        if "error.json" not in names:
            continue
        local = os.path.basename(base)
        try:
            with open(os.path.join(base, "error.json"), "rb") as handle:
                data = json.loads(handle.read(MAX_ERROR_FILE))
            message = data["message"]
            text = message["message"] if isinstance(message, dict) else str(message)
            stamp = message.get("extraInfo", {}).get("timestamp") if isinstance(message, dict) else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        found.append({"local_rank": int(local) if local.isdigit() else -1, "message": str(text)[:2000],
                      "time": float(stamp) if isinstance(stamp, (int, str)) and str(stamp).isdigit() else None})
    return sorted(found, key=lambda e: (e["time"] or 0.0, e["local_rank"]))


def _read_progress(path: str, offset: int) -> tuple[list[JsonObject], int]:
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read(MAX_READ)
    except OSError:
        return [], offset
    end = data.rfind(b"\n")
    if end < 0:
        return [], offset
    records: list[JsonObject] = []
    beats: list[JsonObject] = []
    for line in data[:end].splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
            if record.get("kind") == "heartbeat":
                beats.append(record)
    if not beats:
        return records, offset + end + 1
    # Only the newest heartbeat says what the rank does now: the older ones are not sent. Their
    # compute times are, folded into it: a beat is written at every change of phase too, so where
    # checkpoints come every second or two, most beats that carry a compute time are followed at
    # once by one that carries none (the training resumed), and the watch of stragglers would see
    # almost none of them.
    newest = _with_compute_of(beats)
    kept = [newest if r is beats[-1] else r for r in records if r.get("kind") != "heartbeat" or r is beats[-1]]
    return kept, offset + end + 1


def _with_compute_of(beats: list[JsonObject]) -> JsonObject:
    """The newest of ``beats``, its ``compute_s`` the mean over every step the beats counted (each
    beat's ``compute_s`` is the mean of its ``compute_steps`` steps). A beat whose pair the head would
    not take (coordinator/jobs/progress.py: a finite time of 0 or more, a count of 1 or more) adds
    nothing."""
    total, steps = 0.0, 0
    for beat in beats:
        seconds, counted = beat.get("compute_s"), beat.get("compute_steps")
        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds) \
                and seconds >= 0 and isinstance(counted, int) and not isinstance(counted, bool) and counted > 0:
            total, steps = total + seconds * counted, steps + counted
    newest = dict(beats[-1])
    if steps:
        newest["compute_s"], newest["compute_steps"] = round(total / steps, 6), steps
    return newest


def read_log(workdir: str, job: str, attempt: int, rank: int, offset: int = 0,
             limit: int = MAX_READ) -> DataReply:
    path = os.path.join(rank_dir(workdir, job, attempt, rank), "output.log")
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read(limit)
    except FileNotFoundError:
        data = b""
    return {"data": data, "offset": offset + len(data)}


def dump_stacks(workdir: str, job: str, attempt: int, rank: int) -> DumpStacksReply:
    """Ask a hung rank to print its Python stacks (coord's trainers register SIGUSR1 for it)."""
    pid = _read_int(os.path.join(rank_dir(workdir, job, attempt, rank), "pid"))
    if pid is None or not proc_state.alive(pid):
        return {"sent": False, "detail": "rank is not running"}
    try:
        os.kill(pid, signal.SIGUSR1)
    except OSError as exc:
        return {"sent": False, "detail": str(exc)}
    return {"sent": True, "detail": f"SIGUSR1 sent to {pid}"}


def stop_rank(workdir: str, job: str, attempt: int, rank: int, grace: float = 5.0) -> StopRankReply:
    """Stop the rank's processes (SIGCONT first: a stopped rank cannot act on SIGTERM): SIGTERM,
    and SIGKILL to whatever is left after ``grace`` seconds."""
    directory = rank_dir(workdir, job, attempt, rank)
    pgid = _read_int(os.path.join(directory, "pid"))
    runner = _read_int(os.path.join(directory, "runner.pid"))
    if pgid is None:
        return {"stopped": True, "left": [], "detail": "rank never started"}
    members = _rank_members(pgid, runner)
    # SIGCONT to every member: a stopped worker outside the group would not act on its launcher's SIGTERM.
    _signal_all(pgid, members, signal.SIGCONT)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)  # the launcher (or the script) stops its own workers first
    # Wait on the members already known, a stat each, and read the whole process table only once
    # more before SIGKILL (for a worker started meanwhile): a table is every process of the machine,
    # and ten a second in each agent stopping a rank at once took the CPU from the ranks stopping.
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (members := [pid for pid in members if proc_state.alive(pid)]):
        time.sleep(0.1)
    if members := _rank_members(pgid, runner):
        _signal_all(pgid, members, signal.SIGKILL)
    # The runner records the rank's exit status just after its child ends: give it that moment
    # before killing it, or the status is lost (it was in about 1 stop in 20 here).
    deadline = time.monotonic() + RUNNER_GRACE_S
    while runner and proc_state.alive(runner) and time.monotonic() < deadline:
        time.sleep(0.02)
    left_below = _rank_members(pgid, runner)  # read before the runner goes: its orphans would be init's
    if runner and proc_state.alive(runner):
        with contextlib.suppress(ProcessLookupError):
            os.kill(runner, signal.SIGKILL)
    if left_below:
        _signal_all(pgid, left_below, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (_rank_members(pgid, None) + [p for p in left_below if proc_state.alive(p)]
                                           or proc_state.alive(runner)):
        time.sleep(0.05)
    left = sorted(set(_rank_members(pgid, None) + [p for p in left_below if proc_state.alive(p)])) + \
        ([runner] if proc_state.alive(runner) else [])
    if not left:
        return {"stopped": True, "left": [], "detail": "stopped"}
    named = [proc_state.process_state(pid) or "?" for pid in left]
    return {"stopped": False, "left": left, "states": named,
            "detail": "still running after SIGKILL: " + ", ".join(f"{pid} (state {state})"
                                                                  for pid, state in zip(left, named, strict=True))}


def validate_safetensors(path: str) -> tuple[bool, str]:
    """Complete and readable: a header that parses and tensors that fit in the file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                return False, "shorter than a safetensors header"
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER or 8 + length > size:
                return False, "header length beyond the end of the file"
            header = json.loads(handle.read(length))
    except (OSError, ValueError) as exc:
        return False, f"header unreadable: {exc}"
    if not isinstance(header, dict):
        return False, "header is not a JSON object"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("data_offsets"), list):
            return False, f"tensor {name!r} has no data offsets"
        end = max(end, int(entry["data_offsets"][1]))
    if 8 + length + end != size:
        return False, f"file is {size} bytes, its tensors need {8 + length + end}"
    return True, f"{len(header) - ('__metadata__' in header)} tensors"


#: Checkpoints this agent hashed (or received whole, each chunk checked), by path: (size, mtime_ns,
#: inode, sha256, what its tensors' values are: None when they were not read). A resume re-checks each
#: copy where it lies; one unchanged since it was hashed (same size, mtime and inode, the rule of the
#: sync's hash cache) is not read again.
_hashed: dict[str, tuple[int, int, int, str, Scan | None]] = {}
_HASHED_AT_MOST = 4096


def _stat_key(info: os.stat_result) -> tuple[int, int, int]:
    return info.st_size, info.st_mtime_ns, info.st_ino


def _remember(path: str, before: os.stat_result, sha256: str, scan: Scan | None) -> None:
    if _stat_key(os.stat(path)) != _stat_key(before):
        return  # being written while it was read
    if len(_hashed) >= _HASHED_AT_MOST:
        _hashed.clear()
    _hashed[path] = (*_stat_key(before), sha256, scan)


def remember_hash(path: str, sha256: str) -> None:
    info = os.stat(path)
    _remember(path, info, sha256, None)


def sha256_remembered(path: str) -> str:
    """The file's SHA256, read again only when it changed since this agent last hashed it."""
    before = os.stat(path)
    known = _hashed.get(path)
    if known is not None and known[:3] == _stat_key(before):
        return known[3]
    digest = sha256_file(path, before.st_size)
    _remember(path, before, digest, None)
    return digest


def scanned_remembered(path: str) -> Scan:
    """The file's SHA256 and what its tensors' values are, from one read (agent/tensor_scan.py), read
    again only when it changed since this agent last read it so."""
    before = os.stat(path)
    known = _hashed.get(path)
    if known is not None and known[:3] == _stat_key(before) and known[4] is not None:
        return known[4]
    from agent.tensor_scan import scan_file  # imported when a checkpoint is first listed: zipfile, pickletools

    scan = scan_file(path)
    _remember(path, before, scan.sha256, scan)
    return scan


def nonfinite_of(name: str, scan: Scan) -> NonFinite | None:
    bad = scan.bad
    if bad is None:
        return None
    return {"file": name, "tensor": bad.tensor, "value": bad.value, "element": bad.element, "dtype": bad.dtype}


def checkpoints_mark(workdir: str, job: str, attempt: int) -> str:
    """What the attempt's checkpoints on this node look like, in a stat per entry (its name, type, size,
    inode and mtime, down every checkpoint directory): the head lists this node's checkpoints, which
    hashes the new ones, only when it changed (or after a slow backstop), not at every poll of every node.
    "" when it could not be told (too many entries, an error): the head then lists as it always did."""
    top = checkpoint_dir(workdir, job, attempt)
    digest = hashlib.blake2b(digest_size=12)
    seen = 0
    pending = [""]
    while pending:
        rel = pending.pop()
        try:
            with os.scandir(os.path.join(top, rel) if rel else top) as listing:
                entries = sorted(listing, key=lambda entry: entry.name)
        except FileNotFoundError:
            return "" if rel else "none"  # nothing written yet; or a directory removed as it was read
        except OSError:
            return ""
        try:
            for entry in entries:
                info = entry.stat(follow_symlinks=False)
                name = f"{rel}/{entry.name}" if rel else entry.name
                digest.update(f"{name}\0{info.st_mode}\0{info.st_size}\0{info.st_ino}\0{info.st_mtime_ns}\n"
                              .encode("utf-8", "surrogateescape"))
                if entry.is_dir(follow_symlinks=False):
                    pending.append(name)
        except OSError:  # removed as it was read (retention, a rank's own rotation): changing now
            return ""
        seen += len(entries)
        if seen > MARK_ENTRIES_AT_MOST:
            return ""
    return digest.hexdigest()


def list_checkpoints(workdir: str, job: str, attempt: int,
                     known: list[str] | None = None) -> ListCheckpointsReply:
    """Checkpoints of one attempt, with SHA256 (skipping ones already known): safetensors files,
    validated here, and checkpoint directories (``0000040/``), described file by file: whether one is
    complete may depend on what the other nodes hold of it, which the head judges."""
    directory = checkpoint_dir(workdir, job, attempt)
    skip = set(known or [])
    found: list[CheckpointInfo] = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        names = []
    for name in names:
        if name in skip:
            continue
        path = os.path.join(directory, name)
        if checkpoint_dirs.DIR_NAME.match(name) and os.path.isdir(path) and not os.path.islink(path):
            found.append(describe_checkpoint_dir(name, path, values=True))
            continue
        match = CHECKPOINT_NAME.match(name)
        if not match:
            continue
        found.append(describe_checkpoint_file(name, int(match.group(1)), path))
    reply: ListCheckpointsReply = {"dir": directory, "checkpoints": found}
    with contextlib.suppress(OSError):
        room = os.statvfs(directory if names else workdir)
        reply["free_bytes"] = room.f_bavail * room.f_frsize
    return reply


def describe_checkpoint_file(name: str, iteration: int, path: str) -> CheckpointInfo:
    """One safetensors checkpoint: complete (its header and sizes), and every float value finite, read
    in the same pass that hashes it."""
    size = os.path.getsize(path)
    valid, detail = validate_safetensors(path)
    if not valid:
        return {"name": name, "iteration": iteration, "path": path, "valid": False, "detail": detail, "size": size,
                "sha256": None}
    scan = scanned_remembered(path)
    bad = nonfinite_of(name, scan)
    if bad is not None:
        return {"name": name, "iteration": iteration, "path": path, "valid": False,
                "detail": describe_nonfinite(bad), "size": size, "sha256": None, "nonfinite": bad}
    return {"name": name, "iteration": iteration, "path": path, "valid": True,
            "detail": detail + (f", {describe_values_read(scan.values_read)}" if scan.values_read else ""),
            "size": size, "sha256": scan.sha256}


def describe_checkpoint_dir(name: str, path: str, *, values: bool = False) -> CheckpointInfo:
    """What this node holds of one checkpoint directory: each file with its SHA256 (hashed again only
    when it changed), the notes its format names its parts in, and a digest over all of it. ``values``:
    its tensors' values are read too, in the same pass (whether they are finite is the head's to judge
    with the other nodes' parts)."""
    entries, problem = checkpoint_dirs.walk(path)
    files: list[DirFile] = []
    for rel, full in entries:
        try:
            files.append(_dir_file(rel, full) if values else
                         {"path": rel, "size": os.path.getsize(full), "sha256": sha256_remembered(full)})
        except OSError as exc:  # removed or replaced while it was read: still being written
            problem = problem or f"{rel} could not be read: {exc.strerror or exc}"
    paths = dict(entries)
    return {"name": name, "iteration": int(name), "path": path, "valid": problem is None,
            "detail": problem or f"{len(files)} files", "size": checkpoint_dirs.total_size(files),
            "sha256": checkpoint_dirs.digest(files) if problem is None else None, "kind": "dir", "files": files,
            "notes": checkpoint_dirs.notes_of(paths), "references": checkpoint_dirs.metadata_references(paths)}


def _dir_file(rel: str, full: str) -> DirFile:
    size = os.path.getsize(full)
    scan = scanned_remembered(full)
    entry: DirFile = {"path": rel, "size": size, "sha256": scan.sha256}
    if scan.values_read:
        entry["values_read"] = scan.values_read
    bad = nonfinite_of(rel, scan)
    if bad is not None:
        entry["nonfinite"] = bad
    return entry


def under_workdir(workdir: str, path: str) -> str:
    """``path`` (absolute, or relative to the workdir) where it lies, refused unless it is there and under
    the workdir: every path a checkpoint method takes comes from the wire."""
    from shared.paths import UnsafePath, resolve_under

    try:
        return resolve_under(workdir, os.path.relpath(path, workdir) if os.path.isabs(path) else path,
                             must_exist=True)
    except (UnsafePath, ValueError) as exc:
        raise RemoteError(p.REFUSED, str(exc)) from None


def checkpoint_files(workdir: str, path: str) -> CheckpointFilesReply:
    """The files of a checkpoint directory under the workdir, with their SHA256, to copy it file by file."""
    full = under_workdir(workdir, path)
    if not os.path.isdir(full):
        raise RemoteError(p.BAD_ARGS, f"{path} is not a checkpoint directory")
    described = describe_checkpoint_dir(os.path.basename(full), full)
    if not described["valid"]:
        raise RemoteError(p.REFUSED, f"{path}: {described['detail']}")
    return {"path": full, "files": described.get("files", []), "size": described["size"],
            "sha256": described["sha256"] or ""}


def read_file(workdir: str, path: str, offset: int = 0) -> ReadFileReply:
    """A chunk of a file under the workdir (to copy a checkpoint to another node)."""
    full = under_workdir(workdir, path)
    with open(full, "rb") as handle:
        handle.seek(offset)
        data = handle.read(MAX_READ)
    return {"data": data, "offset": offset + len(data), "size": os.path.getsize(full)}


def hash_file(workdir: str, path: str) -> HashFileReply:
    """Size and SHA256 of a file under the workdir: a checkpoint copy checked where it lies before
    a rank resumes from it."""
    full = under_workdir(workdir, path)
    if os.path.isdir(full):  # a checkpoint directory: its digest over its files
        described = describe_checkpoint_dir(os.path.basename(full), full)
        if not described["valid"]:
            raise RemoteError(p.REFUSED, f"{path}: {described['detail']}")
        return {"size": described["size"], "sha256": described["sha256"] or ""}
    return {"size": os.path.getsize(full), "sha256": sha256_remembered(full)}


def remove_checkpoints(workdir: str, job: str, attempt: int, names: list[str],
                       replica: bool = False) -> RemoveCheckpointsReply:
    directory = checkpoint_dir(workdir, job, attempt, replica)
    removed = 0
    for name in names:
        if not isinstance(name, str) or not (CHECKPOINT_NAME.match(name) or checkpoint_dirs.DIR_NAME.match(name)):
            raise RemoteError(p.BAD_ARGS, f"not a checkpoint name: {name!r}")
        path = os.path.join(directory, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    return {"removed": removed}
