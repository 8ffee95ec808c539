"""The relay's route: a chain by default, Thunderbolt hops first, a star over a full mesh, and
the nearest live sender when one is lost."""

from __future__ import annotations

import pytest

from coordinator.relay.route import ancestors, plan_route, reroute


def cabled(*pairs: tuple[str, str]):
    links = {frozenset(pair) for pair in pairs}
    return lambda a, b: frozenset((a, b)) in links


def test_without_cables_the_route_is_a_chain_in_the_order_given():
    assert plan_route("head", ["n1", "n2", "n3"]) == {"n1": "head", "n2": "n1", "n3": "n2"}


def test_the_source_is_never_its_own_receiver_and_duplicates_count_once():
    assert plan_route("n2", ["n1", "n2", "n3", "n1"]) == {"n1": "n2", "n3": "n1"}
    assert plan_route("n1", ["n1"]) == {}


def test_a_chain_follows_thunderbolt_cables_where_there_are_some():
    # n1-n3 and n3-n2 are cabled; the head reaches everyone over the LAN.
    parents = plan_route("head", ["n1", "n2", "n3"], cabled(("n1", "n3"), ("n3", "n2")))
    assert parents == {"n1": "head", "n3": "n1", "n2": "n3"}


def test_a_source_cabled_to_every_receiver_sends_to_each_directly():
    parents = plan_route("n1", ["n2", "n3", "n4"], cabled(("n1", "n2"), ("n1", "n3"), ("n1", "n4")))
    assert parents == {"n2": "n1", "n3": "n1", "n4": "n1"}


def test_a_lost_relay_is_skipped_for_the_nearest_sender_above_it():
    parents = {"n1": "head", "n2": "n1", "n3": "n2"}
    assert ancestors(parents, "n3") == ["n2", "n1", "head"]
    assert reroute(parents, "n3", {"n2"}) == "n1"
    assert reroute(parents, "n3", {"n2", "n1"}) == "head"
    assert reroute(parents, "n2", {"n1", "head"}) is None


def test_a_route_with_a_cycle_is_refused():
    with pytest.raises(ValueError, match="cycle"):
        ancestors({"a": "b", "b": "a"}, "a")
