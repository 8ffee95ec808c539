"""Text from outside coord, made safe to show or refused: a rank's output cut into an excerpt, and
the names, paths and values a person types.

A rank's output is written for a terminal: colours and cursor moves (ANSI CSI sequences such as
``ESC[38;5;244m``), window titles and links (OSC sequences), carriage returns of progress bars.
Shown verbatim in an event, an alert, the dashboard or ``coord status`` they repaint the reader's
terminal, break a chat message or hide the words around them, so every excerpt of it goes through
``clean_excerpt`` where it is cut from the output. Typed values are refused instead
(``unprintable``): a name or path with an invisible character in it is a mistake, not data.
"""

from __future__ import annotations

import re
import unicodedata

# ESC [ params intermediates final (CSI); ESC ] ... BEL or ST (OSC); ESC P/X/^/_ ... ST (DCS, SOS, PM,
# APC); ESC, intermediates, a final byte (charset choices, ESC 7, ESC =); the 8-bit CSI (0x9b) form.
# An unterminated string sequence runs to the end of the text, as a terminal would swallow it.
_ESCAPES = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]?"
    r"|\x1b\][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c|$)"
    r"|\x1b[PX^_][^\x1b\x9c]*(?:\x1b\\|\x9c|$)"
    r"|\x9b[0-?]*[ -/]*[@-~]?"
    r"|[\x90\x98\x9d\x9e\x9f][^\x1b\x9c]*(?:\x1b\\|\x9c|$)"
    r"|\x1b[ -/]*[0-~]?"
)
# Characters that change how the text around them reads without being seen: the bidirectional
# overrides and isolates (the "Trojan Source" ones), and the line and paragraph separators.
_INVISIBLE = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u2028\u2029")
# Unicode categories a typed name, path or value never needs: control (Cc), format (Cf: zero-width
# and direction marks), surrogates (Cs), unassigned (Cn), line and paragraph separators (Zl, Zp).
_REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Cn", "Zl", "Zp"})


def clean_excerpt(text: str) -> str:
    """``text`` (an excerpt of a rank's output) without terminal escape sequences or control
    characters: escapes and invisible direction marks removed, tabs, newlines and carriage returns
    as spaces, every other control character removed; the ends stripped."""
    if text.isprintable() and text.isascii():
        return text.strip()  # the common case: a plain line
    text = _ESCAPES.sub("", text)
    out = []
    for char in text:
        if char in "\t\n\r\v\f":
            out.append(" ")
        elif char in _INVISIBLE or unicodedata.category(char) in ("Cc", "Cs"):
            continue
        else:
            out.append(char)
    return "".join(out).strip()


def unprintable(text: str) -> str | None:
    """The first character of ``text`` a typed value must not hold, as ``U+XXXX (name)``; None when
    there is none."""
    for char in text:
        if unicodedata.category(char) in _REFUSED_CATEGORIES:
            name = unicodedata.name(char, "") or {"\x1b": "ESCAPE", "\x00": "NUL", "\t": "TAB", "\n": "LINE FEED",
                                                  "\r": "CARRIAGE RETURN", "\x7f": "DELETE"}.get(char, "")
            return f"U+{ord(char):04X}" + (f" ({name})" if name else "")
    return None
