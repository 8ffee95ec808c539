"""Every option of every `coord` command, tried with hostile values, in-process and with no daemon
running: each is refused with exit status 2 and a message naming the option, or accepted and the
command goes on until it needs the daemon (also exit 2: "coordd is not running"); never a
traceback, never a value quietly replaced.

The options are found by walking the argparse parser, so a new option is tried without a new test;
one whose value has no declared checker (coordinator/config/option_values.py) fails the first test.
The commands that act outside the process (init, trust, daemon, demo, agent-bundle) are replaced by
a stand-in once the command line is read: what is tried here is what is checked before they act.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import re
import socket
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import coordinator.cli.parser as cli_parser
from coordinator.cli.client import CliError
from coordinator.cli.main import main
from coordinator.config import option_values as ov
from coordinator.config.cluster_file import NODE_NAME
from coordinator.jobs.spec import JOB_NAME
from shared.text import unprintable

#: The commands that act outside this process, replaced by a stand-in for these tests.
ACTING = ("cmd_init", "cmd_trust", "cmd_daemon", "cmd_demo", "cmd_agent_bundle")
REACHED = "REACHED THE COMMAND"
NOT_RUNNING = "coordd is not running"
EXAMPLES = 25  # random draws per option (beside FIXED): about 120 options, the module in about 15 s
TRIED: Counter[str] = Counter()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _all_options() -> list[tuple[str, argparse.Action]]:
    out = []
    for command, sub in _subparsers(cli_parser.build_parser()).items():
        out += [(command, a) for a in sub._actions if not isinstance(a, argparse._HelpAction)]
    return out


OPTIONS = _all_options()


def _option_id(entry: tuple[str, argparse.Action]) -> str:
    command, action = entry
    return f"{command} {_flag(action) or action.dest}"


def _flag(action: argparse.Action) -> str | None:
    longs = [o for o in action.option_strings if o.startswith("--")]
    return longs[0] if longs else (action.option_strings[0] if action.option_strings else None)


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """Paths of every kind, a cluster file, a socket file no daemon listens on, and the commands that
    act outside the process replaced by a stand-in."""
    root = tmp_path_factory.mktemp("bad-input")
    (root / "dir").mkdir()
    (root / "file.txt").write_text("not a directory\n")
    (root / "job.toml").write_text('name = "j1"\ncommand = ["python", "train.py"]\n')
    (root / "bad.toml").write_text("this is = = not toml\n")
    (root / "cluster.toml").write_text('[cluster]\nname = "c"\nstate_dir = "state"\n[[nodes]]\nname = "a"\n'
                                       'host = "local"\nworkdir = "/w"\n')
    short = Path(os.environ.get("TMPDIR", "/tmp"))
    stale = short / f"coord-bad-input-{os.getpid()}.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(stale))
    listener.close()  # a socket file nothing answers on: what a crashed daemon leaves
    paths = {
        "none_socket": str(short / f"coord-bad-input-none-{os.getpid()}.sock"),
        "stale_socket": str(stale),
        "dir": str(root / "dir"),
        "file": str(root / "file.txt"),
        "job": str(root / "job.toml"),
        "bad_toml": str(root / "bad.toml"),
        "cluster": str(root / "cluster.toml"),
        "missing": str(root / "does" / "not" / "exist"),
        "missing_leaf": str(root / "absent.toml"),
        "under_file": str(root / "file.txt" / "x"),
        "long": str(root / ("x" * 300)),
        "no_user": "~no-such-user-here/x",
        "new_file": str(root / "dir" / "new.out"),
    }

    def stand_in(args: argparse.Namespace) -> int:
        raise CliError(REACHED, 2)

    with pytest.MonkeyPatch.context() as patch:
        for name in ACTING:
            patch.setattr(cli_parser, name, stand_in)
        # The parser is built once, with the stand-ins, and read again for each command line (building it
        # is most of what a call costs; reading does not change it).
        parser = cli_parser.build_parser()
        patch.setattr(cli_parser, "build_parser", lambda: parser)
        patch.delenv("COORD_SOCKET", raising=False)
        patch.delenv("COORD_CONFIG", raising=False)
        patch.chdir(root / "dir")
        yield paths
    stale.unlink(missing_ok=True)


def run_cli(argv: list[str]) -> tuple[int, str]:
    """``coord ARGV`` in this process: its exit status and what it wrote to stderr. Anything but
    SystemExit (a traceback) fails the test that called it."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        else:
            code = 0
    return code, err.getvalue()


