"""The ranges of a job's numbers: what ``coord run``'s options, a job file and a submission over the
control socket may hold (``coordinator.jobs.spec`` checks them, the CLI's parser refuses a value
outside them before anything else runs).

Every `coord` command imports this through the parser, so it imports nothing: start-up time counts.
"""

from __future__ import annotations

#: The longest wait or timeout a job may set: 30 days. Longer is a typo, or a way to switch a safety
#: check off without saying so (a hang timeout of 1e300 s never fires).
MAX_SECONDS = 30 * 24 * 3600.0

#: Whole-number fields: (lowest, highest).
WHOLE: dict[str, tuple[int, int]] = {
    "save_every": (1, 10**9),
    "max_restarts": (0, 10**6),
    "keep": (1, 10**6),
    "min_nodes": (1, 10**4),
    "total_steps": (1, 10**12),
    "priority": (-(10**6), 10**6),
    "procs_per_node": (1, 1024),
    "global_batch": (1, 1 << 30),
    "micro_batch": (1, 1 << 20),
    "max_rollbacks": (0, 10**6),
    "skip_on_rollback": (0, 10**9),
    "store_keep": (1, 10**6),
    "store_keep_every": (1, 10**9),
}

#: Fields in seconds: each greater than 0 and at most MAX_SECONDS.
SECONDS = ("hang_timeout", "node_timeout", "node_wait", "straggler_grace", "durability_lag_alert")
#: What coord does about a straggler: only tell, or drop its node (the elastic shrink).
STRAGGLER_POLICIES = ("tell", "drop")
STORE_FROM = ("nodes", "head")  # who puts a checkpoint into the store (coord run --store-from)

#: How long a job waits for its nodes to be up before it fails (coord run --node-wait).
NODE_WAIT_S = 600.0
