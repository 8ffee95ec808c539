"""Pre-flight checks of a PyTorch job (torchrun, Accelerate, DeepSpeed), as pure functions of what
the nodes' agents reported (``torch_facts``, the rendezvous probe).

They run only for a job whose launcher declares them (``"pytorch"`` in ``Capabilities.preflight``, in
coordinator/launch/registry.py; ``coord preflight --torch``): an MLX job never asks for them. Each check is a
``CheckResult`` like the others (``coordinator/readiness/checks.py``), with the command or the step
that fixes it. Their rules:

- **versions**: torch, the CUDA it was built with, NCCL, Accelerate and DeepSpeed the same on every
  node (ranks of different builds fail in their first collective, or silently differ). Accelerate
  and DeepSpeed are required only by their own launchers.
- **GPUs**: each node's GPUs and their memory; a warning where they differ (a plan sizes for the
  smallest) or where another process holds more than a tenth of a GPU's memory.
- **backend**: NCCL needs a GPU on every rank; CPU-only nodes run Gloo, all of them or none.
- **rendezvous**: rank 0's node listens on the master port and every node connects to the master
  address from where it is. A name that resolves to a loopback address on a node whose ranks are
  not on rank 0's machine is refused: those ranks would look for rank 0 on themselves (Debian's
  ``127.0.1.1 HOSTNAME`` line in /etc/hosts is the usual cause).
- **NCCL environment**: the interface pinned, InfiniBand on or off for all nodes alike (see
  ``coordinator/launch/torch_env.py``).
- **/dev/shm**: a failure below 1 GiB free, a warning below a tenth of the node's RAM. NCCL's
  shared-memory transport between a node's GPUs keeps its buffers there (4 MiB per channel and
  peer by default), and DataLoader workers pass every batch through it; Docker's default of 64 MiB
  is the known failure ("NCCL WARN Error while creating shared memory segment", a DataLoader "bus
  error"). A tenth of RAM leaves room for many workers with large batches; tmpfs takes half of RAM
  unless told otherwise.
- **C++ compiler and Python's headers** (the DeepSpeed launcher only): DeepSpeed builds ops of its
  own with torch's extension builder (``$CXX``, else ``c++``, against ``Python.h``) when a job
  starts. On a node without GPUs its CPU accelerator builds its shared-memory op in
  ``deepspeed.comm``'s init, so there a missing compiler or header fails every rank before its first
  step; on GPU nodes the ops it builds on first use (FusedAdam and others) need them unless
  DeepSpeed was installed with them built (``DS_BUILD_OPS=1``): a warning.
"""

from __future__ import annotations

import shlex
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TypedDict, cast

from coordinator.launch.rendezvous import RendezvousChoice
from coordinator.launch.torch_env import infiniband_ready, torch_envs
from coordinator.readiness.checks import FAIL, PASS, WARN, CheckResult, NodeAccess, check, on_node
from shared.agent_api.torch import RendezvousConnectReply, RendezvousListenReply, TorchFactsReply

GIB = 2**30
SHM_MIN_FREE_BYTES = GIB
SHM_RAM_FRACTION = 0.10
BUSY_GPU_FRACTION = 0.10
#: In a launcher's ``Capabilities.needs``: a C++ compiler and Python's headers on every node.
COMPILER = "c++"


_VERSION_LABELS = (("torch", "torch"), ("cuda", "CUDA (torch.version.cuda)"), ("nccl", "NCCL"),
                   ("accelerate", "Accelerate"), ("deepspeed", "DeepSpeed"))


class RendezvousProbe(TypedDict):
    """What the probe found: the choice it tested, rank 0's listener and each node's connection."""

    choice: RendezvousChoice
    port: int
    listen: RendezvousListenReply | None  # None: rank 0's node could not be asked
    connects: dict[str, RendezvousConnectReply]
    missing: dict[str, str]  # nodes that could not be asked, and why
    colocated: list[str]  # nodes on rank 0's machine (loopback is right for them)
    suggested: str | None  # an address of rank 0's node that its peers share a subnet with, for a fix


