"""The state of a rank's processes (agent/proc_state.py): /proc and ps output, parsed."""

from __future__ import annotations

from agent import proc_state


def test_proc_stat_states_are_read_after_the_command_name():
    assert proc_state.parse_proc_stat("1234 (python3) T 1 1234 1234 0 -1") == "T"
    assert proc_state.parse_proc_stat("99 (a (b) c) D 1 99") == "D"  # a name with parentheses and spaces
    assert proc_state.parse_proc_stat("") is None and proc_state.parse_proc_stat("1 (x)") is None


def test_ps_output_gives_each_process_its_state_parent_and_group():
    text = """  501     1  501 Ss
  502   501  501 T
  503   502  501 U+
  600     1  600 R
 junk line
  700   501  501
"""
    assert proc_state.parse_ps_table(text) == {501: ("S", 1, 501), 502: ("T", 501, 501), 503: ("U", 502, 501),
                                               600: ("R", 1, 600)}
    assert proc_state.parse_ps_table("") == {}


def test_proc_stat_fields_are_read_after_the_command_name():
    assert proc_state.parse_stat_fields("1234 (torch run) S 77 1234 1234 0 -1") == ("S", 77, 1234)
    assert proc_state.parse_stat_fields("1 (x)") is None


def test_a_ranks_processes_are_its_group_and_everything_below_its_runner():
    # runner 10 (group 10) started torchrun 11 in group 11 (the rank's group); torchrun's workers 20 and
    # 21 each lead a session of their own, and 21 has a child 30; 40 is someone else's.
    table = {10: ("S", 1, 10), 11: ("S", 10, 11), 20: ("T", 11, 20), 21: ("S", 11, 21), 30: ("D", 21, 21),
             40: ("R", 1, 40)}
    assert sorted(proc_state.descendants_in(table, 10)) == [11, 20, 21, 30]
    assert proc_state.rank_processes(11, 10, table) == {11: "S", 20: "T", 21: "S", 30: "D"}
    assert proc_state.rank_processes(11, None, table) == {11: "S"}  # without the runner: the group alone
    # a worker orphaned by a killed torchrun is adopted by the runner (its subreaper): still the rank's
    table[20] = ("T", 10, 20)
    del table[11]
    table[50] = ("S", 10, 10)  # the runner's own helper (caffeinate), in the runner's group: not the rank's
    assert proc_state.summarize(proc_state.rank_processes(11, 10, table)) == proc_state.STOPPED
    assert 50 not in proc_state.rank_processes(11, 10, table)


def test_a_group_is_summed_up_in_one_word():
    assert proc_state.summarize({1: "S", 2: "T"}) == proc_state.STOPPED
    assert proc_state.summarize({1: "S", 2: "D"}) == proc_state.UNINTERRUPTIBLE
    assert proc_state.summarize({1: "U"}) == proc_state.UNINTERRUPTIBLE  # macOS's uninterruptible wait
    assert proc_state.summarize({1: "R", 2: "t"}) == proc_state.RUNNING  # a debugger's stop is no hang
    assert proc_state.summarize({1: "Z"}) is None and proc_state.summarize({}) is None
