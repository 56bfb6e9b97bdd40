"""The INT4 FFN linear against the 16-bit one, by number of rows.

Same weights (TinyLlama-1.1B's FFN shapes, random), same inputs, side by side.
As in a real decode step, every call reads its weights from memory, not cache:
each variant cycles through copies totalling more than the CPU's caches.
vLLM's 16-bit CPU linear (its oneDNN-packed path, as the engine runs it), the
`o3_int4` kernel (`Int4Linear`: torch's packed INT4 matmul up to
SMALL_M_MAX rows, dequantize-then-GEMM above), and vLLM's own CPU W4A16
kernel (`CPUWNA16LinearKernel`) for reference. Medians of repeats.

    python -m benchmarks.int4_linear [--repeats 20]
"""

from __future__ import annotations

import argparse
from itertools import cycle

import torch
from tqdm import tqdm

from benchmarks.common import median_time, single_process_vllm, write_report

SHAPES = {"gate_up": (11264, 2048), "down": (2048, 5632)}  # (out, in)
ROWS = (1, 4, 16, 64, 256, 512, 2048)  # plus both sides of the paths' switch
COPIES_BYTES = 768 * 2**20  # of 16-bit weights per variant, beyond any cache


def dense_linear(weight: torch.Tensor):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    out_features, in_features = weight.shape
    layer = ReplicatedLinear(in_features, out_features, bias=False, prefix="bench")
    layer.weight.data.copy_(weight)
    layer.quant_method.process_weights_after_loading(layer)
    return lambda x: layer(x)[0]


def main() -> None:
    from vllm_o3.kernels.int4_linear import SMALL_M_MAX, Int4Linear
    from vllm_o3.quantization.int4_format import quantize

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_default_dtype(torch.bfloat16)
    rows = []
    with single_process_vllm():
        for name, (out_features, in_features) in SHAPES.items():
            torch.manual_seed(0)
            weight = torch.randn(out_features, in_features) * in_features**-0.5
            packed = quantize(weight, 128, sym=True)
            copies = max(2, COPIES_BYTES // (weight.numel() * 2))
            dense = cycle([dense_linear(weight) for _ in range(copies)])
            int4 = cycle([Int4Linear(packed, torch.bfloat16) for _ in range(copies)])
            wna16 = cycle(
                [
                    Int4Linear(packed, torch.bfloat16, vllm_kernel=True)
                    for _ in range(copies)
                ]
            )
            switch = (SMALL_M_MAX, SMALL_M_MAX + 1)
            for m in tqdm(sorted({*ROWS, *switch}), desc=name):
                x = torch.randn(m, in_features)
                t_dense, t_int4, t_wna16 = (
                    median_time(lambda c=c, x=x: next(c)(x), args.repeats)
                    for c in (dense, int4, wna16)
                )
                rows.append(
                    f"| {name} {out_features}x{in_features} | {m} | {t_dense * 1e3:.3f} | "
                    f"{t_int4 * 1e3:.3f} | {t_dense / t_int4:.2f}x | {t_wna16 * 1e3:.3f} | "
                    f"{t_dense / t_wna16:.2f}x |"
                )
    body = (
        f"bf16 activations; INT4 group 128 symmetric; `Int4Linear` switches "
        f"from the packed INT4 matmul to dequantize + GEMM above {SMALL_M_MAX} rows.\n\n"
        "| linear | rows | 16-bit ms | o3_int4 ms | speed-up | vLLM CPUWNA16 ms | speed-up |\n"
        "|---|---|---|---|---|---|---|\n" + "\n".join(rows)
    )
    print(body)
    print(
        f"written to {write_report('bench_int4_linear', 'INT4 FFN linear vs 16-bit', body)}"
    )


if __name__ == "__main__":
    main()
