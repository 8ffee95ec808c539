"""Jobs: what to run (spec), when to restart (policy), checkpoints (catalog), and the loop (supervisor)."""