def torch_checks(facts_by_node: Mapping[str, TorchFactsReply], *, needs: frozenset[str] = frozenset(),
                 needed_by: str = "the job's launcher",
                 nodes: Mapping[str, NodeAccess] | None = None, missing: Mapping[str, str] | None = None,
                 rendezvous: RendezvousProbe | None = None, interfaces: Mapping[str, str | None] | None = None,
                 one_machine: bool = False) -> list[CheckResult]:
    """Every check of a PyTorch job over ``facts_by_node`` (each node's ``torch_facts``).

    ``needs``: what the job's launcher needs on every node besides torch (its ``Capabilities.needs``:
    distributions by name, and COMPILER), ``needed_by`` its name in a message; ``nodes`` how a
    person reaches each node for a fix; ``missing`` the nodes that gave no facts and why;
    ``rendezvous`` the probe's result; ``interfaces`` each node's interface toward rank 0;
    ``one_machine``: every node is the same machine (no interface to pin between them).
    """
    out: list[CheckResult] = []
    if missing:
        out.append(check("torch.facts", "worker", FAIL,
                         "no PyTorch facts from " + "; ".join(f"{n}: {why}" for n, why in sorted(missing.items())),
                         "coord status  # see why"))
    if not facts_by_node:
        return out
    out += version_checks(facts_by_node, needs=needs, needed_by=needed_by, nodes=nodes)
    out += gpu_checks(facts_by_node)
    out.append(backend_check(facts_by_node, nodes=nodes))
    out.append(nccl_env_check(facts_by_node, interfaces or {}, one_machine=one_machine))
    out += shm_checks(facts_by_node, nodes=nodes)
    if COMPILER in needs:
        out += compiler_checks(facts_by_node, nodes=nodes)
    if rendezvous is not None:
        out += rendezvous_checks(rendezvous, nodes=nodes)
    return out


# --- versions -------------------------------------------------------------------------------


def version_checks(facts: Mapping[str, TorchFactsReply], *, needs: frozenset[str] = frozenset(),
                   needed_by: str = "the job's launcher",
                   nodes: Mapping[str, NodeAccess] | None = None) -> list[CheckResult]:
    out = []
    torch_versions = {n: f["versions"]["torch"] for n, f in facts.items()}
    required = {"torch", *(needs - {COMPILER})}
    for key, label in _VERSION_LABELS:
        name = f"torch.versions.{key}"
        values: dict[str, str | None] = {n: cast(Mapping[str, str | None], f["versions"])[key]
                                         for n, f in facts.items()}
        if key in ("cuda", "nccl"):
            if not all(torch_versions.values()):
                continue  # said by the torch check: a build's CUDA and NCCL come with it
            out.append(_build_check(name, label, values, torch_versions, nodes))
            continue
        absent = sorted(n for n, v in values.items() if v is None)
        if len(absent) == len(values) and key not in required:
            out.append(check(name, "worker", PASS, f"{label} is not installed (not needed by {needed_by})"))
            continue
        want, odd = _majority({n: v for n, v in values.items() if v is not None} or values)
        if absent and want is None:
            out.append(check(name, "worker", FAIL, f"{label} is not installed on {', '.join(absent)}",
                             _pip(nodes, facts, absent, key, None)))
            continue
        odd = sorted(set(odd) | set(absent))
        if not odd:
            out.append(check(name, "worker", PASS, f"{label} {want} on every node"))
            continue
        detail = f"{label} differs: most nodes have {want}; " + ", ".join(
            f"{n} has {values[n] or 'none'}" for n in odd)
        out.append(check(name, "worker", FAIL, detail, _pip(nodes, facts, odd, key, want)))
    return out


