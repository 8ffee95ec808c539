"""A multi-host test cluster on one Linux machine, built from network namespaces.

Layout (``P`` is a short per-instance prefix such as ``c4170``)::

    P-br   bridge namespace: Linux bridge ``br0`` plus one veth end per host
    P-hd   head namespace:  ``eth0`` = 10.231.K.1   (coordd runs here)
    P-1    node 1:          ``eth0`` = 10.231.K.11  sshd on :22, user/home/venv of node 1
    P-2    node 2:          ``eth0`` = 10.231.K.12  ...

``add_fast_network()`` gives the nodes a second network beside it, ``thunderbolt0`` = 10.232.K.(11+i) on
bridge ``br1`` (the head is not on it), which coord takes for Thunderbolt: the fast network of the
``coord doctor`` tests, with ``eth0`` capped by ``cap_links`` as the slow one.

Each node is a different Unix user with its own home and venv (``/usr/bin/python3`` plus
mlx[cpu] and mlx-lm at the versions of the running interpreter; no coord). Each node runs
the system OpenSSH ``sshd`` with its own host key; the head holds one client key, a plain
``known_hosts`` and an ``ssh_config``.

Everything created is recorded in a state file under ``/run/coord-netns-test`` so a later
run can remove what a crashed run left behind. ``close()`` is idempotent and registered
with ``atexit``.

Needs root, Linux, iproute2 (``ip netns``), ``/usr/sbin/sshd`` and ``uv``.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import importlib.metadata
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests import socket_wait

__all__ = [
    "DEFAULT_NODES",
    "NetnsCluster",
    "NetnsClusterError",
    "NodeSpec",
    "cluster_available",
    "light_nodes",
]

SSHD = "/usr/sbin/sshd"
SYSTEM_PYTHON = "/usr/bin/python3"
STATE_DIR = Path("/run/coord-netns-test")
USER_MARKER = "coord netns test user"  # GECOS of users this module creates
_NS_RE = re.compile(r"^c\d{3}[0-9a-z]-(br|hd|\d+)$")
_B36 = "0123456789abcdefghijklmnopqrstuvwxyz"

_instance_counter = 0
_counter_lock = threading.Lock()


class NetnsClusterError(RuntimeError):
    """Raised when the cluster cannot be built or a helper fails."""


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    name: str
    user: str
    home: str
    venv: str
    #: extra requirement specifiers installed into this node's venv (e.g. "tokenizers")
    extra_packages: tuple[str, ...] = ()
    #: install this mlx version instead of the running interpreter's (mlx-cpu follows)
    mlx_version: str | None = None
    #: install this mlx-lm version instead of the running interpreter's
    mlx_lm_version: str | None = None
    #: a light node: no venv of its own, this Python (shared by every light node) runs its agent and ranks
    shared_python: str | None = None

    @property
    def python(self) -> str:
        return self.shared_python or f"{self.venv}/bin/python"

    @property
    def workdir(self) -> str:
        return f"{self.home}/work"


DEFAULT_NODES: tuple[NodeSpec, ...] = (
    NodeSpec("n1", "coordalice", "/home/coordalice", "/home/coordalice/venv"),
    NodeSpec("n2", "coordbob", "/srv/coordbob", "/srv/coordbob/mlx/env"),
    NodeSpec("n3", "coordcarol", "/var/tmp/coordcarol-home", "/var/tmp/coordcarol-home/py"),
)


def light_nodes(count: int, suffix: str = "") -> tuple[NodeSpec, ...]:
    """``count`` light nodes (``s1`` ... ``sN``): a namespace, an sshd, a user and a workdir each, and the
    system Python shared by all (the agent's dependencies come in its bundle): a scale cluster of a hundred
    nodes in a few GB. Their ranks run programs of the standard library (``--launcher command``)."""
    return tuple(NodeSpec(f"s{i}", f"coords{i}{suffix}", f"/var/tmp/coord-scale/s{i}{suffix}", "",
                          shared_python=SYSTEM_PYTHON) for i in range(1, count + 1))


def cluster_user_suffix() -> str:
    """The suffix of this process's cluster users: COORD_NETNS_USER_SUFFIX (a cluster beside another
    checkout's), and under pytest-xdist the worker's number past the first (each of the two workers
    that run multi-host tests holds a cluster of its own, its own users among them)."""
    suffix = os.environ.get("COORD_NETNS_USER_SUFFIX", "")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit() and int(worker[2:]) > 0:
        suffix += f"w{worker[2:]}"
    return suffix


def cluster_available() -> tuple[bool, str]:
    """Whether this machine can build a NetnsCluster, and why not if it cannot."""
    if not sys.platform.startswith("linux"):
        return False, f"netns cluster needs Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "netns cluster needs root (ip netns, useradd, sshd)"
    if shutil.which("ip") is None:
        return False, "netns cluster needs iproute2 ('ip' not on PATH)"
    if not os.access(SSHD, os.X_OK):
        return False, f"netns cluster needs OpenSSH server ({SSHD} missing; apt install openssh-server)"
    for tool in ("uv", "ssh", "ssh-keygen", "useradd", "userdel", "usermod", "runuser"):
        if shutil.which(tool) is None:
            return False, f"netns cluster needs '{tool}' on PATH"
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return False, f"netns cluster needs {SYSTEM_PYTHON}"
    return True, ""


# --------------------------------------------------------------------------- helpers


def _run(argv: Sequence[str], *, check: bool = True, timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess:
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    proc = subprocess.run(list(argv), timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise NetnsClusterError(
            f"command failed (exit {proc.returncode}): {shlex.join(argv)}\n"
            f"stdout: {(proc.stdout or '').strip()[-2000:]}\nstderr: {(proc.stderr or '').strip()[-2000:]}"
        )
    return proc


def _proc_start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22: starttime


def _pid_alive(pid: int, start_time: str | None) -> bool:
    now = _proc_start_time(pid)
    return now is not None and (start_time is None or now == start_time)


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def _process_tree(pid: int) -> list[int]:
    """pid and all its descendants (parents first)."""
    children = _children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def _kill_pids(pids: Sequence[int], sig: int = signal.SIGKILL) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_gone(pids: Sequence[int], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    pending = list(pids)
    while pending and time.monotonic() < deadline:
        pending = [p for p in pending if Path(f"/proc/{p}").exists() and not _is_zombie(p)]
        if pending:
            time.sleep(0.02)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _ns_list() -> list[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _ns_pids(ns: str) -> list[int]:
    proc = _run(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in proc.stdout.split() if x.isdigit()]


def _delete_ns(ns: str) -> None:
    for _ in range(3):
        pids = _ns_pids(ns)
        if not pids:
            break
        _kill_pids(pids)
        _wait_gone(pids, 2)
    _run(["ip", "netns", "del", ns], check=False)


def _user_exists(user: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(user)
    except KeyError:
        return None


def _kill_user_procs(user: str) -> None:
    for _ in range(20):
        _run(["pkill", "-KILL", "-u", user], check=False)
        if _run(["pgrep", "-u", user], check=False).returncode != 0:
            return
        time.sleep(0.05)


def _remove_user(user: str) -> None:
    if _user_exists(user) is None:
        return
    _kill_user_procs(user)
    _run(["userdel", user], check=False)
    if _user_exists(user) is not None:  # e.g. a process slipped in; try once more
        _kill_user_procs(user)
        _run(["userdel", "-f", user], check=False)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, os.PathLike)):
        return json.dumps(os.fspath(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")


def _pip_find_links() -> list[str]:
    """The directories of wheels this Python's pip is pointed at (``pip config``'s find-links), that exist."""
    found = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    links: list[str] = []
    for line in found.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            links += [link for link in value.strip().strip("'\"").split() if os.path.isdir(link)]
    return list(dict.fromkeys(links))


# --------------------------------------------------------------------------- stale cleanup


def _cleanup_record(record: Mapping[str, Any]) -> None:
    """Undo what a (possibly crashed) cluster recorded. Tolerates anything already gone."""
    for pid, start in record.get("sshd", {}).values():
        if _pid_alive(pid, start):
            _kill_pids(_process_tree(pid))
    for ns in record.get("namespaces", []):
        if ns in _ns_list():
            _delete_ns(ns)
    for user in record.get("users", []):
        entry = _user_exists(user)
        if entry is not None and entry.pw_gecos.split(",")[0] == USER_MARKER:
            _remove_user(user)
    for path in sorted(record.get("paths", []), key=len, reverse=True):
        if os.path.lexists(path):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass
    tmp = record.get("tmpdir")
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


def _live_records() -> tuple[list[dict], list[Path]]:
    """Return (records of live instances, state files of dead instances)."""
    live, dead = [], []
    if not STATE_DIR.is_dir():
        return live, dead
    for f in STATE_DIR.glob("*.json"):
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            dead.append(f)
            continue
        if rec.get("pid") == os.getpid() or _pid_alive(rec.get("pid", -1), rec.get("pid_start")):
            live.append(rec)
        else:
            dead.append(f)
    return live, dead


def cleanup_stale() -> None:
    """Remove what earlier, no longer running clusters left behind."""
    live, dead = _live_records()
    for f in dead:
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            rec = {}
        _cleanup_record(rec)
        f.unlink(missing_ok=True)
    claimed = {ns for rec in live for ns in rec.get("namespaces", [])}
    for ns in _ns_list():
        if _NS_RE.match(ns) and ns not in claimed:
            _delete_ns(ns)


# --------------------------------------------------------------------------- the cluster


class NetnsCluster:
    """A bridge, a head namespace and one namespace + sshd + user + venv per node.

    Use as a context manager, or call ``start()`` and ``close()``.
    """

    def __init__(
        self,
        nodes: Sequence[NodeSpec] = DEFAULT_NODES,
        *,
        extra_packages: Sequence[str] = (),
        mlx_version: str | None = None,
        mlx_lm_version: str | None = None,
        ssh_port: int = 22,
    ) -> None:
        if not nodes:
            raise ValueError("a cluster needs at least one node")
        names = [n.name for n in nodes]
        users = [n.user for n in nodes]
        if len(set(names)) != len(names) or len(set(users)) != len(users):
            raise ValueError("node names and users must be unique")
        if len(nodes) > 200:
            raise ValueError("at most 200 nodes")
        self.nodes: tuple[NodeSpec, ...] = tuple(nodes)
        self._by_name = {n.name: n for n in self.nodes}
        self._extra_packages = tuple(extra_packages)
        self._mlx_version = mlx_version
        self._mlx_lm_version = mlx_lm_version
        self.ssh_port = ssh_port

        global _instance_counter
        with _counter_lock:
            idx = _instance_counter
            _instance_counter += 1
        pid = os.getpid()
        self.prefix = f"c{pid % 1000:03d}{_B36[idx % 36]}"
        self.subnet_k = (pid * 7 + idx * 31) % 250 + 1
        taken = {rec.get("subnet_k") for rec in _live_records()[0]}  # another worker's cluster, running now
        while self.subnet_k in taken:
            self.subnet_k = self.subnet_k % 250 + 1
        self.bridge_ns = f"{self.prefix}-br"
        self.head_ns = f"{self.prefix}-hd"
        self._ns = {n.name: f"{self.prefix}-{i + 1}" for i, n in enumerate(self.nodes)}
        self._veth = {n.name: f"{self.prefix}v{i + 1}" for i, n in enumerate(self.nodes)}
        self._head_veth = f"{self.prefix}vh"
        self._ip = {n.name: f"10.231.{self.subnet_k}.{11 + i}" for i, n in enumerate(self.nodes)}
        self.head_ip = f"10.231.{self.subnet_k}.1"

        self._tmpdir: Path | None = None
        self._sshd: dict[str, subprocess.Popen] = {}
        self._record: dict[str, Any] = {
            "pid": pid,
            "pid_start": _proc_start_time(pid),
            "prefix": self.prefix,
            "subnet_k": self.subnet_k,
            "namespaces": [],
            "users": [],
            "paths": [],
            "tmpdir": None,
            "sshd": {},
        }
        self._state_file = STATE_DIR / f"{self.prefix}-{pid}.json"
        self._lock = threading.RLock()
        self._started = False
        self._closed = False
        self.start_seconds: float | None = None

    # ----------------------------------------------------------------- properties

    @property
    def tmpdir(self) -> Path:
        self._need_started()
        assert self._tmpdir is not None
        return self._tmpdir

    @property
    def client_key(self) -> Path:
        """Private key (ed25519, no passphrase) the head uses to log in to every node."""
        return self.tmpdir / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        """Plain known_hosts with every node's host key, keyed by its IP."""
        return self.tmpdir / "known_hosts"

    @property
    def ssh_config(self) -> Path:
        """OpenSSH client config with a ``Host <name> <ip>`` entry per node."""
        return self.tmpdir / "ssh_config"

    @property
    def empty_ssh_config(self) -> Path:
        return self.tmpdir / "ssh_config.empty"

    def node(self, name: str) -> NodeSpec:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no node named {name!r} (have {sorted(self._by_name)})") from None

    def node_ip(self, node: str) -> str:
        self.node(node)
        return self._ip[node]

    def node_ns(self, node: str) -> str:
        self.node(node)
        return self._ns[node]

    def sshd_log(self, node: str) -> Path:
        return self.tmpdir / node / "sshd.log"

    def empty_workdirs(self) -> None:
        """Empty every node's workdir (the directory stays, its user's): for a test that counts what a
        sync sends to a fresh node, after other tests' projects were synced there."""
        for spec in self.nodes:
            workdir = Path(spec.workdir)
            for child in workdir.iterdir() if workdir.is_dir() else ():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)

    # ----------------------------------------------------------------- lifecycle

    def __enter__(self) -> NetnsCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> NetnsCluster:
        with self._lock:
            if self._started:
                return self
            if self._closed:
                raise NetnsClusterError("a closed NetnsCluster cannot be started again")
            ok, reason = cluster_available()
            if not ok:
                raise NetnsClusterError(reason)
            t0 = time.monotonic()
            self._started = True
        atexit.register(self.close)
        try:
            self._start()  # not under self._lock: worker threads record what they make
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def _start(self) -> None:
        cleanup_stale()
        live, _ = _live_records()
        for rec in live:
            if rec.get("pid") == os.getpid() and rec.get("prefix") == self.prefix:
                continue
            clash = set(rec.get("users", [])) & {n.user for n in self.nodes}
            if clash:
                raise NetnsClusterError(
                    f"users {sorted(clash)} are in use by another live test cluster (pid {rec.get('pid')})"
                )
        for ns in [self.bridge_ns, self.head_ns, *self._ns.values()]:
            if ns in _ns_list():
                _delete_ns(ns)

        self._tmpdir = Path(tempfile.mkdtemp(prefix=f"coord-netns-{self.prefix}-"))
        os.chmod(self._tmpdir, 0o700)
        self._record["tmpdir"] = str(self._tmpdir)
        self._save_record()

        with concurrent.futures.ThreadPoolExecutor(max_workers=len(self.nodes) + 2) as pool:
            # Users first (venvs are chowned to them), then venvs in the background
            # while namespaces, keys and sshds come up.
            for n in self.nodes:
                self._make_user(n)
            versions = self._versions()
            # One after another: copying ~200 MB per venv is CPU-bound in the kernel, and
            # parallel installs were twice as slow as sequential ones on 2 cores.
            venv_futs = [pool.submit(lambda: [self._make_venv(n, versions) for n in self.nodes
                                              if n.shared_python is None])]
            key_futs = [pool.submit(self._keygen, self._tmpdir / "id_ed25519", "coord-netns-head")]
            for n in self.nodes:
                (self._tmpdir / n.name).mkdir(mode=0o700)
                key_futs.append(
                    pool.submit(self._keygen, self._tmpdir / n.name / "ssh_host_ed25519_key", f"host-{n.name}")
                )
            self._make_network()
            for f in key_futs:
                f.result()
            self._write_client_files()
            for n in self.nodes:
                self._install_authorized_key(n)
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
            os.chmod("/run/sshd", 0o755)
            for n in self.nodes:
                self.start_sshd(n.name)
            self._check_network()
            for f in venv_futs:
                f.result()
        for n in self.nodes:
            self._wait_ssh(n.name)

    def close(self) -> None:
        with self._lock:
            if self._closed or not self._started:
                self._closed = True
                return
            self._closed = True
        try:
            atexit.unregister(self.close)
        except Exception:
            pass
        errors: list[str] = []
        for name in list(self._sshd):
            try:
                self.stop_sshd(name)
            except Exception as e:  # noqa: BLE001
                errors.append(f"stop sshd {name}: {e}")
        try:
            _cleanup_record(self._record)
        except Exception as e:  # noqa: BLE001
            errors.append(f"cleanup: {e}")
        try:
            self._state_file.unlink(missing_ok=True)
        except OSError:
            pass
        if errors:
            print(f"NetnsCluster {self.prefix} close: " + "; ".join(errors), file=sys.stderr)

    # ----------------------------------------------------------------- record

    def _save_record(self) -> None:
        STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self._state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._record))
        os.replace(tmp, self._state_file)

    def _add_record(self, key: str, value: Any) -> None:
        with self._lock:
            if value not in self._record[key]:
                self._record[key].append(value)
            self._save_record()

    # ----------------------------------------------------------------- users and venvs

    def _make_dir_chain(self, path: Path, owner: pwd.struct_passwd | None, mode: int) -> None:
        """mkdir -p path; record the directories made; chown them to owner."""
        missing = []
        p = path
        while not p.exists():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            d.mkdir(mode=mode)
            os.chmod(d, mode)
            self._add_record("paths", str(d))
            if owner is not None:
                os.chown(d, owner.pw_uid, owner.pw_gid)

    def _make_user(self, n: NodeSpec) -> None:
        home = Path(n.home)
        entry = _user_exists(n.user)
        if entry is not None:
            if entry.pw_gecos.split(",")[0] != USER_MARKER:
                raise NetnsClusterError(
                    f"user {n.user!r} exists and was not made by this test cluster; refusing to touch it"
                )
            # Left over from a crashed run: reset it.
            self._add_record("users", n.user)
            _kill_user_procs(n.user)
            _run(["usermod", "-d", str(home), "-s", "/bin/bash", n.user])
            if home.exists():
                self._add_record("paths", str(home))
                shutil.rmtree(home)
        else:
            self._add_record("users", n.user)
            if home.exists():
                raise NetnsClusterError(f"home {home} of new user {n.user} already exists; remove it first")
            _run(["useradd", "-M", "-d", str(home), "-s", "/bin/bash", "-c", USER_MARKER, n.user])
        _run(["usermod", "-p", "*", n.user])  # unlocked, no password: key login only
        entry = pwd.getpwnam(n.user)
        self._make_dir_chain(home.parent, None, 0o755)
        self._make_dir_chain(home, entry, 0o700)
        for sub in (".ssh", "work"):
            d = home / sub
            d.mkdir(mode=0o700)
            os.chown(d, entry.pw_uid, entry.pw_gid)

    def _versions(self) -> tuple[str, str]:
        mlx = self._mlx_version or importlib.metadata.version("mlx")
        mlx_lm = self._mlx_lm_version or importlib.metadata.version("mlx-lm")
        return mlx, mlx_lm

    def _make_venv(self, n: NodeSpec, versions: tuple[str, str]) -> None:
        venv = Path(n.venv)
        entry = pwd.getpwnam(n.user)
        inside_home = venv.is_relative_to(n.home)
        if venv.exists():
            raise NetnsClusterError(f"venv path {venv} of node {n.name} already exists")
        self._make_dir_chain(venv.parent, entry if inside_home else None, 0o755)
        if not inside_home:
            self._add_record("paths", str(venv))
        mlx = n.mlx_version or versions[0]
        mlx_lm = n.mlx_lm_version or versions[1]
        packages = [f"mlx[cpu]=={mlx}", f"mlx-lm=={mlx_lm}", *self._extra_packages, *n.extra_packages]
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "UV_PYTHON", "PYTHONPATH")}
        _run(["uv", "venv", "-q", "-p", SYSTEM_PYTHON, str(venv)], env=env)
        py = str(venv / "bin" / "python")
        base = ["uv", "pip", "install", "-q", "-p", py, "--link-mode=copy"]
        # Offline first: fast and deterministic with a warm cache; then the index.
        proc = _run([*base, "--offline", *packages], check=False, env=env, timeout=300)
        if proc.returncode != 0:
            _run([*base, *packages], env=env, timeout=600)
        _run(["chown", "-R", f"{entry.pw_uid}:{entry.pw_gid}", str(venv)])

    def add_torch(self) -> dict[str, dict[str, str]]:
        """A second Python on every node (beside its venv) that has PyTorch (the version this Python has,
        its CPU build) and Accelerate too, made once; returned as ``extra_node_fields`` for
        ``write_cluster_toml`` ({node: {"python": its path}}).

        A second Python, not the node's own: transformers, which mlx-lm imports, imports torch whenever
        it can, which cost every MLX rank of the tests that follow about 2 s of CPU (tests/node_python.py
        says the same of the local tests). The node's venv stays as a Mac user's MLX environment is,
        and the torch Python (outside the node's home) takes in the venv's packages
        (``site.addsitedir``) and torch's.

        torch is installed once into a directory every node user can read, which each torch Python
        takes on its path (a ``.pth`` file): three copies of torch's 750 MB would cost the suite tens of
        seconds. The wheels come from where this Python's pip finds them (its find-links), else from
        PyTorch's CPU index.
        """
        with self._lock:
            if getattr(self, "_torch_pythons", None):
                return {name: {"python": python} for name, python in self._torch_pythons.items()}
            versions = [f"{name}=={importlib.metadata.version(name)}" for name in ("torch", "accelerate")]
            site = Path(tempfile.mkdtemp(prefix=f"coord-netns-{self.prefix}-torch-", dir="/var/tmp"))
            self._add_record("paths", str(site))
            site.chmod(0o755)
            env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "UV_PYTHON", "PYTHONPATH")}
            links = _pip_find_links()
            sources = [arg for link in links for arg in ("--find-links", link)] or [
                "--extra-index-url", "https://download.pytorch.org/whl/cpu", "--index-strategy", "unsafe-best-match"]
            # Compiled to bytecode as pip does on a user's machine: the directory is root's, so no node
            # user could write torch's .pyc files, and every torch import (a torchrun agent, each
            # worker, each relaunch) compiled some thousand modules from source: 9 s where 4 s is a
            # user's cost, on both sides of the bench and in every multi-host torch test.
            _run(["uv", "pip", "install", "-q", "--compile-bytecode", "-p", SYSTEM_PYTHON, "--target", str(site),
                  *sources, *versions], env=env, timeout=900)
            _run(["chmod", "-R", "a+rX", str(site)])
            pythons: dict[str, str] = {}
            for n in self.nodes:
                if n.shared_python is not None:
                    continue
                pythons[n.name] = self._make_torch_python(n, site, env)
            self._torch_pythons = pythons
            return {name: {"python": python} for name, python in pythons.items()}

    def torch_python(self, node: str) -> str:
        """The node's Python with torch (``add_torch`` first)."""
        return self._torch_pythons[node]

    def _make_torch_python(self, n: NodeSpec, site: Path, env: Mapping[str, str]) -> str:
        # Outside the node's home, where `coord init` would find it beside the node's own venv.
        venv = Path(f"{site}-pythons") / n.name
        if not venv.parent.exists():
            venv.parent.mkdir(mode=0o755)
            self._add_record("paths", str(venv.parent))
        entry = pwd.getpwnam(n.user)
        _run(["uv", "venv", "-q", "-p", SYSTEM_PYTHON, str(venv)], env=dict(env))
        own = _run([str(Path(n.venv) / "bin" / "python"), "-c",
                    "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
        python = str(venv / "bin" / "python")
        purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
        pth = Path(purelib) / "coord-test-torch.pth"
        pth.write_text(f"import site; site.addsitedir({own!r})\n{site}\n")
        _run(["chown", "-R", f"{entry.pw_uid}:{entry.pw_gid}", str(venv)])
        return python

    # ----------------------------------------------------------------- network

    def _ip_ns(self, ns: str, *args: str) -> None:
        _run(["ip", "-n", ns, *args])

    def _add_ns(self, ns: str) -> None:
        self._add_record("namespaces", ns)
        _run(["ip", "netns", "add", ns])
        self._ip_ns(ns, "link", "set", "lo", "up")

    def _make_network(self) -> None:
        br = self.bridge_ns
        self._add_ns(br)
        self._ip_ns(br, "link", "add", "br0", "type", "bridge")
        # No STP forwarding delay: ports forward at once.
        self._ip_ns(br, "link", "set", "br0", "type", "bridge", "forward_delay", "0", "stp_state", "0")
        self._ip_ns(br, "link", "set", "br0", "up")
        hosts = [(self.head_ns, self._head_veth, self.head_ip)] + [
            (self._ns[n.name], self._veth[n.name], self._ip[n.name]) for n in self.nodes
        ]
        for ns, veth, ip in hosts:
            self._add_ns(ns)
            self._ip_ns(br, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._ip_ns(br, "link", "set", veth, "master", "br0")
            self._ip_ns(br, "link", "set", veth, "up")
            self._ip_ns(ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            self._ip_ns(ns, "link", "set", "eth0", "up")

    def _check_network(self) -> None:
        """Head reaches every node: ping when iputils is installed, and a TCP connect
        to every node's sshd (one process in the head namespace)."""
        if shutil.which("ping"):
            for n in self.nodes:
                ip = self._ip[n.name]
                for _ in range(10):
                    proc = _run(["ip", "netns", "exec", self.head_ns, "ping", "-c", "1", "-W", "1", ip], check=False)
                    if proc.returncode == 0:
                        break
                    time.sleep(0.1)
                else:
                    raise NetnsClusterError(f"head cannot ping {n.name} ({ip}): {proc.stdout}{proc.stderr}")
        script = (
            "import socket, sys, time\n"
            "bad = []\n"
            "for host in sys.argv[2:]:\n"
            "    for i in range(20):\n"
            "        try:\n"
            "            socket.create_connection((host, int(sys.argv[1])), timeout=2).close(); break\n"
            "        except OSError as e:\n"
            "            err = e; time.sleep(0.1)\n"
            "    else:\n"
            "        bad.append(f'{host}: {err}')\n"
            "sys.exit('; '.join(bad) if bad else 0)\n"
        )
        proc = _run(
            ["ip", "netns", "exec", self.head_ns, SYSTEM_PYTHON, "-c", script, str(self.ssh_port),
             *(self._ip[n.name] for n in self.nodes)],
            check=False,
        )
        if proc.returncode != 0:
            raise NetnsClusterError(f"head cannot reach node sshd: {proc.stderr.strip()}")

    # ----------------------------------------------------------------- ssh

    @staticmethod
    def _keygen(path: Path, comment: str) -> None:
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])

    def _write_client_files(self) -> None:
        tmp = self.tmpdir
        lines = []
        for n in self.nodes:
            pub = (tmp / n.name / "ssh_host_ed25519_key.pub").read_text().split()
            host = self._ip[n.name] if self.ssh_port == 22 else f"[{self._ip[n.name]}]:{self.ssh_port}"
            lines.append(f"{host} {pub[0]} {pub[1]}\n")
        self.known_hosts.write_text("".join(lines))
        cfg = []
        for n in self.nodes:
            cfg.append(
                f"Host {n.name} {self._ip[n.name]}\n"
                f"    HostName {self._ip[n.name]}\n"
                f"    Port {self.ssh_port}\n"
                f"    User {n.user}\n"
                f"    IdentityFile {self.client_key}\n"
                f"    IdentitiesOnly yes\n"
                f"    UserKnownHostsFile {self.known_hosts}\n"
                f"    GlobalKnownHostsFile /dev/null\n"
                f"    StrictHostKeyChecking yes\n"
                f"    BatchMode yes\n"
                f"    ConnectTimeout 10\n"
            )
        self.ssh_config.write_text("\n".join(cfg))
        self.empty_ssh_config.write_text("")

    def _install_authorized_key(self, n: NodeSpec) -> None:
        entry = pwd.getpwnam(n.user)
        ak = Path(n.home) / ".ssh" / "authorized_keys"
        ak.write_text((self.tmpdir / "id_ed25519.pub").read_text())
        os.chmod(ak, 0o600)
        os.chown(ak, entry.pw_uid, entry.pw_gid)

    def _sshd_config(self, n: NodeSpec) -> Path:
        d = self.tmpdir / n.name
        path = d / "sshd_config"
        path.write_text(
            f"ListenAddress {self._ip[n.name]}:{self.ssh_port}\n"
            f"HostKey {d / 'ssh_host_ed25519_key'}\n"
            f"PidFile {d / 'sshd.pid'}\n"
            "UsePAM no\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "PubkeyAuthentication yes\n"
            "PermitRootLogin no\n"
            "AuthorizedKeysFile .ssh/authorized_keys\n"
            f"AllowUsers {n.user}\n"
            "StrictModes yes\n"
            "MaxStartups 100\n"
            "MaxSessions 100\n"
            "LogLevel VERBOSE\n"
            "PrintMotd no\n"
            "X11Forwarding no\n"
            "Subsystem sftp /usr/lib/openssh/sftp-server\n"
            # Every session's processes (agents, ranks) wait for a peer without spinning a shared core:
            # tests/socket_wait.py says why.
            + (f"SetEnv LD_PRELOAD={shim}\n" if (shim := socket_wait.preload()) else "")
        )
        return path

    def start_sshd(self, node: str) -> None:
        """Start (or restart) the node's sshd in its namespace and wait until it listens."""
        n = self.node(node)
        with self._lock:
            old = self._sshd.get(node)
            if old is not None and old.poll() is None:
                return
            cfg = self._sshd_config(n)
            log = self.sshd_log(node)
            with open(log, "ab") as logf:
                proc = subprocess.Popen(
                    ["ip", "netns", "exec", self._ns[node], SSHD, "-D", "-e", "-f", str(cfg)],
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=logf,
                    start_new_session=True,
                )
            self._sshd[node] = proc
            self._record["sshd"][node] = [proc.pid, _proc_start_time(proc.pid)]
            self._save_record()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise NetnsClusterError(
                    f"sshd for {node} exited with {proc.returncode}; log {log}:\n{_tail(log)}"
                )
            if self._listening(node):
                return
            time.sleep(0.02)
        raise NetnsClusterError(f"sshd for {node} did not start listening; log {log}:\n{_tail(log)}")

    def host_key_pub(self, node: str) -> Path:
        """The public half of the host key the node's sshd presents now."""
        self.node(node)
        return self.tmpdir / node / "ssh_host_ed25519_key.pub"

    def change_host_key(self, node: str) -> None:
        """Restart the node's sshd with a new host key, as a reinstalled node has; the old key is kept
        aside for ``restore_host_key`` (the cluster's own known_hosts holds it, for the other tests)."""
        keys = self.tmpdir / node
        self.stop_sshd(node)
        for name in ("ssh_host_ed25519_key", "ssh_host_ed25519_key.pub"):
            os.replace(keys / name, keys / f"{name}.before")
        self._keygen(keys / "ssh_host_ed25519_key", f"host-{node}-reinstalled")
        self.start_sshd(node)

    def restore_host_key(self, node: str) -> None:
        """Put back the host key ``change_host_key`` set aside, and restart the node's sshd with it."""
        keys = self.tmpdir / node
        if not (keys / "ssh_host_ed25519_key.before").exists():
            return
        self.stop_sshd(node)
        for name in ("ssh_host_ed25519_key", "ssh_host_ed25519_key.pub"):
            os.replace(keys / f"{name}.before", keys / name)
        self.start_sshd(node)
        self._wait_ssh(node)

    def _listening(self, node: str) -> bool:
        proc = _run(
            ["ip", "netns", "exec", self._ns[node], "ss", "-Hltn", f"sport = :{self.ssh_port}"], check=False
        )
        return self._ip[node] in proc.stdout

    def stop_sshd(self, node: str, *, kill_sessions: bool = True) -> None:
        """Stop the node's sshd. With kill_sessions (default) its open sessions and
        everything started through them die too, as when the node's sshd goes away."""
        self.node(node)
        with self._lock:
            proc = self._sshd.pop(node, None)
            self._record["sshd"].pop(node, None)
            if self._tmpdir is not None and self._state_file.parent.exists():
                self._save_record()
        if proc is None:
            return
        if proc.poll() is None:
            if kill_sessions:
                pids = _process_tree(proc.pid)
                _kill_pids(pids)
            else:
                proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def _wait_ssh(self, node: str, timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while True:
            proc = self.ssh(node, "true", timeout=10)
            if proc.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise NetnsClusterError(
                    f"ssh to {node} failed (exit {proc.returncode}): {proc.stderr.strip()}\n"
                    f"sshd log {self.sshd_log(node)}:\n{_tail(self.sshd_log(node))}"
                )
            time.sleep(0.1)

    # ----------------------------------------------------------------- helpers for tests

    def _resolve_ns(self, ns_or_node: str) -> str:
        if ns_or_node in self._ns:
            return self._ns[ns_or_node]
        if ns_or_node == "head":
            return self.head_ns
        if ns_or_node == "bridge":
            return self.bridge_ns
        if ns_or_node in (self.head_ns, self.bridge_ns, *self._ns.values()):
            return ns_or_node
        raise KeyError(f"unknown namespace or node {ns_or_node!r}")

    def ns_argv(self, ns_or_node: str, argv: Sequence[str], user: str | None = None) -> list[str]:
        """The argv that runs argv in a namespace ("head", "bridge", a node name or a
        namespace name), optionally as user (via runuser)."""
        ns = self._resolve_ns(ns_or_node)
        prefix = ["ip", "netns", "exec", ns]
        if user is not None:
            prefix += ["runuser", "-u", user, "--"]
        return prefix + [os.fspath(a) for a in argv]

    def exec_in(self, ns_or_node: str, argv: Sequence[str], user: str | None = None, **kw: Any) -> subprocess.CompletedProcess:
        """subprocess.run argv in a namespace; captures text output unless told otherwise."""
        if "stdout" not in kw and "stderr" not in kw:
            kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.ns_argv(ns_or_node, argv, user), **kw)

    def in_node_mounts(self, node: str, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
        """subprocess.run argv as root in the mount namespace of the node's sshd, and so of its agents:
        ``ip netns exec`` gave it one of its own, which a mount made outside after it started does not
        reach (a small disk for a test is mounted from here)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(["nsenter", "-t", str(self._sshd[node].pid), "-m", "--", *argv], **kw)

    def popen_in(self, ns_or_node: str, argv: Sequence[str], user: str | None = None, **kw: Any) -> subprocess.Popen:
        """subprocess.Popen argv in a namespace (for daemons: coordd in "head")."""
        return subprocess.Popen(self.ns_argv(ns_or_node, argv, user), **kw)

    def ssh_argv(self, node: str, command: str | Sequence[str], options: Sequence[str] = ()) -> list[str]:
        """argv (to run inside the head namespace) of ssh to node with the cluster's config."""
        self.node(node)
        cmd = command if isinstance(command, str) else shlex.join(command)
        return ["ssh", "-F", str(self.ssh_config), *options, node, cmd]

    def ssh(
        self,
        node: str,
        command: str | Sequence[str],
        *,
        options: Sequence[str] = (),
        timeout: float = 60,
        **kw: Any,
    ) -> subprocess.CompletedProcess:
        """Run command on node over SSH from the head namespace, as the node's user."""
        return self.exec_in("head", self.ssh_argv(node, command, options), timeout=timeout, **kw)

    def cut_head(self) -> None:
        """Take the head's own interface down, as a head whose Wi-Fi dropped: it reaches no node (its
        route to them goes with it), while the nodes still reach each other."""
        _run(["ip", "-n", self.head_ns, "link", "set", "eth0", "down"])

    def restore_head(self) -> None:
        _run(["ip", "-n", self.head_ns, "link", "set", "eth0", "up"])

    def cut_link(self, node: str) -> None:
        """Take the node's link to the bridge down: it becomes unreachable."""
        self.node(node)
        _run(["ip", "-n", self.bridge_ns, "link", "set", self._veth[node], "down"])

    def restore_link(self, node: str) -> None:
        self.node(node)
        _run(["ip", "-n", self.bridge_ns, "link", "set", self._veth[node], "up"])

    def cap_links(self, rate: str | None = "1gbit", hosts: Sequence[str] | None = None) -> None:
        """Cap every host's link (the head's too) at ``rate`` each way, as a user's LAN or
        Thunderbolt link is: a token bucket on the host's own ``eth0`` (what it sends) and on
        its veth end in the bridge (what it receives). ``rate=None`` takes the caps off."""
        names = list(hosts) if hosts is not None else ["head", *(n.name for n in self.nodes)]
        for name in names:
            ns = self.head_ns if name == "head" else self._ns[self.node(name).name]
            veth = self._head_veth if name == "head" else self._veth[name]
            for where, dev in ((ns, "eth0"), (self.bridge_ns, veth)):
                _run(["tc", "-n", where, "qdisc", "del", "dev", dev, "root"], check=False)
                if rate is not None:
                    # A burst of at least one 10 ms slice of the rate keeps tbf from starving TCP.
                    _run(["tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                          "burst", "2mb", "latency", "50ms"])

    # ----------------------------------------------------------------- a second, fast network

    FAST_INTERFACE = "thunderbolt0"

    def fast_ip(self, node: str) -> str:
        self.node(node)
        return f"10.232.{self.subnet_k}.{11 + [n.name for n in self.nodes].index(node)}"

    def _fast_veth(self, node: str) -> str:
        return f"{self.prefix}f{[n.name for n in self.nodes].index(node) + 1}"

    def add_fast_network(self) -> None:
        """A second network beside ``eth0``, between the nodes only (the head is not on it): bridge ``br1``
        in the bridge namespace, and in each node ``thunderbolt0`` = 10.232.K.(11+i)/24. coord names a Linux
        interface's kind from its name (agent/interface_parsers.py), so it takes this one for a Thunderbolt
        link and prefers it to ``eth0``, as it prefers a Mac's Thunderbolt bridge to its Ethernet. Cap
        ``eth0`` with ``cap_links`` to make it the slow one. ``remove_fast_network`` takes it away."""
        self._need_started()
        br = self.bridge_ns
        self._ip_ns(br, "link", "add", "br1", "type", "bridge")
        self._ip_ns(br, "link", "set", "br1", "type", "bridge", "forward_delay", "0", "stp_state", "0")
        self._ip_ns(br, "link", "set", "br1", "up")
        for n in self.nodes:
            ns, veth = self._ns[n.name], self._fast_veth(n.name)
            self._ip_ns(br, "link", "add", veth, "type", "veth", "peer", "name", self.FAST_INTERFACE, "netns", ns)
            self._ip_ns(br, "link", "set", veth, "master", "br1")
            self._ip_ns(br, "link", "set", veth, "up")
            # No IPv6 on it: its byte counters then move only for IPv4 traffic a test sends over it.
            _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                  f"net.ipv6.conf.{self.FAST_INTERFACE}.disable_ipv6=1"])
            self._ip_ns(ns, "addr", "add", f"{self.fast_ip(n.name)}/24", "dev", self.FAST_INTERFACE)
            self._ip_ns(ns, "link", "set", self.FAST_INTERFACE, "up")

    def remove_fast_network(self) -> None:
        for n in self.nodes:
            _run(["ip", "-n", self.bridge_ns, "link", "del", self._fast_veth(n.name)], check=False)
        _run(["ip", "-n", self.bridge_ns, "link", "del", "br1"], check=False)

    def cut_fast_link(self, node: str) -> None:
        """Take the node's fast link down at the bridge, as a pulled cable: its ``thunderbolt0`` loses carrier."""
        _run(["ip", "-n", self.bridge_ns, "link", "set", self._fast_veth(node), "down"])

    def restore_fast_link(self, node: str) -> None:
        _run(["ip", "-n", self.bridge_ns, "link", "set", self._fast_veth(node), "up"])

    def cap_fast_pair(self, a: str, b: str, rate: str | None) -> None:
        """Cap the fast link between two nodes only, each way: at each end, what ``thunderbolt0`` sends to
        the other's fast address goes through an htb class at ``rate``; everything else through one at
        10 Gbit/s. ``rate=None`` takes this end's caps off (every pair's, at both nodes)."""
        for here, there in ((a, b), (b, a)):
            ns, dev = self._ns[here], self.FAST_INTERFACE
            if rate is None:
                _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
                continue
            shown = _run(["tc", "-n", ns, "qdisc", "show", "dev", dev]).stdout
            if "htb" not in shown:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"])
                _run(["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
                      "rate", "10gbit"])
            minor = 10 + [n.name for n in self.nodes].index(there)
            known = f"class htb 1:{minor} " in _run(["tc", "-n", ns, "class", "show", "dev", dev]).stdout
            _run(["tc", "-n", ns, "class", "replace", "dev", dev, "parent", "1:", "classid", f"1:{minor}", "htb",
                  "rate", rate, "burst", "256k"])
            if not known:
                _run(["tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio",
                      str(minor), "u32", "match", "ip", "dst", f"{self.fast_ip(there)}/32", "flowid", f"1:{minor}"])

    def write_cluster_toml(
        self,
        path: str | os.PathLike,
        *,
        state_dir: str | os.PathLike,
        socket: str | os.PathLike | None = None,
        extra_node_fields: Mapping[str, Mapping[str, Any]] | None = None,
        nodes: Sequence[str] | None = None,
    ) -> Path:
        """Write a coord cluster file for this cluster.

        extra_node_fields maps a node name (or "*" for every node) to extra keys of its
        [[nodes]] table. nodes limits the file to those node names, in that order.
        """
        extra = dict(extra_node_fields or {})
        unknown = set(extra) - set(self._by_name) - {"*"}
        if unknown:
            raise KeyError(f"extra_node_fields names unknown nodes {sorted(unknown)}")
        out = [
            "[cluster]",
            'name = "netns-test"',
            f"state_dir = {_toml_value(state_dir)}",
        ]
        if socket is not None:
            out.append(f"socket = {_toml_value(socket)}")
        out += [
            "",
            "[ssh]",
            f"known_hosts = {_toml_value(self.known_hosts)}",
            f"identity_file = {_toml_value(self.client_key)}",
            f"config = {_toml_value(self.empty_ssh_config)}",
            "keepalive_s = 1",
        ]
        for name in nodes if nodes is not None else [n.name for n in self.nodes]:
            n = self.node(name)
            fields: dict[str, Any] = {
                "name": n.name,
                "host": self._ip[n.name],
                "user": n.user,
                "port": self.ssh_port,
                "python": n.python,
                "workdir": n.workdir,
            }
            fields.update(extra.get("*", {}))
            fields.update(extra.get(n.name, {}))
            out += ["", "[[nodes]]"] + [f"{k} = {_toml_value(v)}" for k, v in fields.items()]
        p = Path(path)
        p.write_text("\n".join(out) + "\n")
        return p

    # ----------------------------------------------------------------- misc

    def _need_started(self) -> None:
        if self._tmpdir is None:
            raise NetnsClusterError("cluster not started")

    def __repr__(self) -> str:
        return f"NetnsCluster(prefix={self.prefix!r}, nodes={[n.name for n in self.nodes]})"


if __name__ == "__main__":  # manual check: python -m tests.cluster.netns
    with NetnsCluster() as c:
        print(f"started in {c.start_seconds:.2f}s; head ns {c.head_ns}; tmp {c.tmpdir}")
        for n in c.nodes:
            r = c.ssh(n.name, [n.python, "-c", "import mlx.core, getpass; print(getpass.getuser(), mlx.core.__version__)"])
            print(n.name, c.node_ip(n.name), r.returncode, r.stdout.strip(), r.stderr.strip())
