"""Restart policy, job commands and the checkpoint catalog, with plain data and no processes."""

from __future__ import annotations

import pytest

from coordinator.jobs import catalog
from coordinator.jobs.policy import (
    HUNG,
    NODE_LOST,
    PEER_LOST_GRACE_S,
    RANK_FAILED,
    STOPPED,
    SUCCEEDED,
    Outcome,
    RankFailure,
    after_the_last_step,
    awaits_root_cause,
    backoff,
    decide,
    restart_delay,
    root_cause,
)
from coordinator.jobs.spec import JobSpec, JobSpecError, validate
from coordinator.launch.mlx_lm_command import attempt_command, is_mlx_lm

FAIL_EARLY = Outcome(RANK_FAILED, "rank 1 exited with status 1: ImportError", False, "exit:1:ImportError")


def test_a_success_succeeds_and_a_stop_stops():
    assert decide(Outcome(SUCCEEDED, "done", True), [], max_restarts=3, restarts_used=0).action == "succeed"
    assert decide(Outcome(STOPPED, "stop", True), [], max_restarts=3, restarts_used=0).action == "stop"


@pytest.mark.parametrize("kind", [RANK_FAILED, NODE_LOST, HUNG])
def test_failures_restart_with_growing_backoff_until_restarts_run_out(kind):
    outcome = Outcome(kind, "it broke", True, "x")
    delays = []
    for used in range(3):
        decision = decide(outcome, [outcome] * used, max_restarts=3, restarts_used=used)
        assert decision.action == "restart"
        delays.append(decision.delay_s)
    assert delays == [0.0, 1.0, 2.0]  # the first relaunch at once, then backing off
    final = decide(outcome, [outcome] * 3, max_restarts=3, restarts_used=3)
    assert final.action == "fail" and "no restarts left" in final.reason


def test_the_same_failure_before_the_first_step_twice_fails_with_that_error():
    first = decide(FAIL_EARLY, [], max_restarts=10, restarts_used=0)
    assert first.action == "restart"
    second = decide(FAIL_EARLY, [FAIL_EARLY], max_restarts=10, restarts_used=1)
    assert second.action == "fail" and "ImportError" in second.reason and "twice" in second.reason


def test_an_early_failure_after_a_different_one_is_retried():
    other = Outcome(RANK_FAILED, "exit 137", False, "exit:137:")
    assert decide(FAIL_EARLY, [other], max_restarts=10, restarts_used=1).action == "restart"
    after_progress = Outcome(RANK_FAILED, "same", True, FAIL_EARLY.signature)
    assert decide(FAIL_EARLY, [after_progress], max_restarts=10, restarts_used=1).action == "restart"


def test_backoff_is_capped():
    assert [backoff(n) for n in range(6)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]
    assert backoff(100) == 30.0
    assert [restart_delay(n) for n in range(7)] == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0]


MLX = ["python", "-m", "mlx_lm", "lora", "--model", "m", "--train", "--data", "d", "--iters", "60",
       "--fine-tune-type", "full", "--adapter-path", "mine", "--save-every", "5"]


def test_the_root_cause_is_the_rank_that_died_not_the_peers_that_lost_it():
    killed = RankFailure(2, "n3", 137)
    lost = RankFailure(0, "n1", 1, "RuntimeError: [ring] connection to a peer was lost")
    terminated = RankFailure(1, "n2", 143)
    assert root_cause([lost, terminated, killed]) == killed
    crashed = RankFailure(1, "n2", 1, "ValueError: shapes (3,4) and (5,6) cannot be broadcast")
    assert root_cause([lost, crashed]) == crashed  # an ordinary error outranks a lost peer
    assert root_cause([RankFailure(1, "n2", 1, "boom"), RankFailure(0, "n1", 1, "bang")]).rank == 0
    assert root_cause([lost]) == lost  # nothing better known: the lost peer is named


