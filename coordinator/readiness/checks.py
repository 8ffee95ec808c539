"""Pre-flight checks as pure functions of what the nodes reported.

Each check is ``{"name", "layer", "status": pass|warn|fail, "detail", "fix_command"}``.
A failure blocks a launch unless forced. The training-plan format's eight layers
(hardware, worker, checkpoint, gradient, performance, health, pre-RDMA sync,
worker consistency) each own named checks, so the report maps onto the plan.
"""

from __future__ import annotations

import shlex
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal, NotRequired, TypedDict

from coordinator.readiness.consistency import ConsistencyReport, DivergentNode, Manifest, compare_nodes

if TYPE_CHECKING:
    from coordinator.launch.hostfile import Hostfile
    from coordinator.launch.mlx_backend import BackendChoice
    from coordinator.nodes.session import Facts
    from coordinator.store.state import EventRecord

Layer = Literal["health", "hardware", "worker", "worker_consistency", "pre_rdma_sync", "checkpoint", "gradient",
                "performance"]
Status = Literal["pass", "warn", "fail"]
LAYERS: tuple[Layer, ...] = ("health", "hardware", "worker", "worker_consistency", "pre_rdma_sync", "checkpoint",
                             "gradient", "performance")
MIN_FREE_BYTES = 2 * 2**30
PASS: Final = "pass"
WARN: Final = "warn"
FAIL: Final = "fail"


class CheckResult(TypedDict):
    name: str
    layer: Layer
    status: Status
    detail: str
    fix_command: str | None  # what a person runs to fix it, when there is such a command


class CodeConsistencyCheck(CheckResult):
    ratio: float | None
    divergent: list[DivergentNode]
    report: NotRequired[ConsistencyReport]  # the whole comparison: pre-flight moves it into its report


class NodeAccess(TypedDict):
    """What the checks read of a node's view: its state and how a person reaches it."""

    name: str
    host: str
    port: int | None
    user: str | None
    address: str
    state: str
    reason: str | None
    python: str
    workdir: str


class FileInspection(TypedDict):
    """One file as a node's agent inspected it (``inspect_files``; a model's files from its manifest)."""

    size: int
    mode: int
    sha256: str
    lines: NotRequired[int]  # with count_lines


#: node -> {path: its inspection, None when the node lacks it}, or None when nothing was asked
Inspections = Mapping[str, dict[str, FileInspection | None] | None]


class WritableProbe(TypedDict):
    """A node's ``check_writable`` answer for its checkpoint directory."""

    writable: bool
    detail: str
    free_bytes: int | None
    path: str


def check(name: str, layer: Layer, status: Status, detail: str, fix_command: str | None = None) -> CheckResult:
    assert layer in LAYERS and status in (PASS, WARN, FAIL), (layer, status)  # programming errors only
    return {"name": name, "layer": layer, "status": status, "detail": detail, "fix_command": fix_command}


def overall(checks: Sequence[CheckResult]) -> Status:
    statuses = {c["status"] for c in checks}
    return FAIL if FAIL in statuses else WARN if WARN in statuses else PASS


def ssh_prefix(node: NodeAccess) -> str:
    """How a person reaches the node to run a fix there ("" for this machine)."""
    if node["host"] == "local":
        return ""
    port = f" -p {node['port']}" if node.get("port") else ""
    who = f"{node['user']}@" if node.get("user") else ""
    return f"ssh{port} {who}{node['host']} "


def on_node(node: NodeAccess, command: str) -> str:
    prefix = ssh_prefix(node)
    return f"{prefix}{shlex.quote(command)}" if prefix else command


