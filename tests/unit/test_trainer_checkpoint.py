"""coord's trainer, the parts that need no training: safetensors files, trainer state, data order, offsets."""

from __future__ import annotations

import ast
import json
import os
import types
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from agent.trainer import state as trainer_state
from agent.trainer.checkpoint import host_copy
from agent.trainer.data import GlobalOrder, Split
from agent.trainer.main import SetupError, starting_step
from agent.trainer.safetensors_file import HostTensor, read_metadata, remove_stale_temps, temp_path, write_atomic
from tests.integration.daemon_harness import REPO


def test_the_writer_round_trips_through_mx_load_with_float32_bfloat16_ints_scalars_and_metadata(tmp_path):
    arrays = {
        "model.layers.0.w": mx.arange(12, dtype=mx.float32).reshape(3, 4) / 7,
        "model.layers.1.bf": (mx.arange(6, dtype=mx.float32) * 1.37 - 2).astype(mx.bfloat16).reshape(2, 3),
        "ints": mx.array([-3, 0, 2**31 - 1], dtype=mx.int32),
        "step": mx.array(17, dtype=mx.uint64),
        "half": mx.array([0.5, -1.25], dtype=mx.float16),
        "empty": mx.zeros((0, 3)),
        "transposed": mx.arange(6, dtype=mx.float32).reshape(2, 3).T,
    }
    path = tmp_path / "x.safetensors"
    size = write_atomic(str(path), host_copy(arrays), {"coord.trainer_state": '{"a": 1}', "other": "é"})
    assert size == path.stat().st_size
    loaded, metadata = mx.load(str(path), return_metadata=True)
    assert metadata == {"coord.trainer_state": '{"a": 1}', "other": "é"}
    assert set(loaded) == set(arrays)
    for name, array in arrays.items():
        assert loaded[name].dtype == array.dtype, name
        assert loaded[name].shape == array.shape, name
        assert mx.array_equal(loaded[name], array).item(), name
    assert read_metadata(str(path))["other"] == "é"


def test_the_header_is_padded_so_tensor_data_starts_8_byte_aligned(tmp_path):
    path = tmp_path / "a.safetensors"
    write_atomic(str(path), {"x": HostTensor("U8", (3,), b"abc")})
    length = int.from_bytes(path.read_bytes()[:8], "little")
    assert length % 8 == 0 and path.read_bytes()[8 + length:] == b"abc"


def test_host_copy_owns_its_memory():
    array = mx.arange(4, dtype=mx.float32)
    copy = host_copy({"a": array})["a"]
    assert copy.data.flags["OWNDATA"] and copy.data.flags["C_CONTIGUOUS"]
    assert np.array_equal(copy.data, np.arange(4, dtype=np.float32))


