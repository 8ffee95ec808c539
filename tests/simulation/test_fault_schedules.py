"""The supervisor under thousands of seeded fault schedules on a simulated cluster, and the
failures users met, as fixed schedules. See tests/simulation/schedules.py for the invariants;
a failure prints its seed and a replay (``python -m tests.simulation.replay SEED``)."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from tests.simulation.schedules import InvariantBroken, Schedule, make_schedule, run_schedule
from tests.simulation.world import SimEffects

SCHEDULES = int(os.environ.get("COORD_SIM_SCHEDULES", "10000"))
FIRST_SEED = int(os.environ.get("COORD_SIM_SEED", "0"))


def _run_seeds(seeds: range) -> list[str]:
    broken = []
    for seed in seeds:
        try:
            run_schedule(seed)
        except InvariantBroken as exc:
            broken.append(str(exc))
    return broken


def test_thousands_of_fault_schedules_keep_every_invariant():
    workers = max(1, min(4, os.cpu_count() or 1))
    step = -(-SCHEDULES // workers)
    chunks = [range(FIRST_SEED + i, min(FIRST_SEED + SCHEDULES, FIRST_SEED + i + step)) for i in range(0, SCHEDULES, step)]
    started = time.monotonic()
    if workers == 1:
        results = [_run_seeds(chunk) for chunk in chunks]
    else:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            results = pool.map(_run_seeds, chunks)
    broken = [failure for result in results for failure in result]
    seconds = time.monotonic() - started
    print(f"{SCHEDULES} fault schedules in {seconds:.1f} s on {workers} processes")
    assert not broken, f"{len(broken)} of {SCHEDULES} schedules broke an invariant; the first:\n{broken[0]}"


def test_a_schedule_is_the_same_every_time_from_its_seed():
    assert make_schedule(1234).describe() == make_schedule(1234).describe()
    first, again = run_schedule(1234), run_schedule(1234)
    assert [(r["state"], r["record"]["step"], r["record"]["restarts"]) for r in first["runs"]] == \
        [(r["state"], r["record"]["step"], r["record"]["restarts"]) for r in again["runs"]]


def base(**overrides) -> Schedule:
    spec = {"name": "tiny", "command": ["python", "train.py"], "save_every": 10, "max_restarts": 3, "keep": 3,
            "total_steps": 60, "replica": "head", "min_nodes": None, "node_timeout": 60.0, "hang_timeout": None}
    spec.update(overrides.pop("spec", {}))
    fields = {"seed": -1, "nodes": ["n1", "n2", "n3"], "spec": spec, "step_s": 0.1, "startup_s": 2.0,
              "copy_s": 0.5}
    fields.update(overrides)
    return Schedule(**fields)


def test_a_name_run_again_is_a_new_run_that_trains_from_step_zero():
    result = run_schedule(base(runs=2, faults=[{"kind": "kill", "attempt": 0, "rank": 1, "after": 25,
                                                "status": 137}]))
    first, second = result["runs"]
    assert first["run_id"] != second["run_id"]
    assert first["state"] == second["state"] == "succeeded"
    # The second run trained: its own attempt 0 from step 0, not "resumed" from the first run's step 60.
    launches = [launch for launch in result["launches"] if launch["run"] == second["run_id"]]
    assert [start for _, start, _ in launches[0]["ranks"].values()] == [0, 0, 0]
    assert second["record"]["step"] == 60 and second["record"]["history"][-1]["detail"] == "every rank finished"


def test_rank_0s_node_lost_for_good_before_the_session_notices_is_waited_for_then_left_out():
    # The restart (1 s backoff) comes before the keepalive notices n1 is gone (4 s): the launch
    # finds no link information from n1. That is a launch outcome, not an internal error.
    result = run_schedule(base(spec={"min_nodes": 2, "node_timeout": 20.0},
                               faults=[{"kind": "kill", "attempt": 0, "rank": 1, "after": 25, "status": 1},
                                       {"kind": "power", "node": "n1", "at": 6.6, "detect_s": 4.0,
                                        "back_after": None}]))
    (run,) = result["runs"]
    assert run["state"] == "succeeded", run["record"]
    assert run["record"]["order"] == ["n2", "n3"]
    kinds = [h["kind"] for h in run["record"]["history"]]
    assert "launch_failed" in kinds or "node_lost" in kinds, kinds


def test_a_head_without_mlx_launch_fails_the_run_with_what_to_install():
    result = run_schedule(base(faults=[{"kind": "launch", "attempt": 0, "how": "missing"},
                                       {"kind": "launch", "attempt": 1, "how": "missing"}]))
    (run,) = result["runs"]
    assert run["state"] == "failed"
    assert "mlx.launch could not be started" in run["record"]["error"]
    assert "pip install mlx" in run["record"]["error"]


def test_success_waits_for_the_copy_of_the_final_checkpoint():
    # Each copy takes 20 s, far longer than the last steps: the run is not called succeeded
    # (invariant a, checked inside) before the final checkpoint's replica is catalogued.
    result = run_schedule(base(copy_s=20.0))
    (run,) = result["runs"]
    assert run["state"] == "succeeded" and not run["record"].get("warning")


def test_a_copy_that_cannot_land_is_said_with_the_success():
    result = run_schedule(base(spec={"replica": "n3"}, copy_s=3.0,
                               faults=[{"kind": "power", "node": "n3", "at": 7.5, "detect_s": 0.2,
                                        "back_after": None}, ]))
    (run,) = result["runs"]
    assert run["state"] in ("succeeded", "failed"), run


def test_rank_0s_node_lost_resumes_from_another_nodes_own_copy_and_nothing_is_copied():
    # coord's trainer: every rank writes its own copy on its own node. The head is n1's own
    # machine (host "local"), so n2's and n3's copies are what protect a checkpoint, and the head
    # gets none. n1 is powered off for good after step 30: n2 and n3 go on from their own copies
    # of step 30, and not one byte of a checkpoint is copied, before the loss or for the resume.
    result = run_schedule(base(spec={"trainer": "coord", "min_nodes": 2, "node_timeout": 5.0}, head_machine=("n1",),
                               faults=[{"kind": "power", "node": "n1", "at": 6.6, "detect_s": 2.0,
                                        "back_after": None}]))
    (run,) = result["runs"]
    assert run["state"] == "succeeded", run["record"]
    assert run["record"]["order"] == ["n2", "n3"]
    resumed = [launch for launch in result["launches"] if any(start for _, start, _ in launch["ranks"].values())]
    assert resumed, result["launches"]
    ranks = resumed[0]["ranks"]
    start = ranks[0][1]
    assert start >= 30
    for node, _, resume in ranks.values():
        assert resume == f"/w/{node}/checkpoints/{run['run_id']}/attempt-0/{start:07d}_adapters.safetensors"
    assert result["copies"] == []


def test_a_node_that_was_down_is_sent_the_checkpoint_and_the_others_use_their_own():
    # n3 loses power early and is left out (--min-nodes 2); attempt 1 trains on n1 and n2 while
    # it is away. n3 is back when attempt 1's rank 1 is killed: attempt 2 takes it in again and
    # resumes from attempt 1's newest checkpoint, which only n3 lacks: it alone is sent it.
    result = run_schedule(base(spec={"trainer": "coord", "replica": "none", "min_nodes": 2, "node_timeout": 5.0},
                               faults=[{"kind": "kill", "attempt": 1, "rank": 1, "after": 25, "status": 137},
                                       {"kind": "power", "node": "n3", "at": 4.5, "detect_s": 1.0,
                                        "back_after": 8.0}]))
    (run,) = result["runs"]
    assert run["state"] == "succeeded", run["record"]
    last = result["launches"][-1]
    assert sorted(node for node, _, _ in last["ranks"].values()) == ["n1", "n2", "n3"]
    assert result["copies"] and all(c["targets"] == ["n3"] for c in result["copies"]), result["copies"]
    start = last["ranks"][0][1]
    for node, _, resume in last["ranks"].values():
        where = "replica/attempt-1" if node == "n3" else "attempt-1"
        assert resume == f"/w/{node}/checkpoints/{run['run_id']}/{where}/{start - 10:07d}_adapters.safetensors"


def test_mlx_lms_checkpoints_are_copied_to_every_node_and_a_lost_rank_0_resumes_from_them_in_place():
    # mlx-lm's trainer: rank 0 alone saves. Each new checkpoint is streamed in the background to
    # n2 and n3 (one copy_checkpoint, two placements); the head is n1's machine, so it gets none.
    # n1 is lost for good: n2 and n3 resume from the copies they already hold.
    command = ["python", "-m", "mlx_lm", "lora", "--model", "m", "--train", "--data", "d", "--iters", "60",
               "--batch-size", "12"]
    result = run_schedule(base(spec={"command": command, "min_nodes": 2, "node_timeout": 5.0}, head_machine=("n1",),
                               faults=[{"kind": "power", "node": "n1", "at": 6.6, "detect_s": 2.0,
                                        "back_after": None}]))
    (run,) = result["runs"]
    assert run["state"] == "succeeded", run["record"]
    lost_at = 6.6
    before = [c for c in result["copies"] if c["time"] < lost_at]
    assert before and all(c["targets"] == ["n2", "n3"] for c in before), before
    resumed = [launch for launch in result["launches"] if any(start for _, start, _ in launch["ranks"].values())][0]
    start = resumed["ranks"][0][1]
    for node, _, resume in resumed["ranks"].values():
        assert resume == f"/w/{node}/checkpoints/{run['run_id']}/replica/attempt-0/{start:07d}_adapters.safetensors"
    assert not [c for c in result["copies"] if lost_at <= c["time"] <= resumed["time"]], result["copies"]



@pytest.mark.parametrize("trainer", ["mlx_lm", "coord"])
def test_a_daemon_killed_as_an_attempt_starts_catalogues_its_checkpoints_by_their_step(trainer, monkeypatch):
    # Attempt 1 resumes from step 20, so its files are named by their step within it (global step - 20).
    # The daemon is killed at each effect around attempt 1's launch, the one just after mlx.launch
    # started among them; a daemon that came back with the previous attempt's start step would
    # catalogue 0000010 as step 10 and resume from it as such (invariant b).
    command = ["python", "train.py"] if trainer == "coord" else ["python", "-m", "mlx_lm", "lora", "--train"]

    def schedule(crashes):
        return base(spec={"trainer": trainer, "command": command, "total_steps": 50},
                    faults=[{"kind": "kill", "attempt": 0, "rank": 1, "after": 25, "status": 1},
                            {"kind": "kill", "attempt": 1, "rank": 2, "after": 15, "status": 1}], crashes=crashes)

    launches: list[tuple[int, int]] = []  # (attempt, the daemon's effect count once its launcher started)
    start_launcher = SimEffects.start_launcher

    def recorded(self, run_id, attempt, document):
        pid = start_launcher(self, run_id, attempt, document)
        launches.append((attempt, self.calls))
        return pid

    monkeypatch.setattr(SimEffects, "start_launcher", recorded)
    (run,) = run_schedule(schedule([]))["runs"]
    assert run["state"] == "succeeded" and run["record"]["restarts"] == 2, run["record"]
    launched = next(calls for attempt, calls in launches if attempt == 1)
    for effect in range(launched - 4, launched + 6):
        (run,) = run_schedule(schedule([(effect, 6.0)]))["runs"]  # back after attempt 1 saved
        assert run["state"] == "succeeded", (effect, run["record"])


@pytest.mark.parametrize("startup_s", [2.0 + 0.05 * i for i in range(10)])
def test_weights_that_diverge_are_caught_even_when_the_attempt_ends_between_two_polls(startup_s):
    # Rank 1's weights differ from step 7 on; every rank reports a fingerprint every 2 steps. The whole
    # attempt (16 steps of 5 ms, then its last checkpoint written) fits between two of the daemon's polls;
    # over these start-up times some polls find the ranks still running and some find every rank
    # already exited 0, with every fingerprint read in that same poll: a divergence either way, never a
    # success. (Invariant c: the resume is from before the divergence.)
    (run,) = run_schedule(base(spec={"trainer": "coord", "total_steps": 16, "save_every": 2, "keep": 10},
                               step_s=0.005, startup_s=startup_s,
                               faults=[{"kind": "diverge", "attempt": 0, "rank": 1, "from_step": 7, "every": 2}]))["runs"]
    history = run["record"]["history"]
    assert run["state"] == "succeeded", run["record"]
    assert [h["kind"] for h in history] == ["diverged", "succeeded"], history
