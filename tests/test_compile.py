"""The routed FFN is one opaque op to torch.compile: in vLLM's default mode the
model compiles once as a single full graph (vLLM traces with fullgraph=True, so
a graph break would fail the start), and batches of any size and routing mix
then run through it without another compilation."""

from __future__ import annotations

import dataclasses

from vllm.compilation.counter import compilation_counter

from tests.utils import PROMPTS, vllm_engine


def worker_compile_counts(model) -> dict[str, int]:
    """Runs in the worker (via `LLM.apply_model`), where compilation happens."""
    return dataclasses.asdict(compilation_counter)


def test_one_compilation_serves_every_batch_mix(tiny_checkpoint):
    from vllm import SamplingParams

    with vllm_engine(tiny_checkpoint, enforce_eager=False) as llm:
        after_start = llm.apply_model(worker_compile_counts)[0]
        compiled = (
            after_start["num_aot_compiles"] + after_start["num_aot_artifacts_loaded"]
        )
        assert compiled == 1, after_start
        greedy = SamplingParams(temperature=0, max_tokens=5)
        for size in (1, 2, 5, 16):  # batch sizes, prompt lengths, routing mixes
            batch = [PROMPTS[i % len(PROMPTS)] * (1 + i % 3) for i in range(size)]
            llm.generate(batch, greedy, use_tqdm=False)
        assert llm.apply_model(worker_compile_counts)[0] == after_start
