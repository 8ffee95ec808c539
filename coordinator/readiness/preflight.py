"""Pre-flight: every check a cluster must pass before a rank starts, on all nodes at once."""

from __future__ import annotations

import posixpath
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

import anyio

from coordinator.launch.hostfile import Hostfile
from coordinator.launch.mlx_backend import BackendChoice
from coordinator.launch.mlx_launch import find_launcher
from coordinator.launch.plan import plan_backend
from coordinator.launch.registry import LAUNCHERS, capabilities, chosen
from coordinator.launch.topology import Topology
from coordinator.nodes.cluster import ClusterNodeView
from coordinator.nodes.session import UP, NodeSession
from coordinator.readiness import checks
from coordinator.readiness.calibration import is_stale
from coordinator.readiness.checks import CheckResult, FileInspection, Layer, Status, WritableProbe
from coordinator.readiness.consistency import ConsistencyReport, Manifest
from coordinator.readiness.doctor import QUICK_BYTES, QUICK_SECONDS, measure_fabric
from coordinator.readiness.head_python import install_mlx_command
from coordinator.readiness.push import manifest_from_wire
from coordinator.readiness.sync import ignore_patterns, source_manifest
from coordinator.readiness.torch_preflight import FACTS_CALL, TorchPreflight, torch_preflight
from shared import protocol as p
from shared.ignore import DEFAULT_PATTERNS
from shared.rpc import Emit, RemoteError

if TYPE_CHECKING:
    from coordinator.nodes.cluster import Cluster
    from coordinator.nodes.session import Facts

CHECKPOINT_DIR = "checkpoints"


class PreflightNode(ClusterNodeView):
    """A node's view with its ssh port: what the checks name in their fixes."""

    port: int | None


class PreflightInputs(TypedDict):
    """What every node told pre-flight (``gather``), by node."""

    manifests: dict[str, Manifest]  # its workdir's code (the source's files only, with a source)
    missing: dict[str, str]  # nodes not asked, or that failed to answer, and why
    script: dict[str, dict[str, FileInspection | None]]
    data: dict[str, dict[str, FileInspection | None]]
    model: dict[str, dict[str, FileInspection | None]]
    probes: dict[str, WritableProbe]
    topologies: dict[str, Topology]  # each node's ``topology`` answer, as coordinator.launch reads it


class NodeFactsFound(TypedDict):
    method: str  # the agent call, as a launcher's ``Capabilities.node_facts`` names it
    facts: dict[str, Any]  # by node: each one's answer


class PreflightReport(TypedDict):
    status: Status
    checks: list[CheckResult]
    layers: dict[Layer, Status]  # each layer with checks: their overall status
    backend: BackendChoice | None
    hostfile: Hostfile | None
    backend_error: str | None
    consistency: ConsistencyReport  # the code's, in full
    topologies: dict[str, Topology]
    seconds: float
    torch: NotRequired[TorchPreflight]  # with the "pytorch" check set only: what a PyTorch job's checks found
    # The answers to the agent call a launcher plans from (``Capabilities.node_facts``), where its checks
    # asked it: a job's first plan reads them rather than asking every node again.
    node_facts: NotRequired[NodeFactsFound]
    model_bytes: NotRequired[int | None]  # the model files named in the cluster file, on the node with most


