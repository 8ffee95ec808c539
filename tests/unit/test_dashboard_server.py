"""The dashboard server's pure parts: requests, who may look, what it serves from disk, and
the [dashboard] table of the cluster file."""

from __future__ import annotations

import pytest

from coordinator.config import ConfigError, DashboardSettings, parse_config
from coordinator.dashboard.server import BadRequest, Request, host_allowed, parse_request, static_files, token_ok

BASE = '[cluster]\nname = "x"\n[[nodes]]\nname = "a"\nhost = "local"\nworkdir = "/tmp/w"\n'


def test_a_request_line_and_headers_are_parsed_and_garbage_is_refused():
    request = parse_request(b"GET /api/dashboard?token=abc HTTP/1.1\r\nHost: 127.0.0.1:8470\r\nX-A: b")
    assert (request.method, request.path, request.query["token"], request.headers["host"]) == \
        ("GET", "/api/dashboard", ["abc"], "127.0.0.1:8470")
    for bad in (b"GET /", b"GET / SPDY/3", b"GET / HTTP/1.1\r\nno colon here"):
        with pytest.raises(BadRequest):
            parse_request(bad)


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
    def request(query=None, auth=None):
        return Request("GET", "/", {"token": [query]} if query else {}, {"authorization": auth} if auth else {})
    assert token_ok(request(), None)
    assert token_ok(request(query="s" * 20), "s" * 20)
    assert token_ok(request(auth="Bearer " + "s" * 20), "s" * 20)
    assert not token_ok(request(), "s" * 20)
    assert not token_ok(request(query="x" * 20), "s" * 20)


def test_only_the_pages_own_files_are_served_from_disk():
    files = static_files()
    assert {"/static/index.html", "/static/dashboard.js", "/static/dashboard.css",
            "/static/vendor/uPlot.iife.min.js", "/static/vendor/uPlot.min.css"} <= set(files)
    assert all(path.endswith((".html", ".js", ".css")) for path in files)


def test_the_dashboard_table_defaults_to_loopback_and_refuses_an_open_address_without_a_token():
    assert parse_config(BASE).dashboard == DashboardSettings(host="127.0.0.1", port=8470, token=None)
    assert not parse_config(BASE + '[dashboard]\nlisten = "off"\n').dashboard.enabled
    assert parse_config(BASE + '[dashboard]\nlisten = "[::1]:0"\n').dashboard.host == "::1"
    with pytest.raises(ConfigError, match="needs a token"):
        parse_config(BASE + '[dashboard]\nlisten = "0.0.0.0:8470"\n')
    opened = parse_config(BASE + '[dashboard]\nlisten = "0.0.0.0:8470"\ntoken = "0123456789abcdef"\n').dashboard
    assert opened.host == "0.0.0.0" and opened.token == "0123456789abcdef"
    for bad, why in (('listen = "8470"', "not HOST:PORT"), ('listen = "127.0.0.1:99999"', "port"),
                     ('listen = "my-mac:8470"', "IP address"), ('token = "short"', "at least 16")):
        with pytest.raises(ConfigError, match=why):
            parse_config(BASE + "[dashboard]\n" + bad + "\n")
