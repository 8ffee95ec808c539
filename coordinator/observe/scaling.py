"""How a job scales over the cluster's nodes (``coord bench scaling``): from the train points of the
same short job run on 1, 2, ... N nodes, its rate, its speedup and efficiency, and the share of a
step spent waiting on the other ranks; as a table and as an SVG chart.

Pure: the points in, numbers and text out.

- **Rate**: steps per second between the first point after the warm-up and the last one (the
  rank's own time stamps). **Throughput**: the samples (or tokens) per second the job reports
  itself when it does (``samples_per_second``, else ``tokens_per_second``, the median over the
  same window), else the rate times the samples per step the user gives, else the rate.
- **Speedup** on k nodes: throughput(k) / throughput(smallest size run). **Efficiency**: speedup
  / (k / smallest size), 1.0 being perfect scaling.
- **Communication share**: the median over the window of the time a step spent in collectives
  (``comm_seconds``, which coord's trainer reports, and a script may with ``coord_script.report``)
  over the step's time; not known when the job does not report it.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape

#: The share of a run's first steps left out of its rate: compiling, warming caches, the first collective.
WARMUP_SHARE = 0.2


@dataclass(frozen=True)
class SizeResult:
    nodes: int
    steps_per_second: float | None
    throughput: float | None
    unit: str  # what the throughput counts: "samples/s", "tokens/s" or "steps/s"
    comm_share: float | None
    detail: str = ""  # why a number is missing


@dataclass(frozen=True)
class ScalingRow:
    nodes: int
    steps_per_second: float | None
    throughput: float | None
    unit: str
    speedup: float | None
    efficiency: float | None
    comm_share: float | None
    detail: str


def measure(points: Sequence[Mapping[str, object]], nodes: int, *, samples_per_step: int | None = None) -> SizeResult:
    """One size's numbers from its train points (``step``, ``time``, and what the job reported)."""
    ordered = sorted((p for p in points if isinstance(p.get("step"), int) and isinstance(p.get("time"), (int, float))),
                     key=lambda p: float(p["time"]))  # type: ignore[arg-type]
    if len(ordered) < 3:
        return SizeResult(nodes, None, None, "steps/s", None, f"{len(ordered)} steps reported: too few to measure")
    window = ordered[int(len(ordered) * WARMUP_SHARE):]
    if len(window) < 2:
        window = ordered[-2:]
    first, last = window[0], window[-1]
    seconds = float(last["time"]) - float(first["time"])  # type: ignore[arg-type]
    steps = int(last["step"]) - int(first["step"])  # type: ignore[call-overload]
    rate = steps / seconds if seconds > 0 and steps > 0 else None
    reported = _median(window, "samples_per_second")
    unit = "samples/s"
    if reported is None:
        reported, unit = _median(window, "tokens_per_second"), "tokens/s"
    if reported is None and rate is not None:
        reported, unit = (rate * samples_per_step, "samples/s") if samples_per_step else (rate, "steps/s")
    comm = None
    comm_seconds = _median(window, "comm_seconds")
    if comm_seconds is not None and rate:
        comm = min(1.0, comm_seconds * rate)
    return SizeResult(nodes, rate, reported, unit, comm, "" if rate else "no time between its steps")


def table(results: Sequence[SizeResult]) -> list[ScalingRow]:
    """Each size with its speedup and efficiency against the smallest size measured."""
    measured = [r for r in results if r.throughput]
    base = min(measured, key=lambda r: r.nodes) if measured else None
    rows = []
    for r in sorted(results, key=lambda r: r.nodes):
        speedup = efficiency = None
        if base is not None and r.throughput and base.throughput and r.unit == base.unit:
            speedup = r.throughput / base.throughput
            efficiency = speedup / (r.nodes / base.nodes)
        rows.append(ScalingRow(r.nodes, r.steps_per_second, r.throughput, r.unit, speedup, efficiency, r.comm_share,
                               r.detail))
    return rows


def render_svg(rows: Sequence[ScalingRow], title: str) -> str:
    """A chart of throughput (bars) and efficiency (a line with its points) against the number of nodes."""
    width, height, left, right, top, bottom = 640, 360, 64, 64, 40, 48
    inner_w, inner_h = width - left - right, height - top - bottom
    usable = [r for r in rows if r.throughput]
    peak = max((r.throughput or 0.0 for r in usable), default=1.0) or 1.0
    slot = inner_w / max(1, len(rows))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
             f'<line x1="{left}" y1="{top + inner_h}" x2="{left + inner_w}" y2="{top + inner_h}" stroke="#333"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + inner_h}" stroke="#333"/>',
             f'<line x1="{left + inner_w}" y1="{top}" x2="{left + inner_w}" y2="{top + inner_h}" stroke="#333"/>']
    unit = usable[0].unit if usable else "steps/s"
    parts.append(f'<text x="14" y="{top + inner_h / 2}" transform="rotate(-90 14 {top + inner_h / 2})" '
                 f'text-anchor="middle" fill="#3366aa">{escape(unit)}</text>')
    parts.append(f'<text x="{width - 14}" y="{top + inner_h / 2}" transform="rotate(90 {width - 14} '
                 f'{top + inner_h / 2})" text-anchor="middle" fill="#cc5500">efficiency</text>')
    line: list[str] = []
    for index, row in enumerate(rows):
        x = left + slot * index + slot / 2
        parts.append(f'<text x="{x:.1f}" y="{top + inner_h + 18}" text-anchor="middle">{row.nodes} '
                     f'node{"s" if row.nodes != 1 else ""}</text>')
        if row.throughput:
            bar = inner_h * row.throughput / peak
            parts.append(f'<rect x="{x - slot * 0.3:.1f}" y="{top + inner_h - bar:.1f}" width="{slot * 0.6:.1f}" '
                         f'height="{bar:.1f}" fill="#3366aa" opacity="0.8"/>')
            parts.append(f'<text x="{x:.1f}" y="{top + inner_h - bar - 4:.1f}" text-anchor="middle">'
                         f'{row.throughput:.3g}</text>')
        if row.efficiency is not None:
            y = top + inner_h - inner_h * min(row.efficiency, 1.2) / 1.2
            line.append(f"{x:.1f},{y:.1f}")
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="#cc5500"/>')
            parts.append(f'<text x="{x + 8:.1f}" y="{y - 6:.1f}" fill="#cc5500">{row.efficiency:.0%}</text>')
    if len(line) > 1:
        parts.append(f'<polyline points="{" ".join(line)}" fill="none" stroke="#cc5500" stroke-width="2"/>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _median(points: Sequence[Mapping[str, object]], key: str) -> float | None:
    values = [float(v) for p in points if isinstance(v := p.get(key), (int, float)) and not isinstance(v, bool)]
    return statistics.median(values) if values else None
