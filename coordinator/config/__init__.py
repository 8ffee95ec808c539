"""Settings: the cluster file, and the logging set-up the daemon and the CLI share."""
