"""A request's output does not depend on what else is batched with it: the
same greedy tokens alone and inside a batch of 16 mixed-length requests, with
prefix caching and chunked prefill on (small chunks, shared prefixes) and off.
Routing is per token, so this must hold exactly (float32)."""

from __future__ import annotations

import pytest

from tests.utils import PROMPTS, vllm_engine, vllm_generations

MAX_TOKENS = 16
TARGET = PROMPTS[0] + " of a good fortune, must be in want of a wife. " * 6


def batch_of_16() -> list[str]:
    """Mixed lengths; several share the target's prefix (prefix-cache hits)."""
    others = [
        PROMPTS[i % len(PROMPTS)] + " and so on" * (i * 7 % 23) for i in range(1, 12)
    ]
    shared = [TARGET[: 60 + 40 * i] for i in range(4)]
    batch = [*others[:6], *shared, TARGET, *others[6:]]
    assert len(batch) == 16
    return batch


SETTINGS = {
    "prefix_cache_and_chunked_prefill": dict(
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=64,  # prefills split into several chunks
        block_size=32,
    ),
    "neither": dict(
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        max_num_batched_tokens=512,
        enforce_eager=True,
    ),
}


@pytest.fixture(scope="module", params=list(SETTINGS))
def engine(request, tiny_checkpoint):
    with vllm_engine(tiny_checkpoint, **SETTINGS[request.param]) as llm:
        yield llm


def test_output_alone_equals_output_in_a_batch_of_16(engine):
    from vllm import SamplingParams

    greedy = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True
    )
    alone = vllm_generations(engine.generate([TARGET], greedy, use_tqdm=False))[0]
    batch = batch_of_16()
    outputs = vllm_generations(engine.generate(batch, greedy, use_tqdm=False))
    in_batch = outputs[batch.index(TARGET)]
    assert in_batch.token_ids == alone.token_ids
    for a, b in zip(alone.logprobs, in_batch.logprobs, strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
    # The shared prefixes, run again, give what they gave inside the batch.
    again = vllm_generations(engine.generate(batch[6:10], greedy, use_tqdm=False))
    assert [g.token_ids for g in again] == [g.token_ids for g in outputs[6:10]]


def test_offline_batch_returns_one_output_per_prompt_in_order(engine):
    from vllm import SamplingParams

    prompts = batch_of_16()
    outputs = engine.generate(
        prompts, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False
    )
    assert [o.prompt for o in outputs] == prompts
    assert all(len(o.outputs[0].token_ids) <= 4 for o in outputs)


def test_offline_chat(engine):
    from vllm import SamplingParams

    messages = [{"role": "user", "content": "What is routing?"}]
    output = engine.chat(
        messages, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False
    )[0]
    assert output.prompt_token_ids[0] == engine.get_tokenizer().convert_tokens_to_ids(
        "<|im_start|>"
    )
    assert len(output.outputs[0].token_ids) >= 1
