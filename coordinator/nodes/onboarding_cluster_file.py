"""The cluster file `coord init --hosts` writes, with a comment per node saying what was found there."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from coordinator.config.cluster_file import NODE_NAME
from coordinator.nodes.onboarding import NodeReport, OnboardingError, format_bytes, python_path


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
