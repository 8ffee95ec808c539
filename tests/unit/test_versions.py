"""One set of rules for every version the head compares (coordinator.nodes.versions)."""

from __future__ import annotations

import pytest

from coordinator.jobs import diagnosis
from coordinator.jobs.diagnosis import diagnose_cluster
from coordinator.launch import topology
from coordinator.nodes.versions import Version, at_least, oldest, parse


@pytest.mark.parametrize("text, expected", [
    ("0.30.2", Version("0.30.2")),
    ("0.30.2rc1", Version("0.30.2rc1")),
    (" 0.28 ", Version("0.28")),
    ("0.30.2.dev3", Version("0.30.2.dev3")),
    ("0.29.1.dev20250101+g1234abc", Version("0.29.1.dev20250101+g1234abc")),
    ("26.1", Version("26.1")),
    ("15.6.1", Version("15.6.1")),
])
def test_parse_reads_pep_440_and_macos_versions(text, expected):
    assert parse(text) == expected


@pytest.mark.parametrize("text", [None, "", "   ", "unknown", "26.x", "macOS 26.1", "0.30.2-custom build",
                                  "1..2", 26.1, 3, ["0.30.2"]])
def test_what_packaging_cannot_parse_is_unknown(text):
    assert parse(text) is None
    assert at_least(text, "0.30.2") is None


@pytest.mark.parametrize("text, minimum, expected", [
    ("0.30.2", "0.30.2", True),
    ("0.30.10", "0.30.2", True),   # numbers, not strings: 10 > 2
    ("0.30.1", "0.30.2", False),
    ("0.30", "0.30.2", False),
    ("1.0", "0.30.2", True),
    # a pre-release, dev or local build of the release counts as the release
    ("0.30.2rc1", "0.30.2", True),
    ("0.30.2.dev3", "0.30.2", True),
    ("0.30.2+local", "0.30.2", True),
    ("0.30.1rc1", "0.30.2", False),
    ("0.30.1.post2", "0.30.2", False),
    # macOS
    ("26.1", "26.2", False),
    ("26.2", "26.2", True),
    ("26.2.1", "26.2", True),
    ("26", "26.2", False),
    ("27", "26.2", True),
    ("15.6.1", "26.2", False),
    ("26.2.0", "26.2", True),      # trailing zeros do not matter
    ("26.2", "26.2.0", True),
])
def test_at_least_compares_release_numbers(text, minimum, expected):
    assert at_least(text, minimum) is expected


def test_oldest_orders_by_pep_440_and_skips_unknown_versions():
    assert oldest(["0.30.2", "0.30.2rc1", "0.31.0"]) == "0.30.2rc1"
    assert oldest(["0.30.10", "0.30.9"]) == "0.30.9"
    assert oldest(["garbage", "0.29.0", None, "0.30.0"]) == "0.29.0"
    assert oldest(["garbage", None]) is None
    assert oldest([]) is None


def test_diagnosis_and_topology_use_the_same_rules():
    assert diagnosis.MLX_LM_FIXED_VALIDATION == "0.30.2"
    old = diagnose_cluster({"a": {"mlx_lm_version": "0.30.2rc1"}, "b": {"mlx_lm_version": "0.30.1"},
                            "c": {"mlx_lm_version": "garbage"}, "d": {"mlx_lm_version": None}})
    found = [d for d in old if d["id"] == "mlx_lm_validation_graph"]
    assert len(found) == 1 and "b has mlx-lm 0.30.1" in found[0]["detail"]
    assert "a has" not in found[0]["detail"] and "c has" not in found[0]["detail"]
    assert topology._rdma_os_ok("26.2") is True
    assert topology._rdma_os_ok("15.6.1") is False
    assert topology._rdma_os_ok("26.1") is False
    assert topology._rdma_os_ok(None) is None
    assert topology._rdma_os_ok("garbage") is None
