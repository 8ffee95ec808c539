"""The cluster file: parsed, checked, and turned into typed settings.

Every mistake is refused with the file, the line and the key it concerns, so a
user never has to guess which of sixteen ``[[nodes]]`` tables is wrong.
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict
from urllib.parse import urlsplit

from coordinator.config.accounts import Account, shared_account
from coordinator.config.ssh_destination import SshConfigUnreadable, resolve_account, ssh_config_files
from coordinator.config.store_url import StoreUrlError, parse_store_url
from coordinator.config.toml_checks import ConfigError, Locator, Schema, TomlTable, check_table
from coordinator.control.address import MAX_SOCKET_PATH, resolve_under, socket_of

LOCAL_HOST = "local"
NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


@dataclass(frozen=True)
class SshSettings:
    known_hosts: str | None = None  # None: the user's ~/.ssh/known_hosts, as OpenSSH does
    identity_file: str | None = None
    config: str | None = None  # None: ~/.ssh/config when it exists
    keepalive_s: float = 2.0
    connect_timeout_s: float = 10.0
    cluster_file: str | None = None  # the file these came from, named in the fixes coord prints


@dataclass(frozen=True)
class SyncSettings:
    source: Path | None = None  # the project directory on the head; `coord sync --source` overrides
    hook: str | None = None  # a script under the source, run before every sync
    ignore: tuple[str, ...] = ()  # more patterns, on top of .coordignore and the defaults
    threshold: float = 0.95  # agreement ratio below which a launch is blocked
    script: str | None = None  # training script, data and model, relative to each workdir
    data: tuple[str, ...] = ()
    model: str | None = None


@dataclass(frozen=True)
class DashboardSettings:
    """The daemon's HTTP server (/metrics, and the dashboard): loopback by default; any other
    address needs a token, sent as ``Authorization: Bearer TOKEN`` or ``?token=TOKEN``."""

    host: str = "127.0.0.1"
    port: int = 8470
    token: str | None = None
    enabled: bool = True

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"


@dataclass(frozen=True)
class NodeConfig:
    name: str
    host: str
    python: str
    workdir: str
    user: str | None = None
    port: int | None = None
    ips: tuple[str, ...] = ()
    # Per-node overrides of [sync] script/data/model, relative to this node's workdir.
    script: str | None = None
    data: tuple[str, ...] | None = None
    model: str | None = None

    @property
    def is_local(self) -> bool:
        return self.host == LOCAL_HOST

    @property
    def address(self) -> str:
        """user@host[:port], as shown to people."""
        if self.is_local:
            return LOCAL_HOST
        who = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port else ""
        return f"{who}{self.host}{port}"


DEFAULT_DASHBOARD = "127.0.0.1:8470"
#: The longest ssh keepalive interval or connect timeout: an hour (longer only hides a dead node).
MAX_SSH_SECONDS = 3600.0
#: The longest an alert's timer may be: a year (longer is an alert switched off without saying so).
MAX_ALERT_MINUTES = 365 * 24 * 60.0


ALERT_EVENTS = ("job_failed", "job_succeeded", "job_restarted", "job_stalled", "node_down", "diverged", "loss_spike",
                "straggler", "durability_lag")
ALERT_FORMATS = ("generic", "slack", "ntfy")
# A job that gives up is a failed job: job_failed covers it. A run whose training went wrong while its
# processes were fine (a NaN rolled back from, a loss spike) is told by default too: nothing else says it.
# Checkpoints that stopped reaching the store (durability_lag) leave a run one fire from lost: told too.
DEFAULT_ALERT_EVENTS = ("job_failed", "diverged", "loss_spike", "durability_lag")


@dataclass(frozen=True)
class AlertSettings:
    """One [[alerts]] entry: one destination (a webhook or a command) and the events it wants."""

    name: str  # what events and logs call it: the entry's `name`, else alerts[i]
    on: tuple[str, ...] = DEFAULT_ALERT_EVENTS
    webhook: str | None = None  # http(s) URL; may hold a token, so it is never shown in full
    format: str = "generic"  # for a webhook: generic JSON, slack or ntfy
    command: tuple[str, ...] = ()  # argv, run without a shell
    stalled_minutes: float = 30.0  # job_stalled: no progress for this long
    node_down_minutes: float = 5.0  # node_down: down for longer than this
    retries: int = 4  # further tries of a failed delivery, with exponential backoff


class NodeFiles(TypedDict):
    """A node's training script, data files and model, relative to its workdir."""

    script: str | None
    data: list[str]
    model: str | None


