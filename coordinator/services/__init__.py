"""Daemon services shared by the commands and the job supervisor: the launch plan (links,
backend, hostfile), pre-flight and sync. Nothing here imports ``coordinator.commands``."""
