"""The Python the tests' MLX nodes run: this environment's packages without PyTorch.

.ci/setup installs PyTorch's CPU build, Accelerate and DeepSpeed into .venv for the PyTorch job
tests. transformers, which mlx-lm imports (its tokenizers), imports torch whenever torch is
installed beside it, so every MLX rank, and every reference run of coord's trainer, imported
torch too: about 2 s of CPU each, more than half of what the MLX tests cost on a 2-core machine
(test_exact_resume: 139 CPU-seconds with torch beside mlx-lm, 65 without). A Mac user's MLX
environment has no torch, and no test of an MLX job needs it.

``mlx_python()`` is a virtual environment whose site-packages takes in every entry of this
environment's, as symlinks, except the PyTorch family (``site.addsitedir``, so that their ``.pth``
files, coord's editable install among them, apply as in .venv). It is made once per set of
installed packages and shared by every test process; the PyTorch job tests run this Python
(``sys.executable``) itself.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
import venv
from pathlib import Path

#: Distributions left out (their import packages and dist-info), lower-case: torch and what imports it
#: whenever it is installed, so that transformers finds none of them.
TORCH_FAMILY = frozenset({"torch", "torchgen", "functorch", "accelerate", "deepspeed", "triton"})

_made: str | None = None


def _left_out(entry: str) -> bool:
    name = entry.split("-", 1)[0] if entry.endswith((".dist-info", ".egg-info")) else entry.split(".", 1)[0]
    return name.lower() in TORCH_FAMILY


def mlx_python() -> str:
    """The path of the view's Python (made on first use); this Python where there is nothing to leave out."""
    global _made
    if _made is not None:
        return _made
    site = Path(sysconfig.get_paths()["purelib"])
    entries = sorted(os.listdir(site))
    if not any(_left_out(e) for e in entries) or sys.prefix == sys.base_prefix:
        _made = sys.executable  # no torch beside mlx-lm here (or no venv to mirror): nothing to hide
        return _made
    key = hashlib.sha256("\n".join([sys.executable, str(site), *entries]).encode()).hexdigest()[:12]
    root = Path(tempfile.gettempdir()) / f"coord-test-mlx-python-{os.getuid()}-{key}"
    python = root / "venv" / "bin" / "python"
    kept = [e for e in entries if not _left_out(e) and e != "__pycache__"]
    if python.exists() and not _whole(root, kept):
        _set_aside(root)  # one made on an earlier day, partly cleared since by the temp dir's cleaner
    if not python.exists():
        _build(kept, site, root)
    _made = str(python)
    return _made


def _whole(root: Path, kept: list[str]) -> bool:
    # Not its __pycache__: Python writes one into the view once a process imports a top-level module
    # through it (typing_extensions.py, six.py). Counted, it made the next test process set aside a
    # view whose daemons were importing from it (ModuleNotFoundError in a coordd starting meanwhile).
    try:
        return (sorted(e for e in os.listdir(root / "view") if e != "__pycache__") == kept
                and (root / "venv" / "pyvenv.cfg").is_file())
    except OSError:
        return False


def _set_aside(root: Path) -> None:
    aside = root.with_name(f"{root.name}.old-{os.getpid()}")
    try:
        os.rename(root, aside)  # atomic: another test process that saw it too finds it gone
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def _build(kept: list[str], site: Path, root: Path) -> None:
    """Made beside its final place and renamed into it, so that two test processes at once each see a whole one."""
    work = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
    try:
        view = root / "view"  # the final path: the .pth line names it
        (work / "view").mkdir()
        for entry in kept:
            (work / "view" / entry).symlink_to(site / entry)
        venv.EnvBuilder(with_pip=False, symlinks=True).create(work / "venv")
        made = str(work / "venv")
        own_site = Path(sysconfig.get_paths(vars={"base": made, "platbase": made})["purelib"])
        (own_site / "coord-test-mlx-view.pth").write_text(f"import site; site.addsitedir({str(view)!r})\n")
        # The activate scripts name the directory the venv was made in; nothing here uses them: the
        # interpreter finds its environment by the pyvenv.cfg beside its bin/, wherever that lies.
        os.chmod(work, 0o755)
        try:
            os.rename(work, root)
        except OSError:  # another test process made it first
            if not (root / "venv" / "bin" / "python").exists():
                raise
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
