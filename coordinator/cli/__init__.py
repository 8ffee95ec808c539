"""`coord`, the command line, with its progress display and the demo."""