def test_an_mlx_lm_command_is_rewritten_per_attempt():
    spec = validate(JobSpec(name="j", command=list(MLX), save_every=10))
    assert is_mlx_lm(spec.command) and spec.total_steps == 60
    first = attempt_command(spec, adapter_path="/w/checkpoints/j/attempt-0", resume_file=None, start_step=0)
    assert first[:3] == ["python", "-m", "agent.mlx_lm_train"]
    assert "mine" not in first and first.count("--adapter-path") == 1
    assert first[first.index("--adapter-path") + 1] == "/w/checkpoints/j/attempt-0"
    assert first[first.index("--save-every") + 1] == "10"
    assert first[first.index("--iters") + 1] == "60"
    assert first[first.index("--num-layers") + 1] == "-1"  # full fine-tune: every layer
    resumed = attempt_command(spec, adapter_path="/w/checkpoints/j/attempt-1", resume_file="/w/r.safetensors",
                              start_step=30)
    assert resumed[resumed.index("--iters") + 1] == "30"
    assert resumed[resumed.index("--resume-adapter-file") + 1] == "/w/r.safetensors"


def test_num_layers_given_by_the_user_is_kept_and_other_commands_run_as_given():
    spec = validate(JobSpec(name="j", command=MLX + ["--num-layers", "4"]))
    argv = attempt_command(spec, adapter_path="/a", resume_file=None, start_step=0)
    assert argv[argv.index("--num-layers") + 1] == "4" and argv.count("--num-layers") == 1
    plain = validate(JobSpec(name="j", command=["python", "train.py", "--lr", "1"]))
    assert attempt_command(plain, adapter_path="/a", resume_file=None, start_step=5) == plain.command


@pytest.mark.parametrize("fields,message", [
    ({"name": "bad name", "command": ["x"]}, "job name"),
    ({"name": "j", "command": []}, "command"),
    ({"name": "j", "command": ["python", "-m", "mlx_lm", "lora", "--train"]}, "--iters"),
    ({"name": "j", "command": ["x"], "keep": 0}, "keep"),
    ({"name": "j", "command": ["x"], "hang_timeout": -1}, "hang-timeout"),
    ({"name": "j", "command": ["x"], "first_step_timeout": 0}, "first-step-timeout"),
    ({"name": "j", "command": ["x"], "first_step_timeout": "5"}, "first-step-timeout must be a number of seconds greater than 0"),
])
def test_bad_job_specs_are_refused_with_a_reason(fields, message):
    with pytest.raises(JobSpecError, match=message):
        validate(JobSpec(**fields))


def _ckpt(step, valid=True, attempt=0):
    return {"step": step, "attempt": attempt, "valid": valid, "node": "n1", "path": f"/c/{step:07d}"}


def test_an_invalid_newest_checkpoint_is_never_resumed_from():
    checkpoints = [_ckpt(10), _ckpt(20), _ckpt(30, valid=False)]
    assert catalog.newest_valid(checkpoints)["step"] == 20
    assert catalog.newest_valid([_ckpt(10, valid=False)]) is None


def _listed(iteration, valid):
    return {"name": f"{iteration:07d}_adapters.safetensors", "iteration": iteration, "valid": valid}


def test_a_checkpoint_caught_half_written_is_judged_only_when_nothing_can_still_write_it():
    # mlx-lm writes its checkpoints in place: the newest one may be short for a moment.
    found = [_listed(10, True), _listed(20, False)]
    assert [e["iteration"] for e in catalog.settled(found, attempt_over=False)] == [10]
    # a later checkpoint exists: the one before it is finished, whatever it holds
    later = [_listed(20, False), _listed(30, True)]
    assert [e["iteration"] for e in catalog.settled(later, attempt_over=False)] == [20, 30]
    # the ranks are stopped: a short file stays short
    assert [e["iteration"] for e in catalog.settled(found, attempt_over=True)] == [10, 20]


def test_retention_keeps_the_newest_valid_ones():
    checkpoints = [_ckpt(s) for s in (10, 20, 30, 40, 50)] + [_ckpt(15, valid=False)]
    removed = {c["step"] for c in catalog.to_remove(checkpoints, keep=3)}
    assert removed == {10, 15, 20}
    assert catalog.to_remove([_ckpt(10, valid=False)], keep=3) == []


