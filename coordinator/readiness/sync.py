"""Sync: send the project tree to every node, then check they agree (the daemon half of `coord sync` and of a job's sync)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from coordinator.nodes.session import UP
from coordinator.readiness.consistency import compare_nodes, diff_manifests
from coordinator.readiness.push import SourceReader, SyncPlan, manifest_from_wire, plan_sync, sync_node
from coordinator.readiness.relay_sync import relay_files, take_large_files
from shared import protocol as p
from shared.ignore import DEFAULT_PATTERNS, IgnoreRules, read_ignore_file
from shared.manifest import HashCache, scan_tree, tree_hash
from shared.paths import UnsafePath, resolve_under
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from coordinator.nodes.cluster import Cluster
    from coordinator.relay.links import LinkBook

HOOK_TIMEOUT_S = 600


def resolve_source(cluster: Cluster, source: str | None) -> Path:
    chosen = Path(source) if source else cluster.config.sync.source
    if chosen is None:
        raise RemoteError(p.BAD_ARGS, "no source directory: pass --source DIR or set sync.source in the cluster file")
    if not chosen.is_absolute():
        raise RemoteError(p.BAD_ARGS, f"source must be an absolute path, got {chosen}")
    if not chosen.is_dir():
        raise RemoteError(p.NOT_FOUND, f"source directory {chosen} does not exist on the head")
    return chosen


def ignore_patterns(cluster: Cluster, source: Path) -> list[str]:
    patterns = list(DEFAULT_PATTERNS)
    with contextlib.suppress(FileNotFoundError):
        patterns += read_ignore_file((source / ".coordignore").read_text(encoding="utf-8"))
    return patterns + list(cluster.config.sync.ignore)


def run_hook(cluster: Cluster, source: Path) -> dict[str, Any] | None:
    """The user's pre-sync hook: its exit code and output are recorded; missing is a warning."""
    hook = cluster.config.sync.hook
    if not hook:
        return None
    try:
        path = resolve_under(str(source), hook)
    except UnsafePath as exc:
        return {"status": "fail", "path": hook, "detail": str(exc), "exit_code": None, "output": ""}
    if not os.path.isfile(path):
        return {"status": "warn", "path": path, "detail": f"sync hook {path} does not exist; nothing was run",
                "exit_code": None, "output": ""}
    with open(path, "rb") as handle:
        has_shebang = handle.read(2) == b"#!"
    # As a shell would: an executable with a #! line runs itself, anything else runs under sh.
    argv = [path] if has_shebang and os.access(path, os.X_OK) else ["/bin/sh", path]
    started = time.monotonic()
    try:
        done = subprocess.run(argv, cwd=source, capture_output=True, text=True, timeout=HOOK_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
        code, output = done.returncode, (done.stdout + done.stderr)[-4000:]
    except subprocess.TimeoutExpired:
        code, output = None, f"timed out after {HOOK_TIMEOUT_S} s"
    except OSError as exc:
        code, output = None, str(exc)
    status = "pass" if code == 0 else "fail"
    return {"status": status, "path": path, "exit_code": code, "output": output,
            "seconds": round(time.monotonic() - started, 3),
            "detail": f"sync hook {path} exited {code}" if code is not None else f"sync hook {path}: {output}"}


#: The source's hash cache, kept in memory between syncs (a re-check is then a stat per file),
#: with a lock: two syncs of one source at once scan it one after the other.
_source_caches: dict[str, tuple[HashCache, threading.Lock]] = {}
#: Manifests of trees seen lately (the source's, and nodes' that differ from it), by tree hash: a node
#: whose tree hash is one of these is known file by file without sending its manifest.
_known_trees: OrderedDict[str, dict] = OrderedDict()
KNOWN_TREES = 8
KNOWN_TREES_ENTRIES = 2_000_000  # files, over all manifests kept


def remember_tree(digest: str, manifest: dict) -> None:
    _known_trees[digest] = manifest
    _known_trees.move_to_end(digest)
    while len(_known_trees) > 1 and (len(_known_trees) > KNOWN_TREES or
                                     sum(len(m) for m in _known_trees.values()) > KNOWN_TREES_ENTRIES):
        _known_trees.popitem(last=False)


def source_manifest(cluster: Cluster, source: Path, patterns: list[str]) -> tuple[dict, dict]:
    key = hashlib.sha256(str(source).encode()).hexdigest()[:16]
    path = str(cluster.config.state_dir / "hashcache" / f"{key}.json")
    if path not in _source_caches:
        _source_caches[path] = (HashCache(path), threading.Lock())
    cache, lock = _source_caches[path]
    with lock:
        manifest, stats = scan_tree(str(source), IgnoreRules(patterns), cache=cache)
    return manifest, stats.as_dict()


async def node_state(session, patterns: list[str], known: list[str] | None,
                     listings: list[str] | None = None, scans: dict[str, float] | None = None) -> tuple[str, dict | None]:
    """A node's tree hash after it flushed what it was sent, and its manifest when ``known`` lacks its hash
    (then its name is added to ``listings``: the nodes whose listing crossed the wire; and the seconds
    its own scan took to ``scans``)."""
    answer = await session.call("sync_state", {"root": session.node.workdir, "patterns": patterns,
                                               "known": known}, timeout=3600)
    if scans is not None:
        scans[session.node.name] = (answer.get("stats") or {}).get("seconds")
    files = answer.get("files")
    if files is not None and listings is not None:
        listings.append(session.node.name)
    return answer["tree_hash"], (manifest_from_wire(files) if files is not None else None)


def _same_tree_report(hashes: dict[str, str], threshold: float, what: str) -> dict[str, Any]:
    """compare_nodes' report for nodes that all hold one tree (told by hash, with no manifest walked)."""
    digest = next(iter(hashes.values()))
    return {"what": what, "nodes": len(hashes), "threshold": threshold, "hashes": dict(hashes), "divergent": [],
            "ratio": 1.0, "majority_hash": digest, "status": "pass",
            "detail": f"all {len(hashes)} nodes hold the same {what} ({digest[:12]})"}


async def serve_sync(cluster: Cluster, links: LinkBook, emit, source: str | None = None, delete: bool = False,
                     dry_run: bool = False, nodes: list[str] | None = None) -> dict[str, Any]:
    """Send the source to every node, or to ``nodes`` only (a job's own: other jobs' nodes are left as they are).

    The head hashes the source while every node re-checks its tree (a stat per file) and
    answers with its tree hash; a node's manifest crosses the wire only when its hash is not
    a tree the daemon already knows. Nodes are sent what they lack, then each flushes once
    and answers with its tree hash again: equal to the source's, it is proven to match.
    """
    started = time.monotonic()
    timing: dict[str, float] = {}

    def lap(name: str, since: float) -> float:
        now = time.monotonic()
        timing[name] = round(now - since, 4)
        return now

    source_dir = resolve_source(cluster, source)
    patterns = ignore_patterns(cluster, source_dir)
    report: dict[str, Any] = {"source": str(source_dir), "dry_run": dry_run, "delete": delete, "nodes": {},
                              "timing": timing}
    hook = await anyio.to_thread.run_sync(run_hook, cluster, source_dir) if cluster.config.sync.hook else None
    report["hook"] = hook
    if hook is not None:
        cluster.record_event("sync.hook", f"sync hook: {hook['detail']}", data={"exit_code": hook["exit_code"]})
        if hook["status"] == "fail":
            report["status"] = "failed"
            report["detail"] = f"{hook['detail']}; nothing was synced"
            return report
    mark = lap("hook", started)
    await emit({"phase": "hash", "node": "head"})

    sessions = {name: session for name, session in cluster.sessions.items() if not nodes or name in nodes}
    missing: dict[str, str] = {}
    states: dict[str, tuple[str, dict | None]] = {}
    listings: list[str] = []  # one name per node manifest received: none on an unchanged tree
    report["listings_received"] = listings
    report["node_scan_seconds"] = node_scans = {}  # each node's own re-check of its tree, before sending
    known = list(_known_trees) or None
    scanned: dict[str, Any] = {}

    async def scan_source() -> None:
        scanned["files"], scanned["stats"] = await anyio.to_thread.run_sync(source_manifest, cluster, source_dir,
                                                                           patterns)

    async def ask(name: str, session) -> None:
        if session.state != UP:
            missing[name] = f"node is {session.state}" + (f": {session.view.reason}" if session.view.reason else "")
            return
        try:
            states[name] = await node_state(session, patterns, known, listings, node_scans)
        except RemoteError as exc:
            missing[name] = exc.message

    async with anyio.create_task_group() as tasks:  # the head and the nodes scan at once
        for name, session in sessions.items():
            tasks.start_soon(ask, name, session)
        # The head's walk last: each ask has written its request by the time this task runs, so the nodes
        # start at once, not after the daemon's event loop wins the GIL back from the walk's thread.
        tasks.start_soon(scan_source)
    source_files, source_stats = scanned["files"], scanned["stats"]
    source_hash = tree_hash(source_files)
    remember_tree(source_hash, source_files)
    report["source_files"] = len(source_files)
    report["source_bytes"] = sum(entry[0] for entry in source_files.values())
    report["source_tree_hash"] = source_hash
    report["source_scan"] = source_stats
    mark = lap("scan", mark)
    await emit({"phase": "compare"})

    hashes: dict[str, str] = {}
    remote: dict[str, dict] = {}

    async def resolve(name: str) -> None:
        digest, manifest = states[name]
        if manifest is None:
            manifest = source_files if digest == source_hash else _known_trees.get(digest)
        if manifest is None:  # a tree this daemon has not seen: ask for its listing
            try:
                digest, manifest = await node_state(sessions[name], patterns, [], listings)
            except RemoteError as exc:
                missing[name] = exc.message
                return
        if digest != source_hash:
            remember_tree(digest, manifest)
        hashes[name], remote[name] = digest, manifest

    async with anyio.create_task_group() as tasks:
        for name in states:
            tasks.start_soon(resolve, name)
    plans = {name: plan_sync(source_files, manifest, delete=delete) if hashes[name] != source_hash else SyncPlan()
             for name, manifest in remote.items()}
    mark = lap("compare", mark)
    await emit({"phase": "plan", "files_total": sum(len(pl.send) for pl in plans.values()),
                "bytes_total": sum(pl.bytes_to_send for pl in plans.values())})
    for name, reason in missing.items():
        report["nodes"][name] = {"status": "skipped", "detail": reason}

    reader = SourceReader(str(source_dir), source_files)
    # Large files go through the relay (once over the head's uplink, node to node), beside each
    # node's batches of small files; each node is verified once both are done.
    wanted = {} if dry_run else take_large_files(source_files, plans)
    relay_for = {name for nodes in wanted.values() for name in nodes}
    relayed: dict[str, dict[str, Any]] = {}
    relay_done = anyio.Event()

    async def relay() -> None:
        try:
            relayed.update(await relay_files(cluster, links, str(source_dir), source_files, wanted, progress=emit))
        finally:
            relay_done.set()

    async def one(name: str) -> None:
        plan = plans[name]
        entry = {"plan": plan.as_dict()}
        report["nodes"][name] = entry
        if dry_run or (plan.empty and name not in relay_for):
            entry["status"] = "planned" if dry_run else "unchanged"
            return
        session = cluster.sessions[name]
        entry["status"] = "synced"
        try:
            if not plan.empty:
                entry["result"] = await sync_node(session, str(source_dir), source_files, plan, progress=emit,
                                                  reader=reader)
        except (RemoteError, BaseExceptionGroup) as exc:
            entry["status"] = "failed"
            entry["detail"] = _remote_error(exc).message
        if name in relay_for:
            await relay_done.wait()
            await relay_fallback(session, entry, relayed.get(name))
        # Written or half written: the node flushes what it holds, then proves it by its tree hash.
        verify_started = time.monotonic()
        try:
            digest, manifest = await node_state(session, patterns, [source_hash], listings)
            entry["verify_seconds"] = round(time.monotonic() - verify_started, 3)
        except RemoteError as exc:
            remote.pop(name, None)
            hashes.pop(name, None)
            missing[name] = exc.message
            if entry["status"] == "synced":
                entry["status"], entry["detail"] = "failed", f"not verified: {exc.message}"
            return
        if manifest is None:
            manifest = source_files
        else:
            remember_tree(digest, manifest)
        hashes[name], remote[name] = digest, manifest

    async def relay_fallback(session, entry: dict[str, Any], result: dict[str, Any] | None) -> None:
        """What the relay could not bring to the node goes over the node's own session."""
        if result is None:
            return
        entry["relay"] = result
        if not result["failed"] or entry["status"] == "failed":
            return
        if session.state != UP:  # lost during the transfer: nothing to fall back on
            entry["status"], entry["detail"] = "failed", result["failed"][0][1]
            return
        retry = SyncPlan(send=[rel for rel, _ in result["failed"]])
        retry.bytes_to_send = sum(source_files[rel][0] for rel in retry.send)
        try:
            entry["fallback"] = await sync_node(session, str(source_dir), source_files, retry, progress=emit,
                                                reader=reader)
        except (RemoteError, BaseExceptionGroup) as exc:
            entry["status"] = "failed"
            entry["detail"] = f"{_remote_error(exc).message} (the relay first: {result['failed'][0][1]})"

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(relay)
        for name in plans:
            tasks.start_soon(one, name)
    lap("send_verify", mark)
    if any(entry["status"] in ("synced", "failed") for entry in report["nodes"].values()):
        report["source_reads"] = reader.reads

    threshold = cluster.config.sync.threshold
    if len(hashes) >= 2 and len(set(hashes.values())) == 1:
        report["consistency"] = _same_tree_report(hashes, threshold, "code")
    else:
        report["consistency"] = compare_nodes(remote, threshold=threshold, what="code")
    # A node matches the source when it holds every source file as is; files only the node
    # has are kept without --delete, and reported, not failed.
    report["versus_source"] = {}
    for name, manifest in remote.items():
        if hashes.get(name) == source_hash:
            report["versus_source"][name] = {"matches": True, "differences": []}
            continue
        differences = diff_manifests(source_files, manifest)
        missing_or_other = [d for d in differences if d["how"] != "extra"]
        report["versus_source"][name] = {"matches": not missing_or_other if not delete else not differences,
                                         "differences": differences[:20]}
    failed = [n for n, e in report["nodes"].items() if e["status"] in ("failed", "skipped")]
    mismatched = [n for n, v in report["versus_source"].items() if not v["matches"]]
    if failed:
        report["status"] = "failed"
        report["detail"] = f"not synced: {', '.join(sorted(failed))}"
    elif mismatched and not dry_run:
        report["status"] = "failed"
        report["detail"] = f"differs from the source after sync: {', '.join(sorted(mismatched))}"
    else:
        report["status"] = "ok"
        report["detail"] = "dry run: nothing was changed" if dry_run else "every node matches the source"
    report["seconds"] = round(time.monotonic() - started, 3)
    sent = sum(e.get("result", {}).get("files_sent", 0) for e in report["nodes"].values())
    cluster.record_event("sync.done" if report["status"] == "ok" else "sync.failed",
                                f"sync {report['status']}: {sent} files sent; {report['detail']}",
                                data={"seconds": report["seconds"], "files_sent": sent})
    return report


def _remote_error(exc: BaseException) -> RemoteError:
    """The node's own error out of the task groups a send runs in (a node lost mid-send fails
    every call in flight at once): the first RemoteError, else the exception said in words."""
    while isinstance(exc, BaseExceptionGroup):
        exc = next((e for e in exc.exceptions if isinstance(e, (RemoteError, BaseExceptionGroup))),
                   exc.exceptions[0])
    if isinstance(exc, RemoteError):
        return exc
    raise exc
