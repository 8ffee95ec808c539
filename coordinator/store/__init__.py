"""Durable state: SQLite in the daemon's state dir."""
