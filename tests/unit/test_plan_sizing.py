"""Sizing: the model's shape from config.json and safetensors headers, the memory estimate by
component, and which Macs can hold it. The known sizing facts (≤4B full on a 128 GB M4 Max,
14B on a 512 GB M3 Ultra, 70B on no single Mac) must come out of the estimate."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.plan.memory_estimate import estimate_memory
from coordinator.plan.model_shape import SizingError, read_model_shape, read_safetensors_header, shape_from_config
from coordinator.plan.sizing import (
    DOES_NOT_FIT,
    FITS,
    NEEDS_GRAD_CHECKPOINT,
    NodeMemory,
    fit_nodes,
    nodes_from_facts,
    sizing_summary,
    split_layers,
)

GIB = 2**30
M4_MAX = 128 * GIB  # system_profiler's "128 GB" is GiB
M3_ULTRA = 512 * GIB

# Shapes of public checkpoints (Qwen3-4B/8B/14B, Qwen2.5-32B, Llama-3-70B), bfloat16, no weights.
CONFIGS = {
    "4B": {"hidden_size": 2560, "num_hidden_layers": 36, "intermediate_size": 9728, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True},
    "8B": {"hidden_size": 4096, "num_hidden_layers": 36, "intermediate_size": 12288, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False},
    "14B": {"hidden_size": 5120, "num_hidden_layers": 40, "intermediate_size": 17408, "num_attention_heads": 40,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False},
    "32B": {"hidden_size": 5120, "num_hidden_layers": 64, "intermediate_size": 27648, "num_attention_heads": 40,
            "num_key_value_heads": 8, "vocab_size": 152064, "tie_word_embeddings": False, "attention_bias": True},
    "70B": {"hidden_size": 8192, "num_hidden_layers": 80, "intermediate_size": 28672, "num_attention_heads": 64,
            "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False},
}


def write_config(directory: Path, size: str, **extra) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen3", "torch_dtype": "bfloat16", **CONFIGS[size], **extra}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture
def model(tmp_path):
    return lambda size, **extra: read_model_shape(write_config(tmp_path / size, size, **extra))


def one_mac(memory: int, name: str = "mac") -> list[NodeMemory]:
    return [NodeMemory(name, memory)]


# --- the shape --------------------------------------------------------------------------------


@pytest.mark.parametrize("size, billions", [("4B", 4.02), ("8B", 8.19), ("14B", 14.77), ("32B", 32.76),
                                            ("70B", 70.55)])
def test_a_synthetic_config_is_counted_from_the_config_and_says_so(model, size, billions):
    shape = model(size)
    assert shape.parameter_count / 1e9 == pytest.approx(billions, abs=0.01)
    assert shape.source.startswith("computed from") and "no *.safetensors" in shape.source
    assert shape.dtype == "bfloat16"
    assert shape.weight_bytes == 2 * shape.parameter_count


def test_safetensors_headers_give_the_same_count_as_the_config_and_the_model_itself(tmp_path):
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from coordinator.cli.tinymodel import write_model

    directory = write_model(tmp_path / "tiny")
    shape = read_model_shape(directory)
    config = json.loads((directory / "config.json").read_text())
    real = llama.Model(llama.ModelArgs.from_dict(config))
    assert shape.parameter_count == sum(v.size for _, v in tree_flatten(real.parameters()))
    assert shape.layer_parameter_count == sum(v.size for layer in real.layers
                                              for _, v in tree_flatten(layer.parameters()))
    assert shape.parameter_count == shape_from_config(config).parameter_count
    assert shape.dtype == "float32" and shape.weight_bytes == 4 * shape.parameter_count
    assert shape.source == "parameters and dtype from 1 safetensors header"


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]], data: bytes = b"") -> None:
    offset, header = 0, {"__metadata__": {"format": "mlx"}}
    for name, (dtype, shape) in tensors.items():
        size = {"BF16": 2, "F32": 4, "U32": 4}[dtype]
        for n in shape:
            size *= n
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_only_the_headers_are_read_never_the_tensors(tmp_path):
    directory = write_config(tmp_path / "m", "4B")
    # Headers for two shards whose tensor data is not in the files at all.
    write_safetensors(directory / "model-00001-of-00002.safetensors", {
        "model.embed_tokens.weight": ("BF16", [151936, 2560]),
        "model.layers.0.mlp.down_proj.weight": ("BF16", [2560, 9728]),
    })
    write_safetensors(directory / "model-00002-of-00002.safetensors", {
        "model.layers.1.self_attn.q_proj.weight": ("BF16", [4096, 2560]),
        "model.norm.weight": ("BF16", [2560]),
    })
    shape = read_model_shape(directory)
    in_layers = 2560 * 9728 + 4096 * 2560
    assert shape.layer_parameter_count == in_layers
    assert shape.parameter_count == in_layers + 151936 * 2560 + 2560
    assert shape.weight_bytes == 2 * shape.parameter_count
    assert shape.source == "parameters and dtype from 2 safetensors headers"


def test_quantized_weights_are_counted_from_the_config_and_sized_from_the_headers(tmp_path):
    directory = write_config(tmp_path / "q", "4B", quantization={"group_size": 64, "bits": 4})
    write_safetensors(directory / "model.safetensors", {
        "model.layers.0.mlp.down_proj.weight": ("U32", [2560, 9728 // 8]),
        "model.layers.0.mlp.down_proj.scales": ("BF16", [2560, 9728 // 64]),
        "model.layers.0.mlp.down_proj.biases": ("BF16", [2560, 9728 // 64]),
    })
    shape = read_model_shape(directory)
    assert shape.quantization_bits == 4
    assert shape.parameter_count == shape_from_config(CONFIGS["4B"]).parameter_count
    assert shape.weight_bytes == 2560 * 9728 // 2 + 2 * 2 * 2560 * 9728 // 64
    assert "4-bit quantized" in shape.source and "weight bytes from 1 safetensors header" in shape.source
    plan = fit_nodes(shape, one_mac(M4_MAX), batch_size=1)
    assert any("--dequantize --dtype float32" in note for note in plan["notes"])


@pytest.mark.parametrize("header", [b"\x00" * 4, struct.pack("<Q", 2**40), struct.pack("<Q", 50) + b"{}",
                                    struct.pack("<Q", 2) + b"[]"])
def test_a_file_that_is_not_safetensors_is_refused_with_the_file(tmp_path, header):
    path = tmp_path / "model.safetensors"
    path.write_bytes(header)
    with pytest.raises(SizingError, match="model.safetensors"):
        read_safetensors_header(path)


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": None}, "hidden_size must be a positive integer"),
    ({"num_hidden_layers": "36"}, "num_hidden_layers must be a positive integer"),
    ({"num_local_experts": 8}, "mixture-of-experts"),
])
def test_a_config_that_cannot_be_sized_says_why(change, message):
    with pytest.raises(SizingError, match=message):
        shape_from_config({**CONFIGS["8B"], **change})


def test_a_multimodal_config_is_sized_from_its_text_config():
    shape = shape_from_config({"model_type": "vlm", "text_config": CONFIGS["4B"], "torch_dtype": "bfloat16"})
    assert shape.num_layers == 36 and shape.dtype == "bfloat16"


# --- the estimate -----------------------------------------------------------------------------


def test_every_component_has_a_rule_that_shows_its_numbers(model):
    estimate = estimate_memory(model("8B"), "full", batch_size=2, seq_len=2048)
    names = [c.name for c in estimate.components]
    assert names == ["weights", "gradients", "optimizer_state", "optimizer_update", "activations", "logits",
                     "attention_scores"]
    assert estimate.total_bytes == sum(c.bytes for c in estimate.components)
    by_name = {c.name: c for c in estimate.components}
    trainable = estimate.trainable_parameters
    assert by_name["gradients"].bytes == 4 * trainable and f"{trainable:,}" in by_name["gradients"].rule
    assert by_name["optimizer_state"].bytes == 2 * 4 * trainable and "adam keeps 2" in by_name["optimizer_state"].rule
    assert "2 × 2048 tokens × 36 blocks" in by_name["activations"].rule
    assert "151,936 vocab" in by_name["logits"].rule


def test_a_full_fine_tune_trains_the_blocks_in_float32_not_the_embedding(model):
    shape = model("4B")
    estimate = estimate_memory(shape, "full")
    assert estimate.train_dtype == "float32"
    assert estimate.trainable_parameters == shape.layer_parameter_count
    as_stored = estimate_memory(shape, "full", train_dtype="bfloat16")
    assert as_stored.total_bytes < estimate.total_bytes


def test_optimizer_state_follows_the_optimizer(model):
    shape = model("4B")
    state = {name: next(c.bytes for c in estimate_memory(shape, optimizer=name).components
                        if c.name == "optimizer_state") for name in ("adam", "adamw", "sgd", "adafactor")}
    assert state["adam"] == state["adamw"] == 2 * state["sgd"] and state["adafactor"] == 0


def test_gradient_checkpointing_keeps_only_block_inputs(model):
    shape = model("8B")
    plain = estimate_memory(shape, batch_size=4)
    checkpointed = estimate_memory(shape, batch_size=4, grad_checkpoint=True)
    activations = {e.grad_checkpoint: next(c.bytes for c in e.components if c.name == "activations")
                   for e in (plain, checkpointed)}
    tokens = 4 * 2048
    assert activations[True] == tokens * (36 * 4096 + (4 * 4096 + 2 * 4096 + 2 * 1024 + 4 * 12288)) * 4
    assert activations[True] < activations[False] / 5


def test_lora_and_full_trainable_counts_match_mlx_lm(tmp_path):
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from coordinator.cli.tinymodel import write_model

    directory = write_model(tmp_path / "tiny", layers=4)
    shape = read_model_shape(directory)
    config = json.loads((directory / "config.json").read_text())

    full = llama.Model(llama.ModelArgs.from_dict(config))
    full.freeze()
    for layer in full.layers:  # what mlx_lm lora --fine-tune-type full --num-layers -1 unfreezes
        layer.unfreeze()
    assert estimate_memory(shape, "full").trainable_parameters == sum(
        v.size for _, v in tree_flatten(full.trainable_parameters()))

    lora = llama.Model(llama.ModelArgs.from_dict(config))
    lora.freeze()
    linear_to_lora_layers(lora, 2, {"rank": 8, "scale": 20.0, "dropout": 0.0})
    assert estimate_memory(shape, "lora", lora_layers=2).trainable_parameters == sum(
        v.size for _, v in tree_flatten(lora.trainable_parameters()))


@pytest.mark.parametrize("kwargs, message", [
    ({"fine_tune_type": "qlora"}, "fine_tune_type must be one of"),
    ({"optimizer": "lamb"}, "optimizer must be one of"),
    ({"batch_size": 0}, "batch_size must be a positive integer"),
    ({"lora_layers": 0}, "lora_layers must be -1"),
    ({"fine_tune_type": "lora", "lora_layers": 99}, "the model has 36 blocks"),
    ({"train_dtype": "int8"}, "train_dtype must be one of"),
])
def test_a_request_that_cannot_be_sized_says_why(model, kwargs, message):
    with pytest.raises(SizingError, match=message):
        estimate_memory(model("4B"), **kwargs)


# --- the known facts --------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_full_fine_tune_of_4b_fits_a_128_gb_m4_max(model, batch):
    plan = fit_nodes(model("4B"), one_mac(M4_MAX), batch_size=batch)
    assert plan["nodes"][0]["verdict"] in (FITS, NEEDS_GRAD_CHECKPOINT)
    assert plan["recommendation"]["kind"] == "data_parallel"


def test_4b_at_batch_1_needs_no_checkpointing_and_at_batch_4_does(model):
    shape = model("4B")
    assert fit_nodes(shape, one_mac(M4_MAX), batch_size=1)["nodes"][0]["verdict"] == FITS
    plan = fit_nodes(shape, one_mac(M4_MAX), batch_size=4)
    assert plan["nodes"][0]["verdict"] == NEEDS_GRAD_CHECKPOINT and plan["grad_checkpoint"] is True


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_full_fine_tune_of_8b_fits_no_128_gb_mac_and_lora_is_offered(model, batch):
    plan = fit_nodes(model("8B"), one_mac(M4_MAX), batch_size=batch)
    assert plan["nodes"][0]["verdict"] == DOES_NOT_FIT
    assert plan["recommendation"]["kind"] == "lora"
    assert plan["lora"]["replicas"] == ["mac"]


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_full_fine_tune_of_14b_fits_a_512_gb_m3_ultra(model, batch):
    plan = fit_nodes(model("14B"), one_mac(M3_ULTRA), batch_size=batch)
    assert plan["nodes"][0]["verdict"] in (FITS, NEEDS_GRAD_CHECKPOINT)
    assert plan["recommendation"]["kind"] == "data_parallel"


def test_14b_is_the_largest_of_these_a_512_gb_mac_can_fully_fine_tune(model):
    plan = fit_nodes(model("32B"), one_mac(M3_ULTRA), batch_size=1)
    assert plan["nodes"][0]["verdict"] == DOES_NOT_FIT


@pytest.mark.parametrize("memory", [M4_MAX, M3_ULTRA])
@pytest.mark.parametrize("batch", [1, 4])
def test_full_fine_tune_of_70b_fits_no_single_mac(model, memory, batch):
    plan = fit_nodes(model("70B"), one_mac(memory), batch_size=batch)
    assert plan["nodes"][0]["verdict"] == DOES_NOT_FIT
    assert plan["replicas"] == []


def test_70b_on_one_128_gb_mac_is_not_trainable_and_says_why(model):
    detail = fit_nodes(model("70B"), one_mac(M4_MAX), batch_size=1)["recommendation"]
    assert detail["kind"] == "not_trainable"
    assert "one node: no pipeline split" in detail["detail"]
    assert "MLX cannot shard" in detail["detail"]


def test_70b_lora_fits_a_512_gb_m3_ultra(model):
    plan = fit_nodes(model("70B"), one_mac(M3_ULTRA), batch_size=1)
    assert plan["recommendation"]["kind"] == "lora"


# --- mixed clusters and pipelines -------------------------------------------------------------


@pytest.mark.parametrize("asked", ["lora", "full", "dora"])
def test_lora_and_full_are_both_sized_whichever_was_asked_for(model, asked):
    """8B on a 128 GB M4 Max and a 512 GB M3 Ultra: LoRA fits both, a full fine-tune only the Ultra."""
    plan = fit_nodes(model("8B"), [NodeMemory("max", M4_MAX), NodeMemory("ultra", M3_ULTRA)],
                     fine_tune_type=asked, batch_size=1, seq_len=2048)
    both = plan["by_fine_tune_type"]
    assert both["lora"]["replicas"] == ["max", "ultra"] and both["full"]["replicas"] == ["ultra"]
    assert both["full"]["train_dtype"] == "float32"
    assert both["lora"]["need_bytes"] < both["full"]["need_bytes"]
    assert both["full"]["need_bytes_grad_checkpoint"] <= both["full"]["need_bytes"]
    if asked in both:  # the asked-for one is the plan's own estimate, not a second one
        assert both[asked]["need_bytes"] == plan["estimate"]["total_bytes"]


def test_a_node_that_cannot_hold_a_replica_is_left_out_by_name(model):
    nodes = [NodeMemory("ultra", M3_ULTRA), NodeMemory("max", M4_MAX)]
    plan = fit_nodes(model("14B"), nodes, batch_size=1)
    assert plan["replicas"] == ["ultra"]
    assert plan["recommendation"]["kind"] == "data_parallel"
    assert "left out: max (96.0 GiB usable)" in plan["recommendation"]["detail"]


def test_where_no_node_holds_lora_the_blocks_are_split_with_fewer_on_the_weaker_node(model):
    nodes = [NodeMemory("small", 64 * GIB), NodeMemory("big", M4_MAX)]
    plan = fit_nodes(model("70B"), nodes, batch_size=1)
    assert plan["recommendation"]["kind"] == "pipeline"
    stages = plan["pipeline"]["stages"]
    assert [s["node"] for s in stages] == ["small", "big"]
    assert stages[0]["blocks"] < stages[1]["blocks"] and sum(s["blocks"] for s in stages) == 80
    assert all(s["need_bytes"] <= s["usable_bytes"] for s in stages)
    assert "no pipeline mode" in plan["pipeline"]["note"]


def test_a_cluster_too_small_for_any_split_is_not_trainable(model):
    nodes = [NodeMemory("a", 48 * GIB), NodeMemory("b", 48 * GIB)]
    plan = fit_nodes(model("70B"), nodes, batch_size=1)
    assert plan["recommendation"]["kind"] == "not_trainable"
    assert "full: pipeline split" in plan["recommendation"]["detail"]
    assert "lora: pipeline split" in plan["recommendation"]["detail"]


@given(st.lists(st.integers(min_value=1, max_value=1024), min_size=1, max_size=8), st.integers(8, 128))
def test_split_layers_gives_every_block_once_and_never_more_to_a_weaker_node(usable, layers):
    counts = split_layers(layers, usable)
    assert sum(counts) == layers and min(counts) >= 1
    for a in range(len(usable)):
        for b in range(len(usable)):
            if usable[a] < usable[b]:
                assert counts[a] <= counts[b]


def test_split_layers_is_proportional():
    assert split_layers(80, [96, 48]) == [53, 27]
    assert split_layers(80, [384, 96]) == [64, 16]
    with pytest.raises(SizingError, match="3 nodes but only 2 blocks"):
        split_layers(2, [1, 1, 1])


# --- nodes --------------------------------------------------------------------------------------


def test_node_memory_comes_from_facts_with_the_rule_for_its_os():
    nodes, unknown = nodes_from_facts({
        "ultra": {"os": "macOS", "memory_bytes": M3_ULTRA},
        "linux": {"os": "Linux", "memory_bytes": 64 * GIB},
        "down": None,
        "odd": {"os": "macOS", "memory_bytes": None},
    })
    assert unknown == ["down", "odd"]
    ultra, linux = nodes
    assert ultra.usable_bytes == 384 * GIB and "75%" in ultra.usable_rule
    assert linux.usable_bytes == int(64 * GIB * 0.9) and "not a Mac" in linux.usable_rule


def test_gpu_memory_measured_by_calibration_replaces_the_rule_of_thumb():
    measured = {"raised": (120 * GIB, "mx.device_info()['max_recommended_working_set_size']"),
                "cuda": (80 * GIB, "mx.device_info()['total_memory']")}
    nodes, unknown = nodes_from_facts({
        "raised": {"os": "macOS", "memory_bytes": M4_MAX},  # iogpu.wired_limit_mb raised above 75%
        "cuda": {"os": "Linux", "memory_bytes": 512 * GIB},  # the card's memory, not the host's
        "plain": {"os": "macOS", "memory_bytes": M4_MAX},
    }, measured)
    raised, cuda, plain = nodes
    assert not unknown
    assert raised.usable_bytes == 120 * GIB and raised.usable_rule.startswith("measured: ")
    assert cuda.usable_bytes == 80 * GIB and "total_memory" in cuda.usable_rule
    assert plain.usable_bytes == 96 * GIB and "75%" in plain.usable_rule
    # the layer split follows what was measured: the node with the raised limit takes more blocks
    assert split_layers(32, [n.usable_bytes for n in (raised, plain)]) == [18, 14]


def test_the_plan_document_gets_a_batch_a_checkpoint_size_and_a_source(model):
    without = sizing_summary(fit_nodes(model("4B"), one_mac(M4_MAX), batch_size=1))
    assert without["per_rank_batch_size"] == 1 and "--grad-checkpoint" not in without["source"]
    plan = fit_nodes(model("4B"), one_mac(M4_MAX), batch_size=4)
    summary = sizing_summary(plan)
    assert summary["per_rank_batch_size"] == plan["largest_batch_size"] > 4
    assert summary["checkpoint_bytes"] == 4 * model("4B").layer_parameter_count
    # Adam's two moments per trainable parameter ride along in coord's trainer's checkpoints
    assert summary["checkpoint_bytes_with_optimizer"] == 3 * summary["checkpoint_bytes"]
    assert 87 * GIB < summary["memory_per_rank_bytes"] <= 96 * GIB
    assert "largest per-rank batch that fits mac with --grad-checkpoint" in summary["source"]
    unsized = sizing_summary(fit_nodes(model("70B"), one_mac(M4_MAX), batch_size=1))
    assert unsized["per_rank_batch_size"] is None and "not trainable" in unsized["source"]
