"""The INT4 FFN linear against the 16-bit one, by number of rows.

Same weights (the FFN shapes of TinyLlama-1.1B and of the default model,
SmolLM2-135M; random), same inputs, side by side. As in a real decode step,
every call reads its weights from memory, not cache: each variant cycles
through copies totalling more than the CPU's caches. vLLM's 16-bit CPU linear
(its oneDNN-packed path, as the engine runs it); `o3_int4` as it runs here
(`Int4Linear`: the AVX512-BF16 INT4 GEMM); `o3_int4` on a CPU without
AVX512-BF16 (torch's packed INT4 matmul up to SMALL_M_MAX rows, dequantize +
16-bit GEMM above); and vLLM's own CPU W4A16 kernel (`CPUWNA16LinearKernel`)
for reference. Medians of repeats.

    python -m benchmarks.int4_linear [--repeats 20]
"""

from __future__ import annotations

import argparse
from itertools import cycle

import torch
from tqdm import tqdm

from benchmarks.common import median_time, single_process_vllm, write_report

SHAPES = {  # (out, in)
    "1b gate_up": (11264, 2048),
    "1b down": (2048, 5632),
    "135m gate_up": (3072, 576),
    "135m down": (576, 1536),
}
ROWS = (1, 4, 8, 16, 64, 256, 512, 2048)  # plus both sides of the fallback's switch
COPIES_BYTES = 768 * 2**20  # of 16-bit weights per variant, beyond any cache


def dense_linear(weight: torch.Tensor, packed):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    out_features, in_features = weight.shape
    layer = ReplicatedLinear(in_features, out_features, bias=False, prefix="bench")
    layer.weight.data.copy_(weight)
    layer.quant_method.process_weights_after_loading(layer)
    return lambda x: layer(x)[0]


def int4_linear(weight: torch.Tensor, packed):
    from vllm_o3.kernels.int4_linear import Int4Linear

    return Int4Linear(packed, torch.bfloat16)


def vllm_wna16_linear(weight: torch.Tensor, packed):
    from vllm_o3.kernels.int4_linear import Int4Linear

    return Int4Linear(packed, torch.bfloat16, vllm_kernel=True)


def without_avx512_bf16(weight: torch.Tensor, packed):
    from vllm_o3.kernels import cpu_int4_gemm
    from vllm_o3.kernels.int4_linear import Int4Linear

    available = cpu_int4_gemm.unavailable_reason
    cpu_int4_gemm.unavailable_reason = lambda: "benchmarked without it"
    try:
        return Int4Linear(packed, torch.bfloat16)
    finally:
        cpu_int4_gemm.unavailable_reason = available


# The columns of the table, each built from (16-bit weight, INT4 weight).
VARIANTS = (dense_linear, int4_linear, without_avx512_bf16, vllm_wna16_linear)


def main() -> None:
    from vllm_o3.kernels.int4_linear import SMALL_M_MAX
    from vllm_o3.quantization.int4_format import largest_group_size, quantize

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_default_dtype(torch.bfloat16)
    rows = []
    with single_process_vllm():
        for name, (out_features, in_features) in SHAPES.items():
            torch.manual_seed(0)
            weight = torch.randn(out_features, in_features) * in_features**-0.5
            packed = quantize(weight, largest_group_size(name, in_features), sym=True)
            copies = max(2, COPIES_BYTES // (weight.numel() * 2))
            layers = [
                cycle([build(weight, packed) for _ in range(copies)])
                for build in VARIANTS
            ]
            switch = (SMALL_M_MAX, SMALL_M_MAX + 1)
            for m in tqdm(sorted({*ROWS, *switch}), desc=name):
                x = torch.randn(m, in_features)
                times = [
                    median_time(lambda c=c, x=x: next(c)(x), args.repeats)
                    for c in layers
                ]
                cells = [f"{t * 1e3:.3f} | {times[0] / t:.2f}x" for t in times[1:]]
                rows.append(
                    f"| {name} {out_features}x{in_features} | {packed.group_size} "
                    f"| {m} | {times[0] * 1e3:.3f} | " + " | ".join(cells) + " |"
                )
    body = (
        "bf16 activations; INT4 symmetric, group 128 (64 where 128 does not "
        "divide the input); `Int4Linear` runs the AVX512-BF16 INT4 GEMM at "
        "every row count; without AVX512-BF16 it switches from torch's packed "
        f"INT4 matmul to dequantize + GEMM above {SMALL_M_MAX} rows. Speed-ups "
        "are 16-bit time / variant time.\n\n"
        "| linear | group | rows | 16-bit ms | o3_int4 ms | speed-up "
        "| o3_int4 without AVX512-BF16 ms | speed-up "
        "| vLLM CPUWNA16 ms | speed-up |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
    )
    print(body)
    print(
        f"written to {write_report('bench_int4_linear', 'INT4 FFN linear vs 16-bit', body)}"
    )


if __name__ == "__main__":
    main()
