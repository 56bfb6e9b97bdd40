"""Quality of `o3_int4`: perplexity of one model in 16-bit and in INT4,
through vLLM, on held-out English text (the corpora's held-out documents:
Austen, Reuters news, Python's documentation).

Settings: online quantization (`--quantization o3_int4`: round-to-nearest,
symmetric, per projection the largest group of 128/64/32 dividing its input),
and offline checkpoints written by `vllm-o3 quantize` for every group size
that divides the model's FFN, symmetric and asymmetric, by each of
`--methods`: `rtn` round-to-nearest, `gptq` GPTQ calibrated on the corpora's
calibration split (`vllm-o3 quantize --method gptq --tune-steps 0`), `tuned`
GPTQ with the group scales then tuned against the 16-bit model on the same
text (`vllm-o3 quantize --method gptq`). The default model's weights come
from a Q4_1 GGUF (4-bit, asymmetric, groups of 32): group 32 asymmetric has
their grid but an integer zero point where Q4_1 has a float minimum, so it is
not lossless (docs/bench_int4_quality.md).

    python -m benchmarks.int4_quality [MODEL] [--windows 4] [--methods rtn gptq tuned]
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

from tqdm import tqdm

from benchmarks.common import write_report

DOMAINS = ("prose", "news", "docs")  # the English ones


def per_domain_perplexity(
    windows: dict[str, list[list[int]]], nlls: list[float]
) -> dict[str, float]:
    """Perplexity per domain and over all ("all"), from per-window NLLs in
    the order of `windows`."""
    result, start, all_nll, all_tokens = {}, 0, 0.0, 0
    for domain, domain_windows in windows.items():
        nll = sum(nlls[start : start + len(domain_windows)])
        tokens = sum(len(w) - 1 for w in domain_windows)
        result[domain] = math.exp(nll / tokens)
        start += len(domain_windows)
        all_nll, all_tokens = all_nll + nll, all_tokens + tokens
    result["all"] = math.exp(all_nll / all_tokens)
    return result


def main() -> None:
    from transformers import AutoTokenizer

    from vllm_o3.model import O3Config
    from vllm_o3.quantization.int4_format import GROUP_SIZES
    from vllm_o3.tools.cli import positive_int
    from vllm_o3.tools.corpora import load_corpora
    from vllm_o3.tools.evaluate import text_windows, vllm_window_nlls
    from vllm_o3.tools.quantize import (
        calibrate,
        calibration_windows,
        quantize_checkpoint,
    )

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default="o3", type=Path)
    parser.add_argument("--windows", type=int, default=4, help="per domain")
    parser.add_argument(
        "--methods", nargs="+", default=["rtn"], choices=["rtn", "gptq", "tuned"]
    )
    parser.add_argument("--calibration-windows", type=positive_int, default=128)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    corpora = load_corpora()
    windows = {
        d: text_windows(tokenizer, "\n\n".join(corpora[d].held_out), args.windows)
        for d in DOMAINS
    }
    all_windows = [w for d in DOMAINS for w in windows[d]]
    config = O3Config.from_pretrained(args.model)
    inputs = (config.hidden_size, config.intermediate_size)
    groups = [g for g in GROUP_SIZES if all(n % g == 0 for n in inputs)]
    # Calibration depends on the model and the calibration text only: once.
    calibration = (
        calibrate(args.model, calibration_windows(args.model, args.calibration_windows))
        if {"gptq", "tuned"} & set(args.methods)
        else None
    )
    # (label, engine options, offline (group size, symmetric, method) or None)
    settings: list[tuple[str, dict, tuple[int, bool, str] | None]] = [
        ("16-bit", {}, None),
        (
            "online: symmetric, largest group per projection",
            {"quantization": "o3_int4"},
            None,
        ),
    ]
    for method in args.methods:
        for group in sorted(groups, reverse=True):
            for sym in (True, False):
                kind = "symmetric" if sym else "asymmetric"
                label = f"offline {method}: group {group}, {kind}"
                settings.append((label, {}, (group, sym, method)))

    perplexity: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="o3-int4-quality-") as scratch:
        for label, options, offline in tqdm(settings, desc="settings"):
            path = args.model
            if offline is not None:
                group, sym, method = offline
                path = Path(scratch) / f"g{group}-{sym}-{method}"
                quantize_checkpoint(
                    args.model, path, group, sym,
                    calibration=None if method == "rtn" else calibration,
                    tune_steps=0 if method == "gptq" else None,
                )  # fmt: skip
            nlls = vllm_window_nlls(
                str(path), all_windows, dtype="bfloat16", enforce_eager=True, **options
            )
            perplexity[label] = per_domain_perplexity(windows, nlls)

    base = perplexity["16-bit"]
    columns = [*DOMAINS, "all"]
    lines = []
    for label, values in perplexity.items():
        cells = [f"{values[c]:.3f}" for c in columns]
        if label != "16-bit":
            cells = [
                f"{cell} ({(values[c] / base[c] - 1) * 100:+.2f} %)"
                for cell, c in zip(cells, columns, strict=True)
            ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    body = (
        f"Model: `{args.model}` (hidden {config.hidden_size}, FFN "
        f"{config.intermediate_size}; group sizes dividing both: "
        f"{', '.join(map(str, groups))}). Held-out windows of 512 tokens, "
        f"{args.windows} per domain, {sum(len(w) for w in all_windows)} tokens; "
        "bfloat16, vLLM eager mode; perplexity from vLLM's prompt "
        "log-probabilities, increase over 16-bit in brackets."
        + (
            f" Calibrated methods: {len(calibration.windows)} windows of 512 "
            "tokens of the corpora's calibration split (disjoint from the "
            "held-out text)."
            if calibration
            else ""
        )
        + "\n\n"
        "| setting | " + " | ".join(columns) + " |\n"
        "|---|" + "---|" * len(columns) + "\n" + "\n".join(lines)
    )
    print(body)
    title = "o3_int4 quality: perplexity vs 16-bit"
    print(f"written to {write_report('bench_int4_quality', title, body)}")


if __name__ == "__main__":
    main()
