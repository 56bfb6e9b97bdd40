"""Shared test helpers: engines, the reference runner and output comparison."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Prompts of several kinds of text, none from the tokenizer's training corpus.
PROMPTS = [
    "It is a truth universally acknowledged, that a single man in possession",
    "The mitochondria is the powerhouse of the cell, and",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Breaking news: the central bank raised interest rates by half a point",
    "Once upon a time",
    "SELECT name, count(*) FROM users GROUP BY name ORDER BY",
]


@dataclass
class Generation:
    """One greedy continuation: token ids, text and per-step top-k logprobs."""

    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] = field(default_factory=list)


def check_logprobs_close(
    outputs_0: Sequence[Generation],
    outputs_1: Sequence[Generation],
    name_0: str,
    name_1: str,
) -> None:
    """vLLM's model-test convention: greedy tokens must match until the first
    divergence, where each side's token must be in the other's top-k; the
    sequences are not compared after that."""
    assert len(outputs_0) == len(outputs_1)
    for i, (a, b) in enumerate(zip(outputs_0, outputs_1, strict=True)):
        for step, (token_a, token_b) in enumerate(
            zip(a.token_ids, b.token_ids, strict=False)
        ):
            if token_a == token_b:
                continue
            message = (
                f"prompt {i}, step {step}: matched {a.token_ids[:step]}\n"
                f"{name_0}: {token_a} top-k {a.logprobs[step]}\n"
                f"{name_1}: {token_b} top-k {b.logprobs[step]}"
            )
            assert token_a in b.logprobs[step], message
            assert token_b in a.logprobs[step], message
            break


def vllm_generations(outputs) -> list[Generation]:
    """vLLM RequestOutputs as Generations (first completion of each)."""
    result = []
    for output in outputs:
        completion = output.outputs[0]
        logprobs = [
            {token: lp.logprob for token, lp in step.items()}
            for step in (completion.logprobs or [])
        ]
        result.append(Generation(list(completion.token_ids), completion.text, logprobs))
    return result


@torch.no_grad()
def reference_generations(
    model, tokenizer, prompts: Sequence[str], max_tokens: int, top_k: int
) -> list[Generation]:
    """Greedy decoding with the reference, recomputing the whole sequence at
    each step (no KV cache), one prompt at a time."""
    result = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        generation = Generation([], "")
        for _ in range(max_tokens):
            logprobs = model(ids, use_cache=False).logits[0, -1].float().log_softmax(-1)
            top = logprobs.topk(top_k)
            generation.logprobs.append(
                dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            )
            token = int(top.indices[0])
            generation.token_ids.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        generation.text = tokenizer.decode(generation.token_ids)
        result.append(generation)
    return result


@contextlib.contextmanager
def vllm_engine(model: str | Path, **kwargs) -> Iterator:
    """An `LLM` on the CPU with test-sized defaults, shut down on exit."""
    from vllm import LLM

    options = dict(dtype="float32", max_model_len=512, max_num_seqs=16, seed=0)
    options.update(kwargs)
    llm = LLM(model=str(model), **options)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, the seed's output-norm accuracy figure."""
    return float((a - b).norm() / b.norm())
