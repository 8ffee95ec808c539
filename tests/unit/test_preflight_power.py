"""Pre-flight's system-sleep check, on facts as the agent reports them (pmset -g parsed from
the synthetic fixtures)."""

from __future__ import annotations

import shlex
from pathlib import Path

from agent.facts_parsers import parse_pmset
from coordinator.readiness import checks

SYNTHETIC = Path(__file__).resolve().parents[1] / "fixtures" / "macos-synthetic"


def mac(fixture: str | None) -> dict:
    power = parse_pmset((SYNTHETIC / fixture).read_text(encoding="utf-8")) if fixture else None
    return {"os": "macOS", "os_version": "15.5", "power": power}


NODES = {
    "studio": {"name": "studio", "host": "studio.local", "user": "alice", "port": None},
    "mini": {"name": "mini", "host": "mini.local", "user": "bob", "port": 2222},
    "laptop": {"name": "laptop", "host": "local", "user": None, "port": None},
    "linux": {"name": "linux", "host": "10.0.0.5", "user": "carol", "port": None},
}
LINUX = {"os": "Linux", "os_version": "12", "power": None}


def test_macs_that_never_sleep_pass_and_display_or_disk_sleep_does_not_matter():
    [result] = checks.system_sleep(NODES, {"studio": mac("macstudio.pmset-g.sleep-0.txt"),
                                           "laptop": mac("macbookpro.pmset-g.ac-sleep-0.txt"),
                                           "linux": LINUX})
    assert result["name"] == "power.sleep" and result["status"] == "pass" and result["layer"] == "health"
    assert "laptop, studio" in result["detail"] and "linux" not in result["detail"]


def test_a_mac_that_sleeps_on_a_timer_is_named_with_the_command_that_keeps_it_awake():
    [result] = checks.system_sleep(NODES, {"studio": mac("macstudio.pmset-g.sleep-0.txt"),
                                           "mini": mac("macmini.pmset-g.sleep-1.txt"),
                                           "laptop": mac("macbookpro.pmset-g.battery.txt")})
    assert result["status"] == "warn"
    assert "laptop sleeps after 1 min idle (held off for now by powerd, coreaudiod)" in result["detail"]
    assert "mini sleeps after 1 min idle (held off for now by sharingd, powerd)" in result["detail"]
    assert "studio" not in result["detail"]
    # sudo asks for a password: over ssh it needs a terminal (-t); the local node runs it as is.
    assert result["fix_command"].split("; ") == [
        "sudo pmset -a sleep 0",
        "ssh -t -p 2222 bob@mini.local " + shlex.quote("sudo pmset -a sleep 0"),
    ]


def test_sleep_disabled_system_wide_overrides_the_timer():
    [result] = checks.system_sleep(NODES, {"mini": mac("macmini.pmset-g.sleep-disabled.txt")})
    assert result["status"] == "pass"


def test_a_mac_whose_pmset_could_not_be_read_is_a_warning_naming_it():
    [result] = checks.system_sleep(NODES, {"studio": mac(None), "mini": mac("macmini.pmset-g.sleep-1.txt")})
    assert result["status"] == "warn"
    assert "could not read the sleep timer (pmset -g) on studio" in result["detail"]
    assert "mini sleeps after 1 min idle" in result["detail"]
    assert result["fix_command"].endswith("ssh alice@studio.local " + shlex.quote("pmset -g"))


def test_a_cluster_without_macs_gets_no_sleep_check():
    assert checks.system_sleep(NODES, {"linux": LINUX}) == []
    assert checks.system_sleep(NODES, {}) == []