@dataclass(frozen=True)
class ClusterConfig:
    name: str
    state_dir: Path
    socket: Path
    ssh: SshSettings
    nodes: tuple[NodeConfig, ...]
    path: Path | None = None
    sync: SyncSettings = SyncSettings()
    dashboard: DashboardSettings = DashboardSettings()
    alerts: tuple[AlertSettings, ...] = ()
    checkpoint_store: str | None = None  # where jobs upload their checkpoints (a job's own --checkpoint-store wins)

    def node_files(self, node: NodeConfig) -> NodeFiles:
        """The training script, data files and model of a node, relative to its workdir."""
        return {"script": node.script if node.script is not None else self.sync.script,
                "data": list(node.data if node.data is not None else self.sync.data),
                "model": node.model if node.model is not None else self.sync.model}


_CLUSTER_KEYS: Schema = {"name": (str, True), "state_dir": (str, False), "socket": (str, False),
                         "checkpoint_store": (str, False)}
_SSH_KEYS: Schema = {
    "known_hosts": (str, False),
    "identity_file": (str, False),
    "config": (str, False),
    "keepalive_s": ((int, float), False),
    "connect_timeout_s": ((int, float), False),
}
_NODE_KEYS: Schema = {
    "name": (str, True),
    "host": (str, True),
    "user": (str, False),
    "port": (int, False),
    "python": (str, False),  # required unless host = "local"
    "workdir": (str, True),
    "ips": (list, False),
    "script": (str, False),
    "data": (list, False),
    "model": (str, False),
}
_SYNC_KEYS: Schema = {
    "source": (str, False),
    "hook": (str, False),
    "ignore": (list, False),
    "threshold": ((int, float), False),
    "script": (str, False),
    "data": (list, False),
    "model": (str, False),
}
_DASHBOARD_KEYS: Schema = {"listen": (str, False), "token": (str, False), "enabled": (bool, False)}
_ALERT_KEYS: Schema = {
    "name": (str, False),
    "on": (list, False),
    "webhook": (str, False),
    "format": (str, False),
    "command": (list, False),
    "stalled_minutes": ((int, float), False),
    "node_down_minutes": ((int, float), False),
    "retries": (int, False),
}
_TOP_KEYS = {"cluster": dict, "ssh": dict, "nodes": list, "sync": dict, "alerts": list, "dashboard": dict}
#: Every table's keys, by table: what a test walks to try every key of the file with hostile values.
SCHEMAS: dict[str, Schema] = {"cluster": _CLUSTER_KEYS, "ssh": _SSH_KEYS, "nodes": _NODE_KEYS, "sync": _SYNC_KEYS,
                              "dashboard": _DASHBOARD_KEYS, "alerts": _ALERT_KEYS}


def load_config(path: str | os.PathLike[str]) -> ClusterConfig:
    """The cluster file read and checked: its form (``parse_config``), then the files and directories
    it names on this machine (``check_local_paths``), then that no two nodes are one account on one
    machine as this machine's ssh config resolves them (``check_distinct_accounts``)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such cluster file (write one from your hosts with: coord init --hosts "
                          f"USER@HOST,... -o {path})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the cluster file: {exc}") from None
    config = parse_config(text, path)
    locate = Locator(text, str(path))
    check_local_paths(config, locate)
    check_distinct_accounts(config, locate)
    return config


def check_distinct_accounts(config: ClusterConfig, locate: Locator,
                            resolve: Callable[[NodeConfig], Account] | None = None) -> None:
    """No two SSH nodes log in as the same user on the same machine (``accounts.py`` says why), each
    node's host, port and user taken through the ssh config as ssh takes them, unless ``resolve``."""
    if sum(not node.is_local for node in config.nodes) < 2:
        return  # nothing to compare: the ssh config is not even read
    files = ssh_config_files(config.ssh.config)
    resolve = resolve or (lambda node: resolve_account(node.host, node.port, node.user, files))
    try:
        accounts = [None if node.is_local else resolve(node) for node in config.nodes]
    except SshConfigUnreadable as exc:
        raise ConfigError(f"{locate.where}: {exc}") from None
    pair = shared_account(accounts)
    if pair is not None:
        first, second = config.nodes[pair[0]], config.nodes[pair[1]]
        line = locate.line_of("nodes", pair[0], "host")
        raise ConfigError(locate.message("nodes", pair[1], "host", (
            f"nodes[{pair[1]}] {second.name!r} ({second.address}) and nodes[{pair[0]}] {first.name!r} "
            f"({f'line {line}: ' if line else ''}{first.address}) both log in as {accounts[pair[0]]}: two nodes "
            "must be two machines, or two users of one machine (several ranks on one machine are one node with "
            "a PyTorch job's --procs-per-node)")))


