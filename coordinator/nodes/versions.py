"""Every version comparison the coordinator makes: mlx-lm, mlx, macOS, on ``packaging.version``.

The agents only report versions as strings (``importlib.metadata``, ``sw_vers
-productVersion``); the head compares them here, with one set of rules:

- A version is what ``packaging.version.Version`` parses (PEP 440, which also covers
  macOS's ``"26.1"`` and ``"15.6.1"``; surrounding spaces and a leading ``v`` are allowed).
- Anything else (``None``, ``""``, ``"unknown"``, ``"26.x"``, a non-string) is *unknown*:
  :func:`parse` gives None, :func:`at_least` gives None (the caller reports "not checked",
  never "too old"), and :func:`oldest` skips it.
- :func:`at_least` asks "does this version have what release R brought?", so it compares
  release numbers only: ``0.30.2rc1``, ``0.30.2.dev3`` and ``0.30.2+local`` count as
  ``0.30.2`` (a fix lands in a release's pre-releases before the release), and trailing
  zeros do not matter (``26`` is ``26.0``).
- :func:`oldest` orders by PEP 440 in full (``0.30.2rc1`` comes before ``0.30.2``).
"""

from __future__ import annotations

from collections.abc import Iterable

from packaging.version import InvalidVersion, Version

__all__ = ["Version", "at_least", "oldest", "parse"]


def parse(text: object) -> Version | None:
    """The version ``text`` names; None when it is not a string packaging can parse."""
    if not isinstance(text, str) or not text.strip():
        return None
    try:
        return Version(text)
    except InvalidVersion:
        return None


def at_least(text: object, minimum: str | Version) -> bool | None:
    """Whether ``text`` is release ``minimum`` or later, pre-releases of it included;
    None when ``text`` is unknown."""
    version = parse(text)
    if version is None:
        return None
    floor = minimum if isinstance(minimum, Version) else Version(minimum)
    return Version(version.base_version) >= Version(floor.base_version)


def oldest(texts: Iterable[str | None]) -> str | None:
    """The oldest of ``texts`` as given (PEP 440 order); unknown ones are skipped, and
    None comes back when none is known."""
    known = [(version, text) for text in texts if (version := parse(text)) is not None]
    if not known:
        return None
    return min(known, key=lambda pair: pair[0])[1]
