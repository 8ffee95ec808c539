"""Checkpoint directories judged by format, from the parts the nodes hold (coordinator/jobs/checkpoint_formats.py,
shared/checkpoint_dirs.py), with plain data, and a DCP .metadata read without being unpickled."""

from __future__ import annotations

import pickle

from coordinator.jobs.checkpoint_dirs import settled
from coordinator.jobs.checkpoint_formats import join_parts, judge
from shared.checkpoint_dirs import dcp_file_names, digest


def _part(*paths: str, notes: dict | None = None, references: dict | None = None, valid: bool = True) -> dict:
    files = [{"path": p, "size": len(p), "sha256": f"h-{p}"} for p in paths]
    return {"name": "0000040", "iteration": 40, "path": "/w/checkpoints/r/attempt-0/0000040", "valid": valid,
            "detail": "" if valid else "x.bin could not be read", "size": 0, "sha256": None, "kind": "dir",
            "files": files, "notes": notes or {}, "references": references or {}}


def test_a_script_of_its_own_is_complete_with_its_complete_file_written_last():
    assert judge(join_parts({"a": _part("state.pt", "COMPLETE")}), 2).valid
    verdict = judge(join_parts({"a": _part("state.pt")}), 2)
    assert not verdict.valid and "no COMPLETE file" in verdict.detail


def test_accelerate_needs_every_ranks_random_states_wherever_each_was_written():
    node0 = _part("model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
                  "random_states_1.pkl")
    node1 = _part("random_states_2.pkl", "random_states_3.pkl")
    alone = judge(join_parts({"a": node0}), 4)
    assert not alone.valid and alone.format == "accelerate" and "random_states of ranks 2, 3 missing" in alone.detail
    joined = join_parts({"a": node0, "b": node1})
    verdict = judge(joined, 4)
    assert verdict.valid and verdict.format == "accelerate", verdict
    assert joined.missing_on("b") == ["model.safetensors", "optimizer.bin", "random_states_0.pkl",
                                      "random_states_1.pkl", "scheduler.bin"]
    assert joined.missing_on("a") == ["random_states_2.pkl", "random_states_3.pkl"]
    assert not judge(join_parts({"a": _part("random_states_0.pkl", "optimizer.bin")}), 1).valid  # no weights


def test_an_fsdp_state_needs_every_shard_its_metadata_names():
    references = {"pytorch_model_fsdp_0/.metadata": ["pytorch_model_fsdp_0/__0_0.distcp",
                                                     "pytorch_model_fsdp_0/__1_0.distcp"]}
    node0 = _part("pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp", "optimizer_0/.metadata",
                  "random_states_0.pkl", references=references)
    node1 = _part("pytorch_model_fsdp_0/__1_0.distcp", "random_states_1.pkl")
    verdict = judge(join_parts({"a": node0}), 2)
    assert not verdict.valid and "names 1 files not written" in verdict.detail
    assert judge(join_parts({"a": node0, "b": node1}), 2).valid


