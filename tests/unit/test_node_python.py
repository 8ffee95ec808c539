"""The tests' MLX Python (tests/node_python.py): a view of .venv without the torch family, shared by
every test process, set aside only when it is damaged, never because Python wrote its bytecode in it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests import node_python


def test_a_view_with_its_own_bytecode_is_whole_and_one_missing_an_entry_is_not(tmp_path):
    root = tmp_path / "coord-test-mlx-python-0-key"
    (root / "view").mkdir(parents=True)
    (root / "venv").mkdir()
    (root / "venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    kept = ["mlx", "six.py", "typing_extensions.py"]
    for entry in kept:
        (root / "view" / entry).touch()
    (root / "view" / "__pycache__").mkdir()  # written by a process that imported six through the view
    assert node_python._whole(root, kept)
    os.remove(root / "view" / "six.py")  # a temp-dir cleaner took one
    assert not node_python._whole(root, kept)


def test_importing_through_the_view_leaves_it_whole_for_the_next_test_process():
    python = node_python.mlx_python()
    root = Path(python).parents[2]
    if not root.name.startswith("coord-test-mlx-python-"):
        return  # no torch beside mlx-lm here: the tests run with this Python, no view to keep
    # a top-level module, imported through the view, as a user's Python does it (writing bytecode):
    # Python writes view/__pycache__
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    done = subprocess.run([python, "-c", "import typing_extensions; print(typing_extensions.__file__)"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0 and "/view/" in done.stdout, done.stderr
    assert (root / "view" / "__pycache__").is_dir()
    kept = [e for e in sorted(os.listdir(node_python.sysconfig.get_paths()["purelib"]))
            if not node_python._left_out(e) and e != "__pycache__"]
    assert node_python._whole(root, kept)
