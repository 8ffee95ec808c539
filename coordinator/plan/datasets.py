"""Check a JSONL data set the way mlx-lm will read it, in chunks for large files.

mlx-lm (``mlx_lm/tuner/datasets.py``) loads each of ``train``/``valid``/``test.jsonl`` with
``json.loads`` on every line and picks the format from the first example, in this
order: ``prompt`` and ``completion`` (completions), ``messages`` (chat), ``text``. Every
other line is then read as that format, so a line of another format fails the run. A
blank line fails ``json.loads`` too.

Files are streamed, never loaded whole: one pass counts the lines, a second checks them.
From :data:`CHUNK_SIZE` examples on, the check runs in chunks of that many lines,
reports ``Processing chunk 3/10 (30% complete)`` after each, and lets the chunk's
findings go (and collects garbage) before the next.
"""

from __future__ import annotations

import gc
import json
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, TypedDict

CHUNK_SIZE = 50_000
#: How many bad lines a report names; the rest are only counted.
MAX_BAD_LINES = 10
SPLITS = ("train", "valid", "test")
#: mlx-lm's order of preference when it picks a file's format from its first example.
FORMATS = ("completions", "chat", "text")
_READ_BLOCK = 1 << 20
_MEMORY_MANAGEMENT = {"gc_collect": True, "mx_clear_cache": False}  # the check never touches MLX

Progress = Callable[[str], None]
#: One line of the user's data set as json.loads read it: free-form, each key checked where it is read.
Example = dict[str, Any]


class BadLine(TypedDict):
    line: int  # from 1
    reason: str


class SplitReport(TypedDict):
    """One JSONL file, every line checked as mlx-lm will read it (:func:`validate_jsonl`)."""

    source: str  # the file
    examples: int  # its lines
    valid: int
    ok: bool
    format: str | None  # what mlx-lm reads every line as (the first good example's)
    formats: dict[str, int]  # each line's own format: how many of each
    bad_lines: list[BadLine]  # the first MAX_BAD_LINES
    bad_count: int
    chunk_size: int
    chunks: int | None  # None: read in one pass
    memory_management: dict[str, bool] | None  # what is done between chunks
    progress_reporting: str | None  # the last progress message


class DatasetReport(TypedDict):
    """A data directory as ``mlx_lm lora --data`` reads it (:func:`validate_data_dir`); the last five
    fields are the train split's, which the plan's coordinator_chunking section shows."""

    source: str  # the directory
    ok: bool
    splits: dict[str, SplitReport | None]  # train, valid, test: None where the file is missing
    problems: list[str]
    examples: int | None
    chunk_size: int
    chunks: int | None
    memory_management: dict[str, bool] | None
    progress_reporting: str | None


def chunk_plan(n_examples: int) -> int | None:
    """The number of chunks for ``n_examples``, or None below :data:`CHUNK_SIZE` (one pass)."""
    if isinstance(n_examples, bool) or not isinstance(n_examples, int):
        raise TypeError(f"n_examples must be an integer, got {type(n_examples).__name__}")
    if n_examples <= 0:
        raise ValueError(f"a data set needs at least one example to be chunked, got {n_examples}")
    if n_examples < CHUNK_SIZE:
        return None
    return math.ceil(n_examples / CHUNK_SIZE)


def progress_message(chunk: int, chunks: int) -> str:
    return f"Processing chunk {chunk}/{chunks} ({chunk * 100 // chunks}% complete)"


def count_lines(path: str | Path) -> int:
    """Lines in the file, read in 1 MiB blocks; a last line without a newline counts."""
    count, last = 0, b"\n"
    with open(path, "rb") as handle:
        while block := handle.read(_READ_BLOCK):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


_FORMAT_KEYS = {"completions": ("prompt", "completion"), "chat": ("messages",), "text": ("text",)}


def detect_format(example: Example) -> str | None:
    """The format mlx-lm picks for this example (its keys, in mlx-lm's order), or None."""
    for name in FORMATS:
        if all(key in example for key in _FORMAT_KEYS[name]):
            return name
    return None


def classify_example(example: Any, file_format: str | None = None) -> tuple[str | None, str | None]:
    """(the example's own format or None, why mlx-lm cannot read it or None).

    ``file_format`` is the format mlx-lm chose for the file (from its first example):
    every example is read as that format.
    """
    if not isinstance(example, dict):
        return None, f"a JSON {_json_kind(example)}, not an object"
    detected = detect_format(example)
    if detected is None:
        keys = ", ".join(repr(k) for k in list(example)[:5]) or "none"
        return None, f"no known format: needs 'text', 'messages', or 'prompt' and 'completion' (keys: {keys})"
    read_as = file_format or detected
    if not all(key in example for key in _FORMAT_KEYS[read_as]):
        return detected, (f"a {detected} example in a {read_as} file: mlx-lm reads every line as the first "
                          "line's format")
    return detected, _FORMAT_PROBLEMS[read_as](example)


def _completions_problem(example: Example) -> str | None:
    for key in ("prompt", "completion"):
        if not isinstance(example[key], str):
            return f"{key!r} must be a string, got {_json_kind(example[key])}"
    return None


def _chat_problem(example: Example) -> str | None:
    messages = example["messages"]
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{index}] is a JSON {_json_kind(message)}, not an object"
        if not isinstance(message.get("role"), str):
            return f"messages[{index}] has no 'role' string"
        # An assistant turn that only calls tools may carry no content (OpenAI's format).
        if message.get("content") is None and message.get("tool_calls"):
            continue
        if not isinstance(message.get("content"), (str, list)):
            return f"messages[{index}] has no 'content' (a string or a list of parts)"
    return None


