"""How a job scales (coordinator/observe/scaling.py): a size's rate, throughput and communication share from
its train points, the speedup and efficiency against the smallest size, and the chart."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from coordinator.cli.bench_commands import render_rows, train_points
from coordinator.observe.scaling import measure, render_svg, table


def points(steps: int, seconds_per_step: float, **per_step: float) -> list[dict]:
    return [{"step": s, "time": 100.0 + s * seconds_per_step, **per_step} for s in range(1, steps + 1)]


def test_the_rate_leaves_out_the_warm_up_and_uses_the_ranks_own_times():
    slow_start = [{"step": 1, "time": 100.0}, {"step": 2, "time": 130.0}]  # compiling: 30 s for one step
    steady = [{"step": s, "time": 130.0 + (s - 2) * 0.5} for s in range(3, 11)]
    result = measure(slow_start + steady, 2)
    assert result.steps_per_second == pytest.approx(2.0)
    assert (result.throughput, result.unit) == (pytest.approx(2.0), "steps/s")  # nothing else reported
    assert result.comm_share is None and result.detail == ""


def test_reported_samples_per_second_come_first_then_tokens_then_the_rate_times_the_batch():
    assert measure(points(10, 0.5, samples_per_second=64.0, tokens_per_second=9e3), 1).unit == "samples/s"
    tokens = measure(points(10, 0.5, tokens_per_second=9e3), 1)
    assert (tokens.throughput, tokens.unit) == (9e3, "tokens/s")
    given = measure(points(10, 0.5), 1, samples_per_step=32)
    assert (given.throughput, given.unit) == (pytest.approx(64.0), "samples/s")


def test_the_communication_share_is_the_exchange_time_over_the_step_time():
    result = measure(points(10, 0.5, comm_seconds=0.1), 2)
    assert result.comm_share == pytest.approx(0.2)
    # a clock that says more than the step took is capped at the whole step
    assert measure(points(10, 0.5, comm_seconds=3.0), 2).comm_share == 1.0


@pytest.mark.parametrize("few", [[], [{"step": 1, "time": 1.0}], [{"step": 1, "time": 1.0}, {"step": 2, "time": 2.0}]])
def test_too_few_points_say_so_rather_than_give_a_number(few):
    result = measure(few, 3)
    assert result.steps_per_second is None and result.throughput is None and "too few" in result.detail


def test_points_without_a_time_between_them_give_no_rate():
    result = measure([{"step": s, "time": 5.0} for s in range(1, 6)], 1)
    assert result.steps_per_second is None and "no time" in result.detail


def test_speedup_and_efficiency_against_the_smallest_size_measured():
    rows = table([measure(points(20, 0.2, samples_per_second=s), n) for n, s in ((4, 140.0), (1, 40.0), (2, 76.0))])
    assert [r.nodes for r in rows] == [1, 2, 4]
    assert [round(r.speedup or 0, 3) for r in rows] == [1.0, 1.9, 3.5]
    assert [round(r.efficiency or 0, 3) for r in rows] == [1.0, 0.95, 0.875]


def test_sizes_that_count_in_other_units_are_not_compared():
    rows = table([measure(points(10, 0.5, samples_per_second=40.0), 1), measure(points(10, 0.25), 2)])
    assert rows[0].speedup == 1.0 and rows[1].speedup is None and rows[1].efficiency is None


def test_a_size_that_could_not_be_measured_keeps_its_row_with_why():
    rows = table([measure(points(10, 0.5), 1), measure([], 2)])
    assert rows[1].throughput is None and "too few" in rows[1].detail
    text = render_rows(rows)
    assert "too few" in text.splitlines()[2] and "not reported" in text


def test_the_chart_is_well_formed_svg_with_a_bar_and_a_point_per_measured_size_and_escaped_title():
    rows = table([measure(points(10, 0.5, samples_per_second=s, comm_seconds=0.05), n)
                  for n, s in ((1, 40.0), (2, 70.0), (3, 90.0))])
    svg = render_svg(rows, "python train.py --tag <a&b>")
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    bars = [r for r in root.iter(f"{ns}rect") if r.get("fill") == "#3366aa"]
    assert len(bars) == 3 and len(list(root.iter(f"{ns}circle"))) == 3 and root.find(f"{ns}polyline") is not None
    heights = [float(b.get("height")) for b in bars]
    assert heights == sorted(heights) and heights[-1] > heights[0]
    assert "&lt;a&amp;b&gt;" in svg


def test_the_history_documents_columns_become_one_point_each():
    history = {"runs": [{"run_id": "r1", "train": {"step": [1, 2], "time": [1.0, 2.0], "comm_seconds": [None, 0.1],
                                                   "rank_memory_bytes": {"0": [1, 2]}}}]}
    assert train_points(history, "r1") == [{"step": 1, "time": 1.0, "comm_seconds": None},
                                           {"step": 2, "time": 2.0, "comm_seconds": 0.1}]
    assert train_points(history, "other") == []
