"""The agent's side of a PyTorch job's pre-flight: nvidia-smi's CSV and NCCL's version read from
fixtures, the facts collected without importing torch, and the rendezvous probe over loopback."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agent import rdma_parsers, torch_facts, torch_parsers
from agent.rendezvous import Rendezvous
from shared.rpc import RemoteError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "torch"
GIB = 2**30


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_nvidia_smi_gives_each_gpu_its_memory_in_bytes_and_its_compute_capability():
    gpus = torch_parsers.parse_nvidia_smi_gpus(fixture("nvidia-smi.h100x8.csv"))
    assert gpus is not None and len(gpus) == 8
    assert gpus[0] == {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 81559 * 2**20,
                       "memory_used_bytes": 0, "compute_capability": "9.0"}
    assert gpus[7]["memory_used_bytes"] == 71244 * 2**20


def test_a_value_the_driver_cannot_give_is_unknown_not_zero():
    [gpu] = torch_parsers.parse_nvidia_smi_gpus(fixture("nvidia-smi.a10g.na-used.csv")) or []
    assert gpu["memory_used_bytes"] is None and gpu["compute_capability"] == "8.6"


def test_an_old_driver_is_asked_again_without_compute_cap():
    assert torch_parsers.is_unknown_field_error(fixture("nvidia-smi.old-driver.compute-cap.txt"))
    gpus = torch_parsers.parse_nvidia_smi_gpus(fixture("nvidia-smi.v100x2.no-compute-cap.csv"),
                                               torch_parsers.NVIDIA_SMI_FIELDS_OLD)
    assert [g["compute_capability"] for g in gpus or []] == [None, None]
    assert [g["memory_used_bytes"] for g in gpus or []] == [0, 4 * 2**20]


@pytest.mark.parametrize("text", ["0, NVIDIA H100, 81559, 0\n",  # a field short
                                  "x, NVIDIA H100, 81559, 0, 9.0\n",  # no index
                                  "0, NVIDIA H100, [N/A], 0, 9.0\n"])  # no total: cannot be sized
def test_output_that_cannot_be_read_is_unknown(text):
    assert torch_parsers.parse_nvidia_smi_gpus(text) is None


def test_no_gpu_line_is_no_gpu():
    assert torch_parsers.parse_nvidia_smi_gpus("") == []
    assert torch_parsers.parse_nvidia_smi_gpus(None) is None


@pytest.mark.parametrize(("value", "text"), [((2, 21, 5), "2.21.5"), ([2, 18, 1], "2.18.1"), (2708, "2.7.8"),
                                             (21903, "2.19.3"), (None, None), ("2.1", None), (True, None)])
def test_nccl_versions_read_from_either_form_torch_gave(value, text):
    assert torch_parsers.nccl_version_text(value) == text


def test_ibv_devinfo_fixtures_show_infiniband_and_roce_ports():
    devices = rdma_parsers.parse_ibv_devinfo(fixture("ibv_devinfo.ib-and-roce.txt"))
    assert [(d["name"], d["ports"][0]["link_layer"]) for d in devices or []] == [("mlx5_0", "InfiniBand"),
                                                                                 ("mlx5_1", "Ethernet")]
    assert len(rdma_parsers.active_rdma_ports(devices) or []) == 2
    assert rdma_parsers.active_rdma_ports(rdma_parsers.parse_ibv_devinfo(fixture("ibv_devinfo.port-down.txt"))) == []
    assert rdma_parsers.parse_ibv_devinfo(fixture("ibv_devinfo.none.txt")) == []


def test_the_probes_gpus_are_checked_field_by_field():
    good = [{"index": 0, "name": "NVIDIA A100-SXM4-80GB", "memory_total_bytes": 80 * GIB,
             "memory_used_bytes": GIB, "compute_capability": "8.0"}]
    assert torch_parsers.gpus_from_probe(good) == good
    assert torch_parsers.gpus_from_probe([{"index": "0", "name": "x", "memory_total_bytes": 1}]) is None
    assert torch_parsers.gpus_from_probe("gpus") is None


def test_shm_sizes_come_from_statvfs_blocks():
    assert torch_parsers.shm_from_statvfs("/dev/shm", 4096, 16384, 8192) == {
        "path": "/dev/shm", "total_bytes": 64 * 2**20, "free_bytes": 32 * 2**20}
    assert torch_parsers.shm_from_statvfs("/dev/shm", 0, 1, 1) is None


def test_facts_of_a_python_without_torch_import_nothing_and_say_why_no_gpu(tmp_path, monkeypatch):
    # A Python that sees no site-packages (so no torch), no nvidia-smi and no ibv_devinfo on PATH:
    # the facts say so, and torch is never imported here.
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    python.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(torch_facts, "read_shm", lambda path, detail: None)
    facts = torch_facts.collect_torch_facts(str(python))
    assert facts["versions"]["torch"] is None and facts["gpus"] == []
    assert "nvidia-smi not found" in facts["gpu_source"] and "torch is not installed" in facts["gpu_source"]


def test_the_agent_never_imports_torch_even_where_it_is_installed():
    # In a process of its own (another test may have imported torch into this one): the facts of this
    # interpreter, which may well have torch, leave torch out of the agent's own modules.
    code = ("import sys; from agent.torch_facts import collect_torch_facts; "
            "facts = collect_torch_facts(sys.executable); print('torch' in sys.modules, facts['versions']['torch'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    imported, _ = done.stdout.split()
    assert imported == "False"


def test_another_pythons_versions_are_read_without_importing_torch(tmp_path):
    # A fake "torch" distribution in another interpreter's path: its metadata answers, its code never runs.
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("raise ImportError('a broken build')\n")
    (site / "torch-9.9.9.dist-info").mkdir()
    (site / "torch-9.9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9.9.9\n")
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} -S \"$@\"\n")  # -S: no site-packages
    python.chmod(0o755)
    detail: dict[str, str] = {}
    versions = torch_facts.read_versions(str(python), detail)
    assert versions["torch"] == "9.9.9" and versions["accelerate"] is None and detail == {}
    # Only the probe imports torch, and a torch that fails to import says so.
    answer = torch_facts.run_torch_probe(str(python), want_gpus=False, detail=detail)
    assert answer == {} and detail["torch"] == "import torch failed: ImportError: a broken build"


FAKE_TORCH = """\
import os
with open(os.environ["PROBED"], "a") as count:
    count.write("imported\\n")
