"""Control commands: each module holds the daemon half (``serve_*``) and the CLI half (``render_*``)."""