def check_local_paths(config: ClusterConfig, locate: Locator) -> None:
    """The paths the file names on this machine (the head) are what they must be: the files to read
    exist and are files, the directories are directories, and what coord creates (state directory,
    socket, known_hosts) is not in the way of something else. Paths on other nodes are their agents'
    to check; a local node's Python is this machine's."""
    def refuse(table: str, index: int | None, key: str, shown: str, text: str) -> ConfigError:
        return ConfigError(locate.message(table, index, key, f"{shown}: {text}"))

    wanted: list[tuple[str, int | None, str, str | None, str, bool]] = [
        # (table, index, key, path, what it must be, must it exist)
        ("ssh", None, "identity_file", config.ssh.identity_file, "file", True),
        ("ssh", None, "config", config.ssh.config, "file", True),
        ("ssh", None, "known_hosts", config.ssh.known_hosts, "file", False),
        ("sync", None, "source", str(config.sync.source) if config.sync.source else None, "dir", True),
        ("cluster", None, "state_dir", str(config.state_dir), "dir", False),
        ("cluster", None, "socket", str(config.socket), "socket", False),
    ]
    wanted += [("nodes", i, "python", node.python, "file", True) for i, node in enumerate(config.nodes)
               if node.is_local]
    wanted += [("alerts", i, "command", alert.command[0], "file", True) for i, alert in enumerate(config.alerts)
               if alert.command and "/" in alert.command[0]]
    for table, index, key, value, kind, required in wanted:
        if value is None:
            continue
        shown = f"{table}[{index}].{key}" if index is not None else f"{table}.{key}"
        found = _path_kind(value)
        if found is None and required:
            raise refuse(table, index, key, shown, f"{value}: no such {'directory' if kind == 'dir' else 'file'}")
        if found is not None and found != kind and not (kind == "file" and found == "other"):
            words = {"dir": "a directory", "file": "a file", "socket": "a socket", "other": "a special file"}
            raise refuse(table, index, key, shown, f"{value} is {words.get(found, found)}, not {words[kind]}")


def _path_kind(value: str) -> str | None:
    """"dir", "file", "socket" or "other" for what is at ``value``; None when nothing is (or it cannot
    be looked at: a name too long, a directory not readable; the use of it says why)."""
    import stat

    try:
        mode = os.stat(value).st_mode
    except (OSError, ValueError):
        return None
    return ("dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else
            "socket" if stat.S_ISSOCK(mode) else "other")