class version:
    cuda = None
class cuda:
    is_available = staticmethod(lambda: False)
    class nccl:
        @staticmethod
        def version():
            raise RuntimeError("no NCCL in a CPU build")
"""


def _fake_torch_python(tmp_path: Path, version: str = "2.13.0+cpu") -> tuple[Path, Path, Path]:
    """An interpreter whose torch counts its imports: (python, its site directory, the count file)."""
    site = tmp_path / "site"
    (site / "torch" / "distributed").mkdir(parents=True, exist_ok=True)
    (site / "torch" / "__init__.py").write_text(FAKE_TORCH)
    (site / "torch" / "distributed" / "__init__.py").write_text(
        "is_available = lambda: True\nis_gloo_available = lambda: True\nis_nccl_available = lambda: False\n")
    info = site / f"torch-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    probed = tmp_path / "probed"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPROBED={probed} PYTHONPATH={site} exec {sys.executable} -S \"$@\"\n")
    python.chmod(0o755)
    return python, site, probed


def test_the_torch_probe_is_asked_once_until_torch_or_the_driver_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(torch_facts, "_PROBES", {})
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi: a CPU node
    monkeypatch.setattr(torch_facts, "read_shm", lambda path, detail: None)
    python, site, probed = _fake_torch_python(tmp_path)
    first = torch_facts.collect_torch_facts(str(python))
    assert first["versions"]["torch"] == "2.13.0+cpu" and first["gloo"] is True and first["cuda_available"] is False
    again = torch_facts.collect_torch_facts(str(python))
    assert probed.read_text().count("imported") == 1 and again["gloo"] is True  # the second launch: no import
    # torch installed again (pip makes a new dist-info directory): asked again
    (site / "torch-2.13.0+cpu.dist-info").rename(tmp_path / "old-info")
    _fake_torch_python(tmp_path)
    torch_facts.collect_torch_facts(str(python))
    assert probed.read_text().count("imported") == 2
    # a probe that failed is not kept: a torch mended since is seen at once (an agent started afresh)
    monkeypatch.setattr(torch_facts, "_PROBES", {})
    (site / "torch" / "__init__.py").write_text("raise ImportError('half installed')\n")
    broken = torch_facts.collect_torch_facts(str(python))
    assert broken["gloo"] is None and "half installed" in broken["detail"]["torch"]
    (site / "torch" / "__init__.py").write_text(FAKE_TORCH)
    assert torch_facts.collect_torch_facts(str(python))["gloo"] is True


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_rendezvous_probe_connects_to_its_own_listener_and_counts_the_connections():
    async def scenario():
        probes, port = Rendezvous(), _free_port()
        opened = await probes.listen(port, "t0k3n", seconds=30)
        assert opened["listening"], opened
        reached = await probes.connect("127.0.0.1", port, "t0k3n", timeout=5)
        by_name = await probes.connect("localhost", port, "t0k3n", timeout=5)
        assert reached["connected"] and reached["loopback"], reached
        assert by_name["connected"] and by_name["loopback"] and "localhost resolves to" in by_name["detail"]
        closed = await probes.close(port)
        assert closed == {"closed": True, "accepted": 2}
        after = await probes.connect("127.0.0.1", port, "t0k3n", timeout=5)
        assert not after["connected"] and "refused" in after["detail"]
        assert (await probes.close(port)) == {"closed": False, "accepted": 0}

    asyncio.run(scenario())


def test_a_port_held_by_another_service_is_named_both_ways():
    async def scenario():
        holder = await asyncio.start_server(_say_hello, host="127.0.0.1", port=0)
        port = holder.sockets[0].getsockname()[1]
        probes = Rendezvous()
        try:
            opened = await probes.listen(port, "tok", seconds=5)
            assert not opened["listening"] and "in use" in opened["detail"], opened
            reached = await probes.connect("127.0.0.1", port, "tok", timeout=5)
            assert not reached["connected"] and "not as coord's probe" in reached["detail"]
        finally:
            holder.close()
            await holder.wait_closed()
            await probes.close_all()

    asyncio.run(scenario())


async def _say_hello(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"SSH-2.0-other\n")
    await writer.drain()
    writer.close()


def test_a_listener_closes_by_itself_when_its_time_is_up():
    async def scenario():
        probes, port = Rendezvous(), _free_port()
        await probes.listen(port, "tok", seconds=0.2)
        await asyncio.sleep(0.5)
        assert not (await probes.connect("127.0.0.1", port, "tok", timeout=2))["connected"]

    asyncio.run(scenario())


def test_a_name_that_does_not_resolve_and_bad_arguments_are_said():
    async def scenario():
        probes = Rendezvous()
        missing = await probes.connect("no-such-host.invalid", 29500, "tok", timeout=5)
        assert not missing["connected"] and "does not resolve" in missing["detail"]
        for call in (probes.listen(0, "tok"), probes.listen(29500, ""), probes.connect("a b", 29500, "tok"),
                     probes.listen(29500, "tok", seconds=10_000)):
            with pytest.raises(RemoteError):
                await call

    asyncio.run(scenario())


def test_the_cpp_compiler_is_cxx_or_cpp_on_the_ranks_path_beside_their_python(tmp_path, monkeypatch):
    from agent.torch_facts import find_compiler

    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "c++").write_text("#!/bin/sh\n")
    (venv / "c++").chmod(0o755)
    (tmp_path / "clang++").write_text("#!/bin/sh\n")
    (tmp_path / "clang++").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CXX", raising=False)
    assert find_compiler(str(venv / "python")) == str(venv / "c++")  # beside the ranks' Python
    assert find_compiler(str(tmp_path / "elsewhere" / "python")) is None  # none on the PATH
    monkeypatch.setenv("CXX", str(tmp_path / "clang++"))
    assert find_compiler(str(venv / "python")) == str(tmp_path / "clang++")  # $CXX, as torch's builder takes it
