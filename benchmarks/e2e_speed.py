"""End-to-end speed in vLLM: one checkpoint, two ways of serving it, same run.

`--compare routing`: the checkpoint at its own threshold against
`router_threshold: 0`, which computes exactly its dense parent.
`--compare int4`: the checkpoint in 16-bit against `--quantization o3_int4`
(online round-to-nearest, group 128, symmetric).
`--compare bf16_linear`: the checkpoint's bfloat16 linears on O3's CPU kernel
against torch's matmul (`VLLM_O3_CPU_BF16_LINEAR=0`), on a CPU without a
fast bfloat16 GEMM.

For each compilation mode (vLLM's default compiled mode, and eager), one
engine per variant, side by side, measures prefill tokens/s (16 prompts of
512 tokens of real text, other text each repeat, as a server sees; fewer
prompts with `--prefill-prompts` where a CPU's 16-bit GEMM takes minutes) and
decode tokens/s at batch 1 and 16, with the routers' heavy fraction during
each measurement and the bytes of the loaded weights. Medians of repeats,
after a warm-up of each measurement. The engines' threads get every
CPU of this process: vLLM's automatic binding keeps one core for its front
end, which on a two-core machine halves the model's compute.

    python -m benchmarks.e2e_speed MODEL --compare routing|int4|bf16_linear
        [--modes compiled eager]
        [--metrics prefill decode_b1 decode_b16] [--prefill-prompts 16]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from unittest import mock

from vllm_o3.cpu_queue_polling import every_core_binding

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # router_counts
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", every_core_binding())

PREFILL_PROMPTS, PREFILL_LEN = 16, 512
DECODE_PROMPT_LEN, DECODE_TOKENS = 32, 64


def text_windows(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` token ids of real text (CPython's docs)."""
    from vllm_o3.tools.tokenizer import training_text

    ids = tokenizer("\n".join(training_text())).input_ids
    step = (len(ids) - length) // count
    return [ids[i * step : i * step + length] for i in range(count)]


# Per comparison: (variant label, engine options, environment of the engine's
# processes); the last is the baseline.
VARIANTS = {
    "routing": [
        ("O3, checkpoint's threshold", {}, {}),
        (
            "threshold 0 (dense parent)",
            {"hf_overrides": {"router_threshold": 0.0}},
            {},
        ),
    ],
    "int4": [
        ("o3_int4", {"quantization": "o3_int4"}, {}),
        ("16-bit", {}, {}),
    ],
    "bf16_linear": [
        ("O3's bfloat16 linear", {}, {}),
        ("torch's bfloat16 matmul", {}, {"VLLM_O3_CPU_BF16_LINEAR": "0"}),
    ],
}


