"""The values command-line options take, checked as the command line is read: `coord`'s parser and
coordd's give each option one of these as its ``type``.

A value that does not fit is refused by argparse at once, before a daemon is asked or a file
touched, with exit status 2 and a message that names the option and says what it takes: a number
in its range (finite: NaN, infinities and numbers past the range are refused, never clamped or
replaced by a default), text without control characters, a directory that exists and is one, a
file that exists and is one, a place a file can be written. Each checker keeps what it accepts as
attributes, so that a test can walk every option of every command and try values against it.

Imported by every `coord` command through the parser: nothing heavy is imported here.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import stat
from pathlib import Path

from shared.text import unprintable

#: A job's name as `coord run --name` takes it (coordinator.jobs.spec.JOB_NAME; a test holds them equal).
JOB_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
#: A job's name or one of its run ids (the name and 8 hex digits).
JOB_OR_RUN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,72}$"
#: A node's name (coordinator.config.cluster_file.NODE_NAME; a test holds them equal).
NODE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
#: Unix socket paths: 104 bytes on macOS, 108 on Linux, with the terminating NUL.
MAX_SOCKET_BYTES = 103
MAX_TEXT = 4096


class OptionValue:
    """A checker argparse calls with the option's text; raises ArgumentTypeError with what is wrong.
    (Plain classes, not dataclasses: the CLI's start does not import dataclasses.)"""

    kind = "text"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    def __call__(self, text: str) -> object:
        raise NotImplementedError


def _refuse(message: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(message)


def _printable(text: str, what: str) -> str:
    if not text:
        raise _refuse(f"{what} must not be empty")
    if len(text) > MAX_TEXT:
        raise _refuse(f"{what} is longer than {MAX_TEXT} characters")
    bad = unprintable(text)
    if bad:
        raise _refuse(f"{what} holds the control character {bad}: {text!r}")
    return text


def _path(text: str) -> Path:
    try:
        return Path(_printable(text, "the path")).expanduser()
    except RuntimeError:  # ~user of no such user
        raise _refuse(f"{text}: no such user's home directory") from None


def _kind(path: Path, text: str) -> str | None:
    """What is at ``path``: "dir", "file", "socket", "other", or None when nothing is."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:  # a name too long, a directory not readable, a loop of links
        raise _refuse(f"{text}: {exc.strerror or exc}") from None
    return ("dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else
            "socket" if stat.S_ISSOCK(mode) else "other")


def _parent_dir(path: Path, text: str) -> None:
    parent = path.absolute().parent
    found = _kind(parent, text)
    if found != "dir":
        raise _refuse(f"{text}: {'no such directory' if found is None else 'not a directory'}: {parent}")


class Whole(OptionValue):
    """A whole number from ``low`` to ``high``."""

    kind = "whole"

    def __init__(self, low: int, high: int):
        self.low, self.high = low, high

    def __call__(self, text: str) -> int:
        try:
            if not text.isascii():  # int() reads other scripts' digits too: a number is typed in ASCII
                raise ValueError(text)
            value = int(text.strip(), 10)
        except ValueError:
            raise _refuse(f"must be a whole number from {self.low} to {self.high}, got {text!r}") from None
        if not self.low <= value <= self.high:
            raise _refuse(f"must be from {self.low} to {self.high}, got {value}")
        return value


def _shown(number: float) -> str:
    return f"{number:.0f}" if float(number).is_integer() else f"{number:g}"


class Number(OptionValue):
    """A finite number greater than ``low`` (at least ``low`` when not ``low_open``) and at most ``high``."""

    kind = "number"

    def __init__(self, low: float, high: float, *, low_open: bool = True, unit: str = ""):
        self.low, self.high, self.low_open, self.unit = low, high, low_open, unit

    def __call__(self, text: str) -> float:
        low = f"greater than {_shown(self.low)}" if self.low_open else f"at least {_shown(self.low)}"
        wanted = f"a number{' of ' + self.unit if self.unit else ''} {low} and at most {_shown(self.high)}"
        try:
            if not text.isascii():
                raise ValueError(text)
            value = float(text.strip())
        except ValueError:
            raise _refuse(f"must be {wanted}, got {text!r}") from None
        if not math.isfinite(value) or not (self.low < value if self.low_open else self.low <= value) \
                or value > self.high:
            raise _refuse(f"must be {wanted}, got {text!r}")
        return value


class Text(OptionValue):
    """Text without control characters (and matching ``pattern``, when given, described by ``what``)."""

    def __init__(self, pattern: str | None = None, what: str = ""):
        self.pattern, self.what = pattern, what

    def __call__(self, text: str) -> str:
        _printable(text, "the value")
        if self.pattern is not None and not re.match(self.pattern, text):
            raise _refuse(f"{text!r} is not {self.what}")
        return text


class StoreUrl(OptionValue):
    """A checkpoint store's URL (coordinator/config/store_url.py): s3://, gs://, az:// or file:///."""

    kind = "store_url"

    def __call__(self, text: str) -> str:
        from coordinator.config.store_url import StoreUrlError, parse_store_url  # only when given

        _printable(text, "the value")
        try:
            return parse_store_url(text).url
        except StoreUrlError as exc:
            raise _refuse(str(exc)) from None


class Rate(OptionValue):
    """A rate in bytes per second, as people write it: 50MB/s, 40MiB/s, 400Mbit/s, 1Gbps."""

    kind = "rate"

    def __call__(self, text: str) -> float:
        from shared.sizes import parse_rate

        try:
            return parse_rate(_printable(text, "the rate"))
        except ValueError as exc:
            raise _refuse(str(exc)) from None


class Names(OptionValue):
    """Comma-separated node names, each once."""

    kind = "names"

    def __call__(self, text: str) -> list[str]:
        _printable(text, "the value")
        names = [name.strip() for name in text.split(",")]
        if not all(names):
            raise _refuse(f"{text!r}: give node names separated by commas, e.g. n1,n2")
        bad = [name for name in names if not re.match(NODE_NAME, name)]
        if bad:
            raise _refuse(f"{bad[0]!r} is not a node name (letters, digits, '.', '_' or '-')")
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise _refuse(f"names {', '.join(twice)} more than once")
        return names


class Wholes(OptionValue):
    """Comma-separated whole numbers from ``low`` to ``high``, each once; returned in increasing order."""

    kind = "wholes"

    def __init__(self, low: int, high: int):
        self.low, self.high = low, high

    def __call__(self, text: str) -> list[int]:
        _printable(text, "the value")
        one = Whole(self.low, self.high)
        values = [one(part) for part in text.split(",")]
        twice = sorted({value for value in values if values.count(value) > 1})
        if twice:
            raise _refuse(f"{', '.join(map(str, twice))} given more than once")
        return sorted(values)


class ExistingDir(OptionValue):
    """A directory on this machine that exists; returned absolute."""

    kind = "dir"

    def __call__(self, text: str) -> str:
        path = _path(text)
        found = _kind(path, text)
        if found is None:
            raise _refuse(f"{text}: no such directory")
        if found != "dir":
            raise _refuse(f"{text}: not a directory")
        return str(path.resolve())


class ExistingFile(OptionValue):
    """A file on this machine that exists and is one (``suffix``: and is named so; ``hint``: how to make
    one, said when it is missing; ``other``: what to do instead, said when it is not named so)."""

    kind = "file"

    def __init__(self, suffix: str = "", hint: str = "", other: str = ""):
        self.suffix, self.hint, self.other = suffix, hint, other

    def __call__(self, text: str) -> str:
        path = _path(text)
        if self.suffix and path.suffix != self.suffix:
            raise _refuse(f"{text}: not a {self.suffix} file" + (f"; {self.other}" if self.other else ""))
        found = _kind(path, text)
        if found is None:
            raise _refuse(f"{text}: no such file" + (f" ({self.hint})" if self.hint else ""))
        if found == "dir":
            raise _refuse(f"{text}: a directory, not a file")
        if found == "socket":
            raise _refuse(f"{text}: a socket, not a file")
        return str(path)  # a file, or a pipe or device (a shell's <(...)): read as one


class FileToWrite(OptionValue):
    """A file to write (or append to): not a directory, in a directory that exists."""

    kind = "output"

    def __call__(self, text: str) -> str:
        path = _path(text)
        if _kind(path, text) == "dir":
            raise _refuse(f"{text}: a directory, not a file")
        _parent_dir(path, text)
        return str(path)


class DirToMake(OptionValue):
    """A directory to use or create: not a file, in a directory that exists."""

    kind = "newdir"

    def __call__(self, text: str) -> str:
        path = _path(text)
        if _kind(path, text) not in (None, "dir"):
            raise _refuse(f"{text}: not a directory")
        _parent_dir(path, text)
        return str(path)


class SocketPath(OptionValue):
    """The daemon's control socket: short enough for a Unix socket, and a socket if it exists."""

    kind = "socket"

    def __call__(self, text: str) -> str:
        path = _path(text)
        if len(os.fsencode(str(path))) > MAX_SOCKET_BYTES:
            raise _refuse(f"{text}: longer than a Unix socket path may be ({MAX_SOCKET_BYTES} bytes)")
        found = _kind(path, text)
        if found == "dir":
            raise _refuse(f"{text}: a directory, not the daemon's socket")
        if found not in (None, "socket"):
            raise _refuse(f"{text}: not a socket (the daemon's control socket is <state_dir>/coord.sock)")
        if found is None:
            _parent_dir(path, text)
        return str(path)


#: A cluster file given with --config.
CLUSTER_FILE = ExistingFile(hint="write one from your hosts with: coord init --hosts USER@HOST,... -o FILE")
