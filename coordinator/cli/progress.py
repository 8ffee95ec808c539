"""Progress bars for the CLI, fed by the daemon's events (rich does the drawing)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import TaskID

    from coordinator.control.events import NodeProgressEvent
    from coordinator.readiness.push import SyncProgress as SyncEvent


class SyncProgress:
    """One bar per node for bytes sent (files in the description), plus a phase line."""

    def __init__(self, console: Console) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                  TransferSpeedColumn(), TimeElapsedColumn(), console=console, transient=False,
                                  disable=not console.is_terminal)
        self._phase = self._progress.add_task("starting", total=None)
        self._nodes: dict[str, TaskID] = {}  # a bar per node, and per node and relayed file

    def __enter__(self) -> SyncProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.__exit__(*exc)

    def update(self, event: SyncEvent) -> None:
        phase = event.get("phase")
        if phase == "send":
            node = event["node"]
            if node not in self._nodes:
                self._nodes[node] = self._progress.add_task(node, total=event["bytes_total"] or 1)
            self._progress.update(self._nodes[node], completed=event["bytes_done"],
                                  description=f"{node} {event['files_done']}/{event['files_total']} files")
        elif phase == "relay":  # a large file relayed node to node: a bar per node and file
            key = f"{event['node']} {event['file']}"
            if key not in self._nodes:
                self._nodes[key] = self._progress.add_task(key, total=event["bytes_total"] or 1)
            self._progress.update(self._nodes[key], completed=event["bytes_done"],
                                  description=f"{event['node']} <- {event['sender']}: {event['file']}")
        elif phase:
            labels = {"hash": "hashing the source", "compare": "reading node manifests", "plan": "sending",
                      "verify": "verifying nodes"}
            self._progress.update(self._phase, description=labels.get(phase, phase))


class NodeProgress:
    """One bar per node for a fraction-complete measurement (calibration, pre-flight)."""

    def __init__(self, console: Console) -> None:
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

        self._progress = Progress(TextColumn("{task.fields[node]:<12}"), BarColumn(), TaskProgressColumn(),
                                  TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                                  disable=not console.is_terminal)
        self._nodes: dict[str, TaskID] = {}

    def __enter__(self) -> NodeProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.__exit__(*exc)

    def update(self, event: NodeProgressEvent) -> None:
        node = event.get("node", "")
        if node not in self._nodes:
            self._nodes[node] = self._progress.add_task("", total=1.0, node=node)
        fraction = event.get("fraction")
        self._progress.update(self._nodes[node], description=str(event.get("progress", "")),
                              completed=fraction if isinstance(fraction, (int, float)) else None)
