"""`vllm-o3 convert` end to end on a small random Llama (training included),
with one layer given massive-activation tokens, and on a small random Qwen2
(attention biases); `vllm-o3 eval`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import vllm_o3  # noqa: F401
from tests.utils import (
    PROMPTS,
    check_logprobs_close,
    reference_generations,
    vllm_engine,
    vllm_generations,
)
from vllm_o3.tools.convert import (
    ConvertOptions,
    OperatingPoint,
    build_from_routing,
    convert,
    o3_from_parent,
    pick,
)
from vllm_o3.tools.corpora import pydoc_topics, stdlib_code
from vllm_o3.tools.evaluate import evaluate_checkpoint
from vllm_o3.tools.parent import load_parent
from vllm_o3.tools.tokenizer import train_tokenizer

MASSIVE_LAYER = 2
PARENT_SHAPE = dict(
    vocab_size=4096, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=2048,
)  # fmt: skip


def save_parent(folder: Path, model: PreTrainedModel, tokenizer=None) -> Path:
    """A parent checkpoint folder: `model` and a tokenizer of its vocabulary."""
    model.save_pretrained(folder)
    if tokenizer is None:
        tokenizer = train_tokenizer(model.config.vocab_size, 2048)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    """A random 6-layer Llama whose layer 2 FFN gives '.' tokens massive outputs."""
    tokenizer = train_tokenizer(4096, 2048)
    config = LlamaConfig(
        **PARENT_SHAPE, intermediate_size=512, num_hidden_layers=6,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        direction = model.model.embed_tokens.weight[
            tokenizer.convert_tokens_to_ids(".")
        ]
        mlp = model.model.layers[MASSIVE_LAYER].mlp
        direction = direction / direction.norm()
        mlp.gate_proj.weight[0] = 400 * direction
        mlp.up_proj.weight[0] = 400 * direction
        mlp.down_proj.weight[:, 0] = 5.0
    return save_parent(tmp_path_factory.mktemp("llama") / "parent", model, tokenizer)


@pytest.fixture(scope="module")
def converted(parent, tmp_path_factory):
    root = tmp_path_factory.mktemp("o3")
    corpora = {"docs": pydoc_topics(), "code": stdlib_code()}
    routing = root / "routing.safetensors"
    options = ConvertOptions(
        max_ppl_increase=0.5, fit_windows_per_domain=4, dev_windows_per_domain=1,
        train_minutes=0.05, dtype=torch.float32, routing_out=routing,
    )  # fmt: skip
    return convert(parent, root / "o3", options, corpora=corpora), routing


@pytest.fixture(scope="module")
def qwen2_parent(tmp_path_factory):
    """A random 4-layer Qwen2, its q/k/v biases far from zero."""
    config = Qwen2Config(
        **PARENT_SHAPE, intermediate_size=384, num_hidden_layers=4,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in ("q_proj", "k_proj", "v_proj"):
                getattr(layer.self_attn, proj).bias.normal_(0, 0.5)
    return save_parent(tmp_path_factory.mktemp("qwen2") / "parent", model)


@pytest.fixture(scope="module")
def qwen2_converted(qwen2_parent, tmp_path_factory):
    options = ConvertOptions(
        heavy_fraction=0.5, fit_windows_per_domain=2, dev_windows_per_domain=1,
        dtype=torch.float32,
    )  # fmt: skip
    out = tmp_path_factory.mktemp("o3_qwen2") / "o3"
    return convert(qwen2_parent, out, options, corpora={"docs": pydoc_topics()})


def test_qwen2_biases_become_attention_bias(qwen2_parent, qwen2_converted):
    from safetensors.torch import load_file

    config = json.loads((qwen2_converted / "config.json").read_text())
    assert config["attention_bias"] is True
    parent = load_file(qwen2_parent / "model.safetensors")
    o3 = load_file(qwen2_converted / "model.safetensors")
    for i in range(4):
        p = f"model.layers.{i}.self_attn"
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert torch.equal(o3[f"{p}.{proj}.bias"], parent[f"{p}.{proj}.bias"])
        assert not o3[f"{p}.o_proj.bias"].any()


def save_mistral(folder, sliding_window: int):
    """A random 3-layer Mistral whose window is shorter than its positions."""
    config = MistralConfig(
        **PARENT_SHAPE, intermediate_size=256, num_hidden_layers=3, head_dim=32,
        sliding_window=sliding_window,
    )  # fmt: skip
    torch.manual_seed(2)
    save_parent(folder, MistralForCausalLM(config))


@torch.no_grad()
def test_sliding_window_parent_becomes_o3_of_that_many_positions(tmp_path):
    save_mistral(tmp_path, sliding_window=1024)
    parent = load_parent(tmp_path)
    o3 = o3_from_parent(parent, router_layers=[1], light_rank=None)
    assert o3.config.max_position_embeddings == 1024
    o3.config.router_threshold = 0.0  # empty router and light path: all heavy
    ids = torch.randint(0, 4096, (1, 1024))
    expected = parent.model(ids).logits
    torch.testing.assert_close(o3(ids).logits, expected, rtol=0, atol=1e-5)


def test_parent_shorter_than_the_calibration_windows_is_refused(tmp_path):
    save_mistral(tmp_path / "parent", sliding_window=256)
    with pytest.raises(ValueError, match="256 positions"):
        convert(tmp_path / "parent", tmp_path / "o3", ConvertOptions(), corpora={})
    assert not (tmp_path / "o3").exists()


def test_conversion_records_its_operating_point(converted):
    out, _ = converted
    config = json.loads((out / "config.json").read_text())
    report = config["o3_conversion"]
    assert config["model_type"] == "o3"
    assert config["router_layers"] == report["operating_point"]["routed_layers"]
    assert report["training"]["steps"] >= 1
    assert 0 < report["ffn_flops_saved"] < 1
    for figures in report["dev_perplexity"].values():
        assert figures["o3"] <= figures["parent"] * 1.5 + 1e-6


def test_layer_with_massive_activations_stays_dense(converted):
    out, _ = converted
    config = json.loads((out / "config.json").read_text())
    assert MASSIVE_LAYER not in config["router_layers"]
    assert config["o3_conversion"]["dense_layers"][str(MASSIVE_LAYER)] == (
        "massive-activation tokens"
    )


def parent_and_conversion(request, layout: str):
    """(parent folder, converted folder) of the Llama or the Qwen2 parent."""
    if layout == "llama":
        out, _ = request.getfixturevalue("converted")
        return request.getfixturevalue("parent"), out
    return (
        request.getfixturevalue("qwen2_parent"),
        request.getfixturevalue("qwen2_converted"),
    )


@pytest.mark.parametrize("layout", ["llama", "qwen2"])
@torch.no_grad()
def test_threshold_zero_reproduces_the_parent(request, layout):
    parent_folder, out = parent_and_conversion(request, layout)
    parent = AutoModelForCausalLM.from_pretrained(parent_folder, dtype=torch.float32)
    o3 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    o3.config.router_threshold = 0.0
    tokenizer = AutoTokenizer.from_pretrained(out)
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = parent(ids).logits
        torch.testing.assert_close(o3(ids).logits, expected, rtol=0, atol=1e-5)


def test_rebuilt_from_saved_routing_is_identical(parent, converted, tmp_path):
    out, routing = converted
    rebuilt = build_from_routing(
        parent, routing, tmp_path / "rebuilt", dtype=torch.float32
    )
    from safetensors.torch import load_file

    original, copy = (
        load_file(out / "model.safetensors"),
        load_file(rebuilt / "model.safetensors"),
    )
    assert original.keys() == copy.keys()
    for name in original:
        if ".router.fc2.bias" in name:  # bfloat16 in the routing file
            torch.testing.assert_close(copy[name], original[name], atol=0.02, rtol=0)
        elif ".router." in name or ".light." in name:
            torch.testing.assert_close(copy[name], original[name], atol=0.02, rtol=0.01)
        else:
            assert torch.equal(copy[name], original[name]), name


@pytest.mark.parametrize("layout", ["llama", "qwen2"])
def test_converted_model_agrees_in_vllm_and_the_reference(request, layout):
    from vllm import SamplingParams

    _, out = parent_and_conversion(request, layout)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    expected = reference_generations(model, tokenizer, PROMPTS, 10, 5)
    greedy = SamplingParams(temperature=0, max_tokens=10, logprobs=5, ignore_eos=True)
    with vllm_engine(out, enforce_eager=True) as llm:
        got = vllm_generations(llm.generate(PROMPTS, greedy, use_tqdm=False))
    check_logprobs_close(expected, got, "reference", "vllm")


def test_eval_returns_finite_numbers(converted):
    out, _ = converted
    text = "\n".join(pydoc_topics().held_out)
    result = evaluate_checkpoint(out, text, windows=2, use_vllm=True)
    for key in ("perplexity_reference", "perplexity_vllm", "perplexity_random_routing",
                "perplexity_dense_parent", "ffn_flops_saved"):  # fmt: skip
        assert math.isfinite(result[key]), key
    assert result["perplexity_vllm"] == pytest.approx(
        result["perplexity_reference"], rel=1e-3
    )


def test_operating_point_is_picked_from_fitted_and_trained_points():
    """Training that generalises worse than fitting (seen on SmolLM2 with 32
    calibration windows) must not cost the conversion its fitted point."""
    parent_ppl = {"prose": 10.0, "code": 5.0}

    def point(layers, saved, increase, trained):
        ppl = {d: p * (1 + increase) for d, p in parent_ppl.items()}
        return OperatingPoint(layers, 0.75, ppl, flops_saved=saved, trained=trained)

    fitted = [point([1], 0.05, 0.04, False), point([1, 2], 0.10, 0.20, False)]
    worse_trained = [point([1], 0.06, 0.15, True), point([1, 2], 0.12, 0.40, True)]
    budget = ConvertOptions(max_ppl_increase=0.10)
    assert pick(fitted + worse_trained, parent_ppl, budget) is fitted[0]
    better_trained = [point([1], 0.06, 0.03, True), point([1, 2], 0.12, 0.09, True)]
    assert pick(fitted + better_trained, parent_ppl, budget) is better_trained[1]
    fixed = ConvertOptions(heavy_fraction=0.75)
    assert pick(fitted + worse_trained, parent_ppl, fixed) is fitted[1]
    assert pick(fitted + better_trained, parent_ppl, fixed) is better_trained[1]