def test_a_job_file_gives_the_same_fields_as_the_options(tmp_path):
    from coordinator.jobs.spec import load_job_file

    path = tmp_path / "job.toml"
    path.write_text('name = "tiny"\ncommand = ["python", "train.py"]\nsave_every = 5\nsource = "."\n')
    spec = load_job_file(path)
    assert spec.name == "tiny" and spec.save_every == 5 and spec.source == str(tmp_path)
    path.write_text('name = "tiny"\ncommand = ["python", "train.py"]\nsave_evry = 5\n')
    with pytest.raises(JobSpecError, match="unknown key 'save_evry'"):
        load_job_file(path)
    path.write_text('name = "tiny"\ncommand = "python train.py"\n')
    with pytest.raises(JobSpecError, match="job.toml: command must be a list of non-empty strings"):
        load_job_file(path)


def test_a_run_can_ask_its_sync_to_follow_links_leading_out_of_its_source(tmp_path):
    """coord run --follow-outside-links, or a job file's follow_outside_links, reaches the run's sync."""
    import anyio

    from coordinator.cli.parser import parse_command_line
    from coordinator.jobs.spec import JobSpec, load_job_file
    from coordinator.jobs.supervisor import JobRunner

    path = tmp_path / "job.toml"
    path.write_text('name = "tiny"\ncommand = ["python", "train.py"]\nsource = "."\nfollow_outside_links = true\n')
    assert load_job_file(path).follow_outside_links
    args = parse_command_line(["run", "--source", ".", "--follow-outside-links", "--", "python", "t.py"])
    assert args.follow_outside_links
    asked = []

    class Effects:
        async def sync(self, source, nodes=None, *, follow_outside_links=False):
            asked.append(follow_outside_links)
            return {"status": "failed", "detail": "stop here"}

    runner = JobRunner.__new__(JobRunner)  # only what _prepare reads before the sync's answer
    runner.spec = JobSpec(name="tiny", command=["python", "train.py"], source="/src", follow_outside_links=True)
    runner.fx = Effects()
    runner.set_state = lambda state: None
    runner.fx.monotonic = lambda: 0.0
    runner._fail_early = lambda reason: False
    assert anyio.run(runner._prepare) is False and asked == [True]


def test_a_replica_stands_in_for_a_primary_that_is_gone_or_damaged():
    primary, replica = _ckpt(20), {**_ckpt(20), "node": "head", "path": "/state/r/20", "role": "replica"}
    older = _ckpt(10)
    assert catalog.resume_candidates([older, replica, primary]) == [[primary, replica], [older]]
    damaged = {**primary, "valid": False}
    assert catalog.resume_candidates([older, damaged, replica]) == [[replica], [older]]


def test_retention_removes_every_copy_of_an_old_checkpoint_and_replication_follows_the_kept_ones():
    copies = [_ckpt(s) for s in (10, 20, 30)] + [{**_ckpt(10), "node": "head", "role": "replica"}]
    removed = catalog.to_remove(copies, keep=2)
    assert {(c["step"], c["node"]) for c in removed} == {(10, "n1"), (10, "head")}
    copies = [{**c, "sha256": f"h{c['step']}"} for c in copies]
    wanted = catalog.copies_wanted(copies, keep=2, target="head", spread_to=[], same_machine=lambda a, b: a == b)
    assert [(w.source["step"], w.targets) for w in wanted] == [(30, ["head"]), (20, ["head"])]


def test_a_resize_relaunches_at_once_without_using_a_restart():
    from coordinator.jobs.policy import RESIZED

    decision = decide(Outcome(RESIZED, "resize requested", True), [], max_restarts=0, restarts_used=0)
    assert decision.action == "restart" and decision.delay_s == 0.0 and not decision.counts