# --- the values tried ---------------------------------------------------------------------------

NUMBERS = st.one_of(
    st.integers(-(10**30), 10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "NaN", "-nan", "inf", "-inf", "+inf", "Infinity", "1e309", "-1e309", "-0", "0", "-1",
                     "1", "2", "3", "60", "1e-320", "9" * 40, "0x10", "1_000", "\uff11\uff12", " 5 ", "3.5", "1e3"]))
ODD_TEXT = st.sampled_from([
    "", " ", "-", "--", "-x", "\x1b[38;5;244mgrey", "\x1b]0;title\x07", "a\x00b", "a\nb", "tab\there", "\x7f",
    "\u202eevil", "zero\u200bwidth", "\ufeffbom", "\ud800", "\U000e0001tag", "\u2028", "\x9bcsi", "é", "名前",
    "emoji\U0001f600", "a" * 5000, "j1", "a,b", "a,,b", "a,a", ",", "head", "none", "ring", "mlx_lm", "lora", "v2",
    "alice@10.0.0.2", "n1=bob@host:22", "user@", ":22", "SHA256:" + "A" * 43, "job-1.x_y"])
PATH_KINDS = ["none_socket", "stale_socket", "dir", "file", "job", "bad_toml", "cluster", "missing", "missing_leaf",
              "under_file", "long", "no_user", "new_file"]


def hostile(paths: dict[str, str]) -> st.SearchStrategy[str]:
    return st.one_of(NUMBERS, ODD_TEXT, st.text(max_size=20), st.sampled_from(PATH_KINDS).map(paths.__getitem__))


# --- what must be refused, worked out here rather than asked of the checker ---------------------

def _number(value: str, whole: bool) -> float | None:
    if not value.isascii():
        return None
    try:
        return int(value, 10) if whole else float(value)
    except ValueError:
        return None


def _kind(path: str) -> str | None:
    try:
        target = Path(path).expanduser()
        if target.is_socket():
            return "socket"
        return "dir" if target.is_dir() else "file" if target.exists() else None
    except (OSError, RuntimeError, ValueError):
        return "unusable"


