"""`coord init --hosts`: what to look for on a new node, and what its answers mean.

Everything here is pure: it builds the shell commands a node runs (every word quoted) and
reads what they printed. ``coordinator.commands.init`` runs them over SSH.

A node is asked twice. First for its facts (home, user, OS, chip) and the Pythons it has:
the login shell's ``python3``, virtualenvs and conda envs in the usual places, then the
system ones. Then each of those Pythons runs a tiny probe that imports ``mlx.core`` and
finds ``mlx_lm`` (importing mlx-lm itself takes seconds; its metadata is enough) and
prints versions as JSON; the same call measures the free disk where the workdir goes.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict, cast

from coordinator.config.cluster_file import NODE_NAME

DEFAULT_WORKDIR = "coord-work"  # under each node's home
LOW_DISK_BYTES = 20 * 2**30  # a model, its data and a few checkpoints need more than this
PROBE_MARK = "COORD_PROBE "

# Where a Python with mlx usually lives, in the order they are preferred after the login
# shell's python3: ("exe", path) is a Python; ("venv", path) a pyvenv.cfg, whose bin/python
# is the candidate (so a venv with any name is found). Paths without a leading "/" are
# under the node's home; "*" is a shell glob.
CANDIDATES: tuple[tuple[str, str], ...] = (
    ("exe", "venv/bin/python"),
    ("exe", ".venv/bin/python"),
    ("exe", "mlx-venv/bin/python"),
    ("exe", "mlx/bin/python"),
    ("venv", "*/pyvenv.cfg"),  # ~/NAME: any venv directly under home
    ("venv", "*/*/pyvenv.cfg"),  # ~/envs/NAME, ~/projects/NAME
    ("venv", "*/.venv/pyvenv.cfg"),  # a project's own .venv (uv, poetry)
    ("venv", ".virtualenvs/*/pyvenv.cfg"),  # virtualenvwrapper
    ("exe", "miniforge3/envs/*/bin/python"),
    ("exe", "miniconda3/envs/*/bin/python"),
    ("exe", "anaconda3/envs/*/bin/python"),
    ("exe", "mambaforge/envs/*/bin/python"),
    ("exe", ".conda/envs/*/bin/python"),
    ("exe", "miniforge3/bin/python"),
    ("exe", "miniconda3/bin/python"),
    ("exe", "anaconda3/bin/python"),
    ("exe", ".pyenv/versions/*/bin/python"),
    ("exe", "/opt/homebrew/bin/python3"),
    ("exe", "/usr/local/bin/python3"),
    ("exe", "/usr/bin/python3"),
)

# Runs under every candidate Python, old ones included: no f-strings, no walrus.
PROBE = """\
import json, platform, sys
out = {"python": platform.python_version(), "executable": sys.executable, "prefix": sys.prefix,
       "machine": platform.machine()}
try:
    import mlx.core
    out["mlx"] = getattr(mlx.core, "__version__", None) or "unknown"
except Exception as exc:
    out["mlx_error"] = "%s: %s" % (type(exc).__name__, exc)
try:
    import importlib.util
    if importlib.util.find_spec("mlx_lm") is None:
        out["mlx_lm_error"] = "No module named 'mlx_lm'"
    else:
        try:
            from importlib.metadata import version
            out["mlx_lm"] = version("mlx-lm")
        except Exception:
            out["mlx_lm"] = "unknown"
except Exception as exc:
    out["mlx_lm_error"] = "%s: %s" % (type(exc).__name__, exc)
print("COORD_PROBE " + json.dumps(out))
"""


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


# --------------------------------------------------------------------------- first call: facts


def facts_command() -> str:
    """The node's facts and candidate Pythons, one ``key<TAB>value`` line each."""
    lines = [
        "say() { printf '%s\\t%s\\n' \"$1\" \"$2\"; }",
        'say home "$HOME"',
        'say user "$(id -un 2>/dev/null)"',
        'os=$(uname -s 2>/dev/null)',
        'say os "$os"',
        'say arch "$(uname -m 2>/dev/null)"',
        'if [ "$os" = Darwin ]; then',
        '  say os_version "macOS $(sw_vers -productVersion 2>/dev/null)"',
        '  say chip "$(sysctl -n machdep.cpu.brand_string 2>/dev/null)"',
        '  say memory_bytes "$(sysctl -n hw.memsize 2>/dev/null)"',
        'else',
        "  say os_version \"$(. /etc/os-release 2>/dev/null; printf '%s' \"${PRETTY_NAME:-$(uname -sr)}\")\"",
        "  say chip \"$(awk -F': *' '/^model name/ {print $2; exit}' /proc/cpuinfo 2>/dev/null)\"",
        "  say memory_kib \"$(awk '/^MemTotal:/ {print $2}' /proc/meminfo 2>/dev/null)\"",
        'fi',
        # The login shell's python3: what the user gets when they type python3 in a terminal
        # (Homebrew and pyenv put themselves on PATH in the login profile).
        "login=$(\"${SHELL:-/bin/sh}\" -lc 'command -v python3' </dev/null 2>/dev/null | tail -n 1)",
        'case "$login" in /*) say login_python "$login";; esac',
    ]
    for kind, pattern in CANDIDATES:
        if not re.fullmatch(r"[A-Za-z0-9._/*-]+", pattern):
            raise AssertionError(f"candidate pattern {pattern!r} would need quoting")
        words = pattern if pattern.startswith("/") else f'"$HOME"/{pattern}'
        if kind == "venv":
            lines.append(f'for f in {words}; do [ -f "$f" ] && [ -x "${{f%/pyvenv.cfg}}/bin/python" ] && '
                         f'say candidate "${{f%/pyvenv.cfg}}/bin/python"; done')
        elif pattern == "/usr/bin/python3":
            # On a Mac without the command line tools this is a stub that opens an install dialog
            # on the node's screen: leave it alone there.
            lines.append(f'[ -x {words} ] && {{ [ "$os" != Darwin ] || xcode-select -p >/dev/null 2>&1; }} && '
                         f'say candidate {words}')
        else:
            lines.append(f'for f in {words}; do [ -x "$f" ] && say candidate "$f"; done')
    return "/bin/sh -c " + shlex.quote("\n".join(lines) + "\nexit 0\n")


