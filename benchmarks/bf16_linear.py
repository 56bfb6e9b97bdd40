"""O3's bfloat16 CPU linear against vLLM's, by number of rows.

On a CPU without a fast bfloat16 GEMM (no AVX-512: oneDNN has no bfloat16
matmul) vLLM's CPU linear runs torch's bfloat16 matmul, a plain loop; O3's
models run theirs on `cpu_bf16_linear` instead. Both columns are vLLM's
linear layer holding the same weight, called as the model calls it; the
second with O3's kernel as its GEMM. Shapes: the linears of the 1b preset
(TinyLlama-1.1B's) and of the default model (SmolLM2-135M), random weights.
Before each timed call the benchmark reads twice the last-level cache in
other data, so weights come from memory, as in a decode step. Each repeat
calls both columns, alternating which goes first; medians.

    python -m benchmarks.bf16_linear [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from tqdm import tqdm

from benchmarks.common import (
    cache_evictor,
    interleaved_times,
    median_ratio,
    single_process_vllm,
    vllm_linear,
    write_report,
)

SHAPES = {  # (out, in)
    "1b qkv": (2560, 2048),
    "1b o": (2048, 2048),
    "1b gate_up": (11264, 2048),
    "1b down": (2048, 5632),
    "1b head": (32000, 2048),
    "135m qkv": (960, 576),
    "135m gate_up": (3072, 576),
    "135m down": (576, 1536),
    "135m head": (49152, 576),
}
# Both sides of the kernel's switch to the float32 GEMM (256 rows).
ROWS = (1, 2, 4, 16, 64, 255, 256, 512)
HEAD_ROWS = (1, 16)  # the head runs on the rows sampled from: a decode batch


def main() -> None:
    from vllm_o3.kernels import cpu_bf16_linear

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if not cpu_bf16_linear.pays():
        parser.error(
            "vLLM's bfloat16 GEMM on this CPU is a fast one: nothing to compare"
        )
    reason = cpu_bf16_linear.unavailable_reason()
    if reason is not None:
        parser.error(f"O3's kernel does not run here: {reason}")
    torch.set_default_dtype(torch.bfloat16)
    evict = cache_evictor()
    lines = []
    with single_process_vllm():
        for name, (out_features, in_features) in SHAPES.items():
            torch.manual_seed(0)
            weight = torch.randn(out_features, in_features) * in_features**-0.5
            vllm_layer, o3_layer = vllm_linear(weight), vllm_linear(weight)
            o3_layer.cpu_linear = torch.ops.o3_cpu.bf16_linear.default
            rows = HEAD_ROWS if name.endswith("head") else ROWS
            for m in tqdm(rows, desc=name):
                x = torch.randn(m, in_features)
                vllm_times, o3_times = interleaved_times(
                    [lambda x=x, f=f: f(x)[0] for f in (vllm_layer, o3_layer)],
                    args.repeats,
                    before=evict,
                )
                o3_s = statistics.median(o3_times)
                lines.append(
                    f"| {name} {out_features}x{in_features} | {m} "
                    f"| {statistics.median(vllm_times) * 1e3:.3f} | {o3_s * 1e3:.3f} "
                    f"| {median_ratio(vllm_times, o3_times):.2f}x "
                    f"| {weight.numel() * 2 / o3_s / 1e9:.1f} |"
                )
    body = (
        "bfloat16 weights and activations. vLLM's linear: torch's bfloat16 "
        "matmul (no oneDNN bfloat16 GEMM on this CPU); O3's: `o3_cpu::bf16_linear`, "
        "its AVX2 tiles below 256 rows, the weight widened to float32 a block at a "
        "time for torch's float32 GEMM from there. Weights read from memory (the "
        "caches evicted before each call); medians of the repeats, the speed-up "
        "the median of each repeat's ratio; GB/s: the weight's bytes over O3's "
        "time.\n\n"
        "| linear | rows | vLLM ms | O3 ms | speed-up | O3 weight GB/s |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(lines)
    )
    print(body)
    title = "bfloat16 linear on CPU: O3's kernel vs vLLM's (torch's matmul)"
    print(f"written to {write_report('bench_bf16_linear', title, body)}")


if __name__ == "__main__":
    main()
