"""A tiny llama-style model, tokenizer and data set, made here: nothing is downloaded.

Used by `coord demo` and the tests: a few layers of width 64 with a word-level
tokenizer (``tokenizers``), in the layout ``mlx_lm`` loads from a directory,
and a small JSONL data set, so a real `mlx_lm lora` fine-tune runs on the CPU
in seconds.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ["the", "cat", "dog", "bird", "fish", "runs", "jumps", "sleeps", "eats", "sings", "on", "under", "over",
         "near", "a", "red", "blue", "green", "small", "big", "quick", "slow", "happy", "sad", "tree", "house",
         "river", "hill", "sun", "moon", "star", "and", "or", "but", "then"]


def make_sentences(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) for _ in range(count)]


def write_tokenizer(directory: Path) -> int:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {token: i for i, token in enumerate(specials + sorted(set(WORDS)))}
    tokenizer = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": 512}, indent=1))
    (directory / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}, indent=1))
    return len(vocab)


def write_model(directory: Path, *, layers: int = 2, width: int = 64, seed: int = 0) -> Path:
    """config.json, model.safetensors and the tokenizer files, in mlx_lm's layout."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(directory)
    config = {"model_type": "llama", "hidden_size": width, "num_hidden_layers": layers,
              "intermediate_size": width * 2, "num_attention_heads": 4, "num_key_value_heads": 4,
              "rms_norm_eps": 1e-5, "vocab_size": vocab_size, "max_position_embeddings": 256,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return directory


def write_data(directory: Path, *, train: int = 200, valid: int = 20, seed: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, count, offset in (("train", train, 0), ("valid", valid, 1000), ("test", valid, 2000)):
        lines = [json.dumps({"text": text}) for text in make_sentences(count, seed + offset)]
        (directory / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return directory


def write_project(root: Path) -> Path:
    """A project directory as a user would have it: model/ and data/, ready for coord sync."""
    write_model(root / "model")
    write_data(root / "data")
    return root