async def gather(cluster: Cluster, emit: Emit, source: Path | None = None,
                 nodes: list[str] | None = None) -> PreflightInputs:
    """Ask every up node, at once, for what the checks need."""
    config = cluster.config
    source = source or config.sync.source
    patterns = ignore_patterns(cluster, source) if source and source.is_dir() else \
        list(DEFAULT_PATTERNS) + list(config.sync.ignore)
    found: PreflightInputs = {"manifests": {}, "missing": {}, "script": {}, "data": {}, "model": {},
                              "probes": {}, "topologies": {}}
    source_files = None
    if source is not None and source.is_dir():
        source_files, _, _ = await anyio.to_thread.run_sync(source_manifest, cluster, source, patterns)

    async def one(session: NodeSession) -> None:
        name, node = session.node.name, session.node
        if session.state != UP:
            found["missing"][name] = f"node is {session.state}"
            return
        await emit({"node": name, "progress": "hashing the workdir", "fraction": 0.1})
        files = config.node_files(node)
        try:
            # Facts again: a venv changed since the node came up must show in the version checks.
            session.view.facts = await session.call("facts", {"workdir": node.workdir}, timeout=120)
            answer = await session.call("manifest", {"root": node.workdir, "patterns": patterns}, timeout=3600)
            manifest = manifest_from_wire(answer["files"])
            if source_files is not None:
                # With a source, the code is the source's files: what else a node keeps in its
                # workdir (outputs, its own wrappers) is its business, not a divergence.
                manifest = {rel: entry for rel, entry in manifest.items() if rel in source_files}
            found["manifests"][name] = manifest
            if files["script"]:
                found["script"][name] = (await session.call(
                    "inspect_files", {"root": node.workdir, "paths": [files["script"]]}, timeout=600))["files"]
            if files["data"]:
                found["data"][name] = (await session.call(
                    "inspect_files", {"root": node.workdir, "paths": files["data"], "count_lines": True},
                    timeout=3600))["files"]
            if files["model"]:
                model_root = posixpath.join(node.workdir, files["model"])
                try:
                    model = await session.call("manifest", {"root": model_root, "patterns": []}, timeout=3600)
                    found["model"][name] = {rel: {"size": size, "mode": mode, "sha256": sha}
                                            for rel, size, mode, sha in model["files"]} or {files["model"]: None}
                except RemoteError:
                    found["model"][name] = {files["model"]: None}
            await emit({"node": name, "progress": "checking the checkpoint directory", "fraction": 0.7})
            found["probes"][name] = await session.call("check_writable",
                                                       {"root": node.workdir, "subdir": CHECKPOINT_DIR}, timeout=60)
            found["topologies"][name] = await session.call("topology", timeout=120)
            await emit({"node": name, "progress": "done", "fraction": 1.0})
        except RemoteError as exc:
            found["missing"][name] = exc.message

    async with anyio.create_task_group() as tasks:
        for session in cluster.sessions.values():
            if nodes is None or session.node.name in nodes:
                tasks.start_soon(one, session)
    return found


def _mlx_memory_and_calibration(cluster: Cluster, facts: dict[str, Facts], model_bytes: int) -> list[CheckResult]:
    calibrated = {}
    for name, fact in facts.items():
        stale, _ = is_stale(cluster.state.calibration(name), fact, refresh=False)
        calibrated[name] = not stale
    return [checks.memory_for_model(facts, model_bytes or None), checks.calibration(calibrated)]


async def store_check(url: str) -> CheckResult:
    from coordinator.config.store_url import StoreUrlError, parse_store_url
    from coordinator.durable.objects import open_store
    from coordinator.durable.probe import probe

    try:
        found = await probe(open_store(parse_store_url(url)))
    except StoreUrlError as exc:
        return checks.check("checkpoint.store", "checkpoint", checks.FAIL, str(exc))
    except Exception as exc:  # the store's client refused its settings (a malformed endpoint)
        return checks.check("checkpoint.store", "checkpoint", checks.FAIL, f"{url}: {exc}")
    if found.ok:
        return checks.check("checkpoint.store", "checkpoint", checks.PASS, found.detail)
    # A store that refuses (the credentials, a permission, the bucket) never lets a checkpoint in until
    # someone acts; one that does not answer may by the first checkpoint (the job trains on meanwhile).
    refused = found.kind in ("credentials", "denied", "no_bucket", "mismatch")
    status: Status = checks.FAIL if refused else checks.WARN
    return checks.check("checkpoint.store", "checkpoint", status, found.detail)


