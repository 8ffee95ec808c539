"""Starting ranks: the links and backend, the hostfile, and the launchers."""
