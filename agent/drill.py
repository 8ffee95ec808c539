"""What `coord drill` asks of a node: a fault in a rank, its link taken down a while, and the drill's
files removed afterwards.

A drill is a rehearsal on the user's own cluster: coord kills one rank (SIGKILL) and stops
another (SIGSTOP) to time how it finds and recovers from each, then leaves nothing behind. The
faults reach a rank's whole process group, as a crash or a frozen machine would; removal only
ever touches the run's own directories (``.coord/jobs/RUN``, ``checkpoints/RUN``) and the
drill's project directory, all named by patterns a user's own file cannot match by accident.

Taking the node's link down needs root: it runs under ``sudo -n`` (no password asked, so a node
without a rule for it refuses at once, named), in a process of its own that brings the link back
by itself after the time given, whatever becomes of this agent's session meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

from agent import proc_state
from agent.interface_parsers import parse_ifconfig, parse_ip_json_addr
from agent.ranks import _read_int, rank_dir
from shared import protocol as p
from shared.agent_api.ranks import CutLinkReply, RemoveRunReply, SignalRankReply
from shared.rpc import RemoteError

FAULTS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
#: The drill's project directory in a node's workdir: ``coord-drill-`` and the drill's stamp.
DRILL_TREE = re.compile(r"coord-drill-[0-9a-z]{6,32}")
CUT_MAX_S = 600.0
#: The link goes down this long after the answer, so that the answer crosses it first.
CUT_DELAY_S = 1.0


def signal_rank(workdir: str, job: str, attempt: int, rank: int, fault: str) -> SignalRankReply:
    """``fault`` ("kill" or "stop") to the rank's process group, as it is now."""
    sig = FAULTS.get(fault)
    if sig is None:
        raise RemoteError(p.BAD_ARGS, f"fault must be one of {', '.join(FAULTS)}, got {fault!r}")
    directory = rank_dir(workdir, job, attempt, rank)
    pgid = _read_int(os.path.join(directory, "pid"))
    if pgid is None or not proc_state.alive(pgid):
        raise RemoteError(p.NOT_FOUND, f"rank {rank} of {job} attempt {attempt} is not running here")
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        raise RemoteError(p.NOT_FOUND, f"rank {rank} of {job} attempt {attempt} ended before the signal") from None
    return {"pid": pgid, "time": time.time()}


def remove_run(workdir: str, job: str, tree: str | None = None) -> RemoveRunReply:
    """The run's files on this node (its rank directories and checkpoints) and the drill's ``tree``."""
    if not os.path.isabs(workdir):
        raise RemoteError(p.BAD_ARGS, f"workdir must be absolute, got {workdir!r}")
    rank_dir(workdir, job, 0, 0)  # the job's name checked as every rank call checks it
    if tree is not None and not DRILL_TREE.fullmatch(tree):
        raise RemoteError(p.BAD_ARGS, f"refused {tree!r}: not a drill's directory")
    targets = [os.path.join(workdir, ".coord", "jobs", job), os.path.join(workdir, "checkpoints", job)]
    if tree is not None:
        targets.append(os.path.join(workdir, tree))
    removed = []
    for target in targets:
        if os.path.islink(target) or not os.path.isdir(target):
            continue
        shutil.rmtree(target)
        removed.append(os.path.relpath(target, workdir))
    # The directories every run shares, once the last run's files went: a node as it was before its first job.
    for shared_dir in (os.path.join(workdir, "checkpoints"), os.path.join(workdir, ".coord", "jobs")):
        with contextlib.suppress(OSError):
            os.rmdir(shared_dir)  # only when empty
    return {"removed": removed}


def _interfaces() -> list[tuple[str, set[str]]]:
    """(interface, its addresses) of this node."""
    if sys.platform == "darwin":
        out = subprocess.run(["ifconfig"], capture_output=True, text=True, timeout=10).stdout
        parsed_mac = parse_ifconfig(out) or []
        return [(i["name"], {a["address"] for a in i["addresses"]}) for i in parsed_mac]
    out = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, timeout=10).stdout
    parsed = parse_ip_json_addr(out) or []
    return [(i["name"], {a["address"] for a in i["addresses"]}) for i in parsed]


def link_commands(interface: str) -> tuple[list[str], list[str], list[str]]:
    """The commands that show, take down and bring up ``interface`` on this platform."""
    if sys.platform == "darwin":
        return ["ifconfig", interface], ["ifconfig", interface, "down"], ["ifconfig", interface, "up"]
    return (["ip", "link", "show", "dev", interface], ["ip", "link", "set", "dev", interface, "down"],
            ["ip", "link", "set", "dev", interface, "up"])


def cut_link(host: str, seconds: float) -> CutLinkReply:
    """Take down, for ``seconds``, the interface that holds ``host`` (this node's address as the cluster
    file gives it), a second after answering; it comes back by itself."""
    if not 1.0 <= seconds <= CUT_MAX_S:
        raise RemoteError(p.BAD_ARGS, f"seconds must be from 1 to {CUT_MAX_S:g}, got {seconds:g}")
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError as exc:
        raise RemoteError(p.NOT_FOUND, f"{host} does not resolve on this node: {exc}") from None
    holding = [name for name, held in _interfaces() if held & addresses]
    if not holding:
        raise RemoteError(p.NOT_FOUND, f"no interface of this node holds {host} ({', '.join(sorted(addresses))}): "
                                       "its link cannot be told")
    interface = holding[0]
    if interface in ("lo", "lo0"):
        raise RemoteError(p.REFUSED, f"{host} is on this node's loopback ({interface}): no link to take down")
    show, down, up = link_commands(interface)
    try:
        check = subprocess.run(["sudo", "-n", *show], capture_output=True, text=True, timeout=10,
                               stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RemoteError(p.REFUSED, f"taking {interface} down needs root, through sudo, which could not run: "
                                     f"{exc}") from None
    if check.returncode != 0:
        why = (check.stderr.strip().splitlines() or [f"exit status {check.returncode}"])[-1]
        raise RemoteError(p.REFUSED, f"taking {interface} down needs root: `sudo -n {shlex.join(show)}` was refused "
                                     f"({why}); allow {down[0]} without a password for this user (a sudoers "
                                     "rule), or drill without --cut-node")
    script = (f"sleep {CUT_DELAY_S:g}; sudo -n {shlex.join(down)}; sleep {seconds:g}; "
              f"until sudo -n {shlex.join(up)}; do sleep 1; done")
    subprocess.Popen(["/bin/sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    return {"interface": interface, "time": time.time() + CUT_DELAY_S, "seconds": seconds}