def parse_facts(stdout: str) -> HostFacts:
    """Read what facts_command printed; the candidates come out deduplicated, login shell's first."""
    values: dict[str, str] = {}
    found: list[str] = []
    for line in stdout.splitlines():
        key, sep, value = line.partition("\t")
        if not sep:
            continue
        if key == "candidate":
            found.append(value)
        elif key not in values:
            values[key] = value.strip()
    home = values.get("home", "")
    if not home.startswith("/"):
        raise OnboardingError(f"the node did not say where its home is (HOME={home!r})")
    memory = None
    if values.get("memory_bytes", "").isdigit():
        memory = int(values["memory_bytes"])
    elif values.get("memory_kib", "").isdigit():
        memory = int(values["memory_kib"]) * 1024
    login = values.get("login_python") or None
    candidates = order_candidates(login, found)
    return HostFacts(home=home, user=values.get("user") or None, os=values.get("os") or None,
                     os_version=values.get("os_version") or None, arch=values.get("arch") or None,
                     chip=values.get("chip") or None, memory_bytes=memory, candidates=candidates,
                     login_python=login)


def order_candidates(login_python: str | None, found: list[str]) -> list[str]:
    """The login shell's python3 first, then the others in the order found; each path once."""
    ordered: list[str] = []
    for path in ([login_python] if login_python else []) + found:
        if path.startswith("/") and path not in ordered and not any(c in path for c in "\n\t\r"):
            ordered.append(path)
    return ordered


# --------------------------------------------------------------------------- second call: probes


def propose_workdir(home: str, requested: str = DEFAULT_WORKDIR) -> str:
    """An absolute workdir on the node: ``requested`` under the home unless it is absolute."""
    requested = requested.strip()
    if not requested:
        raise OnboardingError("the workdir must not be empty")
    requested = requested.removeprefix("~/")
    path = requested if requested.startswith("/") else home.rstrip("/") + "/" + requested
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise OnboardingError(f"the workdir {requested!r} must not contain '..'")
    return "/" + "/".join(parts)


def probe_command(pythons: list[str], workdir: str) -> str:
    """Ask each Python for its versions, then measure the disk the workdir is (or will be) on."""
    lines = ["say() { printf '%s\\t%s\\n' \"$1\" \"$2\"; }",
             "cd / || exit 1"]  # so nothing in the login directory shadows a module
    if pythons:
        lines += [
            f"for py in {' '.join(shlex.quote(p) for p in pythons)}; do",
            "  printf 'python\\t%s\\t' \"$py\"",
            f"  \"$py\" -c {shlex.quote(PROBE)} 2>&1 </dev/null | tr '\\n\\t' '  ' | tail -c 3000",
            "  printf '\\n'",
            "done",
        ]
    lines += [
        f"d={shlex.quote(workdir)}",
        '[ -d "$d" ] && say workdir_exists yes',
        'while [ ! -d "$d" ]; do d=$(dirname "$d"); done',
        '[ -w "$d" ] && say writable "$d"',
        'say existing "$d"',
        'say df "$(df -Pk "$d" 2>/dev/null | tail -n 1)"',
        "exit 0",
    ]
    return "/bin/sh -c " + shlex.quote("\n".join(lines) + "\n")


_DF = re.compile(r"\s(\d+)\s+(\d+)\s+(\d+)\s+(\d+)%\s+(.+)$")


def parse_probe(stdout: str) -> ProbeResult:
    pythons: list[PythonFound] = []
    values: dict[str, str] = {}
    for line in stdout.splitlines():
        key, sep, rest = line.partition("\t")
        if not sep:
            continue
        if key == "python":
            path, _, output = rest.partition("\t")
            pythons.append(parse_python_probe(path, output))
        else:
            values.setdefault(key, rest.strip())
    disk = None
    match = _DF.search(" " + values.get("df", ""))
    if match:
        total, _, free, _, mount = match.groups()
        disk = DiskFree(path=values.get("existing", ""), free_bytes=int(free) * 1024,
                        total_bytes=int(total) * 1024, mount=mount.strip())
    return ProbeResult(pythons=pythons, workdir_exists=values.get("workdir_exists") == "yes",
                       writable=bool(values.get("writable")), disk=disk)


