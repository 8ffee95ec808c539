"""When a node needs a reboot before it takes part again. Pure, tested without processes.

A rank that outlives SIGKILL is stuck in the kernel (state D on Linux, U on macOS: a driver call
that never returns, Metal's watchdog having given up on a command buffer) or holds memory no
process can give back; nothing but a reboot frees the machine. So is a Mac whose wired memory
(``vm_stat``'s "Pages wired down") stays far above what it was before the attempt's ranks
started, once they are gone: MLX wires a Metal working set, and memory stranded there is lost
to the next attempt. Such a node leaves the job's placement (the job shrinks with --min-nodes
or waits for it), ``coord status`` and the dashboard say so with the fix, and it rejoins when
its agent reconnects after the reboot (with a new boot id: ``coordinator/nodes/reboot_marks.py``).
"""

from __future__ import annotations

# A process still there this long after SIGKILL is not merely slow to unmap its memory.
SURVIVOR_RECHECK_S = 10.0
# Wired memory above its level before the attempt by more than this, after the ranks are gone.
WIRED_FLOOR_BYTES = 4 << 30
WIRED_SHARE = 0.25  # of the machine's memory
WIRED_SETTLE_S = 5.0  # the kernel gives wired memory back a little after a process exits
WIRED_LOOKS = 3


def survivors(rank: int, left: list[int], states: list[str]) -> str:
    """Why the node needs a reboot: which processes of which rank outlived SIGKILL, each with its state."""
    named = ", ".join(f"{pid} (state {state})" for pid, state in zip(left, states + ["?"] * len(left), strict=False))
    return f"rank {rank}'s processes outlived SIGKILL: {named}"


def wired_stranded(baseline: int | None, now: int | None, total: int | None) -> str | None:
    """Why the node needs a reboot when its wired memory stayed far above its baseline after
    the ranks were gone (None: it did not, or it is not known)."""
    if baseline is None or now is None:
        return None
    allowed = max(WIRED_FLOOR_BYTES, int(WIRED_SHARE * total) if total else 0)
    if now - baseline <= allowed:
        return None
    return (f"wired memory stayed at {now / 2**30:.1f} GiB after its ranks were gone, "
            f"{(now - baseline) / 2**30:.1f} GiB above the {baseline / 2**30:.1f} GiB before the attempt")
