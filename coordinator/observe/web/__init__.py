"""The daemon's HTTP side: a small read-only server (``server.py``) and its pages (``routes.py``)."""
