"""deploy/: the launchd plist, the systemd user unit, their installers and install-agent.sh."""

from __future__ import annotations

import asyncio
import os
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
LAUNCHD_INSTALL = DEPLOY / "launchd" / "install.sh"
PLIST = DEPLOY / "launchd" / "com.coord.coordd.plist"
SYSTEMD_INSTALL = DEPLOY / "systemd" / "install.sh"
UNIT = DEPLOY / "systemd" / "coordd.service"
INSTALL_AGENT = DEPLOY / "install-agent.sh"
SCRIPTS = [LAUNCHD_INSTALL, SYSTEMD_INSTALL, INSTALL_AGENT]
UNDER_CI = os.environ.get("CI", "").lower() == "true"


def bash(*args: str | os.PathLike, env: dict[str, str] | None = None, input: bytes | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, env=env,
                          input=None if input is None else input.decode(), timeout=timeout)


def coordd_path() -> str:
    """An existing executable to stand in for coordd (the real one where installed)."""
    return shutil.which("coordd") or sys.executable


def script_env(home: Path, **extra: str) -> dict[str, str]:
    """This environment with HOME moved, and this Python's bin dir (coord, coordd) first on PATH."""
    env = dict(os.environ)
    env["HOME"] = str(home)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["COORD_PYTHON"] = sys.executable
    env.pop("XDG_CONFIG_HOME", None)
    env.update(extra)
    return env


