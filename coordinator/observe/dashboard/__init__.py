"""The live dashboard coordd serves: its data (document.py) and its page (static/)."""
