"""`coord init --hosts`: the two calls a new node gets, and reading what it printed.

First its facts (home, user, OS, chip) and the Pythons it has; then each Python's versions
of mlx and mlx-lm, with the free disk where the workdir goes. Pure: the commands are built
with every word quoted, and ``coordinator.commands.init`` runs them over SSH.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from coordinator.nodes.onboarding import (
    DEFAULT_WORKDIR,
    DiskFree,
    HostFacts,
    OnboardingError,
    ProbeResult,
    PythonFound,
)

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
