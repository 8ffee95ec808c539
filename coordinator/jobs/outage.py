"""A node the head lost: gone, or only out of the head's reach? Pure, tested without processes.

The ranks of a job talk to each other, not to the head. When the head's own network blinks (a Mac
head on Wi-Fi, a laptop head that sleeps), every node's session drops at once while every rank
trains on; relaunching then would throw away the steps since the last checkpoint for nothing. So a
lost session is judged before anything is stopped:

- **The head's path** (``HEAD``): the head's own interface or route toward the lost nodes is down, or
  every node on another machine than the head was lost at once. The job keeps running (state
  ``running``, with a note), nothing is relaunched, and once the nodes are reached again the attempt
  is watched as after a daemon restart: what the ranks wrote meanwhile (progress, checkpoints) is
  read. If they are not back within ``--node-timeout``, they are lost. Once the head reaches some of
  them again, the ones still away are judged as below, over the time since (``back_s``): a node that
  went for good while the head was cut off is a node loss then, not a wait to the node timeout.
- **Out of reach, alive** (``ALIVE``): some nodes still answer, the head's path looks fine, and the
  ranks that answer go on stepping (``ALIVE_STEPS`` steps counted from ``SETTLE_S`` after the loss,
  when what they wrote before it has been read: in data-parallel training no step completes without
  every rank, so the lost node's rank is alive). Waited for the same way, within ``--node-timeout``,
  as long as they keep stepping.
- **Gone** (``GONE``): some nodes still answer and the ranks there are stuck (their heartbeats say
  they have gone three steps' time, at least STUCK_MIN_S, without a step: they wait in their next
  collective for the rank that is gone), or nothing is known of the ranks' steps yet (before the
  first step): a node loss, as it always was: every rank stopped, the job resumed from its newest
  valid checkpoint.

While the ranks that answer are neither clearly stepping nor clearly stuck (a script that writes no
heartbeats), the judgement waits at most ``confirm_window`` (SETTLE_S and four steps' time, at least
CONFIRM_MIN_S, at most the node timeout).
"""

from __future__ import annotations

from dataclasses import dataclass

HEAD, ALIVE, GONE, UNSURE = "head", "alive", "gone", "unsure"
ALIVE_STEPS = 2  # steps the answering ranks finish after a loss that prove the lost rank is alive
# Progress read in the first seconds after a loss may have been written before it (a rank's records wait
# up to a heartbeat and a held status request to be read): steps count from this long after the loss.
SETTLE_S = 4.0
CONFIRM_MIN_S = 5.0  # the shortest wait for proof when the ranks say nothing of being stuck
CONFIRM_STEPS = 4.0  # ... or this many steps' time after settling, when steps are slow
STUCK_MIN_S = 2.0  # an answering rank idle this long (and three steps' time) waits for the lost one


@dataclass(frozen=True)
class OutageFacts:
    """What the head knows when some of an attempt's nodes cannot be reached."""

    lost: tuple[str, ...]  # the attempt's nodes it cannot reach now
    reached: tuple[str, ...]  # the attempt's nodes it reaches
    remote_up: int  # nodes of the cluster on other machines than the head that are up now
    remote_nodes: int  # nodes of the cluster on other machines than the head
    head_route: str | None  # why the head's own path toward the lost nodes is down; None: it looks fine
    lost_at_once: bool  # every node lost was lost within a few seconds of the first
    waited_s: float  # since the first of them was lost
    steps_since: int  # steps the job advanced since SETTLE_S after the loss (as the answering ranks report them)
    stuck_s: float | None  # the least idle answering rank's time without progress (its heartbeat), None: unknown
    step_seconds: float | None  # the measured time per step; None before two steps
    first_step_done: bool
    node_timeout: float
    judged: str | None = None  # what this outage was found to be already (HEAD or ALIVE)
    # Since the head reached a node of this outage again, after it was judged HEAD (None: it has not);
    # ``steps_since`` then counts from SETTLE_S after that, and ``stuck_s`` is read from fresh heartbeats.
    back_s: float | None = None
    # Whether a rank on a node that answers has reported steps in this attempt (in a script where only
    # rank 0 reports, its node's absence leaves ``steps_since`` at 0 whether or not the ranks step).
    reached_report_steps: bool = True


@dataclass(frozen=True)
class OutageVerdict:
    cause: str  # HEAD, ALIVE, GONE or UNSURE
    wait: bool  # keep the attempt running and wait (False: the node is lost)
    reason: str


