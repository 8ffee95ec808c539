"""The README's first command: `coord demo` trains a tiny model on two local ranks, survives a killed rank."""

from __future__ import annotations

import re
import shutil
import subprocess

from tests.integration.daemon_harness import coord, environment, short_tempdir
from tests.node_python import mlx_python


def test_the_demo_resumes_a_killed_rank_from_its_checkpoint_and_finishes():
    root = short_tempdir("coord-demo-test-")
    try:
        # coord run from an MLX environment, as on a Mac (its nodes run the Python that runs coord)
        result = coord("demo", "--dir", str(root), env=environment(), timeout=900, python=mlx_python())
        out = result.stdout
        assert result.returncode == 0, out + result.stderr
        assert "killing rank 1" in out
        assert "exited with status 137 (SIGKILL)" in out
        assert "resuming from the checkpoint of step" in out
        seen = re.search(r"SIGKILL\) \(seen (\d+\.\d+) s after\)", out)
        assert seen and float(seen.group(1)) < 3, out  # polled every 0.5 s; a generous bound, against hangs
        assert "succeeded, step 100/100" in out and "restarts 1/3" in out
        # no rank is left running anywhere
        left = subprocess.run(["pgrep", "-f", f"rank_runner --dir {root}"], capture_output=True, text=True)
        assert left.stdout.strip() == ""
        # the resume never overwrote an earlier checkpoint: each attempt has its own directory
        # (every mlx-lm rank writes its adapter config into its own node's attempt directory)
        attempts = sorted({p.name for node in ("node-a", "node-b")
                           for p in (root / node / "checkpoints").glob("*/attempt-*")})
        tree = sorted(str(p.relative_to(root)) for p in root.glob("node-*/checkpoints/**/*"))
        assert attempts == ["attempt-0", "attempt-1"], (tree, out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
