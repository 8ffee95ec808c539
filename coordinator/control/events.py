"""What a long control method streams before its answer, where its shape is shared by several methods."""

from __future__ import annotations

from typing import TypedDict


class NodeProgressEvent(TypedDict):
    """How far a long command (calibrate, preflight, plan) is on one node, streamed to the CLI as it
    happens (coordinator/cli/progress.py's NodeProgress). A sync streams its own events
    (coordinator/readiness/push.py's SyncProgress)."""

    node: str  # a node's name, or "head"
    progress: str  # the stage
    fraction: float  # of that node's part, from 0 to 1
