"""The source tree's symlinks and names, judged on the head before anything is sent.

A link that points inside the source tree is sent as a link, with its target as it is (or, when
its text could not be checked on a node, such as an absolute path into the tree, as the relative
path that reaches the same place). A link that leads out of the tree is what rsync calls an
unsafe link: coord refuses the sync by default and names each one, because sending the link
itself gives the nodes a link to a place they may not have (rsync's default), and dropping it
(rsync's ``--safe-links``) loses the model a project links to without a word. With
``--follow-outside-links`` (rsync's ``--copy-unsafe-links``) such a link is copied by content:
the file or the directory it leads to arrives on the nodes under the link's name, listed in the
report. A name that a node would refuse (``shared.paths.name_problem``; one that is not UTF-8 is
not even in the manifest: ``shared.manifest``) is not sent, and named with why; the rest of the
tree is. A dry run runs the same checks and says the same.

``decide_link``, ``refusal`` and ``names_left_out`` are pure; ``SourceLinks`` gathers each link's
facts from the head's disk during the source's scan and keeps what was decided.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from shared.manifest import LinkChoice
from shared.paths import link_target_problem, name_problem, printable_name

FLAG = "--follow-outside-links"
LISTED = 200  # links and names kept in a report, each list
SAID = 10  # named in the one-line detail, each list


class OutsideLink(TypedDict):
    """A link in the source that leads out of it, and what the sync did with it."""

    path: str  # the link, relative to the source
    target: str  # its text
    leads_to: str  # where it leads on the head
    action: Literal["followed", "refused"]
    why: str


@dataclass(frozen=True)
class LinkFacts:
    """One link as the head's disk shows it."""

    rel: str
    text: str  # what readlink gives
    real: str  # where it leads, every link on the way followed
    exists: bool  # that place exists
    inside: str | None  # that place relative to the source's root, when it is inside the tree
    loops: bool  # it leads to its own directory or one above it: following it would never end


def decide_link(facts: LinkFacts, follow_outside: bool) -> tuple[LinkChoice, OutsideLink | None]:
    """Keep it as a link (inside the tree), follow it or refuse it (outside): the walk's choice, and the
    report's entry for a link that leads outside."""
    if facts.inside is not None:
        if link_target_problem(facts.rel, facts.text) is None:
            return LinkChoice(target=facts.text), None
        # An absolute path into the tree, or a '..' after a name: the same place, said relatively.
        relative = posixpath.relpath(facts.inside or ".", posixpath.dirname(facts.rel) or ".")
        if link_target_problem(facts.rel, relative) is None:
            return LinkChoice(target=relative), None
    if not follow_outside:
        return LinkChoice(), _outside(facts, "refused", "leads out of the source tree")
    if not facts.exists:
        return LinkChoice(), _outside(facts, "refused", f"leads to {facts.real}, which does not exist on the head")
    if facts.loops:
        return LinkChoice(), _outside(facts, "refused", "leads to a directory that holds it: copying it would "
                                                        "never end")
    return LinkChoice(follow=True), _outside(facts, "followed", f"copied by content ({FLAG})")


def _outside(facts: LinkFacts, action: Literal["followed", "refused"], why: str) -> OutsideLink:
    return {"path": facts.rel, "target": facts.text, "leads_to": facts.real, "action": action, "why": why}


def link_facts(real_root: str, rel: str, path: str) -> LinkFacts:
    """The facts ``decide_link`` needs, read from the head's disk (``path`` is the link's full path)."""
    real = os.path.realpath(path)
    inside = "" if real == real_root else real[len(real_root) + 1:] if real.startswith(real_root + "/") else None
    here = os.path.realpath(os.path.dirname(path))
    return LinkFacts(rel=rel, text=os.readlink(path), real=real, exists=os.path.exists(path), inside=inside,
                     loops=here == real or here.startswith(real + "/"))


@dataclass
class SourceLinks:
    """The source scan's ``on_link``: each link decided, the links to send and the ones outside kept."""

    root: str
    follow_outside: bool
    kept: dict[str, str] = field(default_factory=dict)  # rel -> target, links sent as links
    outside: list[OutsideLink] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.real_root = os.path.realpath(self.root)

    def __call__(self, rel: str, path: str) -> LinkChoice:
        choice, outside = decide_link(link_facts(self.real_root, rel, path), self.follow_outside)
        if outside is not None:
            self.outside.append(outside)
        if choice.target is not None:
            self.kept[rel] = choice.target
        return choice


#: Why a name the head's walk found is in no manifest (``ScanStats.unlisted``).
NOT_UTF8 = "not valid UTF-8 (names cross the wire as UTF-8, and a Mac's disk takes no other)"
NOT_UTF8_DIR = f"a directory whose name is {NOT_UTF8}: nothing in it was sent"


def refused_names(paths: Mapping[str, Any]) -> list[list[str]]:
    """[path, why] of every path a node would refuse."""
    return [[rel, why] for rel in paths if (why := name_problem(rel)) is not None]


def names_not_sent(refused: list[list[str]], unlisted: list[str], unlisted_count: int) -> tuple[list[list[str]], int]:
    """The report's list of names the sync did not send, each as ``printable_name`` writes it with why (at most
    LISTED), and how many there are: the names a node would refuse, then those the walk could not list
    (``unlisted``: already printable, a directory's with a "/" after it)."""
    listed = [[printable_name(rel), why] for rel, why in refused[:LISTED]]
    listed += [[rel, NOT_UTF8_DIR if rel.endswith("/") else NOT_UTF8] for rel in unlisted[:LISTED - len(listed)]]
    return listed, len(refused) + unlisted_count


def names_left_out(names: list[list[str]], count: int) -> str | None:
    """The words a sync's detail adds for the names it did not send (each said, up to SAID), or None."""
    if not count:
        return None
    listed = ", ".join(f"{rel} ({why})" for rel, why in names[:SAID])
    return (f"{_count(count, 'name')} not sent: {listed}{_more(count)}; rename them, or list them in .coordignore "
            "(the rest of the tree was sent)")


def refusal(outside: list[OutsideLink]) -> str | None:
    """Why the sync sends nothing (each link said, up to SAID), or None when it may go on."""
    links = [entry for entry in outside if entry["action"] == "refused"]
    if not links:
        return None
    listed = ", ".join(f"{e['path']} -> {e['target']} ({e['why']})" for e in links[:SAID])
    return (f"nothing was sent: {_count(len(links), 'link')} the sync cannot send: {listed}{_more(len(links))}; "
            f"pass {FLAG} to copy what they point to, or list them in .coordignore")


def _count(n: int, what: str) -> str:
    return f"1 {what}" if n == 1 else f"{n} {what}s"


def _more(n: int) -> str:
    return f" and {n - SAID} more" if n > SAID else ""