def must_refuse(action: argparse.Action, value: str) -> bool:
    """Whether ``value`` is wrong for the option, whatever else the command does with it."""
    if action.nargs == 0:
        return True  # --flag=VALUE: a flag takes none
    if value == "" or unprintable(value) is not None or len(value) > ov.MAX_TEXT:
        return True
    if action.choices is not None:
        return value not in action.choices
    checker = action.type
    if isinstance(checker, (ov.Whole, ov.Number)):
        number = _number(value, isinstance(checker, ov.Whole))
        if number is None or not math.isfinite(number) or number > checker.high:
            return True
        low_open = getattr(checker, "low_open", False)
        return number <= checker.low if low_open else number < checker.low
    if isinstance(checker, ov.Wholes):
        parts = [_number(part, True) for part in value.split(",")]
        return any(n is None or not checker.low <= n <= checker.high for n in parts) or len(set(parts)) != len(parts)
    if isinstance(checker, ov.Names):
        names = [n.strip() for n in value.split(",")]
        return not all(re.match(NODE_NAME.pattern, n) for n in names) or len(set(names)) != len(names)
    if isinstance(checker, ov.SocketPath):
        return _kind(value) in ("dir", "file", "unusable") or len(os.fsencode(value)) > ov.MAX_SOCKET_BYTES or \
            (_kind(value) is None and _kind(str(Path(value).expanduser().absolute().parent)) != "dir")
    if isinstance(checker, ov.ExistingDir):
        return _kind(value) != "dir"
    if isinstance(checker, ov.ExistingFile):
        return _kind(value) not in ("file",) or (bool(checker.suffix) and not value.endswith(checker.suffix))
    if isinstance(checker, ov.FileToWrite):
        return _kind(value) in ("dir", "unusable") or _kind(str(Path(value).expanduser().absolute().parent)) != "dir"
    if isinstance(checker, ov.DirToMake):
        return _kind(value) in ("file", "socket", "unusable") or \
            _kind(str(Path(value).expanduser().absolute().parent)) != "dir"
    if isinstance(checker, ov.Rate):  # digits, a unit of bytes or bits, perhaps /s; more than nothing
        found = re.fullmatch(r"\s*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?) ?([A-Za-z]*)(?:/[sS])?\s*",
                             value)
        units = {"", "b", "k", "kb", "m", "mb", "g", "gb", "kib", "mib", "gib", "kbit", "mbit", "gbit", "kbps",
                 "mbps", "gbps"}
        return (not value.isascii() or found is None or found.group(2).lower() not in units
                or not 0 < float(found.group(1)) < math.inf)
    if isinstance(checker, ov.StoreUrl):
        return not value.startswith(("s3://", "gs://", "az://", "file://"))
    if isinstance(checker, cli_parser.Hosts):
        return False  # the onboarding parser's own tests hold its rules; here: named or accepted
    if isinstance(checker, ov.Text):
        return checker.pattern is not None and not re.match(checker.pattern, value)
    raise AssertionError(f"no rule for {checker!r}")


# --- the command lines ----------------------------------------------------------------------------

def _samples(paths: dict[str, str]) -> dict[tuple[str, str], list[str]]:
    """A valid value for each argument a command needs before another one can be tried."""
    return {("daemon", "config"): ["--config", paths["cluster"]], ("trust", "host"): ["n1"],
            ("wait", "job"): ["j1"], ("stop", "job"): ["j1"], ("cancel", "job"): ["j1"],
            ("resize", "job"): ["j1"], ("logs", "job"): ["j1"], ("bench", "kind"): ["scaling"],
            ("checkpoints", "store"): ["--store", "s3://bucket/coord"]}


def command_line(command: str, action: argparse.Action, value: str, paths: dict[str, str]) -> list[str]:
    sub = _subparsers(cli_parser.build_parser())[command]
    argv = [command]
    if any(a.dest == "socket" for a in sub._actions):
        argv += ["--socket", paths["none_socket"]]
    for other in sub._actions:
        needed = other.required or (not other.option_strings and other.nargs is None)
        if needed and other.dest != action.dest and not isinstance(other, argparse._HelpAction):
            argv += _samples(paths)[(command, other.dest)]
    flag = _flag(action)
    job = ["--", "python", "train.py"] if command in ("run", "bench") else []  # their words after -- are the job's
    if flag is not None:
        return argv + [f"{flag}={value}"] + job
    return argv + ([value, *job] if job else ["--", value])


def test_every_option_that_takes_a_value_declares_what_it_takes():
    untyped = [_option_id(entry) for entry in OPTIONS
               if entry[1].nargs != 0 and entry[1].choices is None and not isinstance(entry[1].type, ov.OptionValue)]
    assert not untyped, f"options without a checker from coordinator/config/option_values.py: {untyped}"


def test_the_name_patterns_are_the_checks_own():
    assert JOB_NAME.pattern == ov.JOB_NAME and NODE_NAME.pattern == ov.NODE_NAME


