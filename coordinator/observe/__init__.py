"""What the daemon shows and tells: metrics, the dashboard, its web server, alerts."""