def test_the_coord_trainer_gets_the_total_steps_and_a_recomputed_batch():
    from coordinator.launch.batch import BatchSplit
    from coordinator.launch.mlx_lm_command import attempt_command, batch_split

    spec = validate(JobSpec(name="j", command=MLX + ["--batch-size", "12"], trainer="coord"))
    assert batch_split(spec, 3) == BatchSplit(12, 1, 3)
    argv = attempt_command(spec, adapter_path="/w/c", resume_file="/w/r.safetensors", start_step=20,
                           batch=BatchSplit(6, 2, 2))
    assert argv[:3] == ["python", "-m", "agent.train"]
    assert argv[argv.index("--iters") + 1] == "60"  # the job's total: the trainer knows its step
    assert argv.count("--batch-size") == 1 and argv[argv.index("--batch-size") + 1] == "6"
    assert argv[argv.index("--grad-accumulation-steps") + 1] == "2"
    assert argv[argv.index("--resume-adapter-file") + 1] == "/w/r.safetensors"


def test_a_command_naming_coords_trainer_uses_it_and_other_trainers_are_refused():
    spec = validate(JobSpec(name="j", command=["python", "-m", "agent.train", "--iters", "5"]))
    assert spec.trainer == "coord"
    with pytest.raises(JobSpecError, match="trainer must be one of"):
        validate(JobSpec(name="j", command=MLX, trainer="torch"))
    with pytest.raises(JobSpecError, match="--trainer coord runs mlx_lm lora"):
        validate(JobSpec(name="j", command=["python", "train.py"], trainer="coord"))


def test_the_global_batch_is_read_as_mlx_lm_reads_it_command_line_then_config_file(tmp_path):
    from coordinator.launch.batch import BatchSplit
    from coordinator.launch.mlx_lm_command import CommandError, batch_split

    (tmp_path / "lora.yaml").write_text("batch_size: 6\ngrad_accumulation_steps: 2\nlearning_rate: 1e-5\n")
    from_file = validate(JobSpec(name="j", command=MLX + ["-c", "lora.yaml"], source=str(tmp_path)))
    assert batch_split(from_file, 3) == BatchSplit(6, 2, 3)
    overridden = validate(JobSpec(name="j", command=MLX + ["-c", "lora.yaml", "--batch-size", "12"],
                                  source=str(tmp_path)))
    assert batch_split(overridden, 3) == BatchSplit(12, 2, 3)
    assert batch_split(validate(JobSpec(name="j", command=MLX)), 2) == BatchSplit(4, 1, 2)  # mlx-lm's default
    (tmp_path / "bad.yaml").write_text("batch_size: six\n")
    for config, message in (("missing.yaml", "cannot read the config file"), ("bad.yaml", "whole numbers")):
        spec = validate(JobSpec(name="j", command=MLX + ["--config", config], source=str(tmp_path)))
        with pytest.raises(CommandError, match=message):
            batch_split(spec, 2)
    with pytest.raises(CommandError, match="no source"):
        batch_split(validate(JobSpec(name="j", command=MLX + ["-c", "lora.yaml"])), 2)


def test_total_steps_is_for_scripts_of_ones_own_and_mlx_lm_takes_its_iters():
    assert validate(JobSpec(name="j", command=["python", "train.py"], total_steps=100)).total_steps == 100
    assert validate(JobSpec(name="j", command=MLX, total_steps=60)).total_steps == 60
    for bad in (0, -5, True, 2.5):
        with pytest.raises(JobSpecError, match="total-steps must be a whole number"):
            validate(JobSpec(name="j", command=["python", "train.py"], total_steps=bad))
    with pytest.raises(JobSpecError, match="differs from mlx_lm's --iters 60"):
        validate(JobSpec(name="j", command=MLX, total_steps=100))