def check_one(command: str, action: argparse.Action, value: str, paths: dict[str, str]) -> None:
    """The oracle: exit 2 and no traceback; a value that must be refused is, naming the option; any
    other is refused naming the option, or the command goes on until it needs the daemon."""
    argv = command_line(command, action, value, paths)
    TRIED["inputs"] += 1
    code, err = run_cli(argv)
    # A positional is named as argparse names it ("argument JOB.toml"), or in words ("job file").
    names = [*action.option_strings] if action.option_strings else \
        [f"argument {action.metavar or action.dest}", action.dest.replace("_", " ") if "_" in action.dest else None]
    named = any(name and name in err for name in names)
    went_on = NOT_RUNNING in err or REACHED in err
    assert code == 2, f"coord {argv!r} exited {code}: {err}"
    # A Python traceback's header: the drawn value itself may be the word "Traceback", echoed in the refusal.
    assert "Traceback (most recent call last)" not in err, err
    if must_refuse(action, value):
        positional_dash = not action.option_strings and value.startswith("-")
        assert not went_on and (named or positional_dash), f"coord {argv!r} did not refuse {value!r}: {err}"
    else:
        assert named or went_on, f"coord {argv!r}: neither refused naming the option nor went on: {err}"


#: Tried on every option, whatever the random draws: the values the issue named.
FIXED = ["", "nan", "inf", "-inf", "-1", "0", "1e309", "9" * 40, "\x1b[38;5;244mgrey", "\u202eevil", "a\x00b",
         "名前", "missing", "file", "dir", "under_file"]


@pytest.mark.parametrize("entry", OPTIONS, ids=[_option_id(e) for e in OPTIONS])
def test_the_values_the_issue_named_are_refused_naming_the_option_or_the_command_goes_on(place, entry):
    for value in FIXED:
        check_one(*entry, place.get(value, value), place)


@pytest.mark.parametrize("entry", OPTIONS, ids=[_option_id(e) for e in OPTIONS])
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_hostile_value_is_refused_naming_the_option_or_the_command_goes_on(place, entry, data):
    check_one(*entry, data.draw(hostile(place), label="value"), place)