def confirm_window(step_seconds: float | None, node_timeout: float) -> float:
    """How long the answering ranks are watched for proof either way, when they say nothing of being stuck."""
    steps = SETTLE_S + CONFIRM_STEPS * step_seconds if step_seconds else 0.0
    return min(node_timeout, max(CONFIRM_MIN_S, steps))


def judge_outage(facts: OutageFacts) -> OutageVerdict:
    """Whether the attempt waits for its lost nodes, and why (see the module's docstring)."""
    lost = ", ".join(facts.lost)
    head = _head_cut(facts)
    if head is None and facts.judged == HEAD:
        gone = _gone_since_back(facts)
        if gone is not None:
            return OutageVerdict(GONE, False, gone)
        # The head's path is back, and its sessions are still reconnecting (with backoff): the same outage.
        head = f"the head lost its path to {lost}, and its sessions are reconnecting"
    if head is not None:
        if facts.waited_s > facts.node_timeout:
            return OutageVerdict(HEAD, False, f"{head}; not reached again within --node-timeout "
                                 f"{facts.node_timeout:g} s")
        return OutageVerdict(HEAD, True, head)
    others = " while the other nodes answer" if facts.reached else ""
    if not facts.first_step_done or facts.step_seconds is None:
        return OutageVerdict(GONE, False, f"{lost} lost{others} (before the job's steps could show whether its rank "
                             "lives)")
    stuck_after = max(STUCK_MIN_S, 3 * facts.step_seconds)
    if facts.stuck_s is not None and facts.stuck_s >= stuck_after:
        # Checked first, every time: a rank out of reach that was alive may die while the head waits.
        return OutageVerdict(GONE, False, f"{lost} lost, and the ranks that answer have waited {facts.stuck_s:.0f} s "
                             "without a step")
    if facts.steps_since >= ALIVE_STEPS or facts.judged == ALIVE:
        why = (f"the head cannot reach {lost}, but the ranks that answer go on stepping, which they could not "
               "without its rank: it is alive, out of the head's reach")
        if facts.waited_s > facts.node_timeout:
            return OutageVerdict(ALIVE, False, f"{why}; not reached again within --node-timeout "
                                 f"{facts.node_timeout:g} s")
        return OutageVerdict(ALIVE, True, why)
    window = confirm_window(facts.step_seconds, facts.node_timeout)
    if facts.waited_s >= window:
        return OutageVerdict(GONE, False, f"{lost} lost, and the ranks that answer finished {facts.steps_since} "
                             f"steps in the {facts.waited_s:.0f} s since")
    return OutageVerdict(UNSURE, True, f"{lost} lost; watching whether the ranks that answer go on stepping "
                         f"(for up to {window:.0f} s)")


def _gone_since_back(facts: OutageFacts) -> str | None:
    """Once the head reaches some of the outage's nodes again: why the ones still away are gone, or None
    while nothing proves it. Only proof counts here (answering ranks stuck since the head came back, or
    no steps in the window after it): a head whose sessions reconnect one by one, with backoff, must not
    take the slower ones for lost while their ranks train on."""
    if not facts.reached or facts.back_s is None or facts.back_s < SETTLE_S:
        return None
    if not facts.first_step_done or facts.step_seconds is None:
        return None  # nothing shows whether the ranks step: the head's wait holds, to the node timeout
    lost = ", ".join(facts.lost)
    stuck_after = max(STUCK_MIN_S, 3 * facts.step_seconds)
    if facts.stuck_s is not None and facts.stuck_s >= max(stuck_after, facts.back_s):
        return (f"the head reaches {', '.join(facts.reached)} again, but not {lost}, and the ranks that answer "
                f"have waited {facts.stuck_s:.0f} s without a step")
    if facts.steps_since >= ALIVE_STEPS or (facts.stuck_s is not None and facts.stuck_s < stuck_after):
        return None
    window = confirm_window(facts.step_seconds, facts.node_timeout)
    if facts.reached_report_steps and facts.back_s >= window + SETTLE_S:
        return (f"the head reaches {', '.join(facts.reached)} again, but not {lost}, and the ranks that answer "
                f"finished {facts.steps_since} steps in the {facts.back_s:.0f} s since")
    return None


def _head_cut(facts: OutageFacts) -> str | None:
    """Why the head's own path is what was lost, or None when nothing says so."""
    lost = ", ".join(facts.lost)
    if facts.head_route is not None:
        return f"the head lost its path to {lost}: {facts.head_route}"
    if facts.remote_nodes >= 2 and facts.remote_up == 0 and facts.lost_at_once:
        return f"the head lost every node at once ({lost}): its own network is the likelier cause"
    return None
