"""Ready to launch, on the multi-host cluster: sync, consistency, pre-flight, hostfile, mlx.launch.

Nodes are different Unix users with different homes and venv paths, reached over
OpenSSH with verified host keys from a daemon in the head namespace.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.control.server import call_daemon
from tests.integration.daemon_harness import REPO, DaemonProcess, all_up, coord, environment, short_tempdir

pytestmark = pytest.mark.cluster

ALLSUM = """\
import mlx.core as mx
group = mx.distributed.init(strict=True, backend="ring")
x = mx.ones(4) * (group.rank() + 1)
total = mx.distributed.all_sum(x, group=group)
mx.eval(total)
print(f"rank {group.rank()} of {group.size()} sum {total.tolist()}", flush=True)
"""


def make_source(root: Path, files: int) -> Path:
    source = root / "project"
    for i in range(files):
        path = source / f"pkg{i % 20:02d}" / f"module_{i:04d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"VALUE = {i}\n" + "# padding\n" * (i % 7))
    (source / "allsum.py").write_text(ALLSUM)
    (source / "run.sh").write_text("#!/bin/sh\necho run\n")
    (source / "run.sh").chmod(0o755)
    (source / "data").mkdir()
    (source / "data" / "train.jsonl").write_text("".join(f'{{"text": "example {i}"}}\n' for i in range(100)))
    (source / ".git").mkdir()
    (source / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return source


@pytest.fixture(scope="module")
def ready(netns_cluster):
    netns_cluster.empty_workdirs()  # what other tests synced there would not be sent again
    root = short_tempdir()
    root.chmod(0o755)
    source = make_source(root, 2000)
    config = netns_cluster.write_cluster_toml(root / "cluster.toml", state_dir=root / "state")
    with config.open("a") as handle:
        handle.write(f'\n[sync]\nsource = "{source}"\nscript = "allsum.py"\ndata = ["data/train.jsonl"]\n')
    daemon = DaemonProcess(config, env=environment(), prefix=["ip", "netns", "exec", netns_cluster.head_ns]).start()
    daemon.wait_for(all_up, 30, "all nodes up")
    yield daemon, source, root
    daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


def run_json(daemon: DaemonProcess, *args: str, timeout: float = 300) -> tuple[int, dict]:
    result = coord(*args, "--json", "--config", str(daemon.config), env=daemon.env, timeout=timeout)
    assert result.stdout, result.stderr
    return result.returncode, json.loads(result.stdout)


def checks_by_name(result: dict) -> dict[str, dict]:
    return {c["name"]: c for c in result["checks"]}


def test_a_2000_file_tree_syncs_to_every_node_and_a_second_sync_sends_nothing(netns_cluster, ready):
    daemon, source, _ = ready
    code, report = run_json(daemon, "sync")
    assert code == 0, report
    assert report["source_files"] == 2003  # .git is ignored
    for spec in netns_cluster.nodes:
        entry = report["nodes"][spec.name]
        assert entry["status"] == "synced" and entry["result"]["files_sent"] == 2003
        copied = Path(spec.workdir) / "pkg07" / "module_0007.py"
        assert copied.read_text() == (source / "pkg07" / "module_0007.py").read_text()
        assert copied.stat().st_uid == pwd.getpwnam(spec.user).pw_uid  # written by that node's own agent
        assert os.access(Path(spec.workdir) / "run.sh", os.X_OK)  # the exec bit travelled
        assert not (Path(spec.workdir) / ".git").exists()
    assert report["consistency"]["status"] == "pass"
    code, again = run_json(daemon, "sync")
    assert code == 0
    assert {entry["status"] for entry in again["nodes"].values()} == {"unchanged"}
    assert all(entry["plan"]["send"] == 0 for entry in again["nodes"].values())


def test_a_file_changed_by_hand_fails_preflight_naming_node_and_file_and_sync_repairs_it(netns_cluster, ready):
    daemon, source, _ = ready
    assert run_json(daemon, "sync")[0] == 0
    victim = Path(netns_cluster.node("n2").workdir) / "pkg03" / "module_0003.py"
    netns_cluster.exec_in("n2", ["sh", "-c", f"echo 'VALUE = -1' > {victim}"], user=netns_cluster.node("n2").user,
                          check=True)
    code, result = run_json(daemon, "preflight")
    assert code == 1 and result["status"] == "fail"
    consistency = checks_by_name(result)["code.consistency"]
    assert consistency["status"] == "fail"
    assert "n2: pkg03/module_0003.py (other hash)" in consistency["detail"]
    assert consistency["fix_command"] == "coord sync"
    assert [d["node"] for d in consistency["divergent"]] == ["n2"]
    code, report = run_json(daemon, "sync")
    assert code == 0 and report["nodes"]["n2"]["result"]["files_sent"] == 1
    assert report["nodes"]["n1"]["status"] == "unchanged"
    code, result = run_json(daemon, "preflight")
    checks = checks_by_name(result)
    assert checks["code.consistency"]["status"] == "pass"
    assert checks["script.hash"]["status"] == "pass" and checks["data.files"]["status"] == "pass"
    assert "data/train.jsonl 100" in checks["data.files"]["detail"]
    assert code == 0, [c for c in result["checks"] if c["status"] == "fail"]


def test_a_node_with_another_mlx_version_fails_preflight_with_the_fix(netns_cluster, ready):
    daemon, _, _ = ready
    spec = netns_cluster.node("n3")
    ours = importlib.metadata.version("mlx")
    other = "0.32.3" if ours != "0.32.3" else "0.32.2"

    def install(version: str) -> None:
        subprocess.run(["uv", "pip", "install", "-q", "-p", spec.python, "--link-mode=copy",
                        f"mlx[cpu]=={version}"], check=True, timeout=600, capture_output=True)
        subprocess.run(["chown", "-R", spec.user, spec.venv], check=True)

    install(other)
    try:
        code, result = run_json(daemon, "preflight")
        mlx_check = checks_by_name(result)["versions.mlx"]
        assert code == 1 and mlx_check["status"] == "fail"
        assert f"n3 has {other}" in mlx_check["detail"] and f"most nodes have {ours}" in mlx_check["detail"]
        assert f"{spec.python} -m pip install mlx=={ours}" in mlx_check["fix_command"]
        assert mlx_check["fix_command"].startswith(f"ssh -p 22 {spec.user}@{netns_cluster.node_ip('n3')} ")
    finally:
        install(ours)
    code, result = run_json(daemon, "preflight")
    assert checks_by_name(result)["versions.mlx"]["status"] == "pass"


TRAVERSAL = """
import asyncio, json, sys
from coordinator.nodes.agent_bundle import build_bundle
from coordinator.config.cluster_file import load_config
from coordinator.nodes.transport import SshTransport
from shared.file_batch import pack_batch
from shared.rpc import Peer, RemoteError
import hashlib