def parse_config(text: str, path: Path | None = None) -> ClusterConfig:
    where = str(path) if path else "<cluster file>"
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML: {exc}") from None
    locate = Locator(text, where)
    base = path.resolve().parent if path else Path.cwd()

    for key, value in raw.items():
        kind = _TOP_KEYS.get(key)
        if kind is None:
            raise ConfigError(locate.message(None, None, key, f"unknown key {key!r} (expected one of: "
                                                                 f"{', '.join(_TOP_KEYS)})"))
        if not isinstance(value, kind):
            shape = f"an array of tables ([[{key}]])" if kind is list else f"a table ([{key}])"
            raise ConfigError(locate.message(None, None, key, f"{key!r} must be {shape}"))

    cluster = raw.get("cluster")
    if cluster is None:
        raise ConfigError(f"{where}: missing the [cluster] table (with at least name = \"...\")")
    check_table(cluster, _CLUSTER_KEYS, "cluster", None, locate)
    ssh_raw = raw.get("ssh", {})
    check_table(ssh_raw, _SSH_KEYS, "ssh", None, locate)
    sync = _parse_sync(raw.get("sync", {}), locate, base)
    dashboard = _parse_dashboard(raw.get("dashboard", {}), locate)

    nodes_raw = raw.get("nodes", [])
    if not nodes_raw:
        raise ConfigError(f"{where}: no nodes: add at least one [[nodes]] table")
    nodes = tuple(_parse_node(entry, i, locate, base) for i, entry in enumerate(nodes_raw))
    seen: dict[str, int] = {}
    for i, node in enumerate(nodes):
        if node.name in seen:
            raise ConfigError(locate.message("nodes", i, "name", f"duplicate node name {node.name!r} "
                                                                 f"(first used by nodes[{seen[node.name]}])"))
        seen[node.name] = i

    state_dir, socket = socket_of(cluster, base)
    if len(str(socket).encode()) > MAX_SOCKET_PATH:
        raise ConfigError(locate.message("cluster", None, "socket" if "socket" in cluster else "state_dir",
                                         f"control socket path {socket} is longer than {MAX_SOCKET_PATH} bytes, "
                                         "which Unix sockets do not allow; set a shorter cluster.socket"
                                         + ("" if "socket" in cluster else " (or cluster.state_dir, under which "
                                            "it is by default)")))
    ssh = SshSettings(
        known_hosts=str(resolve_under(ssh_raw["known_hosts"], base)) if "known_hosts" in ssh_raw else None,
        identity_file=str(resolve_under(ssh_raw["identity_file"], base)) if "identity_file" in ssh_raw else None,
        config=str(resolve_under(ssh_raw["config"], base)) if "config" in ssh_raw else None,
        keepalive_s=float(ssh_raw.get("keepalive_s", 2.0)),
        connect_timeout_s=float(ssh_raw.get("connect_timeout_s", 10.0)),
        cluster_file=str(path) if path else None,
    )
    for key in ("keepalive_s", "connect_timeout_s"):
        if not 0 < getattr(ssh, key) <= MAX_SSH_SECONDS:
            raise ConfigError(locate.message("ssh", None, key, f"{key} must be greater than 0 and at most "
                                             f"{MAX_SSH_SECONDS:.0f} seconds, got {ssh_raw[key]!r}"))
    alerts = _parse_alerts(raw.get("alerts", []), locate, base)
    store = cluster.get("checkpoint_store")
    if store is not None:
        try:
            store = parse_store_url(store).url
        except StoreUrlError as exc:
            raise ConfigError(locate.message("cluster", None, "checkpoint_store", f"checkpoint_store: {exc}")) from None
    return ClusterConfig(name=cluster["name"], state_dir=state_dir, socket=socket, ssh=ssh, nodes=nodes, path=path,
                         sync=sync, dashboard=dashboard, alerts=alerts, checkpoint_store=store)


