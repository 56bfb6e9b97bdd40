"""`vllm-o3 create`: a randomly initialised, valid O3 checkpoint of a named size.

Random weights are for tests and benchmarks. Two things make them useful there:
the logits are peaked enough that greedy decoding is not a coin toss between
near-equal tokens, and each router's bias is set on sample text so that the
default threshold sends about half the tokens to the full FFN, so the default
operating point exercises both paths.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from transformers import GenerationConfig

from vllm_o3.model import O3Config, O3ForCausalLM
from vllm_o3.tools.fit import calibrate_routers
from vllm_o3.tools.output import atomic_output_dir
from vllm_o3.tools.tokenizer import ENDOFTEXT, IM_END, train_tokenizer, training_text

# Linear dimensions are multiples of 128 so every INT4 group size divides them,
# also per rank under tensor parallelism 2.
PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "small": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    # TinyLlama-1.1B's shape, for speed measurements where weight traffic
    # dominates (its FFN 5632 = 44 * 128).
    "1b": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
}

MAX_POSITIONS = 2048
CALIBRATION_TOKENS = 2048
TARGET_HEAVY_FRACTION = 0.5


def build_config(preset: str, vocab: dict[str, int], **overrides) -> O3Config:
    """The O3Config of a preset, with token ids from the tokenizer."""
    fields = dict(
        PRESETS[preset],
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=vocab[ENDOFTEXT],
        eos_token_id=vocab[IM_END],
        pad_token_id=vocab[ENDOFTEXT],
        architectures=["O3ForCausalLM"],
    )
    fields.update(overrides)
    return O3Config(**fields)


def init_weights(model: O3ForCausalLM) -> None:
    """Scale the random weights so the network behaves somewhat like a trained
    one: unit-scale router logits, varied and peaked output logits."""
    config = model.config
    H = config.hidden_size
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=1.0 / math.sqrt(module.in_features))
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    # Output logits of standard deviation ~4, so greedy decoding follows clear
    # maxima. A tied head sees each input token's own embedding in the stream
    # and would only copy it at that scale, so it gets ~1.
    logit_std = 1.0 if config.tie_word_embeddings else 4.0
    nn.init.normal_(model.model.embed_tokens.weight, std=logit_std / math.sqrt(H))
    if not config.tie_word_embeddings:
        nn.init.normal_(model.lm_head.weight, std=logit_std / math.sqrt(H))
    # Residual branches small against the stream, as in a deep trained model.
    for layer in model.model.layers:
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            proj.weight.data.mul_(1.0 / math.sqrt(2 * config.num_hidden_layers))
        if layer.is_routed:
            layer.light.up.weight.data.mul_(
                1.0 / math.sqrt(2 * config.num_hidden_layers)
            )


def create_checkpoint(
    out: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
    **config_overrides,
) -> Path:
    """Write a random O3 checkpoint folder (config, safetensors, tokenizer,
    generation config) to `out`; returns its path."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    tokenizer = train_tokenizer(PRESETS[preset]["vocab_size"], MAX_POSITIONS)
    config = build_config(preset, tokenizer.get_vocab(), **config_overrides)
    torch.manual_seed(seed)
    model = O3ForCausalLM(config)
    init_weights(model)
    text = "\n".join(training_text())[: 8 * CALIBRATION_TOKENS]
    ids = tokenizer(
        text, return_tensors="pt", truncation=True, max_length=CALIBRATION_TOKENS
    ).input_ids
    model.to(dtype)
    config.dtype = dtype
    calibrate_routers(model, ids.view(4, -1), TARGET_HEAVY_FRACTION)
    with atomic_output_dir(out, overwrite=overwrite) as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=[
                config.eos_token_id,
                tokenizer.convert_tokens_to_ids(ENDOFTEXT),
            ],
            pad_token_id=config.pad_token_id,
        ).save_pretrained(folder)
    return Path(out)