def reachability(nodes: Sequence[NodeAccess]) -> list[CheckResult]:
    out = []
    for node in nodes:
        name = f"ssh.{node['name']}"
        if node["state"] == "up":
            where = "this machine (local transport)" if node["host"] == "local" else node["address"]
            out.append(check(name, "health", PASS, f"{node['name']} reachable at {where}, agent answering"))
            continue
        reason = node.get("reason") or node["state"]
        fix = None
        if "trust it with: " in reason:
            fix = reason.split("trust it with: ", 1)[1]
        out.append(check(name, "health", FAIL, f"{node['name']} is {node['state']}: {reason}",
                         fix or f"coord status  # see why {node['name']} is {node['state']}"))
    return out


def agent_versions(agents: Mapping[str, Mapping[str, object]], bundle_id: str) -> CheckResult:
    """``agents``: each up node's hello answer (empty when it gave none)."""
    odd = {n: a.get("bundle") for n, a in agents.items() if a.get("bundle") not in (bundle_id, "source")}
    if not agents:
        return check("agent.version", "worker", FAIL, "no agent answered")
    if odd:
        return check("agent.version", "worker", FAIL,
                     f"agents differ from the daemon's {bundle_id}: " +
                     ", ".join(f"{n} runs {b}" for n, b in sorted(odd.items())),
                     "restart coordd so it installs its agent on every node")
    return check("agent.version", "worker", PASS, f"every agent runs {bundle_id}")


def head_launcher(argv: Sequence[str] | None, python: str, install: str) -> CheckResult:
    """Can coordd start mlx.launch? `argv` is find_launcher()'s answer on the head,
    `python` coordd's own interpreter and `install` the command that gives it mlx."""
    if argv is None:
        return check("launcher.head", "worker", FAIL,
                     f"the head cannot start mlx.launch: coordd's Python {python} has no mlx and no mlx.launch "
                     "is on PATH; every job is launched with it",
                     install)
    if argv[0] != python:
        return check("launcher.head", "worker", WARN,
                     f"coordd's Python {python} has no mlx: jobs start with {argv[0]}, a stock mlx.launch "
                     "whose output threads keep a core of the head busy",
                     install)
    return check("launcher.head", "worker", PASS, f"coordd starts mlx.launch with its own Python {python}")


def _majority(values: Mapping[str, Any]) -> tuple[Any, list[str]]:
    counts = Counter(values.values())
    value, _ = counts.most_common(1)[0]
    return value, sorted(n for n, v in values.items() if v != value)


def equal_versions(nodes: Mapping[str, NodeAccess], facts: Mapping[str, Facts]) -> list[CheckResult]:
    out = []
    for key, label, package in (("python_version", "Python", None), ("mlx_version", "mlx", "mlx"),
                                ("mlx_lm_version", "mlx-lm", "mlx-lm")):
        values = {n: f.get(key) for n, f in facts.items()}
        name = f"versions.{label.lower().replace('-', '_')}"
        if not values:
            continue
        missing = sorted(n for n, v in values.items() if v is None)
        if missing and package:
            out.append(check(name, "worker", FAIL, f"{label} is not installed on {', '.join(missing)}",
                             "; ".join(on_node(nodes[n], f"{nodes[n]['python']} -m pip install {package}")
                                       for n in missing)))
            continue
        want, odd = _majority(values)
        if not odd:
            out.append(check(name, "worker", PASS, f"{label} {want} on every node"))
            continue
        detail = f"{label} differs: most nodes have {want}; " + ", ".join(f"{n} has {values[n]}" for n in odd)
        fix = ("; ".join(on_node(nodes[n], f"{nodes[n]['python']} -m pip install {package}=={want}") for n in odd)
               if package else f"use the same Python {want} on every node (recreate the venv of {', '.join(odd)})")
        out.append(check(name, "worker", FAIL, detail, fix))
    return out


