"""`coord init --hosts`: what to look for on a new node, and what its answers mean.

Everything here is pure. This module holds what a node was found to be (the host spec,
its facts, the Pythons asked, the report), the --hosts list, and the verdict: which
Python, which workdir, what is wrong. ``onboarding_probes`` builds the shell commands a
node runs (every word quoted) and reads what they printed; ``onboarding_cluster_file``
writes the cluster file. ``coordinator.commands.init`` runs the commands over SSH.

A node is asked twice. First for its facts (home, user, OS, chip) and the Pythons it has:
the login shell's ``python3``, virtualenvs and conda envs in the usual places, then the
system ones. Then each of those Pythons runs a tiny probe that imports ``mlx.core`` and
finds ``mlx_lm`` (importing mlx-lm itself takes seconds; its metadata is enough) and
prints versions as JSON; the same call measures the free disk where the workdir goes.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from dataclasses import asdict, dataclass, field
from typing import TypedDict, cast

from coordinator.config.cluster_file import NODE_NAME

DEFAULT_WORKDIR = "coord-work"  # under each node's home
LOW_DISK_BYTES = 20 * 2**30  # a model, its data and a few checkpoints need more than this


class OnboardingError(ValueError):
    """A --hosts list or a node answer that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class HostSpec:
    """One entry of --hosts: ``[NAME=][USER@]HOST[:PORT]``."""

    host: str
    user: str | None = None
    port: int | None = None
    name: str | None = None

    @property
    def label(self) -> str:
        who = f"{self.user}@" if self.user else ""
        host = f"[{self.host}]" if ":" in self.host and self.port else self.host
        return f"{who}{host}" + (f":{self.port}" if self.port else "")


@dataclass
class HostFacts:
    home: str
    user: str | None = None
    os: str | None = None
    os_version: str | None = None
    arch: str | None = None
    chip: str | None = None
    memory_bytes: int | None = None
    candidates: list[str] = field(default_factory=list)  # in order of preference
    login_python: str | None = None


@dataclass
class PythonFound:
    path: str
    python: str | None = None
    prefix: str | None = None
    executable: str | None = None  # sys.executable: what a shim (pyenv, asdf) ran
    mlx: str | None = None
    mlx_lm: str | None = None
    error: str | None = None  # why it could not be asked, or why mlx/mlx-lm is missing

    @property
    def usable(self) -> bool:
        return bool(self.mlx and self.mlx_lm)


@dataclass
class DiskFree:
    path: str  # the nearest existing directory of the workdir
    free_bytes: int
    total_bytes: int
    mount: str


@dataclass
class ProbeResult:
    pythons: list[PythonFound]
    workdir_exists: bool = False
    writable: bool = False
    disk: DiskFree | None = None


class HostSpecDict(TypedDict):
    host: str
    user: str | None
    port: int | None
    name: str | None
    label: str


class HostFactsDict(TypedDict):
    home: str
    user: str | None
    os: str | None
    os_version: str | None
    arch: str | None
    chip: str | None
    memory_bytes: int | None
    candidates: list[str]
    login_python: str | None


class PythonFoundDict(TypedDict):
    path: str
    python: str | None
    prefix: str | None
    executable: str | None
    mlx: str | None
    mlx_lm: str | None
    error: str | None


class DiskFreeDict(TypedDict):
    path: str
    free_bytes: int
    total_bytes: int
    mount: str


class NodeReportDict(TypedDict):
    """``NodeReport.as_dict``: one host in ``coord init --json``."""

    name: str
    spec: HostSpecDict
    facts: HostFactsDict | None
    pythons: list[PythonFoundDict]
    python: PythonFoundDict | None
    workdir: str | None
    workdir_exists: bool
    disk: DiskFreeDict | None
    problem: str | None
    fix: str | None
    warnings: list[str]
    host_key: dict[str, str] | None
    ok: bool


@dataclass
class NodeReport:
    """What onboarding found on one host, and what it proposes for the cluster file."""

    name: str
    spec: HostSpec
    facts: HostFacts | None = None
    pythons: list[PythonFound] = field(default_factory=list)
    python: PythonFound | None = None
    workdir: str | None = None
    workdir_exists: bool = False
    disk: DiskFree | None = None
    problem: str | None = None  # set when the node cannot go into the cluster file as it is
    fix: str | None = None  # the command that solves the problem
    warnings: list[str] = field(default_factory=list)
    host_key: dict[str, str] | None = None  # an untrusted host key: algorithm and fingerprint

    @property
    def ok(self) -> bool:
        return self.problem is None

    def as_dict(self) -> NodeReportDict:
        # asdict gives the fields of these dataclasses, recursively: the TypedDicts above, but for
        # the two keys added here.
        doc = cast(NodeReportDict, asdict(self))
        doc["spec"]["label"] = self.spec.label
        doc["ok"] = self.ok
        return doc


# --------------------------------------------------------------------------- --hosts


