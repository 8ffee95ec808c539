"""Run ``python -m agent.calibrate`` with the node's training Python, from the agent.

Stdlib only: this module runs inside the agent, which never imports mlx itself. The
calibration runs in a child process with the interpreter ranks will use (the one with
mlx); its progress lines (JSON on stderr) are handed to ``on_progress`` as they come, and
its one JSON result line (stdout) is returned.

``run_calibration`` is synchronous (the agent runs it in a thread) and never raises for a
failed calibration: it returns ``{"ok": False, "error": ..., "error_kind": ...}`` instead,
with ``error_kind`` one of ``"timeout"``, ``"mlx_missing"``, ``"spawn_failed"``,
``"exit_status"``, ``"bad_output"``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, cast

if TYPE_CHECKING:  # the agent's own process imports nothing of shared here
    from shared.agent_api.calibration import CalibrationProgress, CalibrationReply
    from shared.agent_api.common import JsonObject

# The directory that holds the ``agent`` package (the bundle root on a node).
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
STDERR_TAIL_LINES = 20


def calibration_command(python: str, *, quick: bool = False) -> list[str]:
    command = [python, "-m", "agent.calibrate"]
    if quick:
        command.append("--quick")
    return command


def calibration_env(
    base: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``base`` (default: this process's environment) with the package root first on
    PYTHONPATH, so the child can import ``agent.calibrate`` whatever its cwd."""
    env = dict(os.environ if base is None else base)
    if extra:
        env.update(extra)
    existing = env.get("PYTHONPATH", "")
    root = str(PACKAGE_ROOT)
    env["PYTHONPATH"] = root + os.pathsep + existing if existing else root
    return env


def run_calibration(
    python: str,
    *,
    quick: bool = False,
    timeout: float = 300,
    on_progress: Callable[[CalibrationProgress], object] | None = None,
    env: Mapping[str, str] | None = None,
) -> CalibrationReply:
    """Calibrate this node with ``python``; returns the result dict (``"ok": True``) or an
    error dict (``"ok": False``). ``env`` adds variables to the child's environment (for
    example a private TMPDIR for MLX's CPU kernel cache). ``on_progress`` is called in
    this thread with each progress dict; an exception from it is ignored."""
    started = time.monotonic()
    try:
        proc = _spawn(python, quick=quick, env=env)
    except OSError as exc:
        return _error("spawn_failed", f"cannot start {python}: {exc}", python, started)

    lines: queue.Queue[str | None] = queue.Queue()
    stdout_chunks: list[bytes] = []
    readers = [
        threading.Thread(target=_pump_lines, args=(proc.stderr, lines), daemon=True),
        threading.Thread(target=_collect, args=(proc.stdout, stdout_chunks), daemon=True),
    ]
    for reader in readers:
        reader.start()

    deadline = started + timeout
    stderr_tail: list[str] = []
    finished = _follow_stderr(lines, deadline, on_progress, stderr_tail) and _wait(proc, deadline)
    if not finished:
        _kill(proc)
    for reader in readers:
        reader.join(timeout=5)
    if not finished:
        return _error(
            "timeout",
            f"calibration timed out after {timeout:g} s and was killed",
            python,
            started,
            stderr_tail=stderr_tail,
        )
    stdout = b"".join(stdout_chunks).decode("utf-8", errors="replace")
    return _outcome(_last_json_object(stdout), proc.returncode, python, started, stderr_tail)


def _spawn(python: str, *, quick: bool, env: Mapping[str, str] | None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        calibration_command(python, quick=quick),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=calibration_env(extra=env),
        cwd=str(PACKAGE_ROOT),
        start_new_session=True,  # its own process group, so a timeout kills all of it
    )


def _follow_stderr(
    lines: queue.Queue[str | None],
    deadline: float,
    on_progress: Callable[[CalibrationProgress], object] | None,
    stderr_tail: list[str],
) -> bool:
    """Hand progress lines to ``on_progress`` and keep the last other lines in ``stderr_tail``
    until stderr closes (True) or the deadline passes (False)."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            line = lines.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            continue
        if line is None:  # stderr closed
            return True
        progress = _progress(line)
        if progress is not None:
            if on_progress is not None:
                with contextlib.suppress(Exception):  # a broken observer must not break the calibration
                    on_progress(progress)
        elif line.strip():
            stderr_tail.append(line.rstrip())
            del stderr_tail[:-STDERR_TAIL_LINES]


def _wait(proc: subprocess.Popen[bytes], deadline: float) -> bool:
    """Whether the child exited before the deadline."""
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return False
    return True


def _outcome(result: JsonObject | None, code: int, python: str, started: float,
             stderr_tail: list[str]) -> CalibrationReply:
    """The answer for a child that exited with ``code`` after printing ``result`` (None: no JSON line)."""
    if result is None:
        kind = "exit_status" if code != 0 else "bad_output"
        why = f"exited with status {code}" if code != 0 else "printed no JSON result line"
        return _error(
            kind,
            f"calibration with {python} {why}" + (f": {stderr_tail[-1]}" if stderr_tail else ""),
            python,
            started,
            exit_code=code,
            stderr_tail=stderr_tail,
        )
    if code != 0 or result.get("ok") is not True:
        result["ok"] = False
        result.setdefault("error_kind", "mlx_missing" if code == 3 else "exit_status")
        result.setdefault("error", f"calibration with {python} exited with status {code}")
        result["exit_code"] = code
        result["stderr_tail"] = stderr_tail
        result.setdefault("python_executable", python)
    result["wall_s"] = round(time.monotonic() - started, 3)
    # agent.calibrate's result line, passed on as it came with the runner's fields added.
    return cast("CalibrationReply", result)


def _pump_lines(stream: IO[bytes], out: queue.Queue[str | None]) -> None:
    try:
        for raw in iter(stream.readline, b""):
            out.put(raw.decode("utf-8", errors="replace"))
    except (OSError, ValueError):
        pass
    finally:
        out.put(None)  # the end


def _collect(stream: IO[bytes], out: list[bytes]) -> None:
    try:
        while True:
            chunk = stream.read(65536)
            if not chunk:
                break
            out.append(chunk)
    except (OSError, ValueError):
        pass


def _progress(line: str) -> CalibrationProgress | None:
    text = line.strip()
    if not text.startswith("{"):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, dict) and "progress" in value:
        return cast("CalibrationProgress", value)  # agent.calibrate's progress line, passed on as it came
    return None


def _last_json_object(stdout: str) -> JsonObject | None:
    for line in reversed(stdout.splitlines()):
        text = line.strip()
        if not text:
            continue
        try:
            value = json.loads(text)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None
    return None


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's process group (it has its own session), then reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if sys.platform != "win32":
            os.killpg(proc.pid, signal.SIGKILL)
        else:  # pragma: no cover - nodes are macOS or Linux
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):  # pragma: no cover - SIGKILL does not wait
        proc.wait(timeout=10)


def _error(
    kind: str,
    message: str,
    python: str,
    started: float,
    *,
    exit_code: int | None = None,
    stderr_tail: list[str] | None = None,
) -> CalibrationReply:
    return {
        "ok": False,
        "error_kind": kind,
        "error": message,
        "python_executable": python,
        "exit_code": exit_code,
        "stderr_tail": list(stderr_tail or []),
        "wall_s": round(time.monotonic() - started, 3),
    }