@dataclass(frozen=True)
class Found:
    """What every pre-flight gathered that a set of framework checks reads."""

    cluster: Cluster
    emit: Emit
    up: dict[str, PreflightNode]
    facts: dict[str, Facts]
    version_checks: list[CheckResult]  # every equal-versions check; a check set keeps its framework's
    topologies: dict[str, Topology]
    model_bytes: int
    backend: tuple[BackendChoice | None, Hostfile | None, str | None]  # the MLX backend's choice, its hostfile, why not
    launcher: str
    master_port: int | None


CheckSet = Callable[[Found], Awaitable[tuple[list[CheckResult], TorchPreflight | None]]]


async def _mlx_launch_on_head(found: Found) -> tuple[list[CheckResult], TorchPreflight | None]:
    """mlx.launch on the head, which starts every rank of an MLX job."""
    return [checks.head_launcher(find_launcher(), sys.executable, install_mlx_command())], None


async def _mlx_versions(found: Found) -> tuple[list[CheckResult], TorchPreflight | None]:
    """The same mlx and mlx-lm on every node (every job gets the other equal-versions checks)."""
    return [c for c in found.version_checks if c["name"] in MLX_VERSIONS], None


async def _mlx_memory(found: Found) -> tuple[list[CheckResult], TorchPreflight | None]:
    """MLX's memory for the model, and calibration (a PyTorch job is sized per GPU by its plan)."""
    return _mlx_memory_and_calibration(found.cluster, found.facts, found.model_bytes), None


async def _mlx_backend(found: Found) -> tuple[list[CheckResult], TorchPreflight | None]:
    """The MLX backend chosen from the links, and the hostfile written for it."""
    choice, document, error = found.backend
    return [*checks.backend(choice, error if choice is None else None), checks.hostfile(document, error)], None


async def _pytorch(found: Found) -> tuple[list[CheckResult], TorchPreflight | None]:
    """A PyTorch job's (coordinator/readiness/torch_checks.py), with the rendezvous probe."""
    await found.emit({"node": "head", "progress": "PyTorch facts and the rendezvous", "fraction": 0.9})
    found_torch = await torch_preflight(found.cluster, found.up, found.topologies, launcher=found.launcher,
                                        master_port=found.master_port)
    return found_torch["checks"], found_torch


#: The framework check sets a launcher may list (``Capabilities.preflight``), run in the order it lists
#: them, after the checks every job gets; a launcher that lists none (a program of one's own, ``--launcher
#: command``) gets only those.
CHECK_SETS: dict[str, CheckSet] = {
    "mlx_launch_on_head": _mlx_launch_on_head,
    "mlx_versions": _mlx_versions,
    "mlx_memory": _mlx_memory,
    "mlx_backend": _mlx_backend,
    "pytorch": _pytorch,
}
MLX_VERSIONS = ("versions.mlx", "versions.mlx_lm")  # the equal-versions checks only an MLX job needs