def parse_hosts(text: str) -> list[HostSpec]:
    """``alice@10.0.0.2,bob@mac-studio.local:2222,n3=carol@host`` into HostSpecs."""
    entries = [part.strip() for part in text.split(",")]
    if not any(entries):
        raise OnboardingError("--hosts is empty: give user@host entries separated by commas")
    specs = [parse_host_spec(entry) for entry in entries if entry]
    # One Mac may hold several nodes, one per user; the same user twice is a mistake.
    seen: set[tuple[str | None, str, int | None]] = set()
    for spec in specs:
        key = (spec.user, spec.host, spec.port)
        if key in seen:
            raise OnboardingError(f"--hosts names {spec.label} twice")
        seen.add(key)
    return specs


def parse_host_spec(text: str) -> HostSpec:
    name = None
    if "=" in text:
        name, text = text.split("=", 1)
        if not NODE_NAME.match(name):
            raise OnboardingError(f"--hosts: node name {name!r} must be letters, digits, '.', '_' or '-' "
                                  "(at most 63)")
    user = None
    if "@" in text:
        user, text = text.rsplit("@", 1)
        if not re.match(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$", user):
            raise OnboardingError(f"--hosts: {user!r} is not a user name (in {user}@{text})")
    host, port = _split_port(text)
    if not host or host.startswith("-") or any(c.isspace() or c in "'\"\\/;" for c in host):
        raise OnboardingError(f"--hosts: {text!r} is not a host name, address or ssh alias")
    return HostSpec(host=host, user=user, port=port, name=name)


def _split_port(text: str) -> tuple[str, int | None]:
    port_text = None
    if text.startswith("["):  # [v6]:port
        host, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise OnboardingError(f"--hosts: {text!r}: expected [ADDRESS]:PORT")
            port_text = rest[1:]
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host = text  # a bare IPv6 address, or no port
    if port_text is None:
        return host, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise OnboardingError(f"--hosts: {text!r}: the port must be a number from 1 to 65535")
    return host, int(port_text)


def name_nodes(specs: list[HostSpec]) -> list[str]:
    """A node name per host: the one given, else the host's first label, else n1, n2, ... for addresses."""
    names: list[str] = []
    for index, spec in enumerate(specs, start=1):
        if spec.name:
            base = spec.name
        elif _is_address(spec.host):
            base = f"n{index}"
        else:
            base = re.sub(r"[^A-Za-z0-9._-]", "-", spec.host.split(".")[0]).strip("-._")[:63] or f"n{index}"
        name, suffix = base, 2
        taken = {s.name for s in specs if s.name and s is not spec}
        while name in names or name in taken:
            name, suffix = f"{base}-{suffix}", suffix + 1
        names.append(name)
    return names


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------- the verdict


def choose_python(pythons: list[PythonFound]) -> PythonFound | None:
    """The first usable Python in order of preference (the login shell's python3 first)."""
    return next((p for p in pythons if p.usable), None)


def python_path(found: PythonFound) -> str:
    """The path to write: as found (a venv's bin/python must not be resolved to its base), except a
    version manager's shim, which picks an interpreter by the directory it runs in."""
    if "/shims/" in found.path and found.executable and found.executable.startswith("/"):
        return found.executable
    return found.path


def dedupe_pythons(pythons: list[PythonFound]) -> list[PythonFound]:
    """One entry per environment: python and python3 of one venv, or a venv on PATH, count once."""
    seen: set[str] = set()
    out = []
    for found in pythons:
        key = found.prefix or found.path
        if key not in seen:
            seen.add(key)
            out.append(found)
    return out


def setup_hint(facts: HostFacts, pythons: list[PythonFound]) -> str:
    """The commands that give this node a Python with mlx and mlx-lm."""
    mlx_only = next((p for p in pythons if p.mlx and not p.mlx_lm), None)
    if mlx_only is not None:
        return f"{shlex.quote(mlx_only.path)} -m pip install mlx-lm"
    packages = "mlx mlx-lm" if facts.os == "Darwin" else "'mlx[cpu]' mlx-lm"
    return f"python3 -m venv ~/mlx-venv && ~/mlx-venv/bin/pip install {packages}"


def assess(name: str, spec: HostSpec, facts: HostFacts, probe: ProbeResult, workdir: str) -> NodeReport:
    """Turn what the node printed into a report: the Python chosen, the workdir, what is wrong."""
    pythons = dedupe_pythons(probe.pythons)
    report = NodeReport(name=name, spec=spec, facts=facts, pythons=pythons, python=choose_python(pythons),
                        workdir=workdir, workdir_exists=probe.workdir_exists, disk=probe.disk)
    if report.python is None:
        asked = ", ".join(p.path for p in pythons) or "none found"
        report.problem = f"no Python with mlx and mlx-lm (asked: {asked})"
        report.fix = f"on {spec.label}: {setup_hint(facts, pythons)}; then run coord init again"
    elif not probe.writable:
        report.problem = f"{facts.user or 'the user'} cannot create or write {workdir}"
        report.fix = "pass --workdir DIR with a directory that user may write (relative to the home, or absolute)"
    if probe.disk is not None and probe.disk.free_bytes < LOW_DISK_BYTES:
        report.warnings.append(f"only {format_bytes(probe.disk.free_bytes)} free on {probe.disk.mount}")
    return report


def format_bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit in ("B", "KiB") else f"{size:.1f} {unit}"
        size /= 1024
    return f"{count} B"
