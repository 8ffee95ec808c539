"""Every key of the cluster file, tried with hostile values through `coord daemon --config FILE`
(in-process, stopped right after the file is accepted, before any state or socket is made): each is
refused with exit status 2 and a message naming the key, or accepted; never a traceback.

The keys are found by walking the file's schemas (``SCHEMAS`` in coordinator/config/cluster_file.py),
so a new key is tried without a new test.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import socket
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import coordinator.cli.parser as cli_parser
import coordinator.daemon as daemon_module
from coordinator.cli.main import main
from coordinator.config.cluster_file import MAX_ALERT_MINUTES, MAX_SSH_SECONDS, SCHEMAS, ConfigError, parse_config
from coordinator.config.toml_checks import MAY_BE_EMPTY
from shared.text import unprintable

EXAMPLES = 40  # random draws per key (beside FIXED): about 36 keys, the module in about 8 s
TRIED: Counter[str] = Counter()
KEYS = [(table, key) for table, schema in SCHEMAS.items() for key in schema]


class Accepted(Exception):
    """The daemon got past its cluster file: what a test stops it with."""


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-config")
    (root / "dir").mkdir()
    (root / "file.txt").write_text("a file\n")
    stale = Path("/tmp") / f"coord-bad-config-{os.getpid()}.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(stale))
    listener.close()
    paths = {"dir": str(root / "dir"), "file": str(root / "file.txt"), "missing": str(root / "no" / "such"),
             "relative_missing": "no-such-thing", "long": str(root / ("x" * 300)), "socket": str(stale),
             "python": sys.executable}

    def accepted(config: Any) -> Any:
        raise Accepted()

    with pytest.MonkeyPatch.context() as patch:
        parser = cli_parser.build_parser()  # built once: most of what a call would cost
        patch.setattr(cli_parser, "build_parser", lambda: parser)
        patch.setattr(daemon_module, "open_state", accepted)
        patch.setattr(daemon_module, "configure_logging", lambda **_: None)
        patch.setattr(os, "umask", lambda mask: 0o022)  # run_daemon's own, kept off this test process
        yield root, paths
    stale.unlink(missing_ok=True)


# --- TOML out -------------------------------------------------------------------------------------

def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        out = []
        for char in value:
            if char in '"\\':
                out.append("\\" + char)
            elif char.isprintable() and char.isascii() or (not char.isascii() and unprintable(char) is None):
                out.append(char)
            else:
                out.append(f"\\U{ord(char):08X}")
        return '"' + "".join(out) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def toml_document(doc: dict[str, Any]) -> str:
    lines = []
    for table, body in doc.items():
        for entry in body if isinstance(body, list) else [body]:
            lines.append(f"[[{table}]]" if isinstance(body, list) else f"[{table}]")
            lines += [f"{key} = {toml_value(value)}" for key, value in entry.items()]
            lines.append("")
    return "\n".join(lines)


def base_document(root: Path, table: str, key: str) -> dict[str, Any]:
    """A valid file, with the table under test present and what the key needs beside it."""
    node = {"name": "a", "host": "local", "python": sys.executable, "workdir": str(root / "w")}
    doc: dict[str, Any] = {"cluster": {"name": "c", "state_dir": str(root / "state")}, "nodes": [node]}
    if table in ("ssh", "sync", "dashboard"):
        doc[table] = {}
    if table == "alerts":
        alert: dict[str, Any] = {"command": [sys.executable]}
        if key in ("webhook", "format"):
            alert = {"webhook": "https://example.com/hook"}
        if key == "stalled_minutes":
            alert["on"] = ["job_stalled"]
        if key == "node_down_minutes":
            alert["on"] = ["node_down"]
        doc["alerts"] = [alert]
    return doc


# --- the values tried -----------------------------------------------------------------------------

def scalars(paths: dict[str, str]) -> st.SearchStrategy[Any]:
    texts = st.one_of(
        st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=16),
        st.sampled_from(["", " ", "\x1b[31mred", "a\x00b", "a\nb", "\u202eevil", "zero\u200bwidth", "\ufeff",
                         "\U000e0001", "\u2028", "é", "名前", "local", "off", "127.0.0.1:8470", "0.0.0.0:80",
                         "https://example.com/x", "ftp://x", "x" * 20, "/abs/path", "relative", "~/x", "-x",
                         "generic", "slack", "job_failed", "node_down"]),
        st.sampled_from(sorted(paths.values())))
    numbers = st.one_of(
        st.integers(-(2**70), 2**70),
        st.sampled_from([2**63 - 1, -(2**63), 2**63, 0, 1, -1, 20, 21, 65535, 65536, 3600, 3601]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([math.nan, math.inf, -math.inf, 0.0, 0.5, 1.0, 1.5, -1.5, 1e308, 1e-300, 3600.0, 1e9]))
    return st.one_of(texts, numbers, st.booleans())


def hostile(paths: dict[str, str]) -> st.SearchStrategy[Any]:
    single = scalars(paths)
    return st.one_of(single, single, st.lists(single, max_size=3), st.just({"a": 1}))


# --- what must be refused, worked out here --------------------------------------------------------

def _kind(path: str) -> str | None:
    try:
        target = Path(path)
        return "socket" if target.is_socket() else "dir" if target.is_dir() else "file" if target.exists() else None
    except (OSError, ValueError):
        return None


def _bad_item(value: Any, may_be_empty: bool = False) -> bool:
    if isinstance(value, str):
        return (not value and not may_be_empty) or unprintable(value) is not None
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return not -(2**63) <= value < 2**63
    if isinstance(value, list):
        return any(_bad_item(item) for item in value)
    return False


def _wrong_type(table: str, key: str, value: Any) -> bool:
    kinds, _ = SCHEMAS[table][key]
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    return (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds)


RANGES = {("ssh", "keepalive_s"): (0, MAX_SSH_SECONDS), ("ssh", "connect_timeout_s"): (0, MAX_SSH_SECONDS),
          ("sync", "threshold"): (0, 1), ("alerts", "stalled_minutes"): (0, MAX_ALERT_MINUTES),
          ("alerts", "node_down_minutes"): (0, MAX_ALERT_MINUTES)}
MUST_EXIST = {("ssh", "identity_file"): "file", ("ssh", "config"): "file", ("sync", "source"): "dir",
              ("nodes", "python"): "file"}
MAY_EXIST_AS = {("ssh", "known_hosts"): "file", ("cluster", "state_dir"): "dir", ("cluster", "socket"): "socket"}


def must_refuse(table: str, key: str, value: Any, base: Path) -> bool:
    if _wrong_type(table, key, value) or _bad_item(value, (table, key) in MAY_BE_EMPTY):
        return True
    if (table, key) in RANGES:
        low, high = RANGES[(table, key)]
        return not low < value <= high
    if (table, key) == ("nodes", "port"):
        return not 0 < value < 65536
    if (table, key) == ("alerts", "retries"):
        return not 0 <= value <= 20
    path = str(base / os.path.expanduser(value)) if isinstance(value, str) else ""
    if (table, key) in MUST_EXIST:
        return _kind(path) != MUST_EXIST[(table, key)]
    if (table, key) in MAY_EXIST_AS:
        return _kind(path) not in (None, MAY_EXIST_AS[(table, key)])
    return False


def start_daemon(path: Path) -> tuple[str, str]:
    """``coord daemon --config PATH`` in this process: "accepted", or "exit N" with its stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(["daemon", "--config", str(path)])
        except Accepted:
            return "accepted", err.getvalue()
        except SystemExit as exc:
            return f"exit {exc.code}", err.getvalue()
    return "returned", err.getvalue()