def _text_problem(example: Example) -> str | None:
    if not isinstance(example["text"], str):
        return f"'text' must be a string, got {_json_kind(example['text'])}"
    if not example["text"].strip():
        return "'text' is empty"
    return None


_FORMAT_PROBLEMS = {"completions": _completions_problem, "chat": _chat_problem, "text": _text_problem}


@dataclass
class _Findings:
    formats: Counter = field(default_factory=Counter)
    first_format: str | None = None
    bad: list[BadLine] = field(default_factory=list)
    bad_count: int = 0

    def add_bad(self, line: int, reason: str) -> None:
        self.bad_count += 1
        if len(self.bad) < MAX_BAD_LINES:
            self.bad.append({"line": line, "reason": reason})

    def merge(self, other: _Findings) -> None:
        self.formats.update(other.formats)
        self.first_format = self.first_format or other.first_format
        self.bad_count += other.bad_count
        self.bad.extend(other.bad[:MAX_BAD_LINES - len(self.bad)])


def validate_jsonl(path: str | Path, progress: Progress | None = None) -> SplitReport:
    """Check every line of a JSONL file as mlx-lm will read it.

    Returns::

        {"source": path, "examples": lines, "valid": n, "ok": bool,
         "format": the format mlx-lm reads every line as (the first good example's) | None,
         "formats": {"completions": n, "chat": n, "text": n} (each line's own format),
         "bad_lines": [{"line": 1-based number, "reason"}] (the first MAX_BAD_LINES),
         "bad_count": n, "chunk_size": CHUNK_SIZE, "chunks": n | None,
         "memory_management": {...} | None, "progress_reporting": last message | None}
    """
    examples = count_lines(path)
    chunks = chunk_plan(examples) if examples else None
    total = _Findings()
    last_message = None
    with open(path, "rb") as handle:
        lines = enumerate(handle, start=1)
        for chunk in range(1, (chunks or 1) + 1):
            findings = _check_lines(lines, CHUNK_SIZE if chunks else examples, total.first_format)
            total.merge(findings)
            if chunks:
                # The chunk's findings are merged; drop them before reading the next chunk.
                del findings
                gc.collect()
                last_message = progress_message(chunk, chunks)
                if progress is not None:
                    progress(last_message)
    return {
        "source": str(path), "examples": examples, "valid": examples - total.bad_count,
        "ok": examples > 0 and total.bad_count == 0,
        "format": total.first_format, "formats": {name: total.formats.get(name, 0) for name in FORMATS},
        "bad_lines": total.bad, "bad_count": total.bad_count,
        "chunk_size": CHUNK_SIZE, "chunks": chunks,
        "memory_management": _MEMORY_MANAGEMENT if chunks else None,
        "progress_reporting": last_message,
    }


def _check_lines(lines: Iterator[tuple[int, bytes]], limit: int, file_format: str | None) -> _Findings:
    """Check up to ``limit`` lines; the file's format is its first good example's, as in mlx-lm."""
    findings = _Findings(first_format=file_format)
    for number, raw in islice(lines, limit):
        detected, why = _check_line(raw, findings.first_format)
        if detected is not None:
            findings.formats[detected] += 1
        if why is not None:
            findings.add_bad(number, why)
        elif findings.first_format is None:
            findings.first_format = detected
    return findings


def _check_line(raw: bytes, file_format: str | None) -> tuple[str | None, str | None]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return None, f"not UTF-8 (byte {error.start + 1} of the line)"
    if not text.strip():
        return None, "blank line (mlx-lm's json.loads fails on it)"
    try:
        example = json.loads(text)
    except ValueError as error:
        return None, f"not JSON: {error}"
    return classify_example(example, file_format)


def validate_data_dir(directory: str | Path, progress: Progress | None = None) -> DatasetReport:
    """Check ``train``/``valid``/``test.jsonl`` in ``directory`` as ``mlx_lm lora --data`` reads it.

    Returns ``{"source", "ok", "splits": {split: validate_jsonl() | None}, "problems": [str],
    "examples", "chunk_size", "chunks", "memory_management", "progress_reporting"}``: the
    last five are the train split's (what the plan's coordinator_chunking section shows).
    ``train.jsonl`` is required; a missing ``valid.jsonl`` only means no validation.
    """
    root = Path(directory)
    splits: dict[str, SplitReport | None] = {}
    problems = []
    for split in SPLITS:
        path = root / f"{split}.jsonl"
        if not path.is_file():
            splits[split] = None
            continue
        report = validate_jsonl(path, _prefixed(progress, split))
        splits[split] = report
        if report["examples"] == 0:
            problems.append(f"{split}.jsonl is empty")
        elif report["bad_count"]:
            first = report["bad_lines"][0]
            problems.append(f"{split}.jsonl: {report['bad_count']} bad line(s), the first at line {first['line']}: "
                            f"{first['reason']}")
    if splits["train"] is None:
        problems.insert(0, f"no train.jsonl in {root}: mlx-lm needs one to train")
    train = splits["train"]
    return {
        "source": str(root), "ok": not problems, "splits": splits, "problems": problems,
        "examples": train["examples"] if train else None, "chunk_size": CHUNK_SIZE,
        "chunks": train["chunks"] if train else None,
        "memory_management": train["memory_management"] if train else None,
        "progress_reporting": train["progress_reporting"] if train else None,
    }


def _prefixed(progress: Progress | None, split: str) -> Progress | None:
    if progress is None:
        return None
    return lambda message: progress(f"{split}.jsonl: {message}")


def _json_kind(value: Any) -> str:
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"
