"""Loading the dense parent of a conversion: a Llama-layout checkpoint from a
Hugging Face folder or a GGUF file, with its tokenizer.

Llama and Mistral layouts (no attention bias, SwiGLU, RMSNorm, rotary) map to
O3 one to one. Qwen2's attention bias is not in the O3 spec, so Qwen2 is
refused rather than converted wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

SUPPORTED_TYPES = ("llama", "mistral")


@dataclass
class Parent:
    model: torch.nn.Module  # transformers' LlamaForCausalLM / MistralForCausalLM
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
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError(f"{source}: attention or MLP bias is not in the O3 spec")
    if getattr(config, "sliding_window", None):
        raise ValueError(f"{source}: sliding-window attention is not in the O3 spec")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    return Parent(model.eval(), tokenizer, str(source))


def llama_fields(config: LlamaConfig) -> dict:
    """The parent's architecture fields, as an O3Config takes them."""
    fields = {
        key: getattr(config, key)
        for key in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
            "max_position_embeddings", "rms_norm_eps", "rope_parameters",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
        )
    }  # fmt: skip
    return {k: v for k, v in fields.items() if v is not None}