def equal_os(facts: Mapping[str, Facts]) -> CheckResult:
    values = {n: (f.get("os"), f.get("os_version"), f.get("os_build")) for n, f in facts.items()}
    if not values:
        return check("os.version", "hardware", FAIL, "no node reported its OS")
    want, odd = _majority(values)
    if not odd:
        return check("os.version", "hardware", PASS, f"{want[0]} {want[1]} ({want[2]}) on every node")
    return check("os.version", "hardware", WARN,
                 f"OS builds differ: most nodes run {want[0]} {want[1]} ({want[2]}); " +
                 ", ".join(f"{n} runs {values[n][0]} {values[n][1]} ({values[n][2]})" for n in odd) +
                 "; Metal and MLX behave differently across macOS builds",
                 f"update {', '.join(odd)} to {want[0]} {want[1]} ({want[2]})")


def code_consistency(manifests: dict[str, Manifest], missing: Mapping[str, str],
                     threshold: float) -> CodeConsistencyCheck:
    report = compare_nodes(manifests, threshold=threshold, what="code")
    detail = report["detail"]
    if missing:
        detail += "; not compared: " + ", ".join(f"{n} ({why})" for n, why in sorted(missing.items()))
    status: Status = PASS if report["status"] == "pass" and not missing else FAIL
    return {**check("code.consistency", "worker_consistency", status, detail,
                    None if status == PASS else "coord sync"), "ratio": report.get("ratio"),
            "divergent": report["divergent"], "report": report}


def named_files(name: str, what: str, inspections: Inspections, *, key: str,
                lines: bool = False, required: bool = True) -> CheckResult:
    """One file set (script, data files) compared across nodes: present, same hash (and lines)."""
    layer: Layer = "worker_consistency"
    if not inspections:
        if required:
            return check(name, layer, FAIL, f"no node reported its {what}")
        return check(name, layer, PASS, f"no {what} configured (sync.{key} in the cluster file)")
    missing = {n: sorted(rel for rel, e in files.items() if e is None) for n, files in inspections.items()
               if files is not None}
    missing = {n: rels for n, rels in missing.items() if rels}
    if missing:
        return check(name, layer, FAIL, f"{what} missing: " + "; ".join(f"{n} lacks {', '.join(r)}"
                                                                       for n, r in sorted(missing.items())),
                     "coord sync")
    # Every file is present from here on (a missing one failed above).
    as_manifests: dict[str, Manifest] = {n: {rel: [e["size"], e["mode"], e["sha256"]] for rel, e in files.items()
                                             if e is not None}
                                         for n, files in inspections.items() if files is not None}
    report = compare_nodes(as_manifests, what=what, threshold=1.0)
    detail = report["detail"]
    if lines:
        counts = {n: {rel: e.get("lines") for rel, e in files.items() if e is not None}
                  for n, files in inspections.items() if files}
        sample = next(iter(counts.values()), {})
        detail += "; lines: " + ", ".join(f"{rel} {count}" for rel, count in sorted(sample.items()))
    return check(name, layer, PASS if report["status"] == "pass" else FAIL, detail,
                 None if report["status"] == "pass" else "coord sync")


def disk_and_checkpoints(nodes: Mapping[str, NodeAccess], probes: Mapping[str, WritableProbe],
                         needed_bytes: int) -> list[CheckResult]:
    out = []
    for name, probe in sorted(probes.items()):
        if not probe.get("writable"):
            out.append(check(f"checkpoint.writable.{name}", "checkpoint", FAIL, probe.get("detail", "not writable"),
                             on_node(nodes[name], f"mkdir -p {probe.get('path')} && chmod u+rwx {probe.get('path')}")))
        else:
            out.append(check(f"checkpoint.writable.{name}", "checkpoint", PASS, probe["detail"]))
        free = probe.get("free_bytes")
        need = max(needed_bytes, MIN_FREE_BYTES)
        if free is None:
            out.append(check(f"disk.free.{name}", "checkpoint", WARN, f"free disk on {name} is unknown"))
        elif free < need:
            out.append(check(f"disk.free.{name}", "checkpoint", FAIL,
                             f"{name} has {free / 2**30:.1f} GiB free at its workdir; checkpoints need about "
                             f"{need / 2**30:.1f} GiB", on_node(nodes[name], f"du -sh {nodes[name]['workdir']}/*")))
        else:
            out.append(check(f"disk.free.{name}", "checkpoint", PASS, f"{free / 2**30:.1f} GiB free on {name}"))
    return out


