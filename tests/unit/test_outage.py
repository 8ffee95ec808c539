"""A node the head lost: gone, or only out of the head's reach (coordinator/jobs/outage.py), and the
head's own route read from the kernel's answers (coordinator/nodes/head_route.py)."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from coordinator.jobs.outage import ALIVE, GONE, HEAD, UNSURE, OutageFacts, confirm_window, judge_outage
from coordinator.nodes.head_route import linux_route, mac_interface_inactive, mac_route_interface, route_down

BASE = OutageFacts(lost=("n3",), reached=("n1", "n2"), remote_up=2, remote_nodes=3, head_route=None,
                   lost_at_once=True, waited_s=1.0, steps_since=0, stuck_s=None, step_seconds=0.1,
                   first_step_done=True, node_timeout=60.0)


def facts(**changes) -> OutageFacts:
    return dataclasses.replace(BASE, **changes)


def test_the_heads_own_route_down_is_the_heads_path_waited_for_until_the_node_timeout():
    cut = facts(lost=("n1", "n2", "n3"), reached=(), remote_up=0, head_route="the head has no route to 10.0.0.3")
    verdict = judge_outage(cut)
    assert (verdict.cause, verdict.wait) == (HEAD, True) and "no route to 10.0.0.3" in verdict.reason
    late = judge_outage(dataclasses.replace(cut, waited_s=61.0))
    assert (late.cause, late.wait) == (HEAD, False) and "--node-timeout 60 s" in late.reason
    # the route alone says it, whichever nodes were lost
    assert judge_outage(facts(head_route="the head's interface en0 toward 10.0.0.3 is inactive")).cause == HEAD


def test_every_node_on_another_machine_lost_at_once_is_the_heads_path():
    every = facts(lost=("n1", "n2", "n3"), reached=(), remote_up=0)
    assert judge_outage(every).cause == HEAD and "every node at once" in judge_outage(every).reason
    # one by one, minutes apart: each its own loss (nothing else says it is the head)
    assert judge_outage(dataclasses.replace(every, lost_at_once=False)).cause != HEAD
    # a cluster with one node beside the head: losing it says nothing of whose path went
    one = facts(lost=("n1",), reached=(), remote_up=0, remote_nodes=1, first_step_done=False)
    assert judge_outage(one).cause == GONE


def test_a_node_whose_peers_step_on_is_alive_and_one_whose_peers_are_stuck_is_gone():
    alive = judge_outage(facts(steps_since=2, waited_s=5.0))
    assert (alive.cause, alive.wait) == (ALIVE, True) and "it is alive" in alive.reason
    assert not judge_outage(facts(steps_since=5, waited_s=61.0)).wait
    stuck = judge_outage(facts(stuck_s=4.0))  # the ranks that answer wait in their collective
    assert (stuck.cause, stuck.wait) == (GONE, False)
    # stuck wins over steps counted earlier, and over an earlier verdict: a rank alive then may die since
    assert judge_outage(facts(stuck_s=4.0, steps_since=3, judged=ALIVE)).cause == GONE
    assert judge_outage(facts(stuck_s=0.3, judged=ALIVE)).cause == ALIVE  # stepping on: still waited for
    watching = judge_outage(facts(waited_s=1.0, steps_since=1))
    assert (watching.cause, watching.wait) == (UNSURE, True)
    quiet = judge_outage(facts(waited_s=confirm_window(0.1, 60.0) + 0.1, steps_since=1))
    assert (quiet.cause, quiet.wait) == (GONE, False) and "finished 1 steps" in quiet.reason


def test_before_the_first_step_a_partial_loss_is_a_node_loss_at_once():
    verdict = judge_outage(facts(first_step_done=False, step_seconds=None))
    assert (verdict.cause, verdict.wait) == (GONE, False)


def test_the_heads_path_once_judged_holds_while_its_sessions_reconnect():
    back = judge_outage(facts(lost=("n3",), reached=("n1", "n2"), judged=HEAD, waited_s=30.0))
    assert (back.cause, back.wait) == (HEAD, True) and "reconnecting" in back.reason
    assert not judge_outage(facts(judged=HEAD, waited_s=61.0)).wait


def test_once_the_head_is_back_a_node_still_away_whose_peers_are_stuck_is_gone_not_waited_to_the_timeout():
    # Cut off 30 s; n1 and n2 answer again, n3 does not. Their ranks have waited 32 s without a step (since
    # before the head came back): n3 went for good while the head was away.
    back = facts(judged=HEAD, waited_s=30.0, back_s=6.0, stuck_s=32.0)
    verdict = judge_outage(back)
    assert (verdict.cause, verdict.wait) == (GONE, False), verdict
    assert "reaches n1, n2 again, but not n3" in verdict.reason and "32 s without a step" in verdict.reason
    # the first seconds after the reconnect, while what the nodes wrote is read: still the head's wait
    assert judge_outage(dataclasses.replace(back, back_s=2.0)).cause == HEAD
    # a rank that stepped after the head came back (idle less than that since) proves nothing yet
    assert judge_outage(dataclasses.replace(back, stuck_s=3.0)).wait
    # ranks that write no heartbeats: no step in the window after the head came back
    quiet = dataclasses.replace(back, stuck_s=None, steps_since=0, back_s=confirm_window(0.1, 60.0) + 4.1)
    assert judge_outage(quiet).cause == GONE and "finished 0 steps" in judge_outage(quiet).reason
    assert judge_outage(dataclasses.replace(quiet, back_s=5.0)).cause == HEAD  # the window not yet over
    # ... unless no rank that answers has reported a step (a script whose rank 0 alone reports, its node
    # the one still reconnecting): no steps then say nothing, and the head's wait holds
    assert judge_outage(dataclasses.replace(quiet, reached_report_steps=False)).cause == HEAD


def test_once_the_head_is_back_ranks_that_step_keep_the_heads_wait_while_the_slower_sessions_reconnect():
    # Sessions reconnect one by one, with backoff: n1 answers, n2 and n3 not yet; every rank trains on.
    stepping = facts(lost=("n2", "n3"), reached=("n1",), judged=HEAD, waited_s=40.0, back_s=20.0, steps_since=50,
                     stuck_s=0.1)
    verdict = judge_outage(stepping)
    assert (verdict.cause, verdict.wait) == (HEAD, True) and "reconnecting" in verdict.reason
    # before the first step nothing shows whether the ranks live: waited for, to the node timeout
    assert judge_outage(dataclasses.replace(stepping, first_step_done=False, step_seconds=None, steps_since=0,
                                            stuck_s=None)).cause == HEAD
    assert not judge_outage(dataclasses.replace(stepping, waited_s=61.0)).wait


def test_the_window_to_see_steps_settles_first_then_four_steps_at_least_five_seconds():
    assert confirm_window(0.1, 60) == 5.0 and confirm_window(2.0, 60) == 12.0 and confirm_window(30.0, 60) == 60.0
    assert confirm_window(None, 60) == 5.0


def test_the_kernels_route_answers_are_read():
    assert linux_route('[{"dst":"10.231.4.12","dev":"eth0","prefsrc":"10.231.4.1","flags":["linkdown"],'
                       '"uid":0,"cache":[]}]') == ("eth0", ["linkdown"])
    assert linux_route("not json") == (None, [])
    mac = "   route to: 10.0.0.3\ndestination: 10.0.0.0\n  interface: en0\n      flags: <UP,DONE,CLONING>\n"
    assert mac_route_interface(mac) == "en0" and mac_route_interface("route: not in table") is None
    assert mac_interface_inactive("en0: flags=8863<UP>\n\tstatus: inactive\n")
    assert not mac_interface_inactive("en0: flags=8863<UP>\n\tstatus: active\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's own route table")
def test_the_heads_route_is_asked_of_the_kernel_and_a_name_is_never_guessed_at():
    assert route_down("127.0.0.1") is None  # loopback is up
    assert route_down("coord-n1") is None  # a name says nothing of a route: not looked up
