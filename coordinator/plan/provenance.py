"""A plan section being filled: each value with its source, each field it cannot fill with why.

Every section of a plan carries ``"sources"`` (``{field: where its value comes from}``) and
``"missing"`` (``{field: why it is not filled}``); a section that cannot be filled at all is
``{"enabled": false, "reason": ...}``.

Each section's fields are named by a ``TypedDict`` that derives from :class:`SectionFields`,
beside the function that fills it; a test holds each to the plan format's schema and to what
its builder writes (tests/unit/test_plan_types.py).
"""

from __future__ import annotations

from typing import Generic, Literal, TypedDict, TypeVar, cast


class SectionFields(TypedDict, total=False):
    """What every section may carry besides its own fields.

    A section is either filled (its fields, ``sources`` and, where some field could not be
    filled, ``missing``) or not (``enabled`` false and ``reason``), so a section's own fields
    are all optional in its type."""

    enabled: bool  # False: not filled, see reason; True: shown by the sections the format flags
    reason: str
    sources: dict[str, str]  # field -> where its value comes from
    missing: dict[str, str]  # field -> why it is not filled


class DisabledSection(TypedDict):
    """A section (or one of coord's additions to the plan) that could not be filled."""

    enabled: Literal[False]
    reason: str


SectionT = TypeVar("SectionT", bound=SectionFields)


class Section(Generic[SectionT]):
    """A section being filled: each value with its source, each unfillable field with why."""

    def __init__(self) -> None:
        self.values: dict[str, object] = {}
        self.sources: dict[str, str] = {}
        self.missing: dict[str, str] = {}

    def put(self, name: str, value: object, source: str) -> None:
        self.values[name] = value
        self.sources[name] = source

    def lack(self, name: str, why: str) -> None:
        self.missing[name] = why

    def done(self, *, flagged: bool = False) -> SectionT:
        """The section; ``flagged`` sections carry ``"enabled": true`` as the format shows them."""
        if not self.sources:
            reasons = "; ".join(f"{name}: {why}" for name, why in self.missing.items())
            return self.disabled(reasons or "nothing measured")
        out: dict[str, object] = {**({"enabled": True} if flagged else {}), **self.values, "sources": self.sources}
        if self.missing:
            out["missing"] = self.missing
        # The names put are the section type's fields: tests/unit/test_plan_types.py checks every
        # section a full and an empty plan hold against its type.
        return cast(SectionT, out)

    def disabled(self, reason: str, **extra: object) -> SectionT:
        """The section unfilled, with why (and what else the reader needs to fill it)."""
        return cast(SectionT, {"enabled": False, "reason": reason, **extra})