def test_backoff_is_two_to_the_n_capped_at_30_s_for_every_n():
    assert [backoff(n) for n in range(-2, 8)] == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert all(backoff(n) == 30.0 for n in (5, 63, 64, 1023, 1024, 10**6))
    assert all(isinstance(backoff(n), float) for n in range(10))
    assert [restart_delay(n) for n in range(-1, 8)] == [0.0, 0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_ranks_that_only_lost_a_peer_wait_a_moment_for_the_one_that_failed_on_its_own():
    gloo = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1447"
    assert awaits_root_cause(gloo, others_running=True, waited_s=0.0)
    assert awaits_root_cause(gloo, others_running=True, waited_s=PEER_LOST_GRACE_S - 0.1)
    assert not awaits_root_cause(gloo, others_running=True, waited_s=PEER_LOST_GRACE_S)  # then it is said as seen
    assert not awaits_root_cause(gloo, others_running=False, waited_s=0.0)  # every rank has said its word
    assert not awaits_root_cause("RuntimeError: the data loader broke at step 7", others_running=True, waited_s=0.0)


TEARDOWN_ABORT = Outcome(RANK_FAILED, "rank 1 on n2 exited with status 1: worker rank 1 failed: Signal 6 (SIGABRT)",
                         True, "exit:1:worker rank 1 failed")


@pytest.mark.parametrize("kind", [RANK_FAILED, HUNG])
def test_a_failure_after_the_last_step_with_its_checkpoint_valid_is_the_work_done(kind):
    failed = Outcome(kind, TEARDOWN_ABORT.detail, True, TEARDOWN_ABORT.signature)
    done = after_the_last_step(failed, total_steps=1500, step=1500, final_checkpoint=1500)
    assert done.kind == SUCCEEDED and done.reached_first_step
    assert done.detail == ("every step ran (1500 of 1500) and the checkpoint of step 1500 is valid; then "
                           + TEARDOWN_ABORT.detail)
    assert decide(done, [], max_restarts=0, restarts_used=0).action == "succeed"


@pytest.mark.parametrize(("total", "step", "final"), [
    (1500, 1500, None),   # no checkpoint at all: the final save may be what failed; only a rerun redoes it
    (1500, 1500, 1000),   # the newest valid one is older: the steps after it are not kept anywhere
    (1500, 1499, 1500),   # progress short of the total (a checkpoint named past it proves nothing alone)
    (None, 1500, 1500),   # no total given: coord cannot tell the last step
])
def test_a_failure_without_the_whole_work_kept_restarts_as_before(total, step, final):
    assert after_the_last_step(TEARDOWN_ABORT, total_steps=total, step=step, final_checkpoint=final) is TEARDOWN_ABORT


@pytest.mark.parametrize("kind", [NODE_LOST, STOPPED, "launch_failed", "diverged", "resized"])
def test_only_a_rank_failure_or_a_hang_after_the_last_step_counts_as_done(kind):
    # a lost node may hold the only copy; a stop is the user's; diverged weights are not the work done
    other = Outcome(kind, "x", True, "x")
    assert after_the_last_step(other, total_steps=10, step=10, final_checkpoint=10) is other


def test_a_nodes_checkpoints_are_listed_when_its_mark_moved_or_something_was_left_unsettled():
    nodes = ["n1", "n2"]
    listed = {"n1": "a", "n2": "b"}

    def due(marks, *, listed=listed, pending=False, since=2.0):
        return catalog.listing_due(nodes, marks, listed, pending=pending, since_listed=since, backstop_s=30.0)

    assert not due({"n1": "a", "n2": "b"})  # nothing written since: no node is asked
    assert due({"n1": "a", "n2": "c"})  # n2 wrote, or removed, a checkpoint
    assert due({"n1": "a"})  # n2's ranks have not reported a mark yet
    assert due({"n1": "a", "n2": ""})  # n2's agent could not tell
    assert due({"n1": "a", "n2": "b"}, listed=None)  # never listed in this attempt (or by this daemon)
    assert due({"n1": "a", "n2": "b"}, pending=True)  # a file still being written, a node not reached
    assert due({"n1": "a", "n2": "b"}, since=30.0)  # the backstop
    assert not catalog.listing_due(["n1"], {"n1": "a", "n2": "c"}, listed, pending=False, since_listed=2.0,
                                   backstop_s=30.0)  # only rank 0's node is listed: n2's writes are not ours