def _build_check(name: str, label: str, values: Mapping[str, str | None], torch_versions: Mapping[str, str | None],
                 nodes: Mapping[str, NodeAccess] | None) -> CheckResult:
    """CUDA and NCCL come with torch's build: a difference is fixed by installing the majority's build."""
    want, odd = _majority(values)
    shown = want or ("a CPU build" if name.endswith("cuda") else "none (not built in)")
    if not odd:
        return check(name, "worker", PASS, f"{label} {shown} on every node")
    wanted_torch = Counter(torch_versions[n] for n in values if values[n] == want).most_common(1)[0][0]
    detail = f"{label} differs: most nodes have {shown}; " + ", ".join(f"{n} has {values[n] or 'none'}" for n in odd)
    fixes = "; ".join(_on(nodes, n, _torch_install(_python(nodes, n), wanted_torch)) for n in odd)
    return check(name, "worker", FAIL, detail + f" (install torch {wanted_torch} as the others have it)", fixes)


def _pip(nodes: Mapping[str, NodeAccess] | None, facts: Mapping[str, TorchFactsReply], names: Sequence[str],
         key: str, want: str | None) -> str:
    commands = []
    for name in names:
        python = facts[name]["python"] or _python(nodes, name)
        if key == "torch":
            commands.append(_on(nodes, name, _torch_install(python, want)))
        else:
            commands.append(_on(nodes, name, f"{shlex.quote(python)} -m pip install {key}"
                                + (f"=={want}" if want else "")))
    return "; ".join(commands)


def _torch_install(python: str, version: str | None) -> str:
    """pip's words for torch at ``version``; a local build tag (+cu121, +cpu) names PyTorch's own index."""
    if not version:
        return f"{shlex.quote(python)} -m pip install torch"
    command = f"{shlex.quote(python)} -m pip install torch=={version}"
    _, _, build = version.partition("+")
    if build:
        command += f" --index-url https://download.pytorch.org/whl/{build}"
    return command


# --- GPUs and the backend -------------------------------------------------------------------


def gpu_checks(facts: Mapping[str, TorchFactsReply]) -> list[CheckResult]:
    with_gpus = {n: f["gpus"] for n, f in facts.items() if f["gpus"]}
    if not with_gpus:
        sources = "; ".join(f"{n}: {f['gpu_source']}" for n, f in sorted(facts.items()))
        return [check("torch.gpus", "hardware", PASS, f"no node has an NVIDIA GPU ({sources})")]
    described = "; ".join(f"{n}: {_gpu_list(gpus)}" for n, gpus in sorted(with_gpus.items()))
    kinds = {n: sorted({(g["name"], g["memory_total_bytes"]) for g in gpus}) for n, gpus in with_gpus.items()}
    out = []
    if len({tuple(k) for k in kinds.values()}) > 1 or any(len(k) > 1 for k in kinds.values()):
        smallest = min(g["memory_total_bytes"] for gpus in with_gpus.values() for g in gpus)
        out.append(check("torch.gpus", "hardware", WARN,
                         f"the GPUs differ ({described}): every rank holds the same share of the model, so a plan "
                         f"sizes for the smallest, {smallest / GIB:.1f} GiB"))
    else:
        out.append(check("torch.gpus", "hardware", PASS, described))
    busy = [f"GPU {g['index']} on {n} has {used / GIB:.1f} of {g['memory_total_bytes'] / GIB:.1f} GiB in use"
            for n, gpus in sorted(with_gpus.items()) for g in gpus
            if (used := g["memory_used_bytes"]) is not None and used > BUSY_GPU_FRACTION * g["memory_total_bytes"]]
    if busy:
        out.append(check("torch.gpus.busy", "health", WARN,
                         "; ".join(busy) + ": another process holds it, and the job gets only what is left",
                         "nvidia-smi  # on that node: see which process holds it"))
    return out


def _gpu_list(gpus: Sequence[Mapping[str, object]]) -> str:
    counts = Counter((str(g["name"]), int(str(g["memory_total_bytes"]))) for g in gpus)
    return ", ".join(f"{count} × {name} ({memory / GIB:.0f} GiB)" for (name, memory), count in sorted(counts.items()))