def memory_for_model(facts: Mapping[str, Facts], model_bytes: int | None) -> CheckResult:
    """A first estimate: a full fine-tune with Adam holds weights, gradients and two moments (4x)."""
    if not model_bytes:
        return check("memory.model", "hardware", PASS, "no model configured: nothing to size yet")
    need = 4 * model_bytes
    short = {n: f["memory_bytes"] for n, f in facts.items()
             if f.get("memory_bytes") is not None and f["memory_bytes"] < need}
    if short:
        return check("memory.model", "hardware", WARN,
                     f"a full fine-tune of a {model_bytes / 2**30:.2f} GiB model needs about {need / 2**30:.1f} GiB; "
                     + ", ".join(f"{n} has {m / 2**30:.0f} GiB" for n, m in sorted(short.items()))
                     + "; use LoRA (--fine-tune-type lora) or a smaller model")
    return check("memory.model", "hardware", PASS,
                 f"every node has more than {need / 2**30:.1f} GiB for a full fine-tune of the model")


def calibration(calibrated: Mapping[str, bool]) -> CheckResult:
    missing = sorted(n for n, ok in calibrated.items() if not ok)
    if missing:
        return check("calibration", "performance", WARN, f"not calibrated (or outdated): {', '.join(missing)}",
                     "coord calibrate")
    return check("calibration", "performance", PASS, "every node has a current calibration")


def sync_hook(configured: str | None, last: EventRecord | None) -> CheckResult:
    """``last``: the newest ``sync.hook`` event."""
    if not configured:
        return check("sync.hook", "pre_rdma_sync", PASS, "no sync hook configured")
    if last is None:
        return check("sync.hook", "pre_rdma_sync", WARN, f"sync hook {configured} has not run yet", "coord sync")
    code = (last.get("data") or {}).get("exit_code")
    if code == 0:
        return check("sync.hook", "pre_rdma_sync", PASS, last["message"])
    if code is None and "does not exist" in last["message"]:
        return check("sync.hook", "pre_rdma_sync", WARN, last["message"])
    return check("sync.hook", "pre_rdma_sync", FAIL, last["message"], "fix the hook, then: coord sync")


def backend(choice: BackendChoice | None, error: str | None) -> list[CheckResult]:
    """RDMA state consistent with the backend; RDMA fixes are instructions for a person."""
    if choice is None:
        return [check("rdma.backend", "gradient", FAIL, error or "no backend could be chosen")]
    fixes = "; ".join(f"{f['node']}: {f['instruction']}" for f in choice.get("fixes", []))
    commands = "; ".join(command for f in choice.get("fixes", []) if (command := f.get("command"))) or None
    if not choice.get("ok"):
        detail = f"{choice.get('error') or 'no usable backend'}" + (f"; {fixes}" if fixes else "")
        return [check("rdma.backend", "gradient", FAIL, detail, commands)]
    detail = f"backend {choice['backend']}: " + "; ".join(choice.get("reasons", [])[:3])
    out = [check("rdma.backend", "gradient", PASS, detail)]
    for warning in choice.get("warnings", []):
        out.append(check("rdma.warning", "gradient", WARN, warning, commands))
    if fixes and choice["backend"] == "ring":
        out.append(check("rdma.available", "gradient", WARN, f"RDMA is not in use: {fixes}", commands))
    return out


def hostfile(document: Hostfile | None, error: str | None) -> CheckResult:
    """``document``: mlx.launch's hostfile, as coordinator.launch built it."""
    if document is None:
        return check("hostfile.valid", "gradient", FAIL, f"hostfile: {error}")
    hosts = ", ".join(f"{h['ssh']}→{h['ips'][0]}" for h in document["hosts"])
    return check("hostfile.valid", "gradient", PASS, f"{document['backend']} hostfile for {hosts}")


