"""A rank's output, cut into the excerpts coord shows (an outcome's last line, a known failure's log
line), comes without terminal escape sequences or control characters (shared/text.py's
``clean_excerpt``). Where those excerpts are shown (events, alerts, the dashboard, coord status) is
tested with a real daemon in tests/integration/test_bad_input_local.py."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.jobs.diagnosis import diagnose_log
from coordinator.jobs.policy import EXCERPT_CHARS, last_line
from shared.text import clean_excerpt, unprintable


@pytest.mark.parametrize("raw,shown", [
    ("\x1b[38;5;244mstep 3\x1b[0m loss 2.1", "step 3 loss 2.1"),  # 256-colour CSI, as the issue showed
    ("\x1b[1;31mError:\x1b[m boom", "Error: boom"),
    ("\x1b[2K\x1b[1Gprogress", "progress"),  # erase line, cursor to column 1
    ("\x1b]0;window title\x07done", "done"),  # OSC ended by BEL
    ("\x1b]8;;https://example.com\x1b\\link\x1b]8;;\x1b\\", "link"),  # OSC 8 hyperlink, ended by ST
    ("\x1bP1$r0m\x1b\\after", "after"),  # DCS
    ("\x1b(Bplain\x1b7\x1b8", "plain"),  # charset choice, save and restore cursor
    ("\u009b31mC1 CSI\u009b0m", "C1 CSI"),
    ("bell\x07 nul\x00 del\x7f back\x08space", "bell nul del backspace"),
    ("tab\tand\rreturn", "tab and return"),
    ("ok \u202eevil\u202c \u2066iso\u2069", "ok evil iso"),  # bidi overrides and isolates
    ("half an escape \x1b[", "half an escape"),
    ("loss 0.5 名前 ✓", "loss 0.5 名前 ✓"),  # text, any script, untouched
    ("   plain   ", "plain"),
])
def test_escapes_and_control_characters_are_removed_and_the_words_kept(raw, shown):
    assert clean_excerpt(raw) == shown


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.one_of(st.characters(), st.sampled_from(["\x1b", "[", "]", ";", "m", "\x07", "\\"])),
               max_size=60))
def test_an_excerpt_holds_nothing_a_terminal_acts_on_whatever_the_output(raw):
    shown = clean_excerpt(raw)
    assert all(unicodedata.category(c) not in ("Cc", "Cs") for c in shown)
    assert not any(c in shown for c in "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
    assert clean_excerpt(shown) == shown


def test_an_outcomes_last_line_is_the_last_with_words_cleaned_then_cut():
    output = "\x1b[32mstep 1\x1b[0m\n\x1b[31mRuntimeError: boom\x1b[0m\n\x1b[0m\n  \n"
    assert last_line(output) == "RuntimeError: boom"
    colourful = "\x1b[38;5;244m" * 100 + "x" * 400
    assert last_line(colourful) == "x" * EXCERPT_CHARS  # the escapes took no room
    assert last_line("") == "" and last_line("\x1b[0m\n") == ""
    assert unprintable(last_line("a\x1b]0;t\x07b\x00c")) is None


def test_a_known_failure_is_found_through_the_colours_and_its_line_shown_without_them():
    log = ("\x1b[2mloading\x1b[0m\n"
           "\x1b[31m[METAL] Command buffer execution failed: Caused GPU \x1b[1mTimeout\x1b[22m Error\x1b[0m\n")
    found = diagnose_log(log)
    assert found, "the colour codes hid the failure"
    assert found[0]["line"] == "[METAL] Command buffer execution failed: Caused GPU Timeout Error"
    assert found[0]["line_number"] == 2
