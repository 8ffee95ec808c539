"""coord's version; the agent and the daemon compare theirs in the handshake."""

COORD_VERSION = "0.1.0"