def test_a_failed_write_leaves_no_partial_file_and_the_old_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "0000010_adapters.safetensors"
    write_atomic(str(path), {"w": HostTensor("F32", (2,), np.ones(2, np.float32))})
    before = path.read_bytes()

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space"):
        write_atomic(str(path), {"w": HostTensor("F32", (4,), np.zeros(4, np.float32))})
    with pytest.raises(OSError):
        write_atomic(str(tmp_path / "0000020_adapters.safetensors"), {"w": HostTensor("F32", (1,), b"\0" * 4)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000010_adapters.safetensors"]
    assert path.read_bytes() == before


def test_a_bad_tensor_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="not a safetensors dtype"):
        write_atomic(str(tmp_path / "a.safetensors"), {"w": HostTensor("F8", (1,), b"x")})
    assert list(tmp_path.iterdir()) == []


def test_temporary_files_of_dead_writers_are_removed_and_live_ones_kept(tmp_path):
    final = tmp_path / "0000005_adapters.safetensors"
    mine = Path(temp_path(str(final)))
    mine.write_bytes(b"in progress")
    dead = tmp_path / ".0000010_adapters.safetensors.999999999.tmp"  # no such pid
    dead.write_bytes(b"left by a killed run")
    assert remove_stale_temps(str(tmp_path)) == [dead.name]
    assert mine.exists()


def _args(**overrides):
    values = {"fine_tune_type": "lora", "num_layers": 4, "lora_parameters": {"rank": 8, "dropout": 0.0, "scale": 20.0},
              "optimizer": "adam", "optimizer_config": {"adam": {}}, "learning_rate": 1e-5, "lr_schedule": None,
              "seed": 0, "max_seq_length": 2048, "mask_prompt": False}
    values.update(overrides)
    return types.SimpleNamespace(**values)


def _state(options):
    return trainer_state.build(global_step=10, optimizer_step=10, mlx_key=[1, 2], epoch=0, index=10,
                               batches_per_epoch=12, world_size=3, batch_size=6, grad_accumulation_steps=1,
                               trained_tokens=100, options=options)


def test_the_trainer_state_survives_the_metadata_round_trip(tmp_path):
    options = trainer_state.fixed_options(_args(), global_batch=6, train_examples=72)
    state = _state(options)
    path = tmp_path / "c.safetensors"
    write_atomic(str(path), {"w": HostTensor("F32", (1,), np.zeros(1, np.float32))}, trainer_state.encode(state))
    decoded = trainer_state.decode(read_metadata(str(path)), str(path))
    assert decoded == json.loads(json.dumps(state))
    trainer_state.check_compatible(decoded, options, str(path))
    trainer_state.check_data_position(decoded, 12, str(path))


def test_a_plain_mlx_lm_adapters_file_has_no_trainer_state():
    assert trainer_state.decode({"format": "mlx"}, "adapters.safetensors") is None


@pytest.mark.parametrize("change, named", [
    ({"fine_tune_type": "dora"}, "fine_tune_type"),
    ({"num_layers": 8}, "num_layers"),
    ({"lora_parameters": {"rank": 16, "dropout": 0.0, "scale": 20.0}}, "lora_parameters"),
    ({"optimizer": "adamw"}, "optimizer"),
    ({"learning_rate": 2e-5}, "learning_rate"),
    ({"lr_schedule": {"name": "cosine_decay", "arguments": [1e-5, 100]}}, "lr_schedule"),
    ({"seed": 1}, "seed"),
])
def test_a_checkpoint_from_other_training_options_is_refused_naming_the_option(change, named):
    state = json.loads(json.dumps(_state(trainer_state.fixed_options(_args(), 6, 72))))
    options = trainer_state.fixed_options(_args(**change), 6, 72)
    with pytest.raises(trainer_state.StateError, match=named):
        trainer_state.check_compatible(state, options, "ckpt")


def test_another_global_batch_or_data_set_is_refused_but_another_split_of_the_same_batch_is_not():
    state = json.loads(json.dumps(_state(trainer_state.fixed_options(_args(), 6, 72))))
    with pytest.raises(trainer_state.StateError, match="global_batch: checkpoint 6, this run 4"):
        trainer_state.check_compatible(state, trainer_state.fixed_options(_args(), 4, 72), "ckpt")
    with pytest.raises(trainer_state.StateError, match="train_examples"):
        trainer_state.check_compatible(state, trainer_state.fixed_options(_args(), 6, 80), "ckpt")
    # 3 ranks × batch 6 saved; 2 ranks with batch 2 × 3 accumulation steps is the same global batch
    trainer_state.check_compatible(state, trainer_state.fixed_options(_args(), 2 * 3, 72), "ckpt")


def test_a_damaged_or_newer_trainer_state_is_refused():
    state = _state(trainer_state.fixed_options(_args(), 6, 72))
    with pytest.raises(trainer_state.StateError, match="version 2 is not supported"):
        trainer_state.decode(trainer_state.encode({**state, "version": 2}), "ckpt")
    with pytest.raises(trainer_state.StateError, match="not valid JSON"):
        trainer_state.decode({trainer_state.METADATA_KEY: "{"}, "ckpt")
    with pytest.raises(trainer_state.StateError, match="RNG key"):
        trainer_state.decode(trainer_state.encode({**state, "rng": {"mlx_key": [1]}}), "ckpt")
    with pytest.raises(trainer_state.StateError, match="data position"):
        trainer_state.check_data_position(json.loads(json.dumps(state)), 11, "ckpt")


def test_the_examples_of_a_step_do_not_depend_on_how_the_global_batch_is_split():
    order = GlobalOrder(size=50, global_batch=6, seed=3)
    assert order.batches_per_epoch == 8
    for step in range(1, 30):
        examples = order.examples(step)
        assert len(set(examples)) == 6
        for world, batch, accumulation in ((1, 6, 1), (3, 6, 1), (2, 2, 3), (1, 1, 6), (3, 3, 2)):
            pieces = [Split(world, rank, batch, accumulation).micro_batches(examples) for rank in range(world)]
            consumed = [i for micro in range(accumulation) for rank in range(world) for i in pieces[rank][micro]]
            assert consumed == examples


def test_each_epoch_is_a_fresh_permutation_fixed_by_the_seed():
    order = GlobalOrder(size=12, global_batch=4, seed=0)
    epoch0 = [i for step in (1, 2, 3) for i in order.examples(step)]
    epoch1 = [i for step in (4, 5, 6) for i in order.examples(step)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(12)) and epoch0 != epoch1
    assert GlobalOrder(size=12, global_batch=4, seed=0).examples(5) == order.examples(5)
    assert GlobalOrder(size=12, global_batch=4, seed=1).examples(1) != order.examples(1)
    assert order.position(7) == (2, 1)


def test_a_batch_the_ranks_cannot_share_is_refused():
    with pytest.raises(ValueError, match="multiple of the number of ranks"):
        Split(world_size=3, rank=0, batch_size=4, accumulation=1)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        GlobalOrder(size=5, global_batch=6, seed=0)


def test_the_step_offset_must_match_the_checkpoint():
    state = {"global_step": 10}
    assert starting_step(state, "c", None) == (10, 0)
    assert starting_step(state, "c", "10") == (10, 10)
    with pytest.raises(SetupError, match="COORD_STEP_OFFSET is 7 but c is the checkpoint of global step 10"):
        starting_step(state, "c", "7")
    # plain mlx-lm adapters: count from the offset
    assert starting_step(None, "adapters.safetensors", "30") == (30, 30)
    assert starting_step(None, None, None) == (0, 0)
    with pytest.raises(SetupError, match="nothing to resume from"):
        starting_step(None, None, "5")


def test_the_trainer_parses_with_python_3_10_grammar():
    # The agent, trainer included, runs under each node's own Python, which may be 3.10.
    for path in [REPO / "agent" / "train.py", *sorted((REPO / "agent" / "trainer").glob("*.py"))]:
        ast.parse(path.read_text(encoding="utf-8"), filename=str(path), feature_version=(3, 10))


def test_a_save_returns_before_the_file_is_written_and_the_file_holds_the_step_it_was_asked_for(tmp_path,
                                                                                                 monkeypatch):
    """The training thread only copies the arrays; the file is written by the background thread."""
    import threading

    from agent.trainer import checkpoint

    release, writers = threading.Event(), []

    def slow_write(path, tensors, metadata=None):
        writers.append(threading.current_thread().name)
        assert release.wait(30)
        return write_atomic(path, tensors, metadata)

    monkeypatch.setattr(checkpoint, "write_atomic", slow_write)
    progress = tmp_path / "progress.jsonl"
    writer = checkpoint.BackgroundWriter(str(progress), rank=0)
    weights = {"w": mx.arange(4, dtype=mx.float32)}
    path = tmp_path / "0000010_adapters.safetensors"
    held = writer.save(str(path), 10, weights, {"coord.trainer_state": "{}"})
    assert not path.exists() and held < 5  # back on the training thread while the write waits
    weights["w"] = weights["w"] + 100  # the next step changes the weights: the save keeps its own copy
    release.set()
    writer.close()
    assert writers and writers[0].startswith("coord-trainer-io") and writers[0] != threading.current_thread().name
    assert mx.load(str(path))["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    record = json.loads(progress.read_text().splitlines()[-1])
    assert record["kind"] == "checkpoint" and record["step"] == 10 and record["blocking_seconds"] == held
