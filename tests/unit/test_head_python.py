"""A head whose Python cannot launch or train is told what to install, for exactly that Python."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from coordinator.readiness import checks as preflight
from coordinator.cli.demo import missing_training_message
from coordinator.readiness.head_python import install_command, install_mlx_command, mlx_requirements

REPO = Path(__file__).resolve().parents[2]
PY = "/Users/alice/.local/share/uv/tools/coord/bin/python"
INSTALL = f"uv pip install --python {PY} mlx mlx-lm"

# Runs the rest of argv as `coord ...` in a Python where the named top-level modules do not exist.
WITHOUT = """
import sys
blocked = set(sys.argv[1].split(","))
class Without:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Without())
for name in [m for m in sys.modules if m.split(".")[0] in blocked]:
    del sys.modules[name]
exec(sys.argv[2], {"args": sys.argv[3:]})
"""


def python_without(modules: str, code: str, *args: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "-c", WITHOUT, modules, code, *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)


# --- the pre-flight check -------------------------------------------------------------


def test_a_head_without_any_mlx_launch_fails_preflight_with_the_install_command() -> None:
    result = preflight.head_launcher(None, PY, INSTALL)
    assert result["status"] == "fail" and result["layer"] == "worker" and result["name"] == "launcher.head"
    assert PY in result["detail"] and "no mlx" in result["detail"]
    assert result["fix_command"] == INSTALL


def test_a_head_whose_python_has_mlx_passes_preflight() -> None:
    result = preflight.head_launcher((PY, "-m", "coordinator.launch.mlx_launch"), PY, INSTALL)
    assert result["status"] == "pass" and result["fix_command"] is None


def test_a_head_left_with_a_stock_mlx_launch_on_path_is_warned() -> None:
    result = preflight.head_launcher(("/opt/homebrew/bin/mlx.launch",), PY, INSTALL)
    assert result["status"] == "warn"
    assert "/opt/homebrew/bin/mlx.launch" in result["detail"]
    assert result["fix_command"] == INSTALL


def test_the_install_command_uses_pip_where_the_python_has_it_and_uv_where_it_has_not() -> None:
    assert install_command("/opt/my venv/bin/python", ["mlx[cpu]", "mlx-lm"], has_pip=True) == \
        "'/opt/my venv/bin/python' -m pip install 'mlx[cpu]' mlx-lm"
    assert install_command(PY, ["mlx", "mlx-lm"], has_pip=False) == INSTALL


def test_linux_gets_mlx_with_its_cpu_library_and_macos_plain_mlx() -> None:
    assert mlx_requirements("darwin") == ["mlx", "mlx-lm"]
    assert mlx_requirements("linux") == ["mlx[cpu]", "mlx-lm"]


def test_the_install_command_names_this_python() -> None:
    assert sys.executable in install_mlx_command()


# --- finding the launcher ---------------------------------------------------------------

FIND = "from coordinator.launch.mlx_launch import find_launcher; print(find_launcher())"


def test_without_mlx_or_mlx_launch_on_path_there_is_no_launcher(tmp_path: Path) -> None:
    result = python_without("mlx", FIND, path=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"


def test_without_mlx_the_mlx_launch_on_path_is_the_launcher(tmp_path: Path) -> None:
    stock = tmp_path / "mlx.launch"
    stock.write_text("#!/bin/sh\n")
    stock.chmod(0o755)
    result = python_without("mlx", FIND, path=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == repr((str(stock),))


def test_with_mlx_this_python_is_the_launcher(tmp_path: Path) -> None:
    result = python_without("nothing", FIND, path=str(tmp_path))
    assert result.stdout.strip() == repr((sys.executable, "-m", "coordinator.launch.mlx_launch")), result.stderr


# --- coord demo -------------------------------------------------------------------------

DEMO = "from coordinator.cli.main import main; main(['demo', *args])"


def test_the_demo_without_mlx_says_what_to_install_and_exits_non_zero(tmp_path: Path) -> None:
    result = python_without("mlx", DEMO, "--dir", str(tmp_path / "demo"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert f"coord demo trains with this Python, {sys.executable}, which cannot import mlx." in result.stderr
    assert install_mlx_command() in result.stderr
    assert not (tmp_path / "demo").exists(), "nothing is made before the check"


def test_the_demo_without_mlx_lm_names_mlx_lm(tmp_path: Path) -> None:
    result = python_without("mlx_lm", DEMO, "--dir", str(tmp_path / "demo"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "cannot import mlx_lm." in result.stderr and "Traceback" not in result.stderr


def test_with_mlx_and_mlx_lm_the_demo_has_nothing_to_ask() -> None:
    assert missing_training_message() is None
