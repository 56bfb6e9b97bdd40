"""`vllm-o3 eval`: perplexity, routing and FFN savings of an O3 checkpoint.

Over fixed windows of the given text: perplexity through vLLM (prompt
log-probabilities) and through the reference; the heavy fraction each routed
layer actually took; the FFN FLOPs saved; and, as the baseline the router must
beat, perplexity with random routing at the same per-layer fractions.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from vllm_o3.model import O3Config, O3ForCausalLM

WINDOW = 512


def text_windows(
    tokenizer, text: str, count: int, window: int = WINDOW
) -> list[list[int]]:
    """Up to `count` consecutive windows of `window` token ids."""
    ids = tokenizer(text).input_ids
    usable = min(count, len(ids) // window)
    if usable == 0:
        raise ValueError(
            f"the text has {len(ids)} tokens, fewer than one window of {window}"
        )
    return [ids[i * window : (i + 1) * window] for i in range(usable)]


@torch.no_grad()
def reference_perplexity(
    model: O3ForCausalLM, windows: list[list[int]]
) -> tuple[float, dict[int, float]]:
    """(perplexity, heavy fraction per routed layer) from the reference."""
    threshold = model.config.router_threshold
    routed = sorted(model.config.router_layers)
    nll, tokens, heavy = 0.0, 0, dict.fromkeys(routed, 0)
    for window in windows:
        ids = torch.tensor([window])
        output = model(ids, labels=ids, output_router_scores=True)
        nll += float(output.loss) * (len(window) - 1)
        tokens += len(window) - 1
        for index, scores in zip(routed, output.router_scores, strict=True):
            heavy[index] += int((scores >= threshold).sum())
    total = sum(len(w) for w in windows)
    return math.exp(nll / tokens), {i: count / total for i, count in heavy.items()}


@contextlib.contextmanager
def random_routing(
    model: O3ForCausalLM, fractions: dict[int, float], seed: int = 0
) -> Iterator[None]:
    """Routers replaced by coin flips that send `fractions[layer]` heavy."""
    generator = torch.Generator().manual_seed(seed)

    def coin(fraction: float):
        def hook(_module, _args, scores):
            draws = torch.rand(scores.shape, generator=generator)
            return (draws < fraction).float()

        return hook

    hooks = [
        model.model.layers[i].router.register_forward_hook(coin(f))
        for i, f in fractions.items()
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def vllm_window_nlls(
    model_path: str, windows: list[list[int]], **engine_options
) -> list[float]:
    """Per window, the summed negative log-likelihood of its tokens after the
    first, from vLLM's prompt log-probabilities (its own engine)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model_path,
        max_model_len=WINDOW + 16,
        enable_prefix_caching=False,
        **engine_options,
    )
    try:
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=w) for w in windows],
            SamplingParams(max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
    return [
        -sum(
            logprobs[token].logprob
            for token, logprobs in zip(
                window[1:], output.prompt_logprobs[1:], strict=True
            )
        )
        for window, output in zip(windows, outputs, strict=True)
    ]


def vllm_perplexity(
    model_path: str, windows: list[list[int]], **engine_options
) -> float:
    """Perplexity over `windows` through vLLM."""
    nll = sum(vllm_window_nlls(model_path, windows, **engine_options))
    return math.exp(nll / sum(len(w) - 1 for w in windows))


def ffn_flops_saved(config: O3Config, heavy: dict[int, float]) -> float:
    """Share of the dense FFN FLOPs not spent, net of light paths and routers."""
    H, I = config.hidden_size, config.intermediate_size
    ffn, light = 3 * H * I, 2 * H * config.light_rank
    router = H * config.router_hidden_size + config.router_hidden_size
    spent = sum(h * ffn + (1 - h) * light + router for h in heavy.values())
    spent += (config.num_hidden_layers - len(heavy)) * ffn
    return 1 - spent / (config.num_hidden_layers * ffn)


def evaluate_checkpoint(
    path: str | Path, text: str, windows: int = 8, use_vllm: bool = True
) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    chunks = text_windows(tokenizer, text, windows)
    ppl, heavy = reference_perplexity(model, chunks)
    threshold = model.config.router_threshold
    model.config.router_threshold = 0.0
    dense_ppl, _ = reference_perplexity(model, chunks)
    model.config.router_threshold = threshold
    with random_routing(model, heavy):
        random_ppl, _ = reference_perplexity(model, chunks)
    result = {
        "windows": len(chunks),
        "tokens": sum(len(c) for c in chunks),
        "perplexity_reference": ppl,
        "perplexity_dense_parent": dense_ppl,
        "perplexity_random_routing": random_ppl,
        "heavy_fraction": {str(i): round(h, 4) for i, h in heavy.items()},
        "heavy_fraction_overall": sum(heavy.values()) / max(1, len(heavy)),
        "ffn_flops_saved": ffn_flops_saved(model.config, heavy),
    }
    if use_vllm:
        result["perplexity_vllm"] = vllm_perplexity(str(path), chunks, dtype="float32")
    return result
