"""What the daemon keeps and shows of its runs and nodes over time: the metrics history
(SQLite), its thinning rules, TensorBoard event files and the Prometheus collector."""
