"""A model's shape, read from its files without loading a tensor.

The model's shape comes from its ``config.json`` and the headers of its ``*.safetensors``
files (only the 8-byte length and the JSON header of each file are read, never a
tensor); a directory with no weights (a synthetic config) is counted from the config
alone, and :attr:`ModelShape.source` says which was used.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from shared import safetensors_header

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_DTYPE = "bfloat16"  # what most published checkpoints hold; used only when nothing says otherwise

_SAFETENSORS_FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_LAYER_TENSOR = re.compile(r"(?:^|\.)layers\.\d+\.")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


class ModelShapeDict(TypedDict):
    """:meth:`ModelShape.as_dict`."""

    parameters: int
    layer_parameters: int
    layers: int
    hidden_size: int
    intermediate_size: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype: str
    quantization_bits: int | None
    weight_bytes: int
    source: str


class SizingError(ValueError):
    """A model directory or request that cannot be sized, with the reason."""


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype: str  # the floating dtype the weights (or a quantized model's scales) are stored in
    quantization_bits: int | None
    parameter_count: int
    layer_parameter_count: int  # all transformer blocks together
    weight_bytes: int  # the weights as stored
    source: str

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def block_parameters(self) -> float:
        return self.layer_parameter_count / self.num_layers

    @property
    def stored_bytes_per_parameter(self) -> float:
        return self.weight_bytes / self.parameter_count

    def as_dict(self) -> ModelShapeDict:
        return {
            "parameters": self.parameter_count, "layer_parameters": self.layer_parameter_count,
            "layers": self.num_layers, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "attention_heads": self.num_attention_heads,
            "kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings, "dtype": self.dtype,
            "quantization_bits": self.quantization_bits, "weight_bytes": self.weight_bytes, "source": self.source,
        }


def read_model_shape(model_dir: str | Path) -> ModelShape:
    """The shape of the model in ``model_dir`` (its config.json and safetensors headers)."""
    directory = Path(model_dir)
    config_path = directory / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except OSError as error:
        raise SizingError(f"cannot read {config_path}: {error.strerror or error}") from error
    except ValueError as error:
        raise SizingError(f"{config_path} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise SizingError(f"{config_path} must hold a JSON object")
    files = sorted(directory.glob("*.safetensors"))
    headers = [read_safetensors_header(path) for path in files]
    return shape_from_config(config, headers, where=str(config_path))


def read_safetensors_header(path: str | Path) -> dict[str, safetensors_header.TensorEntry]:
    """``{tensor name: {"dtype", "shape", "data_offsets"}}`` from a safetensors file's header."""
    try:
        return safetensors_header.tensor_entries(safetensors_header.read_header(path), path)
    except safetensors_header.HeaderError as error:
        raise SizingError(str(error)) from error


def shape_from_config(config: Mapping[str, Any], headers: Sequence[Mapping[str, Mapping[str, Any]]] = (),
                      where: str = "config.json") -> ModelShape:
    """Build the shape from a parsed config.json and the models' safetensors headers (may be none)."""
    text = _language_config(config)
    if any(int_or_none(text.get(key)) not in (None, 0, 1) for key in _EXPERT_KEYS):
        raise SizingError(f"{where}: mixture-of-experts models are not sized yet (only dense transformers)")
    hidden = _required_int(text, "hidden_size", where)
    layers = _required_int(text, "num_hidden_layers", where)
    intermediate = _required_int(text, "intermediate_size", where)
    heads = _required_int(text, "num_attention_heads", where)
    vocab = _required_int(text, "vocab_size", where)
    kv_heads = int_or_none(text.get("num_key_value_heads")) or heads
    head_dim = int_or_none(text.get("head_dim")) or hidden // heads
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    bits = _quantization_bits(config)
    counted_total, counted_layers = count_parameters(
        hidden=hidden, layers=layers, intermediate=intermediate, q_width=heads * head_dim,
        kv_width=kv_heads * head_dim, vocab=vocab, tied=tied, attention_bias=bool(text.get("attention_bias")))
    config_dtype = _config_dtype(config)
    if headers:
        total, layer_total, weight_bytes, stored_dtype = _count_headers(headers)
        files = f"{len(headers)} safetensors header{'s' if len(headers) != 1 else ''}"
        if bits is not None:
            # Packed uint32 weights hold 32/bits values each: the config counts them exactly.
            total, layer_total = counted_total, counted_layers
            source = f"parameters computed from {where} ({bits}-bit quantized weights); weight bytes from {files}"
        else:
            source = f"parameters and dtype from {files}"
        dtype = stored_dtype or config_dtype or DEFAULT_DTYPE
    else:
        total, layer_total = counted_total, counted_layers
        dtype = config_dtype or DEFAULT_DTYPE
        weight_bytes = round(total * _stored_bytes_per_parameter(dtype, bits, config))
        source = (f"computed from {where} (no *.safetensors); dtype "
                  + (f"{dtype} from the config" if config_dtype else f"assumed {dtype}"))
    return ModelShape(hidden_size=hidden, num_layers=layers, intermediate_size=intermediate,
                      num_attention_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
                      tie_word_embeddings=tied, dtype=dtype, quantization_bits=bits, parameter_count=total,
                      layer_parameter_count=layer_total, weight_bytes=weight_bytes, source=source)


