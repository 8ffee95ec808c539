"""Sync: send the project tree to every node, then check they agree (the daemon half of `coord sync` and of a
job's sync)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple

import anyio

from coordinator.nodes.session import UP, NodeSession
from coordinator.readiness.consistency import ConsistencyReport, Manifest, compare_nodes, diff_manifests
from coordinator.readiness.push import (
    SourceReader,
    SyncPlan,
    close_dirs,
    landed_count,
    manifest_from_wire,
    plan_sync,
    sync_node,
)
from coordinator.readiness.relay_sync import RelayResult, relay_files, take_large_files
from coordinator.readiness.source_links import (
    LISTED,
    SourceLinks,
    names_left_out,
    names_not_sent,
    refusal,
    refused_names,
)
from coordinator.readiness.sync_report import (
    HookResult,
    SyncNodeEntry,
    SyncReport,
    SyncSummary,
    SyncVerdict,
    VersusSource,
)
from shared import protocol as p
from shared.agent_api.sync import ScanStatsReport as ScanStats  # what scanning a tree cost (the head's or a node's)
from shared.ignore import DEFAULT_PATTERNS, IgnoreRules, read_ignore_file
from shared.manifest import Contents, HashCache, is_dir, scan_tree, tree_hash
from shared.paths import UnsafePath, resolve_under
from shared.rpc import Emit, RemoteError
from shared.sizes import size_text

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
    if not chosen.exists():
        raise RemoteError(p.NOT_FOUND, f"source directory {chosen} does not exist on the head")
    if not chosen.is_dir():
        raise RemoteError(p.BAD_ARGS, f"source {chosen} is not a directory (the project directory to sync, not a "
                                      "file in it)")
    return chosen


def ignore_patterns(cluster: Cluster, source: Path) -> list[str]:
    patterns = list(DEFAULT_PATTERNS)
    with contextlib.suppress(FileNotFoundError):
        patterns += read_ignore_file((source / ".coordignore").read_text(encoding="utf-8"))
    return patterns + list(cluster.config.sync.ignore)


def run_hook(cluster: Cluster, source: Path) -> HookResult | None:
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
    code: int | None
    try:
        done = subprocess.run(argv, cwd=source, capture_output=True, text=True, timeout=HOOK_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
        code, output = done.returncode, (done.stdout + done.stderr)[-4000:]
    except subprocess.TimeoutExpired:
        code, output = None, f"timed out after {HOOK_TIMEOUT_S} s"
    except OSError as exc:
        code, output = None, str(exc)
    status: Literal["pass", "fail"] = "pass" if code == 0 else "fail"
    return {"status": status, "path": path, "exit_code": code, "output": output,
            "seconds": round(time.monotonic() - started, 3),
            "detail": f"sync hook {path} exited {code}" if code is not None else f"sync hook {path}: {output}"}


#: The source's hash cache, kept in memory between syncs (a re-check is then a stat per file),
#: with a lock: two syncs of one source at once scan it one after the other.
_source_caches: dict[str, tuple[HashCache, threading.Lock]] = {}
#: Manifests of trees seen lately (the source's, and nodes' that differ from it), by tree hash: a node
#: whose tree hash is one of these is known file by file without sending its manifest.
_known_trees: OrderedDict[str, Manifest] = OrderedDict()
KNOWN_TREES = 8
KNOWN_TREES_ENTRIES = 2_000_000  # files, over all manifests kept


def remember_tree(digest: str, manifest: Manifest) -> None:
    _known_trees[digest] = manifest
    _known_trees.move_to_end(digest)
    while len(_known_trees) > 1 and (len(_known_trees) > KNOWN_TREES or
                                     sum(len(m) for m in _known_trees.values()) > KNOWN_TREES_ENTRIES):
        _known_trees.popitem(last=False)


def source_manifest(cluster: Cluster, source: Path, patterns: list[str], follow_outside: bool = False,
                    contents: Contents | None = None) -> tuple[Manifest, ScanStats, SourceLinks]:
    """The source's manifest (its links in it, each decided by ``SourceLinks``), what scanning it cost,
    and the links: those sent as links, those leading outside (followed with ``follow_outside``).
    ``contents``: the bytes of the small files it had to hash (new or changed ones: those a sync sends)."""
    path = _cache_path(cluster, source, follow_outside)
    if path not in _source_caches:
        _source_caches[path] = (HashCache(path), threading.Lock())
    cache, lock = _source_caches[path]
    links = SourceLinks(str(source), follow_outside)
    with lock:
        manifest, stats = scan_tree(str(source), IgnoreRules(patterns), cache=cache, on_link=links, directories=True,
                                    contents=contents)
    return manifest, stats.as_dict(), links


def _cache_path(cluster: Cluster, source: Path, follow_outside: bool) -> str:
    key = hashlib.sha256(str(source).encode()).hexdigest()[:16]
    # A scan that follows outside links has a cache of its own: one that does not would drop the entries of
    # the followed files (a model, say) from a shared one, and the next sync would hash them all again.
    return str(cluster.config.state_dir / "hashcache" / f"{key}{'-followed' if follow_outside else ''}.json")


def forget_source(cluster: Cluster, source: Path) -> None:
    """A source gone for good (coord drill's own): its hash caches, in memory and on disk."""
    for follow_outside in (False, True):
        path = _cache_path(cluster, source, follow_outside)
        _source_caches.pop(path, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class NodeState(NamedTuple):
    """A node's tree as ``sync_state`` answered: its hash, its manifest (when asked for), its scan's stats."""

    tree_hash: str
    manifest: Manifest | None
    stats: ScanStats
    flush_seconds: float  # its flush of what it was sent (0 when nothing was pending)


async def node_state(session: NodeSession, patterns: list[str], known: list[str] | None,
                     listings: list[str] | None = None,
                     scans: dict[str, float | None] | None = None) -> NodeState:
    """A node's tree hash after it flushed what it was sent, and its manifest when ``known`` lacks its hash
    (then its name is added to ``listings``: the nodes whose listing crossed the wire; and the seconds
    its own scan took to ``scans``)."""
    answer = await session.call("sync_state", {"root": session.node.workdir, "patterns": patterns,
                                               "known": known}, timeout=3600)
    stats = answer["stats"]
    if scans is not None:
        scans[session.node.name] = stats.get("seconds")
    files = answer.get("files")
    if files is not None and listings is not None:
        listings.append(session.node.name)
    return NodeState(answer["tree_hash"], manifest_from_wire(files) if files is not None else None, stats,
                     answer.get("flush_seconds", 0.0))


def _same_tree_report(hashes: dict[str, str], threshold: float, what: str) -> ConsistencyReport:
    """compare_nodes' report for nodes that all hold one tree (told by hash, with no manifest walked)."""
    digest = next(iter(hashes.values()))
    return {"what": what, "nodes": len(hashes), "threshold": threshold, "hashes": dict(hashes), "divergent": [],
            "ratio": 1.0, "majority_hash": digest, "status": "pass",
            "detail": f"all {len(hashes)} nodes hold the same {what} ({digest[:12]})"}


async def serve_sync(cluster: Cluster, links: LinkBook, emit: Emit, source: str | None = None, delete: bool = False,
                     dry_run: bool = False, nodes: list[str] | None = None,
                     follow_outside_links: bool = False) -> SyncReport:
    """Send the source to every node, or to ``nodes`` only (a job's own: other jobs' nodes are left as they are).

    The head hashes the source while every node re-checks its tree (a stat per file) and
    answers with its tree hash; a node's manifest crosses the wire only when its hash is not
    a tree the daemon already knows. Nodes are sent what they lack, then each flushes once
    and answers with its tree hash again: equal to the source's, it is proven to match.
    """
    started = time.monotonic()
    source_dir = resolve_source(cluster, source)
    sync = _Sync(cluster, links, emit, source_dir, delete=delete, dry_run=dry_run, nodes=nodes, started=started,
                 follow_outside=follow_outside_links)
    hook = await sync.run_hook()
    if hook is not None and hook["status"] == "fail":
        return sync.hook_failed(hook)
    await sync.scan()
    if sync.refusal is not None:  # names or links no node would take: nothing is sent, a dry run says the same
        return sync.refused()
    await sync.compare()
    await sync.send_and_verify()
    return sync.finish()


class _Sync:
    """One sync's steps and what they found, in the order ``serve_sync`` takes them."""

    def __init__(self, cluster: Cluster, links: LinkBook, emit: Emit, source_dir: Path, *, delete: bool,
                 dry_run: bool, nodes: list[str] | None, started: float, follow_outside: bool = False) -> None:
        self.started = started
        self.follow_outside = follow_outside
        self.source_links = SourceLinks(str(source_dir), follow_outside)
        self.names_not_sent: list[list[str]] = []  # [path (escaped), why], at most LISTED
        self.names_not_sent_count = 0
        self.refusal: str | None = None
        self.cluster, self.links, self.emit = cluster, links, emit
        self.source_dir, self.delete, self.dry_run = source_dir, delete, dry_run
        self.patterns = ignore_patterns(cluster, source_dir)
        self.sessions = {name: session for name, session in cluster.sessions.items() if not nodes or name in nodes}
        self.timing: dict[str, float] = {}
        self.mark = self.started
        self.entries: dict[str, SyncNodeEntry] = {}  # the report's nodes
        self.hook: HookResult | None = None
        self.missing: dict[str, str] = {}  # node -> why it was not (or could not be) synced
        self.states: dict[str, NodeState] = {}  # node -> its first answer
        self.listings: list[str] = []
        self.node_scans: dict[str, float | None] = {}
        self.source_files: Manifest = {}  # files, links and directories
        self.source_dirs = 0
        self.source_hash = ""
        self.source_stats: ScanStats
        self.hashes: dict[str, str] = {}  # node -> its tree hash, last known
        self.remote: dict[str, Manifest] = {}  # node -> its tree, last known
        self.plans: dict[str, SyncPlan] = {}
        self.reader: SourceReader  # once the plans are made: the source read once for every node sent a batch
        self.relay_for: set[str] = set()
        self.planned: dict[str, list[str]] = {}  # node -> every path it was to be sent, relayed ones too
        self.no_space: set[str] = set()  # nodes whose disk was full: their detail says how much is left
        self.relayed: dict[str, RelayResult] = {}
        self.relay_done = anyio.Event()
        self.unlisted: dict[str, tuple[list[str], int]] = {}  # node -> its names that are not UTF-8, and how many
        self.contents = Contents()  # the small files the scan read to hash them: sent as read, not read again

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.timing[name] = round(now - self.mark, 4)
        self.mark = now

    # --- the hook ---------------------------------------------------------------------------

    async def run_hook(self) -> HookResult | None:
        cluster = self.cluster
        hook = await anyio.to_thread.run_sync(run_hook, cluster, self.source_dir) if cluster.config.sync.hook else None
        self.hook = hook
        if hook is not None:
            cluster.record_event("sync.hook", f"sync hook: {hook['detail']}", data={"exit_code": hook["exit_code"]})
        return hook

    def hook_failed(self, hook: HookResult) -> SyncReport:
        return {"source": str(self.source_dir), "dry_run": self.dry_run, "delete": self.delete,
                "nodes": self.entries, "timing": self.timing, "hook": hook, "status": "failed",
                "detail": f"{hook['detail']}; nothing was synced"}

    # --- scanning: the source on the head, each node's tree by its hash ---------------------

    async def scan(self) -> None:
        self.lap("hook")
        await self.emit({"phase": "hash", "node": "head"})
        known = list(_known_trees) or None
        async with anyio.create_task_group() as tasks:  # the head and the nodes scan at once
            for name, session in self.sessions.items():
                tasks.start_soon(self._ask, name, session, known)
            # The head's walk last: each ask has written its request by the time this task runs, so the nodes
            # start at once, not after the daemon's event loop wins the GIL back from the walk's thread.
            tasks.start_soon(self._scan_source)
        # Before anything is sent, and the same for a dry run: every name a node would refuse is left out of
        # the tree to send (and named), every link the sync cannot send as it is refuses the sync.
        refused = refused_names(self.source_files)
        for rel, _ in refused:
            del self.source_files[rel]
        self.names_not_sent, self.names_not_sent_count = names_not_sent(
            refused, self.source_stats.get("unlisted", []), self.source_stats.get("unlisted_count", 0))
        self.refusal = refusal(self.source_links.outside)
        self.source_hash = tree_hash(self.source_files)
        remember_tree(self.source_hash, self.source_files)
        self.source_dirs = sum(1 for entry in self.source_files.values() if is_dir(entry))
        self.lap("scan")

    async def _scan_source(self) -> None:
        self.source_files, self.source_stats, self.source_links = await anyio.to_thread.run_sync(
            source_manifest, self.cluster, self.source_dir, self.patterns, self.follow_outside, self.contents)

    def refused(self) -> SyncReport:
        """The report of a sync that sent nothing: its source has names or links it cannot send."""
        assert self.refusal is not None
        for name in self.sessions:
            self.entries[name] = {"status": "skipped", "detail": self.missing.get(name, "nothing was sent to it")}
        self.cluster.record_event("sync.failed", f"sync refused: {self.refusal}")
        left_out = names_left_out(self.names_not_sent, self.names_not_sent_count)
        return {**self.summary(), "status": "failed",
                "detail": self.refusal if left_out is None else f"{self.refusal}; {left_out}",
                "seconds": round(time.monotonic() - self.started, 3)}

    async def _ask(self, name: str, session: NodeSession, known: list[str] | None) -> None:
        if session.state != UP:
            self.missing[name] = f"node is {session.state}" + (f": {session.view.reason}" if session.view.reason
                                                               else "")
            return
        try:
            self.states[name] = await node_state(session, self.patterns, known, self.listings, self.node_scans)
        except RemoteError as exc:
            self.missing[name] = exc.message
            return
        self._note_unlisted(name, self.states[name].stats)

    # --- comparing: each node's tree against the source's -----------------------------------

    async def compare(self) -> None:
        await self.emit({"phase": "compare"})
        async with anyio.create_task_group() as tasks:
            for name in self.states:
                tasks.start_soon(self._resolve, name)
        self.plans = {name: plan_sync(self.source_files, manifest, delete=self.delete)
                      if self.hashes[name] != self.source_hash else SyncPlan()
                      for name, manifest in self.remote.items()}
        self.lap("compare")
        await self.emit({"phase": "plan", "files_total": sum(len(pl.send) for pl in self.plans.values()),
                         "bytes_total": sum(pl.bytes_to_send for pl in self.plans.values())})
        for name, reason in self.missing.items():
            self.entries[name] = {"status": "skipped", "detail": reason}

    async def _resolve(self, name: str) -> None:
        """A node's tree file by file: known by its hash, else its listing asked for."""
        digest, manifest, _, _ = self.states[name]
        if manifest is None:
            manifest = self.source_files if digest == self.source_hash else _known_trees.get(digest)
        if manifest is None:  # a tree this daemon has not seen: ask for its listing
            try:
                digest, manifest, _, _ = await node_state(self.sessions[name], self.patterns, [], self.listings)
            except RemoteError as exc:
                self.missing[name] = exc.message
                return
            assert manifest is not None  # asked with no known trees, a node always sends its listing
        if digest != self.source_hash:
            remember_tree(digest, manifest)
        self.hashes[name], self.remote[name] = digest, manifest

    # --- sending and verifying --------------------------------------------------------------

    async def send_and_verify(self) -> None:
        self.reader = SourceReader(str(self.source_dir), self.source_files, hashed=self.contents.files)
        # Large files go through the relay (once over the head's uplink, node to node), beside each
        # node's batches of small files; each node is verified once both are done.
        self.planned = {name: list(plan.send) for name, plan in self.plans.items()}
        wanted = {} if self.dry_run else take_large_files(self.source_files, self.plans)
        self.relay_for = {name for nodes in wanted.values() for name in nodes}
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self._relay, wanted)
            for name in self.plans:
                tasks.start_soon(self._send, name)
        self.lap("send_verify")

    async def _relay(self, wanted: dict[str, list[str]]) -> None:
        try:
            self.relayed.update(await relay_files(self.cluster, self.links, str(self.source_dir), self.source_files,
                                                  wanted, progress=self.emit))
        finally:
            self.relay_done.set()

    async def _send(self, name: str) -> None:
        plan = self.plans[name]
        if self.dry_run or (plan.empty and name not in self.relay_for):
            self.entries[name] = {"plan": plan.as_dict(), "status": "planned" if self.dry_run else "unchanged"}
            return
        entry: SyncNodeEntry = {"plan": plan.as_dict(), "status": "synced"}
        self.entries[name] = entry
        session = self.cluster.sessions[name]
        try:
            if not plan.empty:
                entry["result"] = await sync_node(session, str(self.source_dir), self.source_files, plan,
                                                  progress=self.emit, reader=self.reader,
                                                  links=self.source_links.kept, close=False)
        except (RemoteError, BaseExceptionGroup) as exc:
            self._failed(name, entry, _remote_error(exc))
        if name in self.relay_for:
            await self.relay_done.wait()
            await self._relay_fallback(name, session, entry, self.relayed.get(name))
        if entry["status"] != "failed":
            try:  # a directory opened to its owner for the sync gets its own mode back, once all has landed
                await close_dirs(session, plan, self.source_files)
            except RemoteError as exc:
                self._failed(name, entry, exc)
        await self._verify(name, session, entry)
        self._count_landed(name, entry)

    def _failed(self, name: str, entry: SyncNodeEntry, error: RemoteError, first: str = "") -> None:
        entry["status"] = "failed"
        entry["detail"] = error.message + (f" (the relay first: {first})" if first else "")
        if error.code == p.NO_SPACE:
            self.no_space.add(name)

    def _count_landed(self, name: str, entry: SyncNodeEntry) -> None:
        """Count what of the plan is on the node now, by the listing it answered with after its flush:
        a node that failed is credited with what it holds, never with what it was only sent."""
        manifest = self.remote.get(name)
        if manifest is None:
            return
        entry["landed"] = landed_count(self.planned.get(name, []), self.source_files, manifest)
        if name in self.no_space:
            left = entry["landed"]["planned_bytes"] - entry["landed"]["bytes"]
            entry["detail"] = f"{entry.get('detail', '')}; {size_text(left)} of this sync not yet on {name}"

    async def _relay_fallback(self, name: str, session: NodeSession, entry: SyncNodeEntry,
                              result: RelayResult | None) -> None:
        """What the relay could not bring to the node goes over the node's own session; not what the node
        itself could not hold (a full disk fails the same way over SSH, after sending it all again)."""
        if result is None:
            return
        entry["relay"] = result
        if not result["failed"] or entry["status"] == "failed":
            return
        own = result.get("own_failures") or []
        if session.state != UP or own:  # lost during the transfer, or its own disk: nothing to fall back on
            why = next((why for rel, why in result["failed"] if rel in own), result["failed"][0][1])
            entry["status"], entry["detail"] = "failed", why
            if own and why.startswith("no space left"):
                self.no_space.add(name)
            return
        retry = SyncPlan(send=[rel for rel, _ in result["failed"]])
        retry.bytes_to_send = sum(self.source_files[rel][0] for rel in retry.send)
        try:
            entry["fallback"] = await sync_node(session, str(self.source_dir), self.source_files, retry,
                                                progress=self.emit, reader=self.reader, close=False)
        except (RemoteError, BaseExceptionGroup) as exc:
            self._failed(name, entry, _remote_error(exc), first=result["failed"][0][1])

    async def _verify(self, name: str, session: NodeSession, entry: SyncNodeEntry) -> None:
        """Written or half written: the node flushes what it holds, then proves it by its tree hash."""
        verify_started = time.monotonic()
        try:
            digest, manifest, stats, flush_seconds = await node_state(session, self.patterns, [self.source_hash],
                                                                      self.listings)
            entry["verify_seconds"] = round(time.monotonic() - verify_started, 3)
            entry["flush_seconds"], entry["verify_scan_seconds"] = flush_seconds, stats["seconds"]
            self._note_unlisted(name, stats)
        except RemoteError as exc:
            self.remote.pop(name, None)
            self.hashes.pop(name, None)
            self.missing[name] = exc.message
            if entry["status"] == "synced":
                entry["status"], entry["detail"] = "failed", f"not verified: {exc.message}"
            return
        if manifest is None:
            manifest = self.source_files
        else:
            remember_tree(digest, manifest)
        self.hashes[name], self.remote[name] = digest, manifest

    def _note_unlisted(self, name: str, stats: ScanStats) -> None:
        """A node's own names that are not UTF-8: in no manifest (so never a difference), said in its entry."""
        if stats.get("unlisted_count"):
            self.unlisted[name] = (stats["unlisted"], stats["unlisted_count"])
        else:
            self.unlisted.pop(name, None)

    # --- the verdict ------------------------------------------------------------------------

    def consistency(self) -> ConsistencyReport:
        """The nodes compared by the source's paths, as pre-flight compares them: what else a node keeps in
        its workdir (outputs, a directory of its own) is not a divergence."""
        threshold = self.cluster.config.sync.threshold
        if len(self.hashes) >= 2 and len(set(self.hashes.values())) == 1:
            return _same_tree_report(self.hashes, threshold, "code")
        source = self.source_files
        return compare_nodes({name: {rel: entry for rel, entry in manifest.items() if rel in source}
                              for name, manifest in self.remote.items()}, threshold=threshold, what="code")

    def versus_source(self) -> dict[str, VersusSource]:
        """A node matches the source when it holds every source file as is; files only the node
        has are kept without --delete, and reported, not failed."""
        out: dict[str, VersusSource] = {}
        for name, manifest in self.remote.items():
            if self.hashes.get(name) == self.source_hash:
                out[name] = {"matches": True, "differences": []}
                continue
            differences = diff_manifests(self.source_files, manifest)
            missing_or_other = [d for d in differences if d["how"] != "extra"]
            # --delete leaves a directory that holds files the sync ignores (its report names it): not a mismatch.
            extra_files = [d for d in differences if d["how"] == "extra" and not is_dir(manifest[d["path"]])]
            out[name] = {"matches": not missing_or_other and not (self.delete and extra_files),
                         "differences": differences[:20]}
        return out

    def verdict(self, versus: dict[str, VersusSource]) -> tuple[Literal["ok", "failed"], str]:
        failed = [n for n, e in self.entries.items() if e["status"] in ("failed", "skipped")]
        mismatched = [n for n, v in versus.items() if not v["matches"]]
        if failed:
            # Each node with its reason: the summary line alone tells the user what to fix where.
            return "failed", "not synced: " + "; ".join(
                f"{n} ({self.entries[n]['detail']})" if self.entries[n].get("detail") else n for n in sorted(failed))
        if mismatched and not self.dry_run:
            return "failed", f"differs from the source after sync: {', '.join(sorted(mismatched))}"
        return "ok", "dry run: nothing was changed" if self.dry_run else "every node matches the source"

    def summary(self) -> SyncSummary:
        return {
            "source": str(self.source_dir), "dry_run": self.dry_run, "delete": self.delete, "nodes": self.entries,
            "timing": self.timing, "hook": self.hook, "listings_received": self.listings,
            "node_scan_seconds": self.node_scans, "source_files": len(self.source_files) - self.source_dirs,
            "source_dirs": self.source_dirs,
            "source_bytes": sum(entry[0] for entry in self.source_files.values()),
            "source_tree_hash": self.source_hash, "source_scan": self.source_stats,
            "follow_outside_links": self.follow_outside, "links": len(self.source_links.kept),
            "outside_links": self.source_links.outside[:LISTED], "names_not_sent": self.names_not_sent,
            "names_not_sent_count": self.names_not_sent_count}

    def finish(self) -> SyncReport:
        for name, (names, count) in self.unlisted.items():
            if name in self.entries:
                self.entries[name]["unlisted"], self.entries[name]["unlisted_count"] = names, count
        summary = self.summary()
        versus = self.versus_source()
        status, detail = self.verdict(versus)
        left_out = names_left_out(self.names_not_sent, self.names_not_sent_count)
        if left_out is not None:
            detail = f"{detail}; {left_out}"
        verdict: SyncVerdict = {"consistency": self.consistency(), "versus_source": versus, "status": status,
                                 "detail": detail, "seconds": round(time.monotonic() - self.started, 3)}
        report: SyncReport
        if any(entry["status"] in ("synced", "failed") for entry in self.entries.values()):
            report = {**summary, "source_reads": self.reader.reads, **verdict}
        else:
            report = {**summary, **verdict}
        sent = sum(e["landed"]["files"] for e in self.entries.values() if "landed" in e)
        self.cluster.record_event("sync.done" if status == "ok" else "sync.failed",
                                  f"sync {status}: {sent} files sent; {detail}",
                                  data={"seconds": verdict["seconds"], "files_sent": sent})
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
