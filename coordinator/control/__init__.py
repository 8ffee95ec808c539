"""The control socket: where it is, and the server that answers on it."""
