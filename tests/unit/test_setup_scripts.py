""".ci/: the README's two commands are what CI runs, and set-up picks a Python 3.11+ or says what to install."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CI = REPO / ".ci"
SCRIPTS = [CI / "setup", CI / "run", CI / "gates", CI / "find-python"]
BASH = shutil.which("bash") or "/bin/bash"


def readme_commands() -> list[str]:
    """The README's "Two commands", without their comments."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    assert block, "the README's 'Two commands' section has no sh block"
    return [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_has_a_demo_command_and_a_test_command_from_the_venv() -> None:
    demo, tests = readme_commands()
    assert demo == "bash .ci/setup demo && .venv/bin/coord demo"
    assert tests == "bash .ci/setup && .venv/bin/python -m pytest -q"


def test_ci_runs_the_readmes_test_command_verbatim() -> None:
    _, tests = readme_commands()
    lines = [line for line in (CI / "run").read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert lines[-1] == tests


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses_and_is_executable(script: Path) -> None:
    result = subprocess.run([BASH, "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in script.read_text()
    assert os.access(script, os.X_OK)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_passes_shellcheck(script: Path) -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not on PATH")
    result = subprocess.run([shellcheck, "--shell=bash", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_setup_never_installs_into_the_python_it_found() -> None:
    text = (CI / "setup").read_text()
    lines = [line.strip() for line in text.splitlines() if not line.lstrip().startswith("#")]
    installs = [line for line in lines if "pip install" in line]
    assert installs and all(line.startswith((".venv/bin/python -m pip install",
                                             ".venv/bin/uv pip install -q --python .venv/bin/python "))
                            for line in installs), installs


def test_setup_refuses_an_unknown_mode_before_it_installs_anything() -> None:
    result = subprocess.run([BASH, str(CI / "setup"), "everything"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage: bash .ci/setup [demo]" in result.stderr
    assert "installing" not in result.stderr


# Stand-ins for apt-get, dpkg-query, id and the Python .ci/setup finds: each logs its name and arguments. A
# python3.13 on PATH (find-python takes it first) whose venv holds a Python with pip, unconfigured, and uv.
STAND_IN = """#!/bin/bash
name="${0##*/}"
echo "${name} $*" >> "${STAND_IN_LOG}"
case "${name} $*" in
  "id -u") echo 0 ;;
  "dpkg-query "*) exit 1 ;;
  "python3.13 -c "*) echo 3.13 ;;
  "python3.13 --version") echo "Python 3.13.0" ;;
  "python3.13 -m venv .venv") mkdir -p .venv/bin && ln -s "$0" .venv/bin/python && ln -s "$0" .venv/bin/uv ;;
  "python -c import importlib.metadata"*) exit 1 ;;
esac
exit 0
"""


def run_setup_with_stand_ins(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    for name in ("setup", "find-python"):
        shutil.copy(CI / name, repo / ".ci" / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "stand-in"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    for name in ("apt-get", "dpkg-query", "id", "python3.13"):
        (bin_dir / name).symlink_to(stand_in)
    log = tmp_path / "log"
    log.touch()
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "STAND_IN_LOG": str(log)}
    result = subprocess.run([BASH, str(repo / ".ci" / "setup"), *args], capture_output=True, text=True, env=env)
    return result, log.read_text().splitlines()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the apt-get path is Debian's")
def test_the_demo_setup_installs_python_and_coord_only(tmp_path: Path) -> None:
    result, log = run_setup_with_stand_ins(tmp_path, "demo")
    assert result.returncode == 0, result.stderr
    apt = [line for line in log if line.startswith("apt-get install")]
    assert len(apt) == 1 and apt[0].endswith(" python3 python3-venv"), log
    installs = [line for line in log if " install " in line and not line.startswith("apt-get")]
    assert installs == ["python -m pip install -q --disable-pip-version-check uv",
                        "uv pip install -q --python .venv/bin/python -e ."], log
    assert "ready: .venv/bin/coord demo" in result.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the apt-get path is Debian's")
def test_the_full_setup_installs_the_test_tools_and_pytorch_besides(tmp_path: Path) -> None:
    result, log = run_setup_with_stand_ins(tmp_path)
    assert result.returncode == 0, result.stderr
    apt = [line for line in log if line.startswith("apt-get install")]
    assert len(apt) == 1 and " python3 python3-venv python3-pip python3-dev" in apt[0], log
    installs = [line for line in log if " install " in line and not line.startswith("apt-get")]
    assert installs[:2] == ["python -m pip install -q --disable-pip-version-check uv",
                            "uv pip install -q --python .venv/bin/python -e .[test]"], log
    assert "python -m pip install -q --disable-pip-version-check -e .[test,torch]" in installs, log


# --- .ci/find-python with stand-in interpreters -------------------------------------------


def find_python(tmp_path: Path, **versions: str) -> subprocess.CompletedProcess[str]:
    """Run find-python with only stand-ins on PATH: {name: the "X.Y" it reports}."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, version in versions.items():
        stand_in = bin_dir / name.replace("_", ".")
        stand_in.write_text(f"#!/bin/sh\necho {version}\n")
        stand_in.chmod(0o755)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    return subprocess.run([BASH, str(CI / "find-python")], capture_output=True, text=True, env=env)


def test_an_old_python3_alone_is_refused_with_what_to_install(tmp_path: Path) -> None:
    result = find_python(tmp_path, python3="3.9")
    assert result.returncode == 1 and result.stdout == ""
    assert "coord needs Python 3.11 or newer" in result.stderr
    assert f"{tmp_path}/bin/python3 (3.9)" in result.stderr
    assert "apt-get install python3 python3-venv" in result.stderr


def test_no_python_at_all_is_refused(tmp_path: Path) -> None:
    result = find_python(tmp_path)
    assert result.returncode == 1 and "coord needs Python 3.11 or newer" in result.stderr


def test_a_versioned_python_beats_an_old_python3(tmp_path: Path) -> None:
    result = find_python(tmp_path, python3="3.9", python3_12="3.12", python3_11="3.11")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{tmp_path}/bin/python3.12"


def test_a_new_enough_python3_is_used(tmp_path: Path) -> None:
    result = find_python(tmp_path, python3="3.14")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{tmp_path}/bin/python3"