def check_one(table: str, key: str, value: Any, place: tuple[Path, dict[str, str]]) -> None:
    """The oracle: accepted, or exit 2 naming the key; a value that must be refused is."""
    root, _ = place
    doc = base_document(root, table, key)
    (doc[table][0] if isinstance(doc[table], list) else doc[table])[key] = value
    path = root / "cluster.toml"
    path.write_text(toml_document(doc), encoding="utf-8")
    TRIED["inputs"] += 1
    outcome, err = start_daemon(path)
    assert outcome in ("accepted", "exit 2"), f"{table}.{key} = {value!r}: {outcome}: {err}"
    if must_refuse(table, key, value, root):
        assert outcome == "exit 2" and key in err and "coordd: " in err, f"{table}.{key} = {value!r}: {err}"
    elif outcome == "exit 2":
        assert key in err, f"{table}.{key} = {value!r}: refused without naming the key: {err}"


#: Tried on every key, whatever the random draws: the values the issue named.
FIXED: list[Any] = ["", "\x1b[38;5;244mgrey", "\u202eevil", "a\x00b", "名前", math.nan, math.inf, -math.inf, 1e308,
                    -1, 0, 2**64, -(2**64), True, ["", "x"], "missing", "file", "dir", "socket"]


@pytest.mark.parametrize("table,key", KEYS, ids=[f"{t}.{k}" for t, k in KEYS])
def test_the_values_the_issue_named_are_refused_naming_the_key_or_accepted(place, table, key):
    for value in FIXED:
        check_one(table, key, place[1].get(value, value) if isinstance(value, str) else value, place)


@pytest.mark.parametrize("table,key", KEYS, ids=[f"{t}.{k}" for t, k in KEYS])
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_hostile_value_of_any_key_is_refused_naming_it_or_accepted(place, table, key, data):
    check_one(table, key, data.draw(hostile(place[1]), label="value"), place)


def test_the_number_of_inputs_tried():
    print(f"\n{TRIED['inputs']} hostile cluster files tried over {len(KEYS)} keys")
    assert TRIED["inputs"] >= len(KEYS) * (len(FIXED) + EXAMPLES // 2) or TRIED["inputs"] == 0  # 0: run alone


def test_the_form_alone_is_checked_without_the_filesystem():
    """parse_config is the file's form: paths on this machine are load_config's to check."""
    text = ('[cluster]\nname = "c"\n[ssh]\nidentity_file = "/no/such/key"\n[sync]\nsource = "/no/such/dir"\n'
            '[[nodes]]\nname = "a"\nhost = "10.0.0.2"\npython = "/usr/bin/python3"\nworkdir = "/w"\n')
    assert parse_config(text).ssh.identity_file == "/no/such/key"
    with pytest.raises(ConfigError, match="keepalive_s must be greater than 0 and at most 3600"):
        parse_config(text.replace("[sync]", "keepalive_s = 1e300\n[sync]"))