# --- every script ------------------------------------------------------------------


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_script_parses_with_bash_n(script: Path) -> None:
    result = bash("-n", script)
    assert result.returncode == 0, result.stderr
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in script.read_text()
    assert os.access(script, os.X_OK), f"{script} is not executable"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_script_passes_shellcheck(script: Path) -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not on PATH")
    result = subprocess.run([shellcheck, "--shell=bash", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_script_help(script: Path, tmp_path: Path) -> None:
    result = bash(script, "-h", env=script_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: ")


# --- launchd -----------------------------------------------------------------------


def render_plist(tmp_path: Path, *args: str) -> tuple[dict, subprocess.CompletedProcess[str]]:
    result = bash(LAUNCHD_INSTALL, "--dry-run", *args, env=script_env(tmp_path))
    assert result.returncode == 0, result.stderr
    return plistlib.loads(result.stdout.encode()), result


def test_plist_template_has_the_placeholders() -> None:
    text = PLIST.read_text()
    for placeholder in ("__COORDD__", "__CONFIG__", "__LOG_DIR__"):
        assert placeholder in text
    plistlib.loads(PLIST.read_bytes())  # valid as is, placeholders and all


def test_launchd_dry_run_renders_a_valid_plist(tmp_path: Path) -> None:
    config = tmp_path / "cluster.toml"
    config.write_text("")
    coordd = shutil.which("coordd", path=script_env(tmp_path)["PATH"])
    # coordd from `command -v coordd`, or a stand-in where coord's scripts are not on PATH
    args = [str(config)] if coordd else ["--coordd", sys.executable, str(config)]
    coordd = coordd or sys.executable
    plist, result = render_plist(tmp_path, *args)
    assert "__" not in result.stdout, "a placeholder was left unfilled"
    assert plist["Label"] == "com.coord.coordd"
    assert plist["ProgramArguments"] == [coordd, "--config", str(config)]
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ProcessType"] == "Background"
    assert isinstance(plist["ThrottleInterval"], int) and 5 <= plist["ThrottleInterval"] <= 60
    log_dir = tmp_path / "Library" / "Logs" / "coord"
    assert Path(plist["StandardErrorPath"]).parent == log_dir
    assert Path(plist["StandardOutPath"]).parent == log_dir
    assert "UserName" not in plist and "GroupName" not in plist  # a user agent, never root
    assert not (tmp_path / "Library").exists(), "--dry-run must not write anything"


def test_stopping_the_launch_agent_leaves_its_process_group_alone(tmp_path: Path) -> None:
    """launchd SIGKILLs what is left in a job's process group when it exits unless
    AbandonProcessGroup is true; the installed plist keeps the key."""
    assert plistlib.loads(PLIST.read_bytes())["AbandonProcessGroup"] is True
    config = tmp_path / "cluster.toml"
    config.write_text("")
    plist, _ = render_plist(tmp_path, "--coordd", sys.executable, str(config))
    assert plist["AbandonProcessGroup"] is True


def test_launchd_dry_run_makes_paths_absolute_and_escapes_them(tmp_path: Path) -> None:
    workdir = tmp_path / "w"
    workdir.mkdir()
    odd = "a & b <c> | d \\ e.toml"
    result = subprocess.run(["bash", str(LAUNCHD_INSTALL), "--dry-run", "--coordd", sys.executable, odd],
                            capture_output=True, text=True, cwd=workdir, env=script_env(tmp_path))
    assert result.returncode == 0, result.stderr
    plist = plistlib.loads(result.stdout.encode())
    assert plist["ProgramArguments"] == [sys.executable, "--config", str(workdir / odd)]


def test_launchd_requires_a_config(tmp_path: Path) -> None:
    result = bash(LAUNCHD_INSTALL, "--dry-run", env=script_env(tmp_path))
    assert result.returncode == 2
    assert "CONFIG" in result.stderr


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the refusal off macOS")
def test_launchd_install_refuses_off_macos(tmp_path: Path) -> None:
    config = tmp_path / "cluster.toml"
    config.write_text("")
    result = bash(LAUNCHD_INSTALL, str(config), env=script_env(tmp_path))
    assert result.returncode == 2
    assert "macOS" in result.stderr and "--dry-run" in result.stderr
    assert not (tmp_path / "Library").exists()


# --- systemd -----------------------------------------------------------------------


def unit_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_systemd_unit_settings() -> None:
    lines = unit_lines(UNIT.read_text())
    for wanted in ("[Unit]", "[Service]", "[Install]",
                   "ExecStart=%h/.local/bin/coordd --config %h/.config/coord/cluster.toml",
                   "Restart=on-failure", "RestartSec=5", "KillMode=process", "TimeoutStopSec=30",
                   "NoNewPrivileges=yes", "PrivateTmp=no", "WantedBy=default.target"):
        assert wanted in lines, f"{wanted} missing from {UNIT}"
    assert not any(line.startswith(("User=", "Group=")) for line in lines), "a user unit sets no User="


def unit_service_settings(text: str) -> dict[str, str]:
    """The [Service] section's keys as systemd reads them (a later assignment wins)."""
    settings: dict[str, str] = {}
    section = None
    for line in unit_lines(text):
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line:
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings


def test_stopping_or_restarting_the_systemd_unit_signals_coordd_alone() -> None:
    """A job's launcher, its ssh connections and local ranks live in coordd's unit: under
    KillMode=mixed or control-group (the default) systemd would SIGKILL them once coordd exited."""
    settings = unit_service_settings(UNIT.read_text())
    assert settings.get("KillMode") == "process", "stopping coordd would stop its jobs"
    assert settings.get("SendSIGHUP", "no") == "no"
    assert "ExecStop" not in settings and "ExecStopPost" not in settings  # nothing else stops them either


def test_systemd_dry_run_rewrites_exec_start(tmp_path: Path) -> None:
    result = bash(SYSTEMD_INSTALL, "--dry-run", "--coordd", "/opt/coord/bin/coordd",
                  "--config", "/srv/my cluster/50% $x.toml", env=script_env(tmp_path))
    assert result.returncode == 0, result.stderr
    exec_starts = [line for line in result.stdout.splitlines() if line.startswith("ExecStart=")]
    assert exec_starts == ['ExecStart=/opt/coord/bin/coordd --config "/srv/my cluster/50%% $$x.toml"']
    assert unit_lines(result.stdout)[:3] == unit_lines(UNIT.read_text())[:3]
    assert not (tmp_path / ".config").exists(), "--dry-run must not write anything"


def test_systemd_dry_run_without_options_is_the_unit(tmp_path: Path) -> None:
    result = bash(SYSTEMD_INSTALL, "--dry-run", env=script_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout == UNIT.read_text()


def test_systemd_install_refuses_without_a_cluster_file(tmp_path: Path) -> None:
    result = bash(SYSTEMD_INSTALL, "--coordd", coordd_path(), "--config", str(tmp_path / "missing.toml"),
                  env=script_env(tmp_path))
    assert result.returncode == 2
    assert "no cluster file" in result.stderr
    assert not (tmp_path / ".config" / "systemd").exists()


def systemd_verify(unit: Path, home: Path) -> None:
    """systemd-analyze verify, as a user unit; fails on errors and on warnings about the unit."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if UNDER_CI:
            pytest.fail("systemd-analyze is not on PATH, and CI=true forbids skipping the unit check")
        pytest.skip("systemd-analyze is not on PATH (install systemd to verify the unit)")
    runtime = home / "runtime"
    runtime.mkdir(mode=0o700, exist_ok=True)
    env = dict(os.environ, HOME=str(home), XDG_RUNTIME_DIR=str(runtime))
    env.pop("XDG_CONFIG_HOME", None)
    result = subprocess.run([analyze, "--user", "verify", str(unit)], capture_output=True, text=True, env=env)
    if "Failed to initialize manager" in result.stderr:  # no user manager possible here: check it as a system unit
        result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if unit.name in line]
    assert not complaints, "\n".join(complaints)


def test_systemd_rendered_unit_verifies(tmp_path: Path) -> None:
    result = bash(SYSTEMD_INSTALL, "--dry-run", "--coordd", coordd_path(), "--config", "/tmp/x.toml",
                  env=script_env(tmp_path))
    assert result.returncode == 0, result.stderr
    unit_dir = tmp_path / "unit"
    unit_dir.mkdir()
    unit = unit_dir / "coordd.service"
    unit.write_text(result.stdout)
    systemd_verify(unit, tmp_path)


def test_systemd_shipped_unit_verifies_with_coordd_in_local_bin(tmp_path: Path) -> None:
    """The file as shipped: %h/.local/bin/coordd resolves to the user's home."""
    home = tmp_path / "home"
    (home / ".local" / "bin").mkdir(parents=True)
    (home / ".local" / "bin" / "coordd").symlink_to(coordd_path())
    unit_dir = tmp_path / "unit"
    unit_dir.mkdir()
    shutil.copy(UNIT, unit_dir / "coordd.service")
    systemd_verify(unit_dir / "coordd.service", home)


# --- install-agent.sh --------------------------------------------------------------


def current_bundle():
    from coordinator.nodes.agent_bundle import build_bundle

    return build_bundle()


def test_install_agent_usage_errors(tmp_path: Path) -> None:
    env = script_env(tmp_path)
    for args in ([], ["-p", "22", "local"], ["-p", "x", "host"], ["a", "b"], ["--bogus", "host"], ["-p"]):
        result = bash(INSTALL_AGENT, *args, env=env)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert result.stderr.strip(), args
    assert not (tmp_path / ".coord").exists()


def test_install_agent_local_installs_a_working_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    result = bash(INSTALL_AGENT, "local", "--python", sys.executable, env=script_env(home))
    assert result.returncode == 0, result.stdout + result.stderr
    bundle = current_bundle()
    install_dir = home / ".coord" / "agent" / bundle.bundle_id
    assert (install_dir / "BUNDLE_ID").read_text().strip() == bundle.bundle_id
    assert f"installed agent {bundle.bundle_id} on local at {install_dir}" in result.stdout
    assert (home / ".coord").stat().st_mode & 0o777 == 0o700
    assert not list((home / ".coord" / "agent").glob(".install-*")), "a temporary install dir was left behind"

    # The agent runs from the bundle (not this checkout), and exits 0 when its stdin closes.
    env = dict(os.environ, HOME=str(home), PYTHONPATH=str(install_dir))
    where = subprocess.run([sys.executable, "-c",
                            "import agent, shared; print(agent.__file__); print(shared.__file__)"],
                           cwd=install_dir, env=env, capture_output=True, text=True, check=True)
    assert all(Path(line).is_relative_to(install_dir) for line in where.stdout.split()), where.stdout
    agent = subprocess.run([sys.executable, "-m", "agent"], cwd=install_dir, env=env, input=b"",
                           capture_output=True, timeout=60)
    assert agent.returncode == 0, agent.stderr.decode(errors="replace")

    # The daemon's own start command finds it and answers hello with this bundle.
    monkeypatch.setenv("HOME", str(home))
    assert asyncio.run(_hello_via_start_command(bundle)) == bundle.bundle_id

    # Installing again is a no-op that still succeeds.
    again = bash(INSTALL_AGENT, "--python", sys.executable, "local", env=script_env(home))
    assert again.returncode == 0, again.stdout + again.stderr


async def _hello_via_start_command(bundle) -> str:
    from coordinator.nodes.transport import LocalTransport
    from shared import protocol as p
    from shared.rpc import Peer

    proc = await LocalTransport().start(bundle.start_command(sys.executable))
    peer = Peer(proc.reader, proc.writer, name="test")
    runner = asyncio.create_task(peer.run())
    try:
        hello = await peer.call("hello", {"protocol": p.PROTOCOL_VERSION, "client": "test"}, timeout=30)
    finally:
        await peer.close()
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
    return hello["bundle"]


FAKE_SSH = r"""#!/usr/bin/env bash
# A stand-in for ssh: records its arguments, then runs the command here with sh -c.
set -euo pipefail
printf '%s\0' "$@" --end-- >>"$FAKE_SSH_LOG"
while [ "$#" -gt 0 ]; do
    case "$1" in
        -o | -p | -i) shift 2 ;;
        --) shift; break ;;
        -*) echo "fake ssh: unexpected option $1" >&2; exit 255 ;;
        *) break ;;
    esac
done
shift  # the host
exec /bin/sh -c "$*"
"""


def test_install_agent_over_ssh_uses_batch_mode_and_the_daemons_command(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    key = tmp_path / "id_test"
    key.write_text("not a key")
    log = tmp_path / "ssh.log"
    env = script_env(home, FAKE_SSH_LOG=str(log))
    env["PATH"] = os.pathsep.join([str(bin_dir), env["PATH"]])

    result = bash(INSTALL_AGENT, "-p", "2222", "-i", str(key), "--python", sys.executable, "alice@node1", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    bundle = current_bundle()
    assert (home / ".coord" / "agent" / bundle.bundle_id / "BUNDLE_ID").is_file()

    calls: list[list[str]] = [[]]
    for word in log.read_text().split("\0")[:-1]:
        if word == "--end--":
            calls.append([])
        else:
            calls[-1].append(word)
    calls.pop()
    assert len(calls) == 2, calls  # install, then the check
    for argv in calls:
        assert argv[:-2] == ["-o", "BatchMode=yes", "-p", "2222", "-i", str(key), "--"], argv
        assert argv[-2] == "alice@node1"
    assert calls[0][-1] == bundle.install_command(sys.executable)
    assert 'test -f "$d/BUNDLE_ID"' in calls[1][-1] and bundle.bundle_id in calls[1][-1]
    assert "StrictHostKeyChecking" not in INSTALL_AGENT.read_text()
    assert "UserKnownHostsFile" not in INSTALL_AGENT.read_text()


def test_install_agent_reports_a_failed_install(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    result = bash(INSTALL_AGENT, "--python", str(tmp_path / "no-such-python"), "local", env=script_env(home))
    assert result.returncode != 0
    assert "installing on local failed" in result.stderr