def backend_check(facts: Mapping[str, TorchFactsReply], *,
                  nodes: Mapping[str, NodeAccess] | None = None) -> CheckResult:
    cpu_only = sorted(n for n, f in facts.items() if not f["gpus"])
    cpu_builds = sorted(n for n, f in facts.items() if f["gpus"] and f["versions"]["torch"]
                        and (f["versions"]["cuda"] is None or f.get("cuda_available") is False))
    no_torch = sorted(n for n, f in facts.items() if not f["versions"]["torch"])
    if no_torch:
        return check("torch.backend", "gradient", FAIL,
                     f"no backend can be chosen without torch on {', '.join(no_torch)} (see torch.versions.torch)")
    if cpu_builds:
        return check("torch.backend", "gradient", FAIL,
                     "; ".join(f"{n} has {len(facts[n]['gpus'])} GPU(s) but its torch "
                               f"{facts[n]['versions']['torch']} cannot use them ("
                               + ("a CPU build" if facts[n]["versions"]["cuda"] is None
                                  else "torch.cuda.is_available() is False: the driver is too old for its CUDA, "
                                       "or CUDA_VISIBLE_DEVICES hides them") + ")" for n in cpu_builds),
                     "; ".join(_on(nodes, n, f"{shlex.quote(facts[n]['python'])} -m pip install torch "
                                             "--index-url https://download.pytorch.org/whl/cu124") for n in cpu_builds))
    if cpu_only and len(cpu_only) < len(facts):
        gpu_nodes = sorted(set(facts) - set(cpu_only))
        return check("torch.backend", "gradient", FAIL,
                     f"{', '.join(cpu_only)} {'has' if len(cpu_only) == 1 else 'have'} no GPU while "
                     f"{', '.join(gpu_nodes)} {'has' if len(gpu_nodes) == 1 else 'have'}: NCCL needs a GPU on every "
                     "rank, and Gloo on every rank leaves the GPUs idle",
                     f"run the job on the GPU nodes only: coord run --nodes {','.join(gpu_nodes)} ...")
    if cpu_only:
        no_gloo = sorted(n for n, f in facts.items() if f.get("gloo") is False)
        if no_gloo:
            return check("torch.backend", "gradient", FAIL,
                         f"no GPU on any node, and torch on {', '.join(no_gloo)} has no Gloo backend "
                         "(torch.distributed.is_gloo_available() is False)",
                         "; ".join(_on(nodes, n, f"{shlex.quote(facts[n]['python'])} -m pip install --force-reinstall "
                                                 "torch") for n in no_gloo))
        return check("torch.backend", "gradient", PASS, "no GPU on any node: the gloo backend on every rank "
                     "(COORD_TORCH_BACKEND=gloo), in fp32")
    return check("torch.backend", "gradient", PASS, "every node has GPUs and a torch with CUDA: the nccl backend")


# --- the network ----------------------------------------------------------------------------


def nccl_env_check(facts: Mapping[str, TorchFactsReply], interfaces: Mapping[str, str | None], *,
                   one_machine: bool = False) -> CheckResult:
    envs = torch_envs(facts, interfaces)
    pinned = ", ".join(f"{n}: {env['GLOO_SOCKET_IFNAME']}" for n, env in sorted(envs.items())
                       if "GLOO_SOCKET_IFNAME" in env)
    notes = []
    unpinned = sorted(n for n, env in envs.items() if "GLOO_SOCKET_IFNAME" not in env)
    if len(facts) > 1 and unpinned and not one_machine:
        notes.append(f"no interface measured toward rank 0 on {', '.join(unpinned)}: NCCL_SOCKET_IFNAME and "
                     "GLOO_SOCKET_IFNAME are not pinned there, and NCCL takes the first interface that is up")
    ready = sorted(n for n, f in facts.items() if infiniband_ready(f))
    down = sorted(f"{device['name']} on {n}" for n, f in facts.items() if not infiniband_ready(f)
                  for device in f.get("infiniband") or [])
    if ready and len(ready) < len(facts):
        notes.append(f"InfiniBand/RoCE is active on {', '.join(ready)} only: NCCL_IB_DISABLE=1 on every node, so "
                     "the job runs over TCP sockets")
    if down:
        notes.append(f"HCA with no active port: {', '.join(down)} (ibv_devinfo: its ports are down)")
    backend = next(iter(envs.values()))["COORD_TORCH_BACKEND"] if envs else "gloo"
    if backend == "nccl":
        ib = next(iter(envs.values()))["NCCL_IB_DISABLE"] == "0"
        summary = (f"NCCL over {'InfiniBand/RoCE (NCCL_IB_DISABLE=0)' if ib else 'TCP sockets (NCCL_IB_DISABLE=1)'}, "
                   "NCCL_DEBUG=WARN; NCCL_NET_GDR_LEVEL is not set: whether a GPU and an HCA share a PCIe switch "
                   "is not read, and NCCL's own topology detection decides")
    else:
        summary = "Gloo over TCP"
    if pinned:
        summary += f"; interfaces pinned: {pinned}"
    if notes:
        return check("torch.nccl_env", "gradient", WARN, f"{summary}; " + "; ".join(notes))
    return check("torch.nccl_env", "gradient", PASS, summary)


