"""`coord drill`'s figures, from the drill run's own events: pure, tested without processes.

For each fault the drill put into a rank (at ``time``, the head's clock when it was asked for):

- detected: the first ``job.attempt_ended`` event at or after it, the moment coord knew;
- resumed: the first ``job.first_step`` of a later attempt, the first step trained again;
- steps lost: the step the attempt had reached when it ended, less the step the next attempt
  started from (its checkpoint's): the work done again.

Beside them, the run's step time (from the steps the drill saw while it waited for the first
fault, once they moved: never the ranks' loading) and its cold launch (submission to the first step
of the first attempt).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from shared.agent_api.common import JsonObject


class Fault(TypedDict):
    fault: str  # "kill", "stop" or "cut"
    rank: int
    node: str
    time: float  # when the drill asked for it (head clock)
    step: int  # the run's step as the daemon knew it then


class FaultFigures(TypedDict):
    fault: str
    signal: str
    rank: int
    node: str
    at_step: int  # the step the attempt had reached when the fault ended it
    detected_seconds: float | None  # None: never seen to end
    resumed_seconds: float | None  # None: never trained again
    steps_lost: int | None
    how: str  # what coord said when it ended the attempt


class DrillFigures(TypedDict):
    step_seconds: float | None
    cold_launch_seconds: float | None
    faults: list[FaultFigures]


class DrillReport(DrillFigures, total=False):
    """What `coord drill --json` prints: the figures, and the drill's own outcome."""

    job: str
    run_id: str
    nodes: list[str]
    status: str  # "ok" or "failed"
    detail: str  # why it failed
    restarts: int | None
    left_behind: dict[str, str]  # node -> why the drill's files are still on it


class Event(TypedDict):
    ts: float
    kind: str
    message: str
    data: JsonObject | None


SIGNALS = {"kill": "SIGKILL", "stop": "SIGSTOP", "cut": "link down"}
_ATTEMPT_PREFIX = re.compile(r"^.*?: attempt \d+: ")  # "JOB: attempt N: " before what ended it


def step_seconds(samples: Sequence[tuple[float, int]]) -> float | None:
    """Seconds per step from (time, step) samples of one attempt: the slope between the first and the last
    sample at which the step moved on. Samples before the first step (the ranks loading) and the first one
    seen (wherever the run was by then) are no start: None with fewer than two steps between those two."""
    trained = [sample for sample in samples if sample[1] > 0]
    moved = [sample for before, sample in zip(trained, trained[1:], strict=False) if sample[1] != before[1]]
    if len(moved) < 2 or moved[-1][1] - moved[0][1] < 2:
        return None
    return (moved[-1][0] - moved[0][0]) / (moved[-1][1] - moved[0][1])


def _data(event: Event) -> JsonObject:
    return event["data"] or {}


def _whole(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def fault_figures(fault: Fault, events: Sequence[Event]) -> FaultFigures:
    """One fault's figures from the run's events (oldest first)."""
    ended = next((e for e in events if e["kind"] == "job.attempt_ended" and e["ts"] >= fault["time"]), None)
    figures: FaultFigures = {"fault": fault["fault"], "signal": SIGNALS.get(fault["fault"], fault["fault"]),
                             "rank": fault["rank"], "node": fault["node"], "at_step": fault["step"],
                             "detected_seconds": None, "resumed_seconds": None, "steps_lost": None,
                             "how": "the attempt never ended"}
    if ended is None:
        return figures
    figures["detected_seconds"] = round(ended["ts"] - fault["time"], 3)
    figures["how"] = _ATTEMPT_PREFIX.sub("", ended["message"])
    ended_attempt = _whole(_data(ended).get("attempt"))
    # The daemon knew the step a poll late when it put the fault in; by the attempt's end it had read all.
    reached = figures["at_step"] = max(fault["step"], _whole(_data(ended).get("step")) or 0)
    later = [e for e in events if e["ts"] >= ended["ts"]
             and (ended_attempt is None or (_whole(_data(e).get("attempt")) or -1) > ended_attempt)]
    launched = next((e for e in later if e["kind"] == "job.launched"), None)
    resumed = next((e for e in later if e["kind"] == "job.first_step"), None)
    start = _whole(_data(launched).get("start_step")) if launched is not None else None
    if start is not None:
        figures["steps_lost"] = max(0, reached - start)
    if resumed is not None:
        figures["resumed_seconds"] = round(resumed["ts"] - fault["time"], 3)
    return figures


def drill_figures(faults: Sequence[Fault], events: Sequence[Event],
                  samples: Sequence[tuple[float, int]]) -> DrillFigures:
    """Every fault's figures, the step time and the cold launch."""
    submitted = next((e for e in events if e["kind"] == "job.submitted"), None)
    first = next((e for e in events if e["kind"] == "job.first_step"), None)
    cold = round(first["ts"] - submitted["ts"], 3) if submitted is not None and first is not None else None
    step = step_seconds(samples)
    return {"step_seconds": round(step, 4) if step is not None else None, "cold_launch_seconds": cold,
            "faults": [fault_figures(fault, events) for fault in faults]}


def table(figures: DrillFigures) -> list[str]:
    """The figures as a text table, one fault a row."""
    def seconds(value: float | None) -> str:
        return f"{value:.1f} s" if value is not None else "-"

    rows = [("fault", "rank (node)", "at step", "detected after", "first step again after", "steps lost")]
    for fault in figures["faults"]:
        rows.append((fault["signal"], f"{fault['rank']} ({fault['node']})", str(fault["at_step"]),
                     seconds(fault["detected_seconds"]), seconds(fault["resumed_seconds"]),
                     str(fault["steps_lost"]) if fault["steps_lost"] is not None else "-"))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    step = figures["step_seconds"]
    lines.append(f"step time {step:.3f} s" if step is not None else "step time: not measured")
    lines.append(f"cold launch (submitted to first step) {seconds(figures['cold_launch_seconds'])}")
    return lines
