"""The vLLM model against the plain PyTorch reference, in float32.

For each checkpoint (with and without the attention gate) and each routing
regime (all heavy, the default threshold, all light), one engine generates
greedily; the test checks greedy tokens and top-k logprobs the way vLLM's model
tests do, the full prompt log-probability vectors (the seed's L2 relative
error and top-1 difference, printed), and every routed layer's decision for
every token whose score is not within rounding of the threshold.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import vllm_o3  # noqa: F401  (registers O3 with transformers)
from tests.utils import (
    PROMPTS,
    check_logprobs_close,
    reference_generations,
    relative_l2,
    vllm_engine,
    vllm_generations,
)
from vllm_o3.model.router_trace import (
    router_counts,
    start_router_trace,
    stop_router_trace,
    take_router_trace,
)

MAX_TOKENS = 16
TOP_K = 5
# float32 router scores of the two implementations differ by ~1e-7; a token
# this close to the threshold may fall either way (O3_SPEC section 1).
ROUNDING_MARGIN = 1e-5

REGIMES = {"all_heavy": 0.0, "default": None, "all_light": 1.5}
CASES = [
    *[(gate, regime, "compiled") for gate in ("no_gate", "gate") for regime in REGIMES],
    ("no_gate", "default", "eager"),
    ("gate", "default", "eager"),
]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def case(request, tiny_checkpoint, gated_checkpoint):
    """Run one engine: greedy generations, router scores per prompt, and the
    full prompt log-probabilities."""
    from vllm import SamplingParams

    gate, regime, mode = request.param
    checkpoint = gated_checkpoint if gate == "gate" else tiny_checkpoint
    threshold = REGIMES[regime]
    overrides = {} if threshold is None else {"router_threshold": threshold}
    greedy = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, logprobs=TOP_K, ignore_eos=True
    )
    with vllm_engine(
        checkpoint,
        hf_overrides=overrides,
        enforce_eager=mode == "eager",
        enable_prefix_caching=False,
        max_logprobs=-1,
    ) as llm:
        llm.apply_model(start_router_trace)
        generations, scores = [], []
        # One prompt at a time, so the recorded rows are that prompt's tokens.
        for prompt in PROMPTS:
            generations += vllm_generations(
                llm.generate([prompt], greedy, use_tqdm=False)
            )
            scores.append(llm.apply_model(take_router_trace)[0])
        llm.apply_model(stop_router_trace)
        counts = llm.apply_model(router_counts)[0]
        prompt_logprobs = llm.generate(
            PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=-1), use_tqdm=False
        )
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    if threshold is not None:
        reference.config.router_threshold = threshold
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return dict(
        name="-".join(request.param),
        reference=reference,
        tokenizer=tokenizer,
        generations=generations,
        scores=scores,
        counts=counts,
        prompt_logprobs=prompt_logprobs,
    )


def test_greedy_tokens_and_logprobs_match_reference(case):
    expected = reference_generations(
        case["reference"], case["tokenizer"], PROMPTS, MAX_TOKENS, TOP_K
    )
    check_logprobs_close(expected, case["generations"], "reference", "vllm")
    matched = sum(
        e.token_ids == g.token_ids
        for e, g in zip(expected, case["generations"], strict=True)
    )
    print(f"\n[{case['name']}] identical greedy sequences: {matched}/{len(PROMPTS)}")


@torch.no_grad()
def test_prompt_logprob_vectors_match_reference(case):
    """The seed's accuracy figures: L2 relative error of the output vectors and
    the largest difference of the top-1 value, over every prompt position."""
    errors, top1_deltas = [], []
    for prompt, output in zip(PROMPTS, case["prompt_logprobs"], strict=True):
        ids = case["tokenizer"](prompt, return_tensors="pt").input_ids
        expected = case["reference"](ids, use_cache=False).logits[0].log_softmax(-1)
        for position, entry in enumerate(output.prompt_logprobs[1:]):
            got = torch.full_like(expected[position], float("nan"))
            for token, logprob in entry.items():
                got[token] = logprob.logprob
            assert not got.isnan().any(), "vLLM returned an incomplete vocabulary"
            errors.append(relative_l2(got, expected[position]))
            top = expected[position].argmax()
            top1_deltas.append(float((got[top] - expected[position][top]).abs()))
    print(
        f"\n[{case['name']}] L2 relative error max {max(errors):.2e} "
        f"mean {sum(errors) / len(errors):.2e}; top-1 delta max {max(top1_deltas):.2e}"
    )
    assert max(errors) < 1e-3
    assert max(top1_deltas) < 1e-3


@torch.no_grad()
def test_routing_decisions_match_reference(case):
    reference = case["reference"]
    threshold = reference.config.router_threshold
    routed = sorted(reference.config.router_layers)
    agree = total = near = 0
    for prompt, generation, vllm_scores in zip(
        PROMPTS, case["generations"], case["scores"], strict=True
    ):
        prompt_ids = case["tokenizer"](prompt, return_tensors="pt").input_ids
        # vLLM ran the prompt, then each generated token but the last.
        ids = torch.cat([prompt_ids, torch.tensor([generation.token_ids[:-1]])], dim=1)
        output = reference(ids, use_cache=False, output_router_scores=True)
        for layer, expected in zip(routed, output.router_scores, strict=True):
            expected, got = expected[0], vllm_scores[layer]
            assert got.shape == expected.shape, (
                f"layer {layer}: rows {got.shape} vs {expected.shape}"
            )
            clear = (expected - threshold).abs() > ROUNDING_MARGIN
            decided_same = (got >= threshold) == (expected >= threshold)
            assert decided_same[clear].all(), f"layer {layer}: routing differs"
            agree += int(decided_same.sum())
            total += expected.numel()
            near += int((~clear).sum())
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    print(
        f"\n[{case['name']}] routing agreement {agree}/{total} tokens×layers "
        f"({near} within rounding of the threshold)"
    )


def test_heavy_counts_follow_the_threshold(case):
    """Each routed layer's heavy-token count moves with the threshold: all
    tokens at 0, none above 1, the scores' own share in between."""
    threshold = case["reference"].config.router_threshold
    for layer, (heavy, total) in case["counts"].items():
        traced = torch.cat([s[layer] for s in case["scores"]])
        assert total == traced.numel()  # real tokens only, no warm-up runs
        if threshold <= 0:
            assert heavy == total
        elif threshold > 1:
            assert heavy == 0
        else:
            assert 0 < heavy < total
