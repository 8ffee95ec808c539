"""Data set checks: chunking from 50,000 examples, each line as mlx-lm reads it, and the first
bad lines named with their numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.plan.datasets import (
    CHUNK_SIZE,
    MAX_BAD_LINES,
    chunk_plan,
    classify_example,
    count_lines,
    progress_message,
    validate_data_dir,
    validate_jsonl,
)

TEXT = {"text": "The cat sat on the mat."}
CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
COMPLETION = {"prompt": "2 + 2 =", "completion": " 4"}


def write_lines(path: Path, lines: list[str], end: str = "\n") -> Path:
    path.write_text("\n".join(lines) + end, encoding="utf-8")
    return path


def jsonl(path: Path, examples: list, **kwargs) -> Path:
    return write_lines(path, [json.dumps(example) for example in examples], **kwargs)


# --- chunking ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n, chunks", [(1, None), (49_999, None), (50_000, 1), (50_001, 2), (100_000, 2),
                                       (100_001, 3), (500_000, 10)])
def test_chunking_starts_at_exactly_50000_examples(n, chunks):
    assert CHUNK_SIZE == 50_000
    assert chunk_plan(n) == chunks


@pytest.mark.parametrize("n", [0, -1, -50_000])
def test_zero_or_negative_examples_is_an_error(n):
    with pytest.raises(ValueError, match=f"at least one example.*got {n}"):
        chunk_plan(n)


@pytest.mark.parametrize("n", [1.5, "50000", True, None])
def test_a_count_that_is_not_an_integer_is_refused(n):
    with pytest.raises(TypeError):
        chunk_plan(n)


def test_progress_reads_like_the_plan_format():
    assert progress_message(3, 10) == "Processing chunk 3/10 (30% complete)"
    assert progress_message(1, 3) == "Processing chunk 1/3 (33% complete)"


def test_a_large_file_is_checked_in_chunks_with_progress_and_line_numbers_across_chunks(tmp_path):
    lines = [json.dumps(TEXT)] * 100_001
    lines[74_999] = "{not json"  # line 75,000: in the second chunk
    path = write_lines(tmp_path / "train.jsonl", lines)
    messages = []
    report = validate_jsonl(path, progress=messages.append)
    assert messages == ["Processing chunk 1/3 (33% complete)", "Processing chunk 2/3 (66% complete)",
                        "Processing chunk 3/3 (100% complete)"]
    assert report["examples"] == 100_001 and report["chunks"] == 3 and report["chunk_size"] == 50_000
    assert report["valid"] == 100_000 and report["formats"]["text"] == 100_000
    assert report["bad_lines"] == [{"line": 75_000, "reason": report["bad_lines"][0]["reason"]}]
    assert report["bad_lines"][0]["reason"].startswith("not JSON: ")
    assert report["memory_management"] == {"gc_collect": True, "mx_clear_cache": False}
    assert report["progress_reporting"] == "Processing chunk 3/3 (100% complete)"


def test_a_small_file_is_checked_in_one_pass_without_progress(tmp_path):
    messages = []
    report = validate_jsonl(jsonl(tmp_path / "train.jsonl", [TEXT] * 49_999), progress=messages.append)
    assert messages == [] and report["chunks"] is None and report["ok"]
    assert report["memory_management"] is None and report["progress_reporting"] is None


def test_counting_streams_and_counts_a_last_line_without_newline(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "a"}\n{"text": "b"}')
    assert count_lines(path) == 2
    path.write_bytes(b"")
    assert count_lines(path) == 0


# --- lines ------------------------------------------------------------------------------------


@pytest.mark.parametrize("example, fmt", [(TEXT, "text"), (CHAT, "chat"), (COMPLETION, "completions"),
                                          ({**COMPLETION, "text": "x"}, "completions"),
                                          ({"messages": [{"role": "assistant", "content": None,
                                                          "tool_calls": [{"id": "1"}]}]}, "chat")])
def test_each_known_format_is_recognised_in_mlx_lm_s_order(example, fmt):
    assert classify_example(example) == (fmt, None)


@pytest.mark.parametrize("example, reason", [
    ([1, 2], "a JSON array, not an object"),
    ({"input": "x", "output": "y"}, "no known format: needs 'text', 'messages', or 'prompt' and 'completion' "
                                    "(keys: 'input', 'output')"),
    ({"text": 3}, "'text' must be a string, got number"),
    ({"text": "  "}, "'text' is empty"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"content": "hi"}]}, "messages[0] has no 'role' string"),
    ({"messages": [{"role": "user"}]}, "messages[0] has no 'content'"),
    ({"prompt": "a", "completion": None}, "'completion' must be a string, got null"),
])
def test_a_bad_example_says_what_is_wrong(example, reason):
    fmt, why = classify_example(example)
    assert why.startswith(reason)


def test_bad_lines_are_named_with_their_numbers_and_reasons(tmp_path):
    path = write_lines(tmp_path / "train.jsonl", [
        json.dumps(TEXT), "", json.dumps(CHAT), '{"text": "ok"', json.dumps(TEXT),
    ])
    path.write_bytes(path.read_bytes() + b'{"text": "\xff"}\n')
    report = validate_jsonl(path)
    assert report["ok"] is False and report["format"] == "text"
    assert [(bad["line"], bad["reason"].split(":")[0]) for bad in report["bad_lines"]] == [
        (2, "blank line (mlx-lm's json.loads fails on it)"),
        (3, "a chat example in a text file"),
        (4, "not JSON"),
        (6, "not UTF-8 (byte 11 of the line)"),
    ]
    assert report["examples"] == 6 and report["valid"] == 2 and report["bad_count"] == 4
    assert report["formats"] == {"completions": 0, "chat": 1, "text": 2}


def test_the_file_format_is_the_first_good_example_s(tmp_path):
    report = validate_jsonl(jsonl(tmp_path / "train.jsonl", ["oops", COMPLETION, TEXT, COMPLETION]))
    assert report["format"] == "completions"
    assert [bad["line"] for bad in report["bad_lines"]] == [1, 3]


def test_only_the_first_bad_lines_are_listed_but_all_are_counted(tmp_path):
    report = validate_jsonl(write_lines(tmp_path / "train.jsonl", ["nope"] * 25))
    assert len(report["bad_lines"]) == MAX_BAD_LINES and report["bad_count"] == 25
    assert [bad["line"] for bad in report["bad_lines"]] == list(range(1, MAX_BAD_LINES + 1))


def test_an_empty_file_has_no_examples_and_is_not_ok(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("")
    report = validate_jsonl(path)
    assert report["examples"] == 0 and report["ok"] is False and report["chunks"] is None


# --- data directories -------------------------------------------------------------------------


def test_a_data_dir_checks_train_valid_and_test(tmp_path):
    jsonl(tmp_path / "train.jsonl", [CHAT] * 5)
    jsonl(tmp_path / "valid.jsonl", [CHAT, {"text": 1}])
    report = validate_data_dir(tmp_path)
    assert report["splits"]["train"]["ok"] and report["splits"]["test"] is None
    assert report["ok"] is False
    assert report["problems"] == ["valid.jsonl: 1 bad line(s), the first at line 2: a text example in a chat "
                                  "file: mlx-lm reads every line as the first line's format"]
    assert report["examples"] == 5 and report["chunk_size"] == 50_000 and report["chunks"] is None


def test_a_data_dir_without_train_jsonl_is_refused(tmp_path):
    jsonl(tmp_path / "valid.jsonl", [TEXT])
    report = validate_data_dir(tmp_path)
    assert report["ok"] is False
    assert report["problems"][0].startswith("no train.jsonl in ")


def test_a_data_dir_prefixes_progress_with_the_file(tmp_path, monkeypatch):
    from coordinator.plan import datasets

    jsonl(tmp_path / "train.jsonl", [TEXT] * 30)
    monkeypatch.setattr(datasets, "CHUNK_SIZE", 10)
    messages = []
    report = validate_data_dir(tmp_path, progress=messages.append)
    assert messages == ["train.jsonl: Processing chunk 1/3 (33% complete)",
                        "train.jsonl: Processing chunk 2/3 (66% complete)",
                        "train.jsonl: Processing chunk 3/3 (100% complete)"]
    assert report["ok"] and report["chunks"] == 3
