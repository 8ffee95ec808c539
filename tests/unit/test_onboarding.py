"""coord init --hosts: reading --hosts, what nodes print, the choice of Python and workdir, the file written."""

from __future__ import annotations

import json
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

from coordinator.config.cluster_file import parse_config
from coordinator.nodes.onboarding import (
    DiskFree,
    HostFacts,
    HostSpec,
    OnboardingError,
    ProbeResult,
    PythonFound,
    assess,
    choose_python,
    dedupe_pythons,
    name_nodes,
    parse_hosts,
    python_path,
)
from coordinator.nodes.onboarding_cluster_file import SshFileSettings, render_cluster
from coordinator.nodes.onboarding_probes import (
    facts_command,
    parse_facts,
    parse_probe,
    parse_python_probe,
    probe_command,
    propose_workdir,
)

MAC_FACTS = """\
Last login: Tue Nov 24 09:00:01 on ttys000
home\t/Users/alice
user\talice
os\tDarwin
arch\tarm64
os_version\tmacOS 15.1
chip\tApple M2 Ultra
memory_bytes\t137438953472
login_python\t/opt/homebrew/bin/python3
candidate\t/Users/alice/venv/bin/python
candidate\t/Users/alice/venv/bin/python
candidate\t/Users/alice/projects/llm/.venv/bin/python
candidate\t/opt/homebrew/bin/python3
"""


def _probe_line(path: str, **doc) -> str:
    return f"python\t{path}\tCOORD_PROBE {json.dumps(doc)} \n"


# --------------------------------------------------------------------------- --hosts


def test_hosts_are_read_with_users_ports_names_and_ipv6():
    specs = parse_hosts("alice@10.0.0.2, bob@mac-studio.local:2222,n9=carol@[fe80::1]:22,studio, ::1")
    assert specs == [HostSpec("10.0.0.2", "alice"), HostSpec("mac-studio.local", "bob", 2222),
                     HostSpec("fe80::1", "carol", 22, "n9"), HostSpec("studio"), HostSpec("::1")]
    assert specs[1].label == "bob@mac-studio.local:2222" and specs[2].label == "carol@[fe80::1]:22"


@pytest.mark.parametrize("text, complaint", [
    ("", "empty"), ("alice@10.0.0.2,alice@10.0.0.2", "twice"), ("a@h:0", "port"), ("a@h:x", "port"),
    ("bad user@h", "not a user name"), ("a@-oProxyCommand", "not a host"), ("a@h;rm", "not a host"),
    ("bad name!=a@h", "node name"),
])
def test_bad_hosts_are_refused_saying_which(text, complaint):
    with pytest.raises(OnboardingError, match=complaint):
        parse_hosts(text)


def test_one_host_may_hold_a_node_per_user():
    specs = parse_hosts("alice@mac-studio.local,bob@mac-studio.local")
    assert [s.user for s in specs] == ["alice", "bob"]
    assert name_nodes(specs) == ["mac-studio", "mac-studio-2"]


def test_nodes_are_named_for_their_host_or_numbered_when_only_an_address():
    specs = parse_hosts("10.0.0.2,mac-studio.local,mac-studio.lan,x=10.0.0.5,10.0.0.6")
    assert name_nodes(specs) == ["n1", "mac-studio", "mac-studio-2", "x", "n5"]


# --------------------------------------------------------------------------- facts


def test_facts_put_the_login_shells_python_first_and_each_path_once():
    facts = parse_facts(MAC_FACTS)
    assert (facts.home, facts.user, facts.os, facts.chip) == ("/Users/alice", "alice", "Darwin", "Apple M2 Ultra")
    assert facts.memory_bytes == 128 * 2**30
    assert facts.candidates == ["/opt/homebrew/bin/python3", "/Users/alice/venv/bin/python",
                                "/Users/alice/projects/llm/.venv/bin/python"]


def test_facts_without_a_home_are_refused():
    with pytest.raises(OnboardingError, match="home"):
        parse_facts("user\talice\n")


