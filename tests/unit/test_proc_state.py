"""The state of a rank's processes (agent/proc_state.py): /proc and ps output, parsed."""

from __future__ import annotations

from agent import proc_state


def test_proc_stat_states_are_read_after_the_command_name():
    assert proc_state.parse_proc_stat("1234 (python3) T 1 1234 1234 0 -1") == "T"
    assert proc_state.parse_proc_stat("99 (a (b) c) D 1 99") == "D"  # a name with parentheses and spaces
    assert proc_state.parse_proc_stat("") is None and proc_state.parse_proc_stat("1 (x)") is None


def test_ps_states_are_kept_for_the_group_only():
    text = """  501  501 Ss
  502  501 T
  503  501 U+
  600  600 R
 junk line
  700  501
"""
    assert proc_state.parse_ps_states(text, 501) == {501: "S", 502: "T", 503: "U"}
    assert proc_state.parse_ps_states("", 501) == {}


def test_a_group_is_summed_up_in_one_word():
    assert proc_state.summarize({1: "S", 2: "T"}) == proc_state.STOPPED
    assert proc_state.summarize({1: "S", 2: "D"}) == proc_state.UNINTERRUPTIBLE
    assert proc_state.summarize({1: "U"}) == proc_state.UNINTERRUPTIBLE  # macOS's uninterruptible wait
    assert proc_state.summarize({1: "R", 2: "t"}) == proc_state.RUNNING  # a debugger's stop is no hang
    assert proc_state.summarize({1: "Z"}) is None and proc_state.summarize({}) is None