def rendezvous_checks(probe: RendezvousProbe, *, nodes: Mapping[str, NodeAccess] | None = None) -> list[CheckResult]:
    choice, port = probe["choice"], probe["port"]
    master, address = choice["master_node"], choice["master_address"]
    where = f"{address}:{port}"
    listen = probe["listen"]
    if listen is None or not listen["listening"]:
        why = listen["detail"] if listen else probe["missing"].get(master, "its agent could not be asked")
        return [check("torch.rendezvous", "gradient", FAIL, f"{master} (rank 0) cannot listen on port {port}: {why}",
                      _on(nodes, master, f"ss -ltnp 'sport = :{port}'") + "  # what holds it; or give the job "
                      "another master port")]
    out: list[CheckResult] = []
    local = [n for n, reply in sorted(probe["connects"].items())
             if reply["loopback"] and n not in probe["colocated"] and n != master]
    if local:
        fix_address = probe["suggested"] or f"<{master}'s address on the cluster's network>"
        out.append(check(
            "torch.rendezvous.address", "gradient", FAIL,
            f"the master address {address} resolves to a loopback address on " + ", ".join(
                f"{n} ({', '.join(probe['connects'][n]['resolved'])})" for n in local)
            + ": ranks there would look for rank 0 on their own machine",
            f"use an address, not a name: set ips = [\"{fix_address}\"] for node {master} in the cluster file "
            f"(or correct {address}'s line in /etc/hosts on " + ", ".join(local) + ")"))
    failed = {n: reply for n, reply in sorted(probe["connects"].items()) if not reply["connected"]}
    unasked = {n: why for n, why in sorted(probe["missing"].items()) if n != master}
    if failed or unasked:
        details = [f"{n}: {reply['detail']}" for n, reply in failed.items()] + \
                  [f"{n}: not asked ({why})" for n, why in unasked.items()]
        out.append(check("torch.rendezvous", "gradient", FAIL,
                         f"not every node reaches rank 0 at {where} ({choice['reason']}): " + "; ".join(details),
                         f"open TCP port {port} on {master} to the other nodes (for example "
                         + _on(nodes, master, f"sudo ufw allow {port}/tcp") + "), or set the address they reach "
                         f"{master} at: ips = [\"...\"] for node {master} in the cluster file"))
    elif not local:
        out.append(check("torch.rendezvous", "gradient", PASS,
                         f"every node reached rank 0 ({master}) at {where}: {choice['reason']}"))
    return out


# --- /dev/shm --------------------------------------------------------------------------------


