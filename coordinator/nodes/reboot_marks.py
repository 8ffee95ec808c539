"""Nodes that need a reboot before they take part again, as the cluster keeps them. Pure.

A job's supervisor marks a node (``coordinator/jobs/reboot.py`` says when: a rank that outlived
SIGKILL, wired memory stranded on a Mac); the mark is kept in the store with the node's boot id
at that moment, shown by ``coord status`` and the dashboard with its fix, and cleared when the
node's agent comes back with another boot id.
"""

from __future__ import annotations

from coordinator.store.state import RebootMark


def reboot_fix(node: str) -> str:
    return (f"reboot {node} (on it: sudo shutdown -r now); it takes part again by itself once its agent reconnects "
            "after the reboot")


def new_mark(node: str, reason: str, boot_id: str | None, now: float) -> RebootMark:
    return {"reason": reason, "fix": reboot_fix(node), "boot_id": boot_id, "since": now}


def rebooted(mark: RebootMark, boot_id: str | None) -> bool:
    """Whether a marked node came back from a reboot: its boot id changed. A node that cannot say
    its boot id (now or when it was marked) counts as rebooted when its agent comes back at all:
    coord cannot tell, and a mark that never cleared would keep the node out for good."""
    if mark.get("boot_id") is None or boot_id is None:
        return True
    return boot_id != mark["boot_id"]