def system_sleep(nodes: Mapping[str, NodeAccess], facts: Mapping[str, Facts]) -> list[CheckResult]:
    """macOS nodes whose system sleeps on an idle timer (``pmset -g``: ``sleep`` > 0).

    A running rank holds a power assertion (caffeinate), but between attempts (a restart, a
    wait for a node) nothing does, and a Mac asleep drops off the cluster. Only system sleep
    counts: a sleeping display or disk stops nothing. Linux nodes report no ``power``; a
    cluster with no macOS node gets no check at all.
    """
    power = {n: f.get("power") for n, f in facts.items() if f.get("os") == "macOS"}
    if not power:
        return []
    unread = sorted(n for n, p in power.items()
                    if not p or (p.get("sleep_minutes") is None and not p.get("sleep_disabled")))
    sleepy = {n: p for n, p in power.items() if p and p.get("sleep_minutes") and not p.get("sleep_disabled")}
    if not sleepy and not unread:
        return [check("power.sleep", "health", PASS,
                      f"no macOS node sleeps on an idle timer ({', '.join(sorted(power))})")]
    details = [_sleep_detail(n, p) for n, p in sorted(sleepy.items())]
    fixes = [_sudo_on_node(nodes[n], "pmset -a sleep 0") for n in sorted(sleepy)]
    if sleepy:
        details.append("a running rank keeps its Mac awake, but between attempts a sleeping Mac drops off "
                       "the cluster (sudo pmset -c sleep 0 keeps sleep on battery)")
    if unread:
        details.append(f"could not read the sleep timer (pmset -g) on {', '.join(unread)}")
        fixes += [on_node(nodes[n], "pmset -g") for n in unread]
    return [check("power.sleep", "health", WARN, "; ".join(details), "; ".join(fixes))]


def _sleep_detail(name: str, power: Mapping[str, Any]) -> str:
    """``power``: the node's ``power`` fact (pmset -g), as its agent read it."""
    detail = f"{name} sleeps after {power['sleep_minutes']} min idle"
    if power.get("sleep_prevented_by"):
        detail += f" (held off for now by {', '.join(power['sleep_prevented_by'])})"
    return detail


def _sudo_on_node(node: NodeAccess, command: str) -> str:
    """``sudo COMMAND`` on the node; over ssh with a terminal, where sudo asks for a password."""
    prefix = ssh_prefix(node)
    if not prefix:
        return f"sudo {command}"
    return f"ssh -t {prefix[len('ssh '):]}{shlex.quote(f'sudo {command}')}"


def links_quick(links: Sequence[Mapping[str, Any]], seconds: float) -> CheckResult:
    """Pre-flight's quick look at each link the backend will use (latency and a short burst,
    coordinator/readiness/doctor.py): a dead or wrong link fails, since the job would hang on it or
    run on the wrong network; a slow one is `coord doctor`'s to judge, with the bytes to judge it by."""
    if not links:
        return check("links.quick", "gradient", PASS, "no link between two machines to measure")
    bad = [link for link in links if link.get("verdict") in ("down", "wrong-route")]
    if not bad:
        shown = ", ".join(f"{link['a']}↔{link['b']} {link.get('latency_ms') or 0:.2f} ms" for link in links)
        return check("links.quick", "gradient", PASS, f"every link answers ({shown}; {seconds:.1f} s)")
    named = "; ".join(f"{link['a']} ↔ {link['b']} {link['verdict']}: {link.get('cause')} (fix: {link.get('fix')})"
                      for link in bad)
    return check("links.quick", "gradient", FAIL,
                 f"{named}. The launch is blocked until the link is fixed; `coord run --force` launches anyway",
                 "coord doctor")
