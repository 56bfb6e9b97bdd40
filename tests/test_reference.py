"""The plain PyTorch reference against independent references: transformers'
own Llama for the dense case, and hand-computed layer outputs for routing."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
)

import vllm_o3  # noqa: F401
from tests.utils import PROMPTS, reference_generations
from vllm_o3.model import O3Config, O3ForCausalLM
from vllm_o3.model.checkpoint import expected_tensor_shapes

O3_ONLY_FIELDS = (
    "router_hidden_size",
    "router_threshold",
    "router_layers",
    "light_rank",
    "attn_output_gate",
)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def test_autoclasses_load_the_reference(model):
    assert isinstance(model, O3ForCausalLM) and isinstance(model.config, O3Config)


def test_created_checkpoint_holds_exactly_the_spec_tensors(
    tiny_checkpoint, gated_checkpoint
):
    for checkpoint in (tiny_checkpoint, gated_checkpoint):
        config = O3Config.from_pretrained(checkpoint)
        tensors = load_file(checkpoint / "model.safetensors")
        shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        assert shapes == expected_tensor_shapes(config)


@torch.no_grad()
def test_threshold_zero_equals_dense_llama(tiny_checkpoint, model, tokenizer):
    """With every token on the full FFN, O3 is its dense parent: transformers'
    LlamaForCausalLM on the same weights (router and light path dropped)."""
    fields = json.loads((tiny_checkpoint / "config.json").read_text())
    for name in (*O3_ONLY_FIELDS, "model_type", "architectures"):
        fields.pop(name)
    llama = LlamaForCausalLM(LlamaConfig(**fields)).eval()
    state = {
        k: v.float()
        for k, v in load_file(tiny_checkpoint / "model.safetensors").items()
    }
    dense = {
        k: v for k, v in state.items() if ".router." not in k and ".light." not in k
    }
    llama.load_state_dict(dense, strict=False)
    llama.tie_weights()
    model.config.router_threshold = 0.0
    try:
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            torch.testing.assert_close(
                model(ids).logits, llama(ids).logits, rtol=0, atol=1e-5
            )
    finally:
        model.config.router_threshold = 0.85


@torch.no_grad()
def test_routed_ffn_sends_each_token_to_the_path_its_score_chooses(model):
    layer = model.model.layers[model.config.router_layers[0]]
    u = torch.randn(64, model.config.hidden_size)
    full, light = layer.mlp(u), layer.light(u)
    by_hand_scores = torch.sigmoid(
        F.linear(
            F.silu(F.linear(u, layer.router.fc1.weight, layer.router.fc1.bias)),
            layer.router.fc2.weight,
            layer.router.fc2.bias,
        )
    ).squeeze(-1)
    for threshold in (0.0, float(by_hand_scores.median()), 1.5):
        model.config.router_threshold = threshold
        y, scores = layer.routed_ffn(u)
        heavy = by_hand_scores >= threshold
        torch.testing.assert_close(scores, by_hand_scores)
        torch.testing.assert_close(y[heavy], full[heavy])
        torch.testing.assert_close(y[~heavy], light[~heavy])
    model.config.router_threshold = 0.85


@torch.no_grad()
def test_router_scores_are_float32_in_a_bfloat16_model(tiny_checkpoint, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16)
    ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    output = model(ids, output_router_scores=True)
    assert len(output.router_scores) == len(model.config.router_layers)
    assert all(
        s.dtype == torch.float32 and s.shape == ids.shape for s in output.router_scores
    )


@torch.no_grad()
def test_default_threshold_routes_some_tokens_each_way(model, tokenizer):
    ids = tokenizer(" ".join(PROMPTS), return_tensors="pt").input_ids
    for scores in model(ids, output_router_scores=True).router_scores:
        heavy = (scores >= model.config.router_threshold).float().mean()
        assert 0.1 < heavy < 0.9


@torch.no_grad()
def test_loss_with_labels_is_next_token_cross_entropy(model, tokenizer):
    ids = tokenizer(PROMPTS[1], return_tensors="pt").input_ids
    output = model(ids, labels=ids)
    by_hand = F.cross_entropy(output.logits[0, :-1], ids[0, 1:])
    torch.testing.assert_close(output.loss, by_hand)


@torch.no_grad()
def test_generate_with_kv_cache_equals_recomputation(model, tokenizer):
    recomputed = reference_generations(model, tokenizer, PROMPTS[:3], 12, 1)
    for prompt, expected in zip(PROMPTS[:3], recomputed, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert out[0, ids.shape[1] :].tolist() == expected.token_ids


@torch.no_grad()
def test_a_token_is_routed_the_same_alone_and_in_a_padded_batch(model, tokenizer):
    tokenizer.padding_side = "left"
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    batched = model(**batch, output_router_scores=True).router_scores
    for row, prompt in enumerate(PROMPTS):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        alone = model(ids, output_router_scores=True).router_scores
        n = ids.shape[1]
        for a, b in zip(alone, batched, strict=True):
            torch.testing.assert_close(a[0], b[row, -n:], atol=1e-5, rtol=0)
