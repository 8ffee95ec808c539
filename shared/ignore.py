"""Ignore rules in gitignore syntax, for the trees coord syncs and hashes.

Both sides apply the same rules (the daemon sends its patterns to the agents),
so a node never reports a file the head would not send. Stdlib only: this runs
with the node's Python.

Supported, as in git: comments, ``\\#`` and ``\\!`` escapes, ``!`` negation
(last match wins), a trailing ``/`` for directories only, anchoring by a leading
or inner ``/``, ``*``, ``?``, ``[...]`` and ``**`` (leading, trailing, inner).
As in git, nothing inside an ignored directory can be re-included.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Always ignored: version control, caches, virtual environments, coord's own
#: state and the checkpoint directory (which a sync must never send or delete).
DEFAULT_PATTERNS = (
    ".git/",
    ".hg/",
    ".svn/",
    "__pycache__/",
    "*.pyc",
    ".DS_Store",
    ".venv/",
    "venv/",
    ".coord/",
    ".coordignore.local",
    "/checkpoints/",
    "/adapters/",
    ".mypy_cache/",
    ".pytest_cache/",
    ".ipynb_checkpoints/",
)


@dataclass(frozen=True)
class Rule:
    pattern: str
    regex: re.Pattern
    negate: bool
    dir_only: bool
    #: A pattern without a slash matches a path's last component, at any depth: its regex is
    #: matched against the name alone (as git does), which is also what makes a walk cheap.
    on_name: bool = False


def _translate(glob: str) -> str:
    """A gitignore glob (without anchoring and trailing slash) to a regex body."""
    out = []
    i, n = 0, len(glob)
    while i < n:
        c = glob[i]
        if c == "*":
            if glob.startswith("**", i):
                before_ok = i == 0 or glob[i - 1] == "/"
                after = glob[i + 2:i + 3]
                if before_ok and after == "/":
                    out.append("(?:.*/)?")  # "**/": zero or more directories
                    i += 3
                    continue
                if before_ok and after == "":
                    out.append(".*")  # trailing "/**": everything inside
                    i += 2
                    continue
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = glob.find("]", i + 2 if glob[i + 1:i + 2] in ("!", "^") else i + 1)
            if end == -1:
                out.append(re.escape(c))
            else:
                body = glob[i + 1:end]
                if body[:1] in ("!", "^"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = end
        elif c == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(glob[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def compile_rule(line: str) -> Rule | None:
    text = line.rstrip("\n").rstrip("\r")
    # Trailing spaces are ignored unless escaped.
    while text.endswith(" ") and not text.endswith("\\ "):
        text = text[:-1]
    if not text or text.startswith("#"):
        return None
    negate = text.startswith("!")
    if negate or text.startswith("\\!") or text.startswith("\\#"):
        text = text[1:]
    dir_only = text.endswith("/")
    text = text.rstrip("/")
    if not text:
        return None
    anchored = "/" in text
    text = text.lstrip("/")
    # \Z, not $: "$" also matches before a final newline, and a name may end in one.
    return Rule(line, re.compile(f"^{_translate(text)}\\Z", re.DOTALL), negate, dir_only, on_name=not anchored)


#: What coord itself writes into a tree (hash caches, rank state): never user data, so never part of a
#: manifest, a sync or a consistency check, whatever patterns a caller gives (an empty list included).
#: Last, so that no negation before it can bring it back.
#: The temporaries beside a file being written (a sync's, a relay's) are left behind only by an
#: agent killed mid-write.
ALWAYS_IGNORED = (".coord/", ".*.coord-relay-*", ".*.coord-[0-9]*-[0-9]*")


class IgnoreRules:
    def __init__(self, patterns: list[str] | tuple[str, ...] = ()):
        self.patterns = list(patterns) + list(ALWAYS_IGNORED)
        self.rules = [rule for rule in map(compile_rule, self.patterns) if rule is not None]
        # Without negations the order of rules does not matter: one alternation per kind
        # of path replaces a dozen regex calls per file (a 10,000-file tree notices).
        # Four of them: rules on the name or on the whole path, for any path or for directories only.
        self._combined: tuple[re.Pattern | None, ...] | None = None
        if not any(rule.negate for rule in self.rules):
            self._combined = tuple(_alternation([r for r in self.rules if r.on_name == on_name and r.dir_only == dirs])
                                   for on_name in (True, False) for dirs in (False, True))

    @classmethod
    def with_defaults(cls, extra: list[str] | tuple[str, ...] = ()) -> IgnoreRules:
        return cls(list(DEFAULT_PATTERNS) + list(extra))

    def file_rules(self) -> tuple:
        """For a walk's files: (match on the name, match on the path or None), each a bound
        ``re.Pattern.match``; (None, None) where the rules have negations and must run in order
        through ``matches``."""
        if self._combined is None:
            return None, None
        name_any, _, path_any, _ = self._combined
        return (name_any or _NEVER).match, (path_any.match if path_any is not None else None)

    def matches(self, path: str, is_dir: bool, name: str | None = None) -> bool:
        """Whether this path itself is ignored (its parents are the walker's business).

        ``name`` is the path's last component, when the caller has it at hand (a walk does).
        """
        if name is None:
            name = path.rpartition("/")[2]
        if self._combined is not None:
            name_any, name_dir, path_any, path_dir = self._combined
            return bool((name_any is not None and name_any.match(name)) or
                        (path_any is not None and path_any.match(path)) or
                        (is_dir and ((name_dir is not None and name_dir.match(name)) or
                                     (path_dir is not None and path_dir.match(path)))))
        ignored = False
        for rule in self.rules:
            if rule.dir_only and not is_dir:
                continue
            if rule.regex.match(name if rule.on_name else path):
                ignored = not rule.negate
        return ignored


_NEVER = re.compile(r"(?!)")  # matches nothing


def _alternation(rules: list[Rule]) -> re.Pattern | None:
    return re.compile("|".join(f"(?:{r.regex.pattern})" for r in rules), re.DOTALL) if rules else None


def read_ignore_file(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