async def main():
    config = load_config(sys.argv[1])
    node = next(n for n in config.nodes if n.name == "n1")
    transport = await SshTransport.connect(node, config.ssh)
    proc = await transport.start(build_bundle().start_command(node.python))
    peer = Peer(proc.reader, proc.writer, name="test")
    runner = asyncio.ensure_future(peer.run())
    await peer.call("hello", {"protocol": 1})
    outcome = {}
    data = b"pwned"
    sha = hashlib.sha256(data).hexdigest()
    for bad in sys.argv[2:]:
        try:
            await peer.call("put_files", {"root": node.workdir, "batch": pack_batch([(bad, 0o644, sha, data)])})
            outcome[bad] = "written"
        except RemoteError as exc:
            outcome[bad] = exc.code + ": " + exc.message
    print(json.dumps(outcome))
    await peer.close()
    runner.cancel()
    await transport.close()

asyncio.run(main())
"""


def test_traversal_attempts_over_ssh_are_refused_and_nothing_is_written_outside(netns_cluster, ready):
    daemon, _, root = ready
    spec = netns_cluster.node("n1")
    outside = Path(spec.home) / "outside"
    outside.mkdir(exist_ok=True)
    shutil.chown(outside, spec.user)
    escape = Path(spec.workdir) / "escape"
    if not escape.is_symlink():
        escape.symlink_to(outside)
    bad = ["../outside/x.txt", f"{outside}/abs.txt", "pkg00/../../outside/y.txt", "escape/z.txt"]
    try:
        result = netns_cluster.exec_in("head", [sys.executable, "-c", TRAVERSAL, str(daemon.config), *bad],
                                       env={**environment(), "PYTHONPATH": str(REPO)}, timeout=120)
    finally:
        # n1's tree must not keep the link: a node's own links count in the code-consistency check
        # (tests/cluster/test_run_multihost.py compares the nodes' trees later in the session)
        escape.unlink()
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    for path in bad:
        assert outcome[path].startswith("refused: refused path"), outcome
    assert list(outside.iterdir()) == []
    assert not (Path(spec.home) / "x.txt").exists()


def test_mlx_launch_with_coords_hostfile_runs_all_sum_across_every_node(netns_cluster, ready, tmp_path):
    daemon, _, root = ready
    assert run_json(daemon, "sync")[0] == 0
    output = root / "hostfile.json"
    written = coord("hostfile", "-o", str(output), "--config", str(daemon.config), env=daemon.env)
    assert written.returncode == 0, written.stderr
    from mlx._distributed_utils.common import Hostfile  # mlx's own reader
    parsed = Hostfile.from_file(str(output))
    assert parsed.backend == "ring"
    assert [h.ips for h in parsed.hosts] == [[netns_cluster.node_ip(n.name)] for n in netns_cluster.nodes]
    # The fixture's key and known_hosts are not the user's: named through coord's include file (the
    # user's side of it is test_hostfile_multihost); coord's own launch below needs none of it.
    assert [h.ssh_hostname for h in parsed.hosts] == [f"coord-netns-test-{n.name}" for n in netns_cluster.nodes]
    prepared = asyncio.run(call_daemon(Path(daemon.config.parent / "state" / "coord.sock"), "prepare_job",
                                       {"job": "allsum", "argv": ["python", "allsum.py"]}, timeout=120))
    env = {**environment(), **prepared["env"]}
    result = netns_cluster.exec_in("head", prepared["argv"], env=env, timeout=180)
    lines = sorted(line.strip() for line in result.stdout.splitlines() if line.strip().startswith("rank "))
    assert lines == [f"rank {r} of 3 sum [6.0, 6.0, 6.0, 6.0]" for r in range(3)], (result.stdout, result.stderr)
    assert result.returncode == 0
