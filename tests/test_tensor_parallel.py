"""Tensor parallelism 2 on the CPU gives the greedy tokens of TP=1 (float32).

The gated checkpoint exercises every split: column-parallel attention heads
and head gate, row-parallel o_proj and down_proj, and the routed FFN's heavy
rows all-reduced inside the custom op while the router and light path are
replicated.
"""

from __future__ import annotations

from tests.utils import PROMPTS, vllm_engine, vllm_generations


def greedy_tokens(checkpoint, **kwargs) -> list[list[int]]:
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with vllm_engine(checkpoint, enforce_eager=True, **kwargs) as llm:
        return [
            g.token_ids
            for g in vllm_generations(llm.generate(PROMPTS, greedy, use_tqdm=False))
        ]


def test_tp2_equals_tp1(gated_checkpoint, monkeypatch):
    single = greedy_tokens(gated_checkpoint)
    # One core per rank; vLLM's CPU backend refuses TP=2 without the binding.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    assert greedy_tokens(gated_checkpoint, tensor_parallel_size=2) == single