def test_deepspeed_needs_the_tag_latest_names_with_every_ranks_zero_state():
    tag = ["latest", "global_step40/mp_rank_00_model_states.pt",
           "global_step40/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    node0 = _part(*tag, notes={"latest": "global_step40"})
    node1 = _part("global_step40/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    partial = judge(join_parts({"a": node0}), 2)
    assert not partial.valid and "lacks the ZeRO states of rank 1" in partial.detail
    assert judge(join_parts({"a": node0, "b": node1}), 2).valid
    wrong = judge(join_parts({"a": _part(*tag, notes={"latest": "global_step30"})}), 1)
    assert not wrong.valid and "tag global_step30 has no model states" in wrong.detail
    # latest comes from rank 0 while rank 1 may still be writing its shard: whole, but not final at once
    both = join_parts({"a": node0, "b": node1})
    assert not settled(both, judge(both, 2), seen_before=None, newer_exists=False, attempt_over=False)
    assert settled(both, judge(both, 2), seen_before=both.digest, newer_exists=False, attempt_over=False)


def test_a_dcp_checkpoint_alone_and_nodes_that_disagree():
    references = {".metadata": ["__0_0.distcp", "__1_0.distcp"]}
    assert judge(join_parts({"a": _part(".metadata", "__0_0.distcp", references=references),
                             "b": _part("__1_0.distcp")}), 2).valid
    a, b = _part("COMPLETE", "w.pt"), _part("w.pt")
    b["files"][0]["sha256"] = "other"
    verdict = judge(join_parts({"a": a, "b": b}), 2)
    assert not verdict.valid and "w.pt differs between a and b" in verdict.detail
    unreadable = judge(join_parts({"a": _part("COMPLETE"), "b": _part(valid=False)}), 2)
    assert not unreadable.valid and "b's part cannot be read" in unreadable.detail


def test_the_joined_digest_is_the_same_on_every_node_that_holds_the_whole():
    whole = _part("COMPLETE", "w.pt")
    joined = join_parts({"a": whole, "b": _part("w.pt")})
    assert joined.digest == digest(whole["files"]) and joined.size == sum(f["size"] for f in whole["files"])


def test_a_whole_is_settled_by_its_last_file_or_when_seen_twice_alike_or_when_nothing_can_write_it():
    marked = join_parts({"a": _part("COMPLETE", "w.pt")})
    assert settled(marked, judge(marked, 1), seen_before=None, newer_exists=False, attempt_over=False)
    joined = join_parts({"a": _part("model.safetensors", "optimizer.bin", "random_states_0.pkl")})
    verdict = judge(joined, 1)
    assert verdict.valid and verdict.format == "accelerate"
    assert not settled(joined, verdict, seen_before=None, newer_exists=False, attempt_over=False)
    assert settled(joined, verdict, seen_before=joined.digest, newer_exists=False, attempt_over=False)
    part = join_parts({"a": _part("w.pt")})
    incomplete = judge(part, 1)
    assert not settled(part, incomplete, seen_before=part.digest, newer_exists=False, attempt_over=False)
    assert settled(part, incomplete, seen_before=None, newer_exists=True, attempt_over=False)
    assert settled(part, incomplete, seen_before=None, newer_exists=False, attempt_over=True)


def test_a_file_holding_a_nan_makes_the_whole_invalid_whichever_node_read_it():
    bad = {"file": "optimizer.bin", "tensor": "state.0.exp_avg", "value": "NaN", "element": 7, "dtype": "bfloat16"}
    writer = _part("model.safetensors", "optimizer.bin", "random_states_0.pkl")
    writer["files"][0]["values_read"] = 3
    whole = judge(join_parts({"a": writer}), 1)
    assert whole.valid and whole.detail == "accelerate: 3 files, 3 float tensors read, no NaN", whole
    writer["files"][1]["nonfinite"] = bad
    # node a received its copy through the relay (hashed on arrival, its values not read): node b's word counts
    received = _part("model.safetensors", "optimizer.bin", "random_states_0.pkl")
    verdict = judge(join_parts({"a": received, "b": writer}), 1)
    assert not verdict.valid and verdict.nonfinite == bad
    assert verdict.detail == "optimizer.bin: tensor 'state.0.exp_avg' holds NaN (bfloat16 element 7)"
    # never final while the ranks may still write: a later file of the same step replaces it
    joined = join_parts({"b": writer})
    assert not settled(joined, judge(joined, 1), seen_before=joined.digest, newer_exists=False, attempt_over=False)


class _StorageInfo:  # what torch.distributed.checkpoint pickles for each piece, near enough
    def __init__(self, relative_path: str):
        self.relative_path, self.offset, self.length = relative_path, 0, 8


def test_a_dcp_metadata_names_its_files_read_from_the_pickle_without_running_it():
    data = pickle.dumps({"storage_data": {("w", 0): _StorageInfo("__0_0.distcp"),
                                          ("w", 1): _StorageInfo("__1_0.distcp")}})
    assert dcp_file_names(data) == ["__0_0.distcp", "__1_0.distcp"]
    # A pickle that would run code when loaded is only read: nothing in it runs.
    hostile = b"cos\nsystem\n(S'touch /tmp/coord-pwned __9_9.distcp'\ntR."
    assert dcp_file_names(hostile) == []
    assert dcp_file_names(b"not a pickle") is None


def test_a_real_torch_distributed_checkpoint_names_its_shards(tmp_path):
    import warnings

    import pytest

    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # saved without a process group: one rank
        dcp.save({"w": torch.ones(4), "optim": {"m": torch.zeros(2)}}, checkpoint_id=str(tmp_path))
    names = dcp_file_names((tmp_path / ".metadata").read_bytes())
    assert names == sorted(p.name for p in tmp_path.glob("*.distcp")) and names
