"""Before a relaunch, each node's tree compared with the job's source (``--source``) and what a node
lost sent again: a workdir that lost its model or its code would otherwise fail its rank with an
error about the files it lacks ("could not locate the files on the Hub"), which names neither the
node nor the cause. An unchanged tree costs a sync that sends nothing (each node re-checks its files
by size and time, the head's source hash is cached); a node whose tree cannot be restored fails the
launch with that reason."""

from __future__ import annotations

from coordinator.jobs.effects import LaunchError, TreePorts
from coordinator.jobs.run_context import RunContext

SHOWN_PATHS = 3  # the paths an event names, of the files a node was sent again


async def restore_trees(ctx: RunContext, order: list[str]) -> None:
    """Sync the job's source to the attempt's nodes, naming every node that was sent anything; a
    LaunchError when a node's tree could not be restored."""
    spec = ctx.spec
    if not spec.source:
        return  # the job brings no tree of its own: nothing to compare with
    fx: TreePorts = ctx.fx
    started = fx.monotonic()
    report = await fx.sync(spec.source, order, follow_outside_links=spec.follow_outside_links)
    resent = 0
    for name, entry in sorted(report["nodes"].items()):
        if entry["status"] in ("failed", "skipped"):  # skipped: its tree could not even be read
            raise LaunchError(f"{name}'s workdir could not be restored from {spec.source} before the relaunch: "
                              f"{entry.get('detail') or report['detail']}")
        plan = entry.get("plan")
        if entry["status"] != "synced" or plan is None or not (plan["send"] or plan["chmod"] or plan["dirs"]):
            continue
        resent += plan["send"]
        missing = plan["missing"]
        changed = plan["send"] - missing
        said = [f"lost {missing} files" if missing else "", f"had {changed} files changed" if changed else "",
                f"had {plan['chmod']} modes changed" if plan["chmod"] else "",
                f"lacked or changed {plan['dirs']} directories" if plan["dirs"] else ""]
        what = " and ".join(part for part in said if part)
        shown = plan["missing_paths"] or plan["send_paths"] or plan["dir_paths"]
        paths = ", ".join(shown[:SHOWN_PATHS]) + (", ..." if len(shown) > SHOWN_PATHS else "")
        ctx.event("workdir_restored", f"{name}'s workdir {what} ({paths}): sent again from {spec.source} before "
                  "the relaunch", node=name, files=plan["send"], missing=missing, paths=shown[:20])
    if report["status"] != "ok":
        raise LaunchError(f"the job's tree could not be restored on its nodes before the relaunch: {report['detail']}")
    ctx.log.info("trees_checked", seconds=round(fx.monotonic() - started, 3), resent=resent)
