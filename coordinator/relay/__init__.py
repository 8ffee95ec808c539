"""Broadcasts: a file several nodes need sent over each link once, relayed node to node.

``route`` is the pure policy (which node sends to which, and where to go when one fails);
``broadcast`` carries a route out through the agents (``agent/relay.py``) and the data plane
(``shared/relay.py``).
"""
