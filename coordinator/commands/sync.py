"""`coord sync`: the report on screen (the sync itself is in coordinator.readiness.sync)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for the checker only: the CLI draws the report without the daemon's modules
    from rich.console import Console

    from coordinator.readiness.sync import SyncReport


def render_sync(report: SyncReport, console: Console) -> None:
    from rich.table import Table

    console.print(f"source {report['source']}: {report.get('source_files', 0)} files, "
                  f"{report.get('source_dirs', 0)} directories, {_size(report.get('source_bytes', 0))}")
    hook = report.get("hook")
    if hook:
        console.print(f"hook: {hook['detail']}")
        if hook.get("output") and hook["status"] != "pass":
            console.print(hook["output"], markup=False, highlight=False)
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("NODE", "STATUS", "SENT", "BYTES", "RELAYED", "DIRS", "MODES", "DELETED", "EXTRA KEPT", "TIME"):
        table.add_column(column)
    for name, entry in sorted(report["nodes"].items()):
        # Read defensively, as from any daemon: a skipped node has no plan, an unchanged one no result.
        plan: Mapping[str, Any] = entry.get("plan", {})
        result: Mapping[str, Any] = entry.get("result", {})
        relay: Mapping[str, Any] = entry.get("relay") or {}
        seconds = max(result.get("seconds", 0), relay.get("seconds", 0))
        files, size = _sent(entry, plan, result)
        table.add_row(name, entry["status"], files, size,
                      f"{relay['files']} ({_size(relay['bytes'])})" if relay else "-", str(plan.get("dirs", 0)),
                      str(plan.get("chmod", 0)),
                      str(result.get("deleted", plan.get("delete", 0))), str(plan.get("extra_kept", 0)),
                      f"{seconds:.2f}s" if seconds else "-")
    console.print(table)
    for name, entry in sorted(report["nodes"].items()):
        if entry.get("detail"):
            console.print(f"[red]{name}[/]: {entry['detail']}", soft_wrap=True)
        relayed: Mapping[str, Any] = entry.get("relay") or {}
        for rel, why in relayed.get("failed", []):
            how = "sent over its SSH session instead" if entry.get("fallback") else "not sent"
            console.print(f"{name}: {rel}: the relay could not bring it ({why}); {how}", soft_wrap=True,
                          markup=False)
        sent: Mapping[str, Any] = entry.get("result") or {}
        kept: list[str] = sent.get("dirs_kept", [])
        if kept:
            console.print(f"{name}: directories --delete left in place, they hold files the sync ignores: "
                          f"{', '.join(kept)}", soft_wrap=True, markup=False, highlight=False)
        if entry.get("unlisted_count"):
            console.print(f"{name}: {entry['unlisted_count']} names in its workdir are not UTF-8, so in no listing "
                          f"(never compared, never deleted): {', '.join(entry.get('unlisted', []))}",
                          soft_wrap=True, markup=False, highlight=False)
    _render_source_checks(report, console)
    consistency = report.get("consistency")
    if consistency:
        console.print(f"consistency: {consistency['status']}: {consistency['detail']}", soft_wrap=True,
                      markup=False)
    console.print(f"{report['status']}: {report['detail']}", soft_wrap=True, markup=False)


def _render_source_checks(report: SyncReport, console: Console) -> None:
    """The source's links and names: none is left out without a line saying so."""
    if report.get("links"):
        console.print(f"links inside the source, sent as links: {report['links']}")
    for entry in report.get("outside_links", []):
        verb = "copied by content" if entry["action"] == "followed" else f"REFUSED: {entry['why']}"
        console.print(f"link {entry['path']} -> {entry['target']} (leads to {entry['leads_to']}): {verb}",
                      soft_wrap=True, markup=False, highlight=False)
    for rel, why in report.get("names_not_sent", []):
        console.print(f"name {rel} NOT SENT: {why}", soft_wrap=True, markup=False, highlight=False)
    more = report.get("names_not_sent_count", 0) - len(report.get("names_not_sent", []))
    if more > 0:
        console.print(f"and {more} more names not sent", soft_wrap=True, markup=False)
    scan: Mapping[str, Any] = report.get("source_scan") or {}
    if scan.get("skipped_count"):
        console.print(f"not sent, neither files nor links ({scan['skipped_count']}): "
                      f"{', '.join(scan.get('skipped', []))}", soft_wrap=True, markup=False, highlight=False)


def _sent(entry: Mapping[str, Any], plan: Mapping[str, Any], result: Mapping[str, Any]) -> tuple[str, str]:
    """The SENT and BYTES cells: what landed on the node (of what was planned, when not all of it did);
    the plan for a dry run or an unchanged node; "?" for a node that could not be asked afterwards."""
    landed: Mapping[str, Any] | None = entry.get("landed")
    if landed is not None:
        if landed["files"] == landed["planned_files"]:
            return str(landed["files"]), _size(landed["bytes"])
        return (f"{landed['files']} of {landed['planned_files']}",
                f"{_size(landed['bytes'])} of {_size(landed['planned_bytes'])}")
    if entry["status"] in ("planned", "unchanged", "skipped"):
        return str(plan.get("send", 0)), _size(plan.get("bytes_to_send", 0))
    if result:  # a daemon from before landed was counted
        return str(result.get("files_sent", 0)), _size(result.get("bytes_sent", 0))
    return "?", "?"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
