"""Checking a table of a TOML file against its schema, and naming the line of a key in a message:
what the cluster file's parser refuses a mistake with."""

from __future__ import annotations

import math
import re
from typing import Any

from shared.text import unprintable

#: A table of the cluster file as tomllib read it: the user's own data, checked key by key before use.
TomlTable = dict[str, Any]


class ConfigError(Exception):
    """A cluster file that cannot be used; the message names the file, line and key."""


# key -> (accepted types, required)
Schema = dict[str, tuple[type | tuple[type, ...], bool]]

#: (table, key) whose value may be an empty string, because the empty string means something there
#: (``listen = ""``: no dashboard, as documented). Everywhere else an empty string is a mistake.
MAY_BE_EMPTY = {("dashboard", "listen")}


def check_table(table: TomlTable, schema: Schema, name: str, index: int | None, locate: Locator) -> None:
    label = f"{name}[{index}]" if index is not None else name
    for key, value in table.items():
        if key not in schema:
            raise ConfigError(locate.message(name, index, key,
                                             f"unknown key {label}.{key} (expected one of: {', '.join(schema)})"))
        kind, _ = schema[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            expected = " or ".join(KIND_WORDS[k.__name__] for k in kinds)
            raise ConfigError(locate.message(name, index, key,
                                             f"{label}.{key} must be {expected}, got {toml_type(value)} {value!r}"))
        problem = value_problem(value, may_be_empty=(name, key) in MAY_BE_EMPTY)
        if problem:
            raise ConfigError(locate.message(name, index, key, f"{label}.{key} {problem}"))
    for key, (_, required) in schema.items():
        if required and key not in table:
            raise ConfigError(locate.message(name, index, None, f"{label} is missing the required key {key!r}"))


def value_problem(value: Any, *, may_be_empty: bool = False) -> str | None:
    """What no key of the file may hold, whatever its own rules: an empty string, a string with a control
    or invisible character (an escape, a NUL, a zero-width space, a direction override), a number that is
    not finite (TOML writes nan and inf), an integer past 64 bits; in a list, the same of each item. None
    when there is none."""
    if isinstance(value, str):
        if not value and not may_be_empty:
            return "must not be an empty string"
        bad = unprintable(value)
        return f"holds the control character {bad}: {value!r}" if bad else None
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        return f"must fit in 64 bits as TOML integers do, got {value}"
    if isinstance(value, list):
        for item in value:
            problem = value_problem(item)
            if problem:
                return f"item {item!r} {problem}"
    return None


KIND_WORDS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
              "list": "a list", "dict": "a table"}


def toml_type(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)


class Locator:
    """Finds the line of a key in the source, since tomllib keeps no positions."""

    _HEADER = re.compile(r"^\s*(\[\[?)\s*([A-Za-z0-9_.\-\"' ]+?)\s*\]\]?")
    _KEY = re.compile(r"^\s*([A-Za-z0-9_\-]+|\"[^\"]*\"|'[^']*')\s*=")

    def __init__(self, text: str, where: str):
        self.lines = text.splitlines()
        self.where = where

    def line_of(self, table: str | None, index: int | None, key: str | None) -> int | None:
        current, occurrence = None, -1
        for number, line in enumerate(self.lines, start=1):
            header = self._HEADER.match(line)
            if header:
                current = header.group(2).strip().strip("\"'")
                if current == table:
                    occurrence += 1
                    if occurrence == (index or 0) and key is None:
                        return number
                continue
            found = self._KEY.match(line)
            if key is not None and found and found.group(1).strip("\"'") == key:
                in_place = (table is None and current is None) or (
                    current == table and (index is None or occurrence == index))
                if in_place:
                    return number
        if table is None and key is not None:  # a top-level table named by a header
            for number, line in enumerate(self.lines, start=1):
                header = self._HEADER.match(line)
                if header and header.group(2).strip() == key:
                    return number
        return None

    def message(self, table: str | None, index: int | None, key: str | None, text: str) -> str:
        line = self.line_of(table, index, key)
        return f"{self.where}:{line}: {text}" if line else f"{self.where}: {text}"