def test_the_number_of_inputs_tried():
    print(f"\n{TRIED['inputs']} hostile command lines tried over {len(OPTIONS)} options")
    assert TRIED["inputs"] >= len(OPTIONS) * (len(FIXED) + EXAMPLES // 2) or TRIED["inputs"] == 0  # 0: run alone


# --- coord run's command line ---------------------------------------------------------------------

def test_options_are_coords_wherever_they_sit_before_the_separator_and_the_commands_after_it(place):
    args = cli_parser.parse_command_line(["run", place["job"], "--detach", "--save-every", "5"])
    assert args.job_file == place["job"] and args.detach and args.save_every == 5 and args.command is None
    args = cli_parser.parse_command_line(["run", "--name", "j", "--", "python", "t.py", "--save-every", "5", "--"])
    assert args.save_every is None and args.command == ["python", "t.py", "--save-every", "5", "--"]


@pytest.mark.parametrize("argv,words", [
    (["run", "python", "train.py"], ["argument JOB.toml", "a command goes after --"]),
    (["run", "python", "train.py", "--lr", "1"], ["argument JOB.toml", "a command goes after --"]),
    (["run", "--lr", "--", "python", "t.py"], ["unrecognized arguments: --lr"]),
    (["run", "--lr", "1", "--", "python", "t.py"], ["argument JOB.toml: 1: not a .toml file", "goes after --"]),
    (["run", "--name", "j"], ["give the command after --"]),
    (["run", "--name", "j", "--"], ["give the command after --"]),
    (["run", "JOB", "--", "python", "t.py"], ["give the command once"]),
    (["run", "--resume", "a", "--name", "b", "--", "x"], ["--resume NAME names the job"]),
    (["run", "--on-divergence", "retry", "--", "python", "t.py"], ["--on-divergence", "invalid choice: 'retry'"]),
    (["run", "--max-rollbacks", "-1", "--", "python", "t.py"], ["--max-rollbacks", "-1"]),
    (["run", "--nodes", "a,b", "--min-nodes", "3", "--", "python", "t.py"], ["--min-nodes 3 is more than"]),
    (["run", "--", "python", "-m", "mlx_lm", "lora", "--train", "--iters", "nan"], ["--iters must be a whole"]),
    (["run", "--", "python", "-m", "mlx_lm", "lora", "--train", "--iters", "-5"], ["--iters must be a whole"]),
    (["run", "--total-steps", "7", "--", "python", "-m", "mlx_lm", "lora", "--iters", "5"], ["differs from"]),
    (["bench", "scaling"], ["give the job after --"]),
    (["bench", "scaling", "--", "python", "-m", "mlx_lm", "lora", "--iters", "nan"], ["--iters must be a whole"]),
    (["bench", "scaling", "--nodes", "a,b", "--sizes", "1,3", "--", "python", "t.py"], ["--sizes 3 is more than"]),
    (["bench", "scaling", "--sizes", "2,2", "--", "python", "t.py"], ["--sizes", "more than once"]),
    (["bench", "--", "python", "t.py"], ["the following arguments are required: kind"]),
    (["status", "--interval", "2"], ["--interval applies only with --watch"]),
    (["status", "--since", "60"], ["--since applies only with --history"]),
    (["status", "--run", "j1"], ["--run applies only with --history"]),
])
def test_a_command_line_that_does_not_hold_together_is_refused_before_the_daemon_is_looked_for(place, argv, words):
    argv = [place["job"] if word == "JOB" else word for word in argv]
    code, err = run_cli([argv[0], "--socket", place["none_socket"], *argv[1:]])
    assert code == 2 and NOT_RUNNING not in err, err
    for word in words:
        assert word in err, err


def test_a_job_file_given_with_options_takes_them_over_its_own_fields(place):
    from coordinator.cli.job_commands import run_request

    args = cli_parser.parse_command_line(["run", place["job"], "--save-every", "7", "--priority", "-3"])
    spec = run_request(args)["spec"]
    assert (spec["name"], spec["save_every"], spec["priority"], spec["keep"]) == ("j1", 7, -3, 3)  # type: ignore[index]


def test_a_resumed_run_is_sent_only_the_options_given_and_the_daemon_keeps_its_others():
    from coordinator.cli.job_commands import run_request
    from coordinator.jobs.spec import JobSpec, resumed_fields, validate

    request = run_request(cli_parser.parse_command_line(["run", "--resume", "j1", "--keep", "5"]))
    assert request == {"spec": {"keep": 5, "name": "j1"}, "resume": True}
    previous = validate(JobSpec(name="j1", command=["python", "-m", "mlx_lm", "lora", "--iters", "60"],
                                save_every=50, force=True)).as_dict()
    merged = resumed_fields(previous, request["spec"])  # type: ignore[arg-type]
    assert (merged["save_every"], merged["keep"], merged["force"], merged["total_steps"]) == (50, 5, False, 60)
    longer = resumed_fields(previous, {"name": "j1", "command": ["python", "-m", "mlx_lm", "lora", "--iters", "90"]})
    assert validate(JobSpec(**longer)).total_steps == 90  # a new --iters is the new total, not a conflict


def test_coord_init_refuses_the_options_of_hosts_without_hosts(place, monkeypatch):
    from coordinator.cli.setup_commands import cmd_init

    for extra in (["--workdir", "w"], ["--timeout", "3"], ["--name", "lab"], ["--json"]):
        args = cli_parser.parse_command_line(["init", "-o", place["new_file"], *extra])
        with pytest.raises(CliError, match=f"{extra[0]} applies only with --hosts") as refused:
            cmd_init(args)
        assert refused.value.status == 2
    assert not Path(place["new_file"]).exists()


def test_the_daemons_refusal_of_what_it_was_sent_exits_2_and_a_failure_exits_1():
    from coordinator.cli.client import _refused

    assert _refused("run", "bad_args", "--nodes names x").status == 2
    assert _refused("stop", "not_found", "no job").status == 1


def test_a_traceback_would_fail_these_tests(place):
    """The oracle itself: an unexpected exception in a command is not taken for a refusal."""
    def broken(args: argparse.Namespace) -> int:
        raise ValueError("a bug")

    status = _subparsers(cli_parser.build_parser())["status"]
    original = status.get_default("func")
    status.set_defaults(func=broken)
    try:
        with pytest.raises(ValueError):
            run_cli(["status", "--socket", place["none_socket"]])
    finally:
        status.set_defaults(func=original)
