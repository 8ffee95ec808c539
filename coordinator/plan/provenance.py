"""A plan section being filled: each value with its source, each field it cannot fill with why.

Every section of a plan carries ``"sources"`` (``{field: where its value comes from}``) and
``"missing"`` (``{field: why it is not filled}``); a section that cannot be filled at all is
``{"enabled": false, "reason": ...}``.
"""

from __future__ import annotations

from typing import Any


def disabled_section(reason: str, **extra: Any) -> dict[str, Any]:
    return {"enabled": False, "reason": reason, **extra}


class Section:
    """A section being filled: each value with its source, each unfillable field with why."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.sources: dict[str, str] = {}
        self.missing: dict[str, str] = {}

    def put(self, name: str, value: Any, source: str) -> None:
        self.values[name] = value
        self.sources[name] = source

    def lack(self, name: str, why: str) -> None:
        self.missing[name] = why

    def done(self, *, flagged: bool = False) -> dict[str, Any]:
        """The section; ``flagged`` sections carry ``"enabled": true`` as the format shows them.

        A section is a JSON object whose fields differ from one section to the next (the plan
        format's, each with its source): a plain dict, not a type per section."""
        if not self.sources:
            reasons = "; ".join(f"{name}: {why}" for name, why in self.missing.items())
            return disabled_section(reasons or "nothing measured")
        out = {**({"enabled": True} if flagged else {}), **self.values, "sources": self.sources}
        if self.missing:
            out["missing"] = self.missing
        return out