def _fake_python(path: Path, version: str = "3.12.1", mlx: str | None = "0.29.1", mlx_lm: str | None = "0.28.0"):
    """An executable that answers the probe as a Python with these versions would."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"python": version, "executable": str(path), "prefix": str(path.parent.parent)}
    if mlx:
        doc["mlx"] = mlx
    else:
        doc["mlx_error"] = "ModuleNotFoundError: No module named 'mlx'"
    if mlx_lm:
        doc["mlx_lm"] = mlx_lm
    answer = shlex.quote("COORD_PROBE " + json.dumps(doc))
    path.write_text(f"#!/bin/sh\necho 'some warning' >&2\nprintf '%s\\n' {answer}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _venv(home: Path, relative: str, **versions) -> str:
    (home / relative).mkdir(parents=True)
    (home / relative / "pyvenv.cfg").write_text("home = /usr/bin\n")
    _fake_python(home / relative / "bin" / "python", **versions)
    return str(home / relative / "bin" / "python")


def _sh(command: str, home: Path) -> str:
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "SHELL": "/bin/sh"}
    result = subprocess.run(command, shell=True, capture_output=True, text=True, env=env, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_facts_command_finds_venvs_of_any_name_one_or_two_levels_under_home(tmp_path):
    home = tmp_path / "home with space"
    found = [_venv(home, "venv"), _venv(home, "py"), _venv(home, "mlx/env"), _venv(home, "proj/.venv"),
             _venv(home, ".virtualenvs/work")]
    _fake_python(home / "miniforge3" / "envs" / "mlx" / "bin" / "python")
    (home / "notavenv" / "bin").mkdir(parents=True)  # no pyvenv.cfg: not a candidate
    facts = parse_facts(_sh(facts_command(), home))
    assert facts.home == str(home)
    assert set(found) | {str(home / "miniforge3/envs/mlx/bin/python")} <= set(facts.candidates)
    assert facts.candidates.index(found[0]) == 0 or facts.candidates[0] == facts.login_python
    assert not any("notavenv" in c for c in facts.candidates)


# --------------------------------------------------------------------------- probes


def test_the_probe_command_asks_each_python_even_with_quotes_in_its_path(tmp_path):
    home = tmp_path / "it's \"odd\" $HOME"
    good = _venv(home, "venv")
    bare = _venv(home, "other", mlx=None, mlx_lm=None)
    missing = str(home / "gone" / "bin" / "python")
    workdir = propose_workdir(str(home))
    result = parse_probe(_sh(probe_command([good, bare, missing], workdir), home))
    assert [p.path for p in result.pythons] == [good, bare, missing]
    assert result.pythons[0].usable and result.pythons[0].mlx == "0.29.1"
    assert not result.pythons[1].usable and "No module named 'mlx'" in result.pythons[1].error
    assert "could not run it" in result.pythons[2].error
    assert result.writable and not result.workdir_exists
    assert result.disk is not None and result.disk.free_bytes > 0 and result.disk.path == str(home)


def test_a_python_that_prints_no_answer_is_reported_with_what_it_said():
    found = parse_python_probe("/usr/bin/python3", "xcrun: error: invalid active developer path ")
    assert not found.usable and "invalid active developer path" in found.error
    assert parse_python_probe("/p", "COORD_PROBE {not json").error == "its answer was not readable JSON"


def test_free_disk_is_read_from_df_even_with_spaces_in_the_mount():
    out = ("writable\t/Users/alice\nexisting\t/Users/alice\n"
           "df\t/dev/disk3s5   971350180 612345678 340123456    65%    /System/Volumes/My Data\n")
    disk = parse_probe(out).disk
    assert disk == DiskFree("/Users/alice", 340123456 * 1024, 971350180 * 1024, "/System/Volumes/My Data")


def test_the_first_usable_python_wins_and_one_environment_counts_once():
    found = [PythonFound("/usr/bin/python3", prefix="/usr", error="no mlx"),
             PythonFound("/u/venv/bin/python", prefix="/u/venv", mlx="0.29", mlx_lm="0.28"),
             PythonFound("/u/venv/bin/python3", prefix="/u/venv", mlx="0.29", mlx_lm="0.28"),
             PythonFound("/u/other/bin/python", prefix="/u/other", mlx="0.30", mlx_lm="0.29")]
    unique = dedupe_pythons(found)
    assert [p.path for p in unique] == ["/usr/bin/python3", "/u/venv/bin/python", "/u/other/bin/python"]
    assert choose_python(unique).path == "/u/venv/bin/python"


def test_a_venv_path_is_kept_but_a_version_manager_shim_is_resolved():
    venv = PythonFound("/u/venv/bin/python", executable="/usr/bin/python3.12", mlx="1", mlx_lm="1")
    shim = PythonFound("/u/.pyenv/shims/python3", executable="/u/.pyenv/versions/3.12.1/bin/python3",
                       mlx="1", mlx_lm="1")
    assert python_path(venv) == "/u/venv/bin/python"
    assert python_path(shim) == "/u/.pyenv/versions/3.12.1/bin/python3"


# --------------------------------------------------------------------------- workdir


@pytest.mark.parametrize("requested, expected", [
    ("coord-work", "/Users/alice/coord-work"), ("~/work/coord/", "/Users/alice/work/coord"),
    ("/Volumes/Fast/coord", "/Volumes/Fast/coord"), ("./a//b", "/Users/alice/a/b"),
])
def test_the_workdir_is_absolute_under_the_home_unless_given_absolute(requested, expected):
    assert propose_workdir("/Users/alice/", requested) == expected


def test_a_workdir_climbing_out_is_refused():
    with pytest.raises(OnboardingError, match=r"\.\."):
        propose_workdir("/Users/alice", "../bob")


# --------------------------------------------------------------------------- verdict


def _facts(os_name: str = "Darwin") -> HostFacts:
    return HostFacts(home="/Users/alice", user="alice", os=os_name, os_version="macOS 15.1", arch="arm64",
                     chip="Apple M4 Pro", memory_bytes=64 * 2**30, login_python="/opt/homebrew/bin/python3")


def _disk(free_gib: float = 500) -> DiskFree:
    return DiskFree("/Users/alice", int(free_gib * 2**30), 1000 * 2**30, "/System/Volumes/Data")


def test_a_node_without_mlx_gets_the_command_that_makes_a_venv_for_its_os():
    spec = HostSpec("10.0.0.2", "alice")
    probe = ProbeResult(pythons=[PythonFound("/opt/homebrew/bin/python3", error="no mlx")], writable=True)
    mac = assess("n1", spec, _facts("Darwin"), probe, "/Users/alice/coord-work")
    assert not mac.ok and "no Python with mlx and mlx-lm" in mac.problem
    assert mac.fix.startswith("on alice@10.0.0.2: python3 -m venv ~/mlx-venv && ~/mlx-venv/bin/pip install mlx mlx-lm")
    linux = assess("n1", spec, _facts("Linux"), probe, "/home/alice/coord-work")
    assert "pip install 'mlx[cpu]' mlx-lm" in linux.fix
    half = ProbeResult(pythons=[PythonFound("/Users/alice/my env/bin/python", mlx="0.29")], writable=True)
    assert "'/Users/alice/my env/bin/python' -m pip install mlx-lm" in assess("n1", spec, _facts(), half, "/w").fix


def test_an_unwritable_workdir_and_a_full_disk_are_said():
    probe = ProbeResult(pythons=[PythonFound("/p", mlx="1", mlx_lm="1")], writable=False, disk=_disk(3))
    report = assess("n1", HostSpec("h"), _facts(), probe, "/Users/alice/coord-work")
    assert "cannot create or write /Users/alice/coord-work" in report.problem and "--workdir" in report.fix
    assert report.warnings == ["only 3.0 GiB free on /System/Volumes/Data"]


# --------------------------------------------------------------------------- the file


def _ready(name: str, spec: HostSpec, python: str, home: str = "/Users/alice") -> object:
    facts = _facts()
    facts.home = home
    probe = ProbeResult(pythons=[PythonFound("/opt/homebrew/bin/python3", python="3.13.0", error="no mlx"),
                                 PythonFound(python, python="3.12.4", prefix=python.rsplit("/bin", 1)[0],
                                             mlx="0.29.1", mlx_lm="0.28.0")],
                        writable=True, disk=_disk())
    return assess(name, spec, facts, probe, propose_workdir(home))


def test_the_cluster_file_loads_and_says_what_was_found_on_each_node(tmp_path):
    reports = [_ready("n1", HostSpec("10.0.0.2", "alice"), "/Users/alice/venv/bin/python"),
               _ready("studio", HostSpec("mac-studio.local", "bob", 2222), "/Users/bob/mlx \"env\"/bin/python",
                      home="/Users/bob")]
    text = render_cluster("lab", SshFileSettings(known_hosts="/etc/coord/known_hosts"), reports,
                          command="coord init --hosts alice@10.0.0.2,bob@mac-studio.local:2222", when="today")
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    config = parse_config(text, path)
    assert [(n.name, n.host, n.user, n.port, n.python, n.workdir) for n in config.nodes] == [
        ("n1", "10.0.0.2", "alice", None, "/Users/alice/venv/bin/python", "/Users/alice/coord-work"),
        ("studio", "mac-studio.local", "bob", 2222, "/Users/bob/mlx \"env\"/bin/python", "/Users/bob/coord-work")]
    assert config.ssh.known_hosts == "/etc/coord/known_hosts" and config.ssh.identity_file is None
    assert "# alice@10.0.0.2: macOS 15.1, arm64, Apple M4 Pro, 64.0 GiB memory" in text
    assert "#   python: Python 3.12.4, mlx 0.29.1, mlx-lm 0.28.0" in text
    assert "#   workdir: coord creates it; 500.0 GiB free of 1000.0 GiB on /System/Volumes/Data" in text


def test_what_a_node_prints_cannot_break_out_of_a_comment(tmp_path):
    report = _ready("n1", HostSpec("10.0.0.2", "alice"), "/Users/alice/venv/bin/python")
    report.facts.chip = "M2\n[[nodes]]\nname = \"evil\""
    text = render_cluster("lab", SshFileSettings(), [report], command="coord init", when="now")
    assert [n.name for n in parse_config(text, tmp_path / "c.toml").nodes] == ["n1"]


def test_no_file_is_rendered_while_a_node_needs_fixing():
    broken = assess("n2", HostSpec("h"), _facts(), ProbeResult(pythons=[], writable=True), "/w")
    ready = _ready("n1", HostSpec("10.0.0.2"), "/Users/alice/venv/bin/python")
    with pytest.raises(OnboardingError, match="n2"):
        render_cluster("lab", SshFileSettings(), [ready, broken], command="coord init", when="now")


def test_every_word_of_the_remote_commands_is_quoted():
    # Both commands are one `/bin/sh -c WORD`: the login shell (zsh, bash) sees a single quoted word.
    for command in (facts_command(), probe_command(["/a b/bin/python", "/x'y/bin/python"], "/w o/rk")):
        assert command.startswith("/bin/sh -c '")
        assert shlex.split(command)[:2] == ["/bin/sh", "-c"] and len(shlex.split(command)) == 3
