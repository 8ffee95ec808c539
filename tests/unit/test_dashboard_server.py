"""The dashboard server's pure parts: requests, who may look, what it serves from disk, and
the [dashboard] table of the cluster file."""

from __future__ import annotations

import json

import anyio
import pytest

from coordinator.config.cluster_file import ConfigError, DashboardSettings, parse_config
from coordinator.observe.dashboard.assets import static_files
from coordinator.observe.web.routes import api_routes, page_routes
from coordinator.observe.web.server import Request, WebServer, host_allowed

BASE = '[cluster]\nname = "x"\n[[nodes]]\nname = "a"\nhost = "local"\nworkdir = "/tmp/w"\n'


def test_on_loopback_only_a_loopback_host_header_is_answered():
    loopback = DashboardSettings(host="127.0.0.1", port=8470)
    assert host_allowed("127.0.0.1:8470", loopback, 8470)
    assert host_allowed("localhost:8470", loopback, 8470)
    assert host_allowed("[::1]:8470", loopback, 8470)
    assert not host_allowed("evil.example:8470", loopback, 8470)
    assert not host_allowed("127.0.0.1:9999", loopback, 8470)
    assert not host_allowed(None, loopback, 8470)
    # Reachable from other machines: the token is the guard, any Host is fine.
    assert host_allowed("mac-studio.local:8470", DashboardSettings(host="0.0.0.0", port=8470, token="t" * 16), 8470)


def test_the_token_comes_as_a_bearer_header_or_a_query_and_must_match():
    def ok(token, query=None, auth=None):
        server = WebServer(DashboardSettings(token=token), {})
        return server._authorized(Request("GET", "/", {"token": [query]} if query else {},
                                          {"authorization": auth} if auth else {}))
    assert ok(None)
    assert ok("s" * 20, query="s" * 20)
    assert ok("s" * 20, auth="Bearer " + "s" * 20)
    assert not ok("s" * 20)
    assert not ok("s" * 20, query="x" * 20)


def test_only_the_pages_own_files_are_served_from_disk():
    files = static_files()
    assert {"/static/index.html", "/static/dashboard.js", "/static/dashboard.css",
            "/static/vendor/uPlot.iife.min.js", "/static/vendor/uPlot.min.css"} <= set(files)
    assert all(path.endswith((".html", ".js", ".css")) for path in files)
    # The page is also the root; these, and only these, need no token.
    assert set(page_routes()) == set(files) | {"/", "/index.html"}


def test_the_history_page_answers_from_the_metrics_history():
    asked = []

    class History:
        def document(self, run_id=None, since=None):
            asked.append((run_id, since))
            return {"runs": [], "nodes": []}

    async def status():
        return {}

    routes = api_routes(status_document=status, history=History(), dashboard_document=dict, registry=None)
    answer = anyio.run(routes["/api/history"], Request("GET", "/api/history", {"run": ["r-1"], "since": ["5"]}, {}))
    assert answer.status == 200 and json.loads(answer.body) == {"runs": [], "nodes": []}
    assert asked == [("r-1", 5.0)]
    refused = anyio.run(routes["/api/history"], Request("GET", "/api/history", {"since": ["soon"]}, {}))
    assert refused.status == 400


def test_the_dashboard_table_defaults_to_loopback_and_refuses_an_open_address_without_a_token():
    assert parse_config(BASE).dashboard == DashboardSettings(host="127.0.0.1", port=8470, token=None)
    assert not parse_config(BASE + '[dashboard]\nlisten = "off"\n').dashboard.enabled
    assert not parse_config(BASE + '[dashboard]\nenabled = false\n').dashboard.enabled
    assert parse_config(BASE + '[dashboard]\nlisten = "[::1]:0"\n').dashboard.host == "::1"
    with pytest.raises(ConfigError, match="needs a token"):
        parse_config(BASE + '[dashboard]\nlisten = "0.0.0.0:8470"\n')
    opened = parse_config(BASE + '[dashboard]\nlisten = "0.0.0.0:8470"\ntoken = "0123456789abcdef"\n').dashboard
    assert opened.host == "0.0.0.0" and opened.token == "0123456789abcdef"
    for bad, why in (('listen = "8470"', "not HOST:PORT"), ('listen = "127.0.0.1:99999"', "port"),
                     ('listen = "my-mac:8470"', "IP address"), ('token = "short"', "at least 16")):
        with pytest.raises(ConfigError, match=why):
            parse_config(BASE + "[dashboard]\n" + bad + "\n")
