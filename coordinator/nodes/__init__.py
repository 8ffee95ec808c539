"""Nodes: reaching each node (transport, host keys, sessions) and what the head ships and learns there."""
