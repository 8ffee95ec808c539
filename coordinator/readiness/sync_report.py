"""What a sync reports (``serve_sync``'s answer, the `coord sync` report, a job's sync): its parts as typed
dicts, plain data on the wire."""

from __future__ import annotations

from typing import Literal, NotRequired, Required, TypedDict

from coordinator.readiness.consistency import ConsistencyReport, Difference
from coordinator.readiness.push import Landed, SendResult, SyncPlanDict
from coordinator.readiness.relay_sync import RelayResult
from coordinator.readiness.source_links import OutsideLink
from shared.agent_api.sync import ScanStatsReport as ScanStats  # what scanning a tree cost (the head's or a node's)


class HookResult(TypedDict):
    """The pre-sync hook's run (``run_hook``)."""

    status: Literal["pass", "warn", "fail"]
    path: str
    detail: str
    exit_code: int | None  # None: it did not run, or did not finish
    output: str  # the end of its stdout and stderr
    seconds: NotRequired[float]  # when it ran


class SyncNodeEntry(TypedDict, total=False):
    """One node in a sync report."""

    plan: SyncPlanDict  # absent for a node that was skipped
    status: Required[Literal["skipped", "planned", "unchanged", "synced", "failed"]]
    detail: str  # why skipped or failed
    result: SendResult  # what its own session carried (absent when that failed: see landed)
    relay: RelayResult  # what the relay brought it
    fallback: SendResult  # the relay's misses, sent over its session
    landed: Landed  # absent when the node could not be asked afterwards
    verify_seconds: float  # its flush and re-check at the end, as the head waited for them
    flush_seconds: float  # of which the flush (the re-check's scan ran meanwhile; it goes on behind the answer)
    verify_scan_seconds: float
    unlisted: list[str]  # names in its workdir that are not UTF-8 (escaped): in no listing, never deleted
    unlisted_count: int


class VersusSource(TypedDict):
    matches: bool  # holds every source file as is (and nothing else, with --delete)
    differences: list[Difference]  # the first 20


class SyncReport(TypedDict):
    """``serve_sync``'s answer. A failed hook ends a sync before the scan: its report stops at ``hook``
    (then ``status`` and ``detail``)."""

    source: str
    dry_run: bool
    delete: bool
    nodes: dict[str, SyncNodeEntry]
    timing: dict[str, float]  # seconds of each phase: hook, scan, compare, send_verify
    hook: HookResult | None
    listings_received: NotRequired[list[str]]  # one name per node manifest received: none on an unchanged tree
    node_scan_seconds: NotRequired[dict[str, float | None]]  # each node's re-check of its tree, before sending
    source_files: NotRequired[int]  # files and links
    source_dirs: NotRequired[int]
    source_bytes: NotRequired[int]
    source_tree_hash: NotRequired[str]
    source_scan: NotRequired[ScanStats]  # the head's scan of the source
    follow_outside_links: NotRequired[bool]
    links: NotRequired[int]  # links in the source sent as links (they point inside it)
    outside_links: NotRequired[list[OutsideLink]]  # links leading out of it: followed or refused
    names_not_sent: NotRequired[list[list[str]]]  # [path (escaped), why] of each name no node accepts: not sent
    names_not_sent_count: NotRequired[int]
    source_reads: NotRequired[int]  # batches read from the source disk, when anything was sent
    consistency: NotRequired[ConsistencyReport]
    versus_source: NotRequired[dict[str, VersusSource]]
    status: Literal["ok", "failed"]
    detail: str
    seconds: NotRequired[float]


class SyncSummary(TypedDict):
    """What a sync's report opens with: what was asked, and what the scans found."""

    source: str
    dry_run: bool
    delete: bool
    nodes: dict[str, SyncNodeEntry]
    timing: dict[str, float]
    hook: HookResult | None
    listings_received: list[str]
    node_scan_seconds: dict[str, float | None]
    source_files: int
    source_dirs: int
    source_bytes: int
    source_tree_hash: str
    source_scan: ScanStats
    follow_outside_links: bool
    links: int
    outside_links: list[OutsideLink]
    names_not_sent: list[list[str]]
    names_not_sent_count: int


class SyncVerdict(TypedDict):
    """What a sync's report closes with: the evidence, and what it means."""

    consistency: ConsistencyReport
    versus_source: dict[str, VersusSource]
    status: Literal["ok", "failed"]
    detail: str
    seconds: float
