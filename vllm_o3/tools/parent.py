"""Loading the dense parent of a conversion: a Llama-layout checkpoint from a
Hugging Face folder or a GGUF file, with its tokenizer.

Llama, Mistral and Qwen2 layouts (SwiGLU, RMSNorm, rotary) map to O3 one to
one. Qwen2's q/k/v biases become O3's `attention_bias` (Llama's field, which
also gives o_proj a bias: zero for a Qwen2 parent, see `o3_from_parent`);
MLP biases are refused rather than converted wrongly. O3 attention is full
attention: a parent with a sliding window becomes an O3 model of at most that
many positions, on which the two agree exactly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

logger = logging.getLogger(__name__)

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class Parent:
    model: torch.nn.Module  # transformers' Llama/Mistral/Qwen2ForCausalLM
    tokenizer: object
    source: str


def load_parent(source: str | Path, dtype: torch.dtype = torch.float32) -> Parent:
    """The parent model in `dtype` (GGUF weights are dequantized by
    transformers' GGUF reader, which also undoes llama.cpp's Q/K permutation)."""
    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"{source}: no such checkpoint folder or .gguf file")
    if source.suffix == ".gguf":
        kwargs = {"gguf_file": source.name}
        folder = source.parent
    else:
        kwargs, folder = {}, source
    config = AutoConfig.from_pretrained(folder, **kwargs)
    if config.model_type not in SUPPORTED_TYPES:
        raise ValueError(
            f"{source}: model_type {config.model_type!r} is not a Llama layout O3 "
            f"can take ({', '.join(SUPPORTED_TYPES)})"
        )
    if getattr(config, "mlp_bias", False):
        raise ValueError(f"{source}: MLP bias is not in the O3 spec")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    return Parent(model.eval(), tokenizer, str(source))


def llama_fields(config: LlamaConfig) -> dict:
    """The parent's architecture fields, as an O3Config takes them (those a
    layout lacks, such as Qwen2's head_dim, left to O3Config's defaults)."""
    fields = {
        key: getattr(config, key, None)
        for key in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
            "max_position_embeddings", "rms_norm_eps", "rope_parameters",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
        )
    }  # fmt: skip
    fields["attention_bias"] = config.model_type == "qwen2" or getattr(
        config, "attention_bias", False
    )
    positions = full_attention_positions(config)
    if positions < config.max_position_embeddings:
        logger.warning(
            "parent attends to a sliding window of %d tokens: the O3 model takes "
            "max_position_embeddings %d (not %d), where full attention is the same",
            positions, positions, config.max_position_embeddings,
        )  # fmt: skip
        fields["max_position_embeddings"] = positions
    return {k: v for k, v in fields.items() if v is not None}


def full_attention_positions(config: LlamaConfig) -> int:
    """How many positions the parent takes with attention equal to full
    attention: its sliding window, if shorter than max_position_embeddings."""
    window = getattr(config, "sliding_window", None)
    positions = config.max_position_embeddings
    return positions if window is None else min(window, positions)
