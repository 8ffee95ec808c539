"""Is the cluster ready to run a job: sync, consistency, pre-flight checks and calibration."""