def parse_listen(value: str) -> tuple[str | None, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) to (host, port); ``off`` or an empty string to (None, 0).
    Raises ValueError with what is wrong."""
    value = value.strip()
    if value.lower() in ("", "off", "none", "false"):
        return None, 0
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"listen = {value!r} is not HOST:PORT (e.g. \"{DEFAULT_DASHBOARD}\", or \"off\")")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"listen = {value!r}: the port must be a number from 0 to 65535")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            raise ValueError(f"listen = {value!r}: the host must be an IP address of this machine "
                             "(127.0.0.1 for this machine only) or localhost") from None
    return host, int(port)


def is_loopback(host: str) -> bool:
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


def _parse_dashboard(raw: TomlTable, locate: Locator) -> DashboardSettings:
    check_table(raw, _DASHBOARD_KEYS, "dashboard", None, locate)
    try:
        host, port = parse_listen(raw.get("listen", DEFAULT_DASHBOARD))
    except ValueError as exc:
        raise ConfigError(locate.message("dashboard", None, "listen", str(exc))) from None
    token = raw.get("token")
    if token is not None and (len(token) < 16 or any(c.isspace() for c in token)):
        raise ConfigError(locate.message("dashboard", None, "token", "token must be at least 16 characters without "
                                         "spaces (e.g. the output of: openssl rand -hex 16)"))
    if host is not None and not is_loopback(host) and token is None:
        raise ConfigError(locate.message("dashboard", None, "listen",
                                         f"the dashboard on {host}, which other machines can reach, needs a token: "
                                         "add token = \"...\" (e.g. from: openssl rand -hex 16) to [dashboard], "
                                         "or listen on 127.0.0.1"))
    if host is None or not raw.get("enabled", True):  # listen = "off", or enabled = false
        return DashboardSettings(enabled=False)
    return DashboardSettings(host=host, port=port, token=token)


def _relative_paths(values: Sequence[str], table: str, index: int | None, key: str,
                    locate: Locator) -> tuple[str, ...]:
    from shared.paths import UnsafePath, check_relative

    out = []
    for value in values:
        try:
            out.append(check_relative(value))
        except UnsafePath as exc:
            raise ConfigError(locate.message(table, index, key,
                                             f"{key}: {exc} (paths are relative to the workdir)")) from None
    return tuple(out)


def _parse_sync(raw: TomlTable, locate: Locator, base: Path) -> SyncSettings:
    check_table(raw, _SYNC_KEYS, "sync", None, locate)
    threshold = float(raw.get("threshold", 0.95))
    if not 0 < threshold <= 1:
        raise ConfigError(locate.message("sync", None, "threshold", "threshold must be in (0, 1]"))
    for key in ("ignore", "data"):
        if not all(isinstance(v, str) and v for v in raw.get(key, [])):
            raise ConfigError(locate.message("sync", None, key, f"sync.{key} must be a list of strings"))
    single = {key: _relative_paths([raw[key]], "sync", None, key, locate)[0] for key in ("hook", "script", "model")
              if key in raw}
    return SyncSettings(
        source=resolve_under(raw["source"], base) if "source" in raw else None,
        ignore=tuple(raw.get("ignore", [])),
        threshold=threshold,
        data=_relative_paths(raw.get("data", []), "sync", None, "data", locate),
        **single,
    )


def _parse_node(entry: Any, index: int, locate: Locator, base: Path) -> NodeConfig:
    if not isinstance(entry, dict):
        raise ConfigError(locate.message("nodes", index, None, "each node must be a [[nodes]] table"))
    check_table(entry, _NODE_KEYS, "nodes", index, locate)
    name = entry["name"]
    if not NODE_NAME.match(name):
        raise ConfigError(locate.message("nodes", index, "name",
                                         f"node name {name!r} must be letters, digits, '.', '_' or '-' (at most 63)"))
    host = entry["host"].strip()
    if not host or any(c.isspace() for c in host) or host.startswith("-"):
        raise ConfigError(locate.message("nodes", index, "host",
                                         f"host {entry['host']!r} is not an address or ssh alias"))
    port = entry.get("port")
    if port is not None and not 0 < port < 65536:
        raise ConfigError(locate.message("nodes", index, "port", f"port {port} is not between 1 and 65535"))
    user = entry.get("user")
    if user is not None and not re.match(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$", user):
        raise ConfigError(locate.message("nodes", index, "user", f"user {user!r} is not a valid user name"))
    python = entry.get("python")
    if python is None:
        if host != LOCAL_HOST:
            raise ConfigError(locate.message("nodes", index, None,
                                             f"node {name!r} is missing the key 'python' (the node's training Python, "
                                             "e.g. \"/Users/alice/venv/bin/python\")"))
        python = sys.executable
    for key, value in (("python", python), ("workdir", entry["workdir"])):
        if not value.startswith("/"):
            raise ConfigError(locate.message("nodes", index, key,
                                             f"{key} must be an absolute path on the node, got {value!r}"))
    ips = entry.get("ips", [])
    if not all(isinstance(ip, str) and ip for ip in ips):
        raise ConfigError(locate.message("nodes", index, "ips", "ips must be a list of address strings"))
    if not all(isinstance(v, str) and v for v in entry.get("data", [])):
        raise ConfigError(locate.message("nodes", index, "data", "data must be a list of paths"))
    files = {key: _relative_paths([entry[key]], "nodes", index, key, locate)[0] for key in ("script", "model")
             if key in entry}
    data = _relative_paths(entry["data"], "nodes", index, "data", locate) if "data" in entry else None
    return NodeConfig(name=name, host=host, python=python, workdir=entry["workdir"].rstrip("/") or "/",
                      user=user, port=port, ips=tuple(ips), data=data, **files)


def redact_url(url: str) -> str:
    """A webhook URL as events and logs show it: scheme and host only, since the path, the query
    or the user part usually is the secret (a Slack hook's path, an ntfy topic, ?token=...)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<an unreadable URL>"
    tail = "/…" if (parts.path not in ("", "/") or parts.query or parts.username) else ""
    return f"{parts.scheme}://{host}{port}{tail}"


def _parse_alerts(entries: list[Any], locate: Locator, base: Path) -> tuple[AlertSettings, ...]:
    alerts = tuple(_parse_alert(entry, i, locate, base) for i, entry in enumerate(entries))
    seen: dict[str, int] = {}
    for i, alert in enumerate(alerts):
        if alert.name in seen:
            raise ConfigError(locate.message("alerts", i, "name", f"duplicate alert name {alert.name!r} (first used "
                                             f"by alerts[{seen[alert.name]}]); give each [[alerts]] its own name"))
        seen[alert.name] = i
    return alerts


_Refuse = Callable[[str | None, str], ConfigError]  # (key, what is wrong) -> the error naming its line


def _parse_alert(entry: Any, index: int, locate: Locator, base: Path) -> AlertSettings:
    label = f"alerts[{index}]"

    def refuse(key: str | None, text: str) -> ConfigError:
        return ConfigError(locate.message("alerts", index, key, f"{label}: {text}"))

    if not isinstance(entry, dict):
        raise ConfigError(locate.message("alerts", index, None, "each alert must be an [[alerts]] table"))
    check_table(entry, _ALERT_KEYS, "alerts", index, locate)
    name = entry.get("name", label)
    if "name" in entry and not NODE_NAME.match(name):
        raise refuse("name", f"name {name!r} must be letters, digits, '.', '_' or '-' (at most 63)")
    webhook, fmt, command = _alert_destination(entry, refuse, base)
    on = _alert_events(entry, refuse)
    minutes = _alert_minutes(entry, on, refuse)
    retries = entry.get("retries", 4)
    if not 0 <= retries <= 20:
        raise refuse("retries", f"retries must be between 0 and 20, got {retries}")
    return AlertSettings(name=name, on=tuple(on), webhook=webhook, format=fmt, command=tuple(command),
                         retries=retries, **minutes)


def _alert_destination(entry: TomlTable, refuse: _Refuse, base: Path) -> tuple[str | None, str, list[str]]:
    """An [[alerts]] entry's one destination: (webhook, its format, command)."""
    if ("webhook" in entry) == ("command" in entry):
        raise refuse(None, "give exactly one destination: webhook = \"https://...\" or command = "
                           "[\"/path/to/program\", \"arg\", ...]")
    webhook = entry.get("webhook")
    if webhook is not None and not _valid_webhook(webhook):
        raise refuse("webhook", f"webhook must be an http:// or https:// URL with a host, got "
                                f"{redact_url(webhook)!r}")
    fmt = entry.get("format", "generic")
    if fmt not in ALERT_FORMATS:
        raise refuse("format", f"format must be one of {', '.join(ALERT_FORMATS)}, got {fmt!r}")
    if "format" in entry and webhook is None:
        raise refuse("format", "format applies to a webhook only; a command gets the alert as JSON on its stdin")
    command = entry.get("command", [])
    if webhook is None:
        if not command or not all(isinstance(word, str) and word for word in command):
            raise refuse("command", "command must be a non-empty list of strings, the program and its arguments "
                                    "(it runs without a shell), e.g. [\"/usr/local/bin/notify\", \"--urgent\"]")
        if "/" in command[0]:  # a path, relative to the cluster file like every path in it; else found on PATH
            command = [str(resolve_under(command[0], base)), *command[1:]]
    return webhook, fmt, command


def _valid_webhook(webhook: str) -> bool:
    try:
        parts = urlsplit(webhook)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and not any(c.isspace() for c in webhook)
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        return False
    return valid


def _alert_events(entry: TomlTable, refuse: _Refuse) -> list[str]:
    on = entry.get("on", list(DEFAULT_ALERT_EVENTS))
    if not on or not all(isinstance(kind, str) for kind in on):
        raise refuse("on", f"on must be a non-empty list of event names: {', '.join(ALERT_EVENTS)}")
    unknown = [kind for kind in on if kind not in ALERT_EVENTS]
    if unknown:
        raise refuse("on", f"unknown event {unknown[0]!r} in on (expected any of: {', '.join(ALERT_EVENTS)})")
    if len(set(on)) != len(on):
        raise refuse("on", "on names an event twice")
    return list(on)


def _alert_minutes(entry: TomlTable, on: list[str], refuse: _Refuse) -> dict[str, float]:
    """stalled_minutes and node_down_minutes, each set only with its event in ``on``."""
    minutes = {}
    for key, event, default in (("stalled_minutes", "job_stalled", 30.0), ("node_down_minutes", "node_down", 5.0)):
        if key in entry and event not in on:
            raise refuse(key, f"{key} is set but {event!r} is not in on; add {event!r} to on, or remove {key}")
        minutes[key] = float(entry.get(key, default))
        if not 0 < minutes[key] <= MAX_ALERT_MINUTES:
            raise refuse(key, f"{key} must be greater than 0 and at most {MAX_ALERT_MINUTES:.0f} (a year), "
                              f"got {entry[key]!r}")
    return minutes
