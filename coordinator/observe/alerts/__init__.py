"""Alerts: telling someone when a job fails, stalls or a node stays down.

``rules`` decides, as pure functions over plain data and a clock value, which alerts an event
or the current facts call for; ``payloads`` renders an alert for a webhook (generic JSON,
Slack, ntfy), a command or a macOS notification; ``delivery`` sends them from a queue per
destination, retrying with backoff, so the supervisor never waits on a slow receiver;
``hookup`` connects it all to the daemon's event stream. The supervisor knows nothing of it.
"""