def parse_python_probe(path: str, output: str) -> PythonFound:
    """One candidate's answer: the probe's JSON, or the error it died with."""
    at = output.find(PROBE_MARK)
    if at < 0:
        text = " ".join(output.split()) or "printed nothing"
        return PythonFound(path=path, error=f"could not run it: {text[-300:]}")
    try:
        doc, _ = json.JSONDecoder().raw_decode(output[at + len(PROBE_MARK):])
    except ValueError:
        return PythonFound(path=path, error="its answer was not readable JSON")
    if not isinstance(doc, dict):
        return PythonFound(path=path, error="its answer was not a JSON object")
    errors = [str(doc[k]) for k in ("mlx_error", "mlx_lm_error") if doc.get(k)]
    return PythonFound(path=path, python=_text(doc.get("python")), prefix=_text(doc.get("prefix")),
                       executable=_text(doc.get("executable")), mlx=_text(doc.get("mlx")),
                       mlx_lm=_text(doc.get("mlx_lm")), error="; ".join(errors) or None)


def _text(value: Any) -> str | None:
    return str(value) if value not in (None, "") else None


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


# --------------------------------------------------------------------------- the cluster file


@dataclass(frozen=True)
class SshFileSettings:
    """The [ssh] keys init was given (absolute paths), written so the daemon connects the same way."""

    known_hosts: str | None = None
    identity_file: str | None = None
    config: str | None = None


def describe_node(report: NodeReport) -> list[str]:
    """The comment above a node's table: what was found there."""
    facts, py = report.facts, report.python
    assert facts is not None and py is not None
    system = ", ".join(x for x in (facts.os_version or facts.os, facts.arch, facts.chip,
                                   format_bytes(facts.memory_bytes) + " memory" if facts.memory_bytes else None) if x)
    how = ""
    if py.path == facts.login_python:
        how = " (the login shell's python3" + (f", {py.path}" if python_path(py) != py.path else "") + ")"
    lines = [f"{report.spec.label}: {system or 'system unknown'}",
             f"  python: Python {py.python or '?'}, mlx {py.mlx}, mlx-lm {py.mlx_lm}{how}"]
    for other in report.pythons:
        if other is not py and other.usable:
            lines.append(f"  also usable: {other.path} (Python {other.python}, mlx {other.mlx}, mlx-lm {other.mlx_lm})")
    state = "exists" if report.workdir_exists else "coord creates it"
    disk = (f"{format_bytes(report.disk.free_bytes)} free of {format_bytes(report.disk.total_bytes)} on "
            f"{report.disk.mount}" if report.disk else "free disk unknown")
    lines.append(f"  workdir: {state}; {disk}")
    lines += [f"  warning: {w}" for w in report.warnings]
    return [_comment(line) for line in lines]


def render_cluster(cluster_name: str, ssh: SshFileSettings, reports: list[NodeReport], *, command: str,
                   when: str) -> str:
    """The cluster file, with a comment per node saying what was found there."""
    if not NODE_NAME.match(cluster_name):
        raise OnboardingError(f"cluster name {cluster_name!r} must be letters, digits, '.', '_' or '-'")
    bad = [r.name for r in reports if not r.ok]
    if bad or not reports:
        raise OnboardingError(f"cannot write a cluster file while nodes need fixing: {', '.join(bad) or 'none given'}")
    out = [_comment(f"coord cluster file, written by: {command}"),
           _comment(f"on {when}. Start the daemon with: coord daemon --config THIS_FILE; then check the "
                    "cluster with: coord preflight"),
           "", "[cluster]", f"name = {toml_string(cluster_name)}",
           ('# state_dir = "..."    # default: ~/Library/Application Support/coord on macOS, '
            "~/.local/state/coord elsewhere"), "", "[ssh]"]
    for key, value, default in (("known_hosts", ssh.known_hosts, "~/.ssh/known_hosts"),
                                ("identity_file", ssh.identity_file, "~/.ssh/id_ed25519"),
                                ("config", ssh.config, "~/.ssh/config")):
        out.append(f"{key} = {toml_string(value)}" if value else f"# {key} = {toml_string(default)}")
    for report in reports:
        assert report.facts is not None and report.python is not None and report.workdir is not None
        out += ["", *describe_node(report), "[[nodes]]", f"name = {toml_string(report.name)}",
                f"host = {toml_string(report.spec.host)}"]
        user = report.spec.user or report.facts.user
        if user:
            out.append(f"user = {toml_string(user)}")
        if report.spec.port:
            out.append(f"port = {report.spec.port}")
        out += [f"python = {toml_string(python_path(report.python))}", f"workdir = {toml_string(report.workdir)}"]
    return "\n".join(out) + "\n"


def toml_string(value: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's, as long as nothing is written as a surrogate pair."""
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def _comment(text: str) -> str:
    return "# " + re.sub(r"[\x00-\x1f\x7f]", " ", text)