def count_parameters(*, hidden: int, layers: int, intermediate: int, q_width: int, kv_width: int, vocab: int,
                     tied: bool, attention_bias: bool = False) -> tuple[int, int]:
    """(all parameters, those in the transformer blocks) of a llama-style dense model.

    A block: q and o projections (hidden × q_width each), k and v (hidden × kv_width each),
    a gated MLP (3 × hidden × intermediate) and two norms (hidden each); per-head q/k norms
    (Qwen3) are left out, under 0.01% of a block. Outside the blocks: the embedding, the LM
    head unless tied, and the final norm.
    """
    attention = 2 * hidden * q_width + 2 * hidden * kv_width
    if attention_bias:
        attention += q_width + 2 * kv_width
    block = attention + 3 * hidden * intermediate + 2 * hidden
    in_blocks = layers * block
    embedding = vocab * hidden
    return in_blocks + embedding + (0 if tied else embedding) + hidden, in_blocks


def _count_headers(headers: Sequence[Mapping[str, Mapping[str, Any]]]) -> tuple[int, int, int, str | None]:
    total = in_layers = weight_bytes = 0
    float_bytes: dict[str, int] = {}
    for header in headers:
        for name, entry in header.items():
            count = math.prod(int(n) for n in entry["shape"])
            start, end = entry["data_offsets"]
            size = int(end) - int(start)
            total += count
            weight_bytes += size
            if _LAYER_TENSOR.search(name):
                in_layers += count
            dtype = _SAFETENSORS_FLOAT_DTYPES.get(entry["dtype"])
            if dtype is not None:
                float_bytes[dtype] = float_bytes.get(dtype, 0) + size
    stored = max(float_bytes, key=float_bytes.__getitem__) if float_bytes else None
    return total, in_layers, weight_bytes, stored


def _language_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    # Multimodal checkpoints nest the language model's shape under text_config.
    nested = config.get("text_config")
    if "hidden_size" not in config and isinstance(nested, dict):
        return nested
    return config


def _quantization_bits(config: Mapping[str, Any]) -> int | None:
    for key in ("quantization", "quantization_config"):
        section = config.get(key)
        if isinstance(section, dict) and int_or_none(section.get("bits")):
            return int(section["bits"])
    return None


def _config_dtype(config: Mapping[str, Any]) -> str | None:
    for section in (config, _language_config(config)):
        for key in ("torch_dtype", "dtype"):
            value = section.get(key)
            if value in DTYPE_BYTES:
                return value
    return None


def _stored_bytes_per_parameter(dtype: str, bits: int | None, config: Mapping[str, Any]) -> float:
    if bits is None:
        return DTYPE_BYTES[dtype]
    # MLX quantization: `bits` per value plus a scale and a bias (in `dtype`) per group.
    section = config.get("quantization") or config.get("quantization_config") or {}
    group = int_or_none(section.get("group_size")) or 64
    return bits / 8 + 2 * DTYPE_BYTES[dtype] / group


def _required_int(config: Mapping[str, Any], key: str, where: str) -> int:
    value = int_or_none(config.get(key))
    if value is None or value <= 0:
        raise SizingError(f"{where}: {key} must be a positive integer, got {config.get(key)!r}")
    return value


def int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def stored_text(shape: ModelShape) -> str:
    if shape.quantization_bits is None:
        return shape.dtype
    return f"{shape.quantization_bits}-bit quantized, scales in {shape.dtype}"