class Engine:
    """One LLM plus the measurements, each with its heavy fraction."""

    def __init__(
        self,
        model: str,
        options: dict,
        env: dict[str, str],
        eager: bool,
        prefills: int,
        prompts: int,
    ):
        """`prefills`: how many prefill calls of `prompts` prompts to hold text
        for (0: none, and batches of up to 1024 tokens, which start the engine
        faster). `env` is set while the engine's processes start."""
        from vllm import LLM

        with mock.patch.dict(os.environ, env):
            self.llm = LLM(
                model,
                **options,
                enforce_eager=eager,
                enable_prefix_caching=False,  # every repeat computes its prompt
                max_model_len=1024,
                max_num_seqs=16,
                max_num_batched_tokens=max(1024, prompts * PREFILL_LEN)
                if prefills
                else 1024,
                seed=0,
            )
        tokenizer = self.llm.get_tokenizer()
        windows = (
            text_windows(tokenizer, prompts * prefills, PREFILL_LEN) if prefills else []
        )
        # One batch per prefill call, in turn: each call routes new text.
        self.prefill_batches = itertools.cycle(
            windows[i : i + prompts] for i in range(0, len(windows), prompts)
        )
        self.decode_prompts = text_windows(tokenizer, 16, DECODE_PROMPT_LEN)

    def heavy_tokens(self) -> tuple[int, int]:
        from vllm_o3.model.router_trace import router_counts

        counts = self.llm.apply_model(router_counts)[0].values()
        return sum(h for h, _ in counts), sum(t for _, t in counts)

    def timed(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
        """(seconds, heavy fraction) of one generate call."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        heavy0, total0 = self.heavy_tokens()
        start = time.perf_counter()
        self.llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        heavy1, total1 = self.heavy_tokens()
        return seconds, (heavy1 - heavy0) / max(1, total1 - total0)

    def prefill(self) -> tuple[float, float]:
        batch = next(self.prefill_batches)
        seconds, heavy = self.timed(batch, 1)
        return len(batch) * PREFILL_LEN / seconds, heavy

    def decode(self, batch: int) -> tuple[float, float]:
        """Tokens/s of the decode steps alone: a run of DECODE_TOKENS + 1
        tokens minus a run of 1 token (its prefill)."""
        prompts = self.decode_prompts[:batch]
        long, heavy = self.timed(prompts, DECODE_TOKENS + 1)
        short, _ = self.timed(prompts, 1)
        return batch * DECODE_TOKENS / (long - short), heavy

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


METRICS = {
    "prefill": Engine.prefill,
    "decode_b1": lambda engine: engine.decode(1),
    "decode_b16": lambda engine: engine.decode(16),
}


def measure(
    model: str,
    variants: list,
    eager: bool,
    repeats: int,
    metrics: list[str],
    prefill_prompts: int,
) -> dict:
    """Per variant label: {metric: (each repeat's tokens/s, median heavy
    fraction)} and "weights". The variants' engines run side by
    side, their repeats interleaved, so that a drift of the machine's speed
    hits all alike, and each repeat starts with the engine the previous one
    ended with, so that whatever running first or second costs falls on both."""
    from benchmarks.common import weight_bytes

    engines: dict[str, Engine] = {}
    try:
        for label, options, env in variants:
            prefills = 1 + repeats if "prefill" in metrics else 0
            engines[label] = Engine(
                model, options, env, eager, prefills, prefill_prompts
            )
            for metric in metrics:  # warm-up
                METRICS[metric](engines[label])
        samples = {(label, metric): [] for label in engines for metric in metrics}
        order = list(engines.items())
        for _ in range(repeats):
            for metric in metrics:
                for label, engine in order:
                    samples[label, metric].append(METRICS[metric](engine))
            order.reverse()
        results = {}
        for label, engine in engines.items():
            results[label] = {
                "weights": (engine.llm.apply_model(weight_bytes)[0], None)
            }
            for metric in metrics:
                runs = samples[label, metric]
                results[label][metric] = (
                    [s[0] for s in runs],
                    statistics.median(s[1] for s in runs),
                )
        return results
    finally:
        for engine in engines.values():
            engine.close()


def main() -> None:
    from tqdm import tqdm

    from benchmarks.common import median_ratio, write_report

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--compare", choices=sorted(VARIANTS), required=True)
    parser.add_argument("--modes", nargs="+", default=["compiled", "eager"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--metrics",
        nargs="+",
        choices=list(METRICS),
        default=list(METRICS),
        help="a subset, e.g. decode alone where a CPU's prefill takes minutes",
    )
    parser.add_argument(
        "--prefill-prompts",
        type=int,
        default=PREFILL_PROMPTS,
        help="prompts of a prefill call; fewer where 16 x 512 tokens take minutes",
    )
    parser.add_argument("--report", default=None, help="docs/ file name")
    args = parser.parse_args()
    if args.prefill_prompts < 1:
        parser.error("--prefill-prompts must be at least 1")
    variants = VARIANTS[args.compare]
    results = {}
    for mode in tqdm(args.modes, desc="modes"):
        for label, measured in measure(
            args.model,
            variants,
            mode == "eager",
            args.repeats,
            args.metrics,
            args.prefill_prompts,
        ).items():
            results[mode, label] = measured
    baseline = variants[-1][0]
    lines = [
        "| mode | variant | metric | tokens/s | heavy fraction | vs baseline |",
        "|---|---|---|---|---|---|",
    ]
    for mode in args.modes:
        for metric in args.metrics:
            base = results[mode, baseline][metric][0]
            for label, *_ in variants:
                speeds, heavy = results[mode, label][metric]
                ratio = (
                    "" if label == baseline else f"{median_ratio(speeds, base):.2f}x"
                )
                lines.append(
                    f"| {mode} | {label} | {metric} | {statistics.median(speeds):.1f} "
                    f"| {heavy:.1%} | {ratio} |"
                )
    weights = "\n".join(
        f"- {label}: {results[args.modes[0], label]['weights'][0] / 2**20:.0f} MiB"
        for label, *_ in variants
    )
    prefill = (
        f"Prefill: {args.prefill_prompts} prompts x {PREFILL_LEN} tokens of text, other "
        "text each repeat. "
        if "prefill" in args.metrics
        else ""
    )
    body = (
        f"Model: `{args.model}`. {prefill}Decode: prompts of "
        f"{DECODE_PROMPT_LEN} tokens, "
        f"{DECODE_TOKENS} greedy tokens, prefill time subtracted. Prefix caching "
        f"off; a warm-up of each metric, then medians of {args.repeats} repeats "
        "(the ratio: median of each repeat's); "
        "heavy fraction over all routed layers during the measurement; the two "
        "engines run side by side, repeats interleaved, each repeat in the other "
        "order.\n\n"
        + "\n".join(lines)
        + "\n\nLoaded weights (parameters, buffers and the 16-bit linear weights vLLM holds in oneDNN):\n\n"
        + weights
    )
    print(body)
    titles = {
        "routing": "Routed FFN end to end: O3 vs its dense parent in vLLM",
        "int4": "o3_int4 end to end: INT4 FFN vs 16-bit in vLLM",
        "bf16_linear": "O3's bfloat16 linear end to end: vs torch's matmul in vLLM",
    }
    name = args.report or f"bench_e2e_{args.compare}"
    print(f"written to {write_report(name, titles[args.compare], body)}")


if __name__ == "__main__":
    main()