async def run_preflight(cluster: Cluster, emit: Emit, backend: str | None = None,
                        source: str | None = None, only: list[str] | None = None,
                        launcher: str | None = None, master_port: int | None = None,
                        checkpoint_store: str | None = None) -> PreflightReport:
    """Every check on every node, or on the nodes in ``only`` (a job that holds a subset of the cluster).

    ``launcher`` (the default one where none is named): its framework checks are the check sets it lists
    (``Capabilities.preflight``, coordinator/launch/registry.py; CHECK_SETS above).
    The MLX launcher's: mlx.launch on the head, the mlx and mlx-lm versions, MLX's memory and calibration,
    the MLX backend and its hostfile. The PyTorch launchers' (torchrun, Accelerate, DeepSpeed): the
    PyTorch checks (coordinator/readiness/torch_checks.py, with the rendezvous probe on ``master_port``).
    A program of one's own (``--launcher command``): none; every other check runs for every job.

    ``checkpoint_store`` (else the cluster file's): the store is written, listed, read and cleared."""
    launcher = chosen(launcher)
    if launcher not in LAUNCHERS:
        raise RemoteError(p.BAD_ARGS, f"launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    check_sets = capabilities(launcher).preflight
    started = time.monotonic()
    config = cluster.config
    found = await gather(cluster, emit, Path(source) if source else None, only)
    views = [v for v in cluster.node_views() if only is None or v["name"] in only]
    nodes: dict[str, PreflightNode] = {
        v["name"]: {**v, "port": next(n.port for n in config.nodes if n.name == v["name"])} for v in views}
    up = {n: v for n, v in nodes.items() if v["state"] == "up"}
    facts = {n: node_facts for n, v in up.items() if (node_facts := v["facts"])}

    report: list[CheckResult] = []
    report += checks.reachability(list(nodes.values()))
    report.append(checks.agent_versions({n: v["agent"] or {} for n, v in up.items()},
                                        cluster.bundle.bundle_id))
    version_checks = checks.equal_versions(nodes, facts)
    report += [c for c in version_checks if c["name"] not in MLX_VERSIONS]
    report.append(checks.equal_os(facts))
    report += checks.system_sleep(nodes, facts)
    code = checks.code_consistency(found["manifests"], found["missing"], config.sync.threshold)
    report.append(code)
    configured = [config.node_files(n) for n in config.nodes if only is None or n.name in only]
    report.append(checks.named_files("script.hash", "training script", found["script"], key="script",
                                     required=any(f["script"] for f in configured)))
    report.append(checks.named_files("data.files", "data files", found["data"], key="data", lines=True,
                                     required=any(f["data"] for f in configured)))
    report.append(checks.named_files("model.files", "model files", found["model"], key="model",
                                     required=any(f["model"] for f in configured)))
    model_bytes = max((sum(e["size"] for e in files.values() if e) for files in found["model"].values()),
                      default=0)
    report += checks.disk_and_checkpoints(nodes, found["probes"], needed_bytes=3 * model_bytes)
    last_hook = next((e for e in reversed(cluster.state.recent_events(200)) if e["kind"] == "sync.hook"), None)
    report.append(checks.sync_hook(config.sync.hook, last_hook))
    choice, document, error = plan_backend(cluster, found["topologies"], forced=backend, nodes=only)
    framework = Found(cluster, emit, up, facts, version_checks, found["topologies"], model_bytes,
                      (choice, document, error), launcher, master_port)
    found_torch: TorchPreflight | None = None
    for name in check_sets:
        found_checks, found_torch_now = await CHECK_SETS[name](framework)
        report += found_checks
        found_torch = found_torch_now or found_torch
    if len(up) > 1:
        await emit({"node": "head", "progress": "a quick look at each link", "fraction": 0.95})
        quick = await measure_fabric(cluster, quick=True, size=QUICK_BYTES, seconds=QUICK_SECONDS,
                                     topologies=found["topologies"], nodes=[n for n in nodes if n in up],
                                     record=False)
        report.append(checks.links_quick(quick["links"], quick["seconds"]))
    store = checkpoint_store or config.checkpoint_store
    if store:
        await emit({"node": "head", "progress": f"the checkpoint store {store}", "fraction": 0.97})
        report.append(await store_check(store))
    status = checks.overall(report)
    layers = {layer: checks.overall([c for c in report if c["layer"] == layer]) for layer in checks.LAYERS
              if any(c["layer"] == layer for c in report)}
    cluster.record_event("preflight." + status, f"pre-flight {status}: "
                                f"{sum(c['status'] == 'fail' for c in report)} failed, "
                                f"{sum(c['status'] == 'warn' for c in report)} warnings")
    result: PreflightReport = {
        "status": status, "checks": report, "layers": layers, "backend": choice, "hostfile": document,
        "backend_error": error, "consistency": code.pop("report"), "topologies": found["topologies"],
        "seconds": round(time.monotonic() - started, 3), "model_bytes": model_bytes or None}
    if found_torch is not None:
        result["torch"] = found_torch
        result["node_facts"] = {"method": FACTS_CALL, "facts": dict(found_torch["facts"])}
    return result