def shm_checks(facts: Mapping[str, TorchFactsReply], *,
               nodes: Mapping[str, NodeAccess] | None = None) -> list[CheckResult]:
    out = []
    for name, fact in sorted(facts.items()):
        if fact.get("os") != "Linux":
            continue  # /dev/shm is a Linux tmpfs; macOS ranks share memory otherwise
        shm, check_name = fact.get("shm"), f"torch.shm.{name}"
        if shm is None:
            out.append(check(check_name, "hardware", FAIL, f"{name} has no /dev/shm "
                             f"({fact['detail'].get('shm', 'not readable')}): NCCL and DataLoader workers need it",
                             _on(nodes, name, "sudo mount -t tmpfs -o size=8g tmpfs /dev/shm")))
            continue
        memory = fact.get("memory_bytes")
        want = SHM_RAM_FRACTION * memory if memory else None
        text = f"{name}: /dev/shm {shm['total_bytes'] / GIB:.2f} GiB, {shm['free_bytes'] / GIB:.2f} GiB free"
        size = max(8, int((want or 0) / GIB) + 1)
        fix = (_on(nodes, name, f"sudo mount -o remount,size={size}g /dev/shm")
               + f"  # in a container: docker run --shm-size={size}g")
        if shm["free_bytes"] < SHM_MIN_FREE_BYTES:
            out.append(check(check_name, "hardware", FAIL,
                             f"{text}: below 1 GiB, NCCL's shared-memory transport and DataLoader workers fail "
                             "(Docker's default is 64 MiB)", fix))
        elif want is not None and memory and shm["total_bytes"] < want:
            out.append(check(check_name, "hardware", WARN,
                             f"{text}: less than a tenth of its {memory / GIB:.0f} GiB of RAM; DataLoader workers with "
                             "large batches may run out", fix))
        else:
            out.append(check(check_name, "hardware", PASS, text))
    return out


def compiler_checks(facts: Mapping[str, TorchFactsReply], *,
                    nodes: Mapping[str, NodeAccess] | None = None) -> list[CheckResult]:
    """A C++ compiler on every node of a DeepSpeed job (its ops are built when a job starts)."""
    asked = {name: fact for name, fact in facts.items() if "compiler" in fact}
    if not asked:
        return []
    lacking: dict[str, list[tuple[str, str]]] = {}  # node -> (what it lacks, the Debian package with it)
    for name, fact in sorted(asked.items()):
        needs = [(what, package) for what, package, found in (
            ("a C++ compiler (c++, or $CXX)", "g++", fact.get("compiler")),
            ("Python's headers (Python.h)", "python3-dev", fact.get("python_headers", True))) if not found]
        if needs:
            lacking[name] = needs
    if not lacking:
        return [check("torch.compiler", "worker", PASS, "a C++ compiler and Python's headers on every node "
                      "(DeepSpeed builds its ops with them)")]
    said = "; ".join(f"{name} lacks {' and '.join(what for what, _ in needs)}" for name, needs in lacking.items())
    fix = "; ".join(_on(nodes, name, "sudo apt-get install " + " ".join(package for _, package in needs))
                    for name, needs in lacking.items())
    if any(not facts[name]["gpus"] for name in lacking):
        return [check("torch.compiler", "worker", FAIL,
                      f"{said}: DeepSpeed's CPU accelerator builds its shared-memory op with them when the job "
                      "starts, and every rank fails at init (\"c++: not found\", \"Python.h: No such file\")", fix)]
    return [check("torch.compiler", "worker", WARN,
                  f"{said}: DeepSpeed ops it builds on first use (FusedAdam and others) fail there, unless "
                  "DeepSpeed was installed with them built (DS_BUILD_OPS=1)", fix)]


# --- helpers ----------------------------------------------------------------------------------


def _majority(values: Mapping[str, str | None]) -> tuple[str | None, list[str]]:
    counts = Counter(values.values())
    value, _ = counts.most_common(1)[0]
    return value, sorted(n for n, v in values.items() if v != value)


def _python(nodes: Mapping[str, NodeAccess] | None, name: str) -> str:
    return nodes[name]["python"] if nodes and name in nodes else "python3"


def _on(nodes: Mapping[str, NodeAccess] | None, name: str, command: str) -> str:
    if nodes and name in nodes:
        return on_node(nodes[name], command)
    return f"on {name}: {command}"
