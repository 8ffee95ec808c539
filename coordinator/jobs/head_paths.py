"""Where the head keeps each run's files in its state directory."""

from __future__ import annotations

from pathlib import Path


def run_dir(state_dir: Path, run_id: str) -> Path:
    """Where the head keeps a run's launch files and each rank's output."""
    return state_dir / "jobs" / run_id


def tensorboard_dir(state_dir: Path, run_id: str) -> Path:
    """Where a run's TensorBoard event files are: ``tensorboard --logdir <state_dir>/jobs`` shows every run."""
    return run_dir(state_dir, run_id) / "tensorboard"


def attempt_dir(state_dir: Path, run_id: str, attempt: int) -> Path:
    return run_dir(state_dir, run_id) / f"attempt-{attempt}"
