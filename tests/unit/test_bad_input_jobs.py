"""A job as the daemon gets it over the control socket is checked as the CLI checks it: every field's
type and range, the source directory, the named nodes and that none of them has failed to come up
since the daemon started; a rank or attempt that does not exist is said so. The wait for nodes is
bounded by the job's --node-wait and shows what it waits for.

The job manager and the wait run here over a small fake of their effects: the checks are policy
(what a submission may be), the real daemon's side is tests/integration/test_bad_input_local.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.jobs.effects import NodeView
from coordinator.jobs.limits import MAX_SECONDS, WHOLE
from coordinator.jobs.manager import JobError, JobManager
from coordinator.jobs.node_health import NodeHealth
from coordinator.jobs.node_wait import NodesAway, NodeWait
from coordinator.jobs.run_context import RunContext
from coordinator.jobs.spec import JobSpec, JobSpecError, option_label, source_problem, spec_from_fields
from coordinator.jobs.view import run_view
from coordinator.launch.registry import launcher_named
from shared import protocol as p


class Effects:
    """What the job manager and the node wait use of their effects, and nothing more."""

    def __init__(self, nodes: dict[str, NodeView]):
        self.nodes = nodes
        self.saved: list[str] = []
        self.events: list[tuple[str, str]] = []
        self.spawned: list[str] = []
        self.started = 1_700_000_000.0

    def now(self) -> float:
        return self.started + anyio.current_time() if _in_loop() else self.started

    def monotonic(self) -> float:
        return anyio.current_time() if _in_loop() else 0.0

    def node_names(self) -> list[str]:
        return list(self.nodes)

    def node(self, name: str) -> NodeView:
        return self.nodes[name]

    def store_url(self, job_store: str | None) -> str | None:
        return job_store

    def save_run(self, run_id: str, *args: Any) -> None:
        self.saved.append(run_id)

    def event(self, kind: str, message: str, data: Any) -> None:
        self.events.append((kind, message))

    def spawn(self, func: Any, *, name: str) -> None:
        self.spawned.append(name)


def _in_loop() -> bool:
    try:
        anyio.current_time()
    except Exception:  # noqa: BLE001 (no event loop: the manager's synchronous calls)
        return False
    return True


class Store:
    def runs(self) -> list[Any]:
        return []

    def run_ids(self) -> set[str]:
        return set()


def up(name: str) -> NodeView:
    return NodeView(name, True, "/w", "/usr/bin/python3", generation=1)


def never_up(name: str, why: str) -> NodeView:
    return NodeView(name, False, "/w", "/usr/bin/python3", reason=why, unreachable=why)


def manager(*views: NodeView, tmp_path: Path) -> tuple[JobManager, Effects]:
    fx = Effects({v.name: v for v in views})
    return JobManager(fx, Store(), tmp_path), fx  # type: ignore[arg-type]


# --- the spec from the wire -------------------------------------------------------------------

WIRE_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**20), 10**20), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.lists(st.one_of(st.text(max_size=6), st.integers()), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.sampled_from(["", "\x1b[31m", "/does/not/exist", "head", "none", "ring", "coord", "mlx_lm", "mlx", ["a"],
                     ["a", "a"], [], math.nan, math.inf, MAX_SECONDS * 2, -1, 0, 10**13]))
FIELDS = list(JobSpec.__dataclass_fields__)


@settings(max_examples=400, deadline=None)
@given(key=st.sampled_from(FIELDS), value=WIRE_VALUES)
def test_any_value_of_any_field_from_the_wire_is_taken_or_refused_naming_the_field(key, value):
    fields: dict[str, Any] = {"name": "j", "command": ["python", "train.py"], key: value}
    try:
        spec = spec_from_fields(fields)
    except JobSpecError as exc:
        assert option_label(key) in str(exc) or key in ("name", "command", "nodes"), str(exc)
        return
    taken = getattr(spec, key)
    assert taken == value or key == "trainer"  # never another value in its place
    if isinstance(value, float):
        assert math.isfinite(value) and (key not in ("hang_timeout", "node_timeout", "node_wait")
                                         or 0 < value <= MAX_SECONDS)
    if key in WHOLE:
        assert value is None or WHOLE[key][0] <= value <= WHOLE[key][1]


@pytest.mark.parametrize("fields,words", [
    ({"name": "j"}, "a job needs command"),
    ({"name": "j", "command": ["x"], "speed": 3}, "unknown field 'speed'"),
    ({"name": "j", "command": ["x"], "save_every": "10"}, "--save-every must be a whole number from 1"),
    ({"name": "j", "command": ["x"], "hang_timeout": math.nan}, "--hang-timeout must be a number of seconds"),
    ({"name": "j", "command": ["x"], "node_wait": math.inf}, "--node-wait must be a number of seconds"),
    ({"name": "j", "command": ["x"], "priority": 10**9}, "--priority must be a whole number from -1000000"),
    ({"name": "j", "command": ["x"], "backend": "tcp"}, "--backend must be one of"),
    ({"name": "j", "command": ["x", "a\x00b"]}, "--command must be a list of non-empty strings without NUL"),
    ({"name": "j", "command": ["--", "python", "train.py"]}, "--command must start with the program to run, got '--'"),
    ({"name": "j", "command": ["x"], "nodes": ["a", "a"]}, "--nodes names a node twice"),
    ({"name": "j", "command": ["x"], "source": "relative/dir"}, "--source must be an absolute path"),
])
def test_a_field_that_cannot_be_used_is_refused_with_what_it_takes(fields, words):
    with pytest.raises(JobSpecError, match=words.replace("(", r"\(")):
        spec_from_fields(fields)


def test_a_missing_source_and_a_file_given_as_the_source_are_told_apart(tmp_path):
    (tmp_path / "train.py").write_text("")
    assert "no such directory" in source_problem(str(tmp_path / "nope"))  # type: ignore[operator]
    assert "not a directory" in source_problem(str(tmp_path / "train.py"))  # type: ignore[operator]
    assert source_problem(str(tmp_path)) is None


# --- the manager: refused before a run exists -------------------------------------------------

def test_the_daemon_refuses_what_the_cli_would_before_any_run_is_made(tmp_path):
    jobs, fx = manager(up("a"), up("b"), tmp_path=tmp_path)
    (tmp_path / "file").write_text("")
    for fields, words in (
        ({"source": str(tmp_path / "nope")}, "no such directory"),
        ({"source": str(tmp_path / "file")}, "not a directory"),
        ({"save_every": math.nan}, "--save-every must be a whole number"),
        ({"nodes": ["a", "z"]}, "--nodes names z, not a node of this cluster (a, b)"),
        ({"replica": "z"}, "--replica 'z' is not head, none or a node"),
        ({"min_nodes": 3}, "--min-nodes 3 is more than the cluster's 2 nodes"),
    ):
        with pytest.raises(JobError) as refused:
            jobs.submit({"name": "j", "command": ["python", "train.py"], **fields})
        assert refused.value.code == p.BAD_ARGS and words in refused.value.message, refused.value.message
    assert fx.saved == [] and jobs.runs == {}


def test_a_node_never_up_since_the_daemon_started_is_reported_at_submit_with_its_error(tmp_path):
    why = "cannot connect to 10.0.0.9:22: [Errno 111] Connect call failed"
    jobs, fx = manager(up("a"), never_up("b", why), tmp_path=tmp_path)
    with pytest.raises(JobError) as refused:
        jobs.submit({"name": "j", "command": ["python", "train.py"]})
    message = refused.value.message
    assert refused.value.code == p.BAD_ARGS and f"node b has not been up since coordd started: {why}" in message
    assert "--nodes a" in message and fx.saved == []
    assert jobs.submit({"name": "j", "command": ["python", "train.py"], "nodes": ["a"]}).spec.nodes == ["a"]
    # a node that was up once and is down now is waited for, as before (it may come back)
    jobs, _ = manager(up("a"), NodeView("b", False, "/w", "/p", reason="lost: ping", generation=2),
                      tmp_path=tmp_path)
    assert jobs.submit({"name": "j", "command": ["python", "train.py"]}).state in ("pending", "queued")


def test_a_resumed_run_keeps_its_fields_but_those_given_again(tmp_path):
    jobs, _ = manager(up("a"), tmp_path=tmp_path)
    first = jobs.submit({"name": "j", "command": ["python", "train.py"], "save_every": 50, "node_wait": 30.0})
    first.ctx.state = first.ctx.state.__class__("failed")
    resumed = jobs.submit({"name": "j", "keep": 7}, resume=True)
    assert (resumed.spec.save_every, resumed.spec.keep, resumed.spec.node_wait) == (50, 7, 30.0)
    assert resumed.spec.command == ["python", "train.py"]


def test_a_run_from_a_checkpoint_store_is_checked_before_its_checkpoint_is_fetched(tmp_path):
    jobs, _ = manager(up("a"), tmp_path=tmp_path)
    running = jobs.submit({"name": "j", "command": ["python", "train.py"]})
    # A run this head knows is continued with --resume, not fetched again.
    with pytest.raises(JobError) as known:
        jobs.check_from_store({"name": "other", "command": ["python", "train.py"]}, running.run_id, "s3://b/coord")
    assert "continue it with coord run --resume j" in known.value.message
    # A job of that name still going is stopped first.
    with pytest.raises(JobError) as busy:
        jobs.check_from_store({"name": "j", "command": ["python", "train.py"]}, "j-0123abcd", "s3://b/coord")
    assert "stop it first: coord stop j" in busy.value.message
    # Bad fields are said as for any run.
    with pytest.raises(JobError):
        jobs.check_from_store({"name": "k", "command": [], "keep": 0}, "k-0123abcd", "s3://b/coord")
    # The run keeps going to the store it came from, unless it names another.
    spec = jobs.check_from_store({"name": "k", "command": ["python", "train.py"]}, "k-0123abcd", "s3://b/coord")
    assert spec.checkpoint_store == "s3://b/coord"
    spec = jobs.check_from_store({"name": "k", "command": ["python", "train.py"], "checkpoint_store": "file:///nas"},
                                 "k-0123abcd", "s3://b/coord")
    assert spec.checkpoint_store == "file:///nas"


def test_a_rank_or_attempt_that_does_not_exist_is_said_so(tmp_path):
    jobs, _ = manager(up("a"), up("b"), tmp_path=tmp_path)
    runner = jobs.submit({"name": "j", "command": ["python", "train.py"]})
    runner.record.attempt, runner.record.order = 0, ["a", "b"]
    for kwargs, words in (({"rank": 2}, "has no rank 2 (its ranks: 0 to 1, on a, b)"),
                          ({"attempt": 3}, "has no attempt 3 (its attempts: 0 to 0)"),
                          ({"rank": -1}, "0 or more"), ({"offset": -5}, "0 or more")):
        with pytest.raises(JobError, match=re_escape(words)):
            jobs.read_log("j", **kwargs)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


# --- the wait for nodes -----------------------------------------------------------------------

def test_the_wait_shows_which_nodes_why_and_for_how_long_and_ends_at_node_wait(tmp_path):
    why = "lost: agent sent nothing for 6 s (no heartbeat, no answer)"
    fx = Effects({"a": up("a"), "b": NodeView("b", False, "/w", "/p", reason=why, generation=1)})
    spec = JobSpec(name="j", command=["python", "train.py"], node_wait=0.3)
    ctx = RunContext(fx, spec, run_id="j-00000000", record=None, state="recovering")  # type: ignore[arg-type]
    wait = NodeWait(ctx, NodeHealth(fx), launcher_named(spec.launcher))  # type: ignore[arg-type]
    seen: dict[str, Any] = {}

    async def main() -> Any:
        async with anyio.create_task_group() as tasks:
            outcome: list[Any] = []

            async def waiting() -> None:
                outcome.append(await wait.wait())

            tasks.start_soon(waiting)
            await anyio.sleep(0.1)
            seen.update(run_view(ctx, queue_position=None)["waiting"] or {})
        return outcome[0]

    outcome = anyio.run(main)
    assert isinstance(outcome, NodesAway) and outcome.waited_s >= 0.3
    assert outcome.why == f"waiting for b to be up; b: {why}"
    assert seen["nodes"] == ["b"] and seen["reasons"] == {"b": why} and seen["limit_s"] == 0.3
    assert 0.0 <= seen["waited_s"] < 0.3
    assert run_view(ctx, queue_position=None)["waiting"] is None  # over: nothing shown any more
    (kind, message), = [e for e in fx.events if e[0] == "job.waiting_for_nodes"]
    assert message == f"j: waiting for b to be up; b: {why} (waited 0 s of at most 0.3 s, --node-wait)"


def test_coord_sync_tells_a_missing_source_from_a_file(tmp_path):
    from types import SimpleNamespace

    from coordinator.readiness.sync import resolve_source
    from shared.rpc import RemoteError

    (tmp_path / "train.py").write_text("")
    cluster = SimpleNamespace(config=SimpleNamespace(sync=SimpleNamespace(source=None)))
    with pytest.raises(RemoteError, match="does not exist on the head"):
        resolve_source(cluster, str(tmp_path / "nope"))  # type: ignore[arg-type]
    with pytest.raises(RemoteError, match="is not a directory") as refused:
        resolve_source(cluster, str(tmp_path / "train.py"))  # type: ignore[arg-type]
    assert refused.value.code == p.BAD_ARGS
    assert resolve_source(cluster, str(tmp_path)) == tmp_path  # type: ignore[arg-type]
