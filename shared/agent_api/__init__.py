"""The shapes of the agent's RPC requests and replies, for type checking both ends.

Each method the agent serves (``agent.server.build_dispatcher``) takes the arguments of
its ``...Request`` and answers a ``...Reply``, declared in this package by group of
methods: ``session`` (hello, ping), ``facts`` (facts, usage), ``sync``, ``relay``,
``topology``, ``ranks`` (a rank's life and its checkpoints), ``progress`` (what the
trainers report through ``rank_status``), ``calibration`` and ``torch`` (a PyTorch job's node
facts and the rendezvous probe). These are ``TypedDict``s: at
run time they are the plain dicts that msgpack carries, so naming them changes nothing on
the wire. A request's required keys are those of the dispatcher's ``required`` table, its
optional keys those of ``optional`` (``methods.REQUESTS`` maps each method to its request,
and a test holds the two together).

An optional key is declared in a ``total=False`` subclass rather than with
``NotRequired``: these modules are imported on nodes whose Python may be 3.10.

Where a value is data nobody here gives a shape to (a training script's progress
records, a program's JSON output before it is checked), it is a ``common.JsonObject``.
Standard library only: the agent runs with the node's Python.

Import a shape from its group's module (``from shared.agent_api.ranks import RankStatusReply``).
"""
