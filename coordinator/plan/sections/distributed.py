"""The plan's distributed sections: how mlx.launch starts the ranks (the command, the hostfile, each
rank's environment) and the RDMA links they use."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from coordinator.launch.mlx_backend import BackendChoice, Fix
from coordinator.plan.inputs import PlanInputs, rank_order, trainer_of
from coordinator.plan.options import ResolvedOptions
from coordinator.plan.provenance import Section, SectionFields

#: mlx.launch's default port for the jaccl coordinator (rank 0).
JACCL_PORT = 32323


class RankEntry(TypedDict):
    """Where one rank runs, from the cluster file."""

    rank: int
    node: str
    address: str
    python: str
    workdir: str


class DistributedSection(SectionFields, total=False):
    mlx_launch_command: str
    hostfile: str  # its path
    launch_environment: dict[str, str]
    training_command: str
    ranks: list[RankEntry]
    gradient_sync: str
    unified_memory: bool
    mlx_env_vars: dict[str, str]  # variable -> who sets it, and to what


class RdmaLink(TypedDict):
    nodes: list[str]
    devices: list[str | None]  # each node's RDMA device toward the other
    speed_gbps: float | None
    generation: int | None
    ip_link: str | None  # the kind of the IP link beside it


class RdmaSection(SectionFields, total=False):
    platform: str
    os_versions: dict[str, str | None]  # node -> its macOS version
    backend: str | None
    links: list[RdmaLink]
    env_vars: dict[str, str]
    setup: str
    expected_speedup: str
    fixes: list[Fix]  # only when not filled: what would enable RDMA, node by node


def distributed_section(inputs: PlanInputs, options: ResolvedOptions) -> DistributedSection:
    section: Section[DistributedSection] = Section()
    if not inputs.launch_argv:
        return section.disabled(f"no launch command: {inputs.backend_error or 'no hostfile could be written'} "
                                "(coord hostfile says why)")
    order, _ = rank_order(inputs)
    backend = (inputs.backend.get("backend") if inputs.backend else None) or (inputs.hostfile or {}).get("backend")
    mlx_version = _common_fact(inputs, order, "mlx_version")
    section.put("mlx_launch_command", shlex.join(inputs.launch_argv),
                "coord's launcher: mlx.launch (run as coordinator.launch.mlx_launch where the head's Python has mlx: "
                "the same main(), without its busy output loops) with the hostfile coord writes; each rank runs "
                "its node's rank "
                "script (~/.coord/jobs/JOB/rank-$MLX_RANK.sh), which enters the node's workdir and runs the "
                "training command with the node's Python")
    if inputs.hostfile_path:
        section.put("hostfile", inputs.hostfile_path, f"coord hostfile ({backend} backend, from the measured links)")
    if inputs.launch_env:
        section.put("launch_environment", dict(inputs.launch_env),
                    "coord: its ssh wrapper first on PATH, so ranks reach nodes with the cluster file's ssh settings")
    if inputs.training_command:
        section.put("training_command", shlex.join(inputs.training_command),
                    "the job's command; a leading 'python' is each node's own Python")
    section.put("ranks", [_rank_entry(inputs, rank, name) for rank, name in enumerate(order)],
                "cluster file: each node's user, host, Python and workdir")
    trainer_facts, trainer_source = trainer_of(inputs, options)
    if trainer_facts is None:
        section.lack("gradient_sync", f"the training script syncs its gradients itself ({trainer_source})")
    else:
        section.put("gradient_sync", trainer_facts["gradient_sync"],
                    f"{trainer_source}; mlx-lm {_common_fact(inputs, order, 'mlx_lm_version')} on the nodes")
    unified, unified_source = _unified_memory(inputs, order)
    if unified is None:
        section.lack("unified_memory", unified_source)
    else:
        section.put("unified_memory", unified, unified_source)
    if backend:
        section.put("mlx_env_vars", mlx_rank_environment(backend, inputs.hostfile),
                    f"mlx.launch of mlx {mlx_version} for the {backend} backend, the hostfile's envs, and coord's "
                    "rank script")
    else:
        section.lack("mlx_env_vars", "no backend chosen yet")
    return section.done()


def mlx_rank_environment(backend: str, hostfile: Mapping[str, Any] | None) -> dict[str, str]:
    """What every rank finds in its environment, by who sets it (mlx 0.32's launcher)."""
    env = {"MLX_RANK": "this rank's index, 0 … ranks − 1 (mlx.launch)"}
    if backend == "ring":
        env["MLX_HOSTFILE"] = "a file with every rank's ip:port for the TCP ring (written by mlx.launch)"
    else:
        env["MLX_JACCL_COORDINATOR"] = f"rank 0's address:{JACCL_PORT}, where the ranks meet (mlx.launch)"
        env["MLX_IBV_DEVICES"] = "a file with the RDMA device each rank uses toward each other rank (mlx.launch)"
        if backend == "jaccl-ring":
            env["MLX_JACCL_RING"] = "1 (mlx.launch: RDMA links form a ring, not a mesh)"
    for entry in (hostfile or {}).get("envs") or []:
        name, value = entry.split("=", 1)
        env[name] = f"{value} (the hostfile's envs)"
    env["TMPDIR"] = "<workdir>/.coord/tmp: one per node, so MLX's compiled CPU kernels never collide (coord)"
    env["COORD_RANK"] = ("this rank (coord); COORD_JOB, COORD_ATTEMPT, COORD_CHECKPOINT_DIR and the rest: "
                         "see docs/script-contract.md")
    return env


def rdma_section(inputs: PlanInputs) -> RdmaSection:
    order, _ = rank_order(inputs)
    versions = {name: (inputs.facts.get(name) or {}).get("os_version") for name in order}
    choice = inputs.backend
    section: Section[RdmaSection] = Section()
    if not choice:
        return section.disabled(f"no backend chosen: {inputs.backend_error or 'no topology measured'} "
                                "(coord hostfile)")
    fixes = [fix.copy() for fix in choice.get("fixes") or []]
    if choice.get("transport") != "rdma":
        why = (choice.get("error") or "; ".join(choice.get("reasons") or [])
               or f"the {choice.get('backend')} backend does not use RDMA")
        setup = {"setup": "; ".join(f"{fix['node']}: {fix['instruction']}" for fix in fixes)} if fixes else {}
        return section.disabled(why, backend=choice.get("backend"), os_versions=versions, fixes=fixes, **setup)
    links = rdma_links(choice)
    speeds = sorted({link["speed_gbps"] for link in links if link["speed_gbps"]})
    generations = sorted({link["generation"] for link in links if link["generation"]})
    section.put("platform", ", ".join(f"{_platform_of(inputs, name)} on {name}" for name in order)
                + "; " + (", ".join(f"Thunderbolt {g}" for g in generations) or "Thunderbolt")
                + (f" at {', '.join(f'{s:g}' for s in speeds)} Gb/s" if speeds else ""),
                "node facts (sw_vers) and system_profiler SPThunderboltDataType on each node")
    section.put("os_versions", versions, "node facts (sw_vers)")
    section.put("backend", choice["backend"], "coord topology: " + "; ".join(choice.get("reasons") or []))
    section.put("links", links, "topology: cables with reciprocal Thunderbolt domain UUIDs and an active RDMA "
                "port at both ends (ibv_devinfo)")
    section.put("env_vars", {name: value for name, value in
                             (entry.split("=", 1) for entry in (inputs.hostfile or {}).get("envs") or [])},
                "the hostfile's envs (coord sets none of its own for RDMA)")
    section.put("setup", "; ".join(f"{fix['node']}: {fix['instruction']}" for fix in fixes)
                or "nothing to do: RDMA is enabled and active on every link in use",
                "coord topology: rdma_ctl status, macOS version and Thunderbolt Bridge state on each node")
    section.lack("expected_speedup", "not measured: coord does not time the same job over TCP and RDMA")
    return section.done(flagged=True)


def rdma_links(choice: BackendChoice) -> list[RdmaLink]:
    """Each RDMA pair once: the two nodes, their devices, the cable's speed and generation."""
    links: list[RdmaLink] = []
    seen: set[tuple[str, ...]] = set()
    for host in choice.get("hosts") or []:
        for peer, toward in (host.get("toward") or {}).items():
            pair = tuple(sorted((host["node"], peer)))
            if not toward or not toward.get("rdma_device") or pair in seen:
                continue
            seen.add(pair)
            links.append({"nodes": [host["node"], peer],
                          "devices": [toward["rdma_device"], toward.get("peer_rdma_device")],
                          "speed_gbps": toward.get("speed_gbps"), "generation": toward.get("generation"),
                          "ip_link": toward.get("kind")})
    return links


def _common_fact(inputs: PlanInputs, order: Sequence[str], key: str) -> str:
    values = sorted({str(value) for name in order if (value := (inputs.facts.get(name) or {}).get(key))})
    return "/".join(values) or "unknown"


def _platform_of(inputs: PlanInputs, name: str) -> str:
    facts = inputs.facts.get(name) or {}
    return f"{facts.get('os') or 'OS unknown'} {facts.get('os_version') or ''}".strip()


def _unified_memory(inputs: PlanInputs, order: Sequence[str]) -> tuple[bool | None, str]:
    gpus = {name: (inputs.facts.get(name) or {}).get("gpu") for name in order}
    if any(gpu is None for gpu in gpus.values()):
        return None, "GPU backend unknown on " + ", ".join(n for n, g in gpus.items() if g is None)
    if all(gpu == "metal" for gpu in gpus.values()):
        return True, "node facts: Metal on every node (Apple silicon: CPU and GPU share one memory)"
    if any(gpu == "cuda" for gpu in gpus.values()):
        return False, "node facts: CUDA on " + ", ".join(n for n, g in gpus.items() if g == "cuda") + \
            " (device memory apart from the host's)"
    return None, "no GPU on " + ", ".join(n for n, g in gpus.items() if g == "none") + \
        ": MLX runs on the CPU there, so there is no device memory to unify"


def _rank_entry(inputs: PlanInputs, rank: int, name: str) -> RankEntry:
    node = next(node for node in inputs.nodes if node.name == name)
    return {"rank": rank, "node": name, "address": node.address, "python": node.python, "workdir": node.workdir}
