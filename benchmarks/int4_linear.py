"""The INT4 FFN linear against the 16-bit one, by number of rows.

Same weights (the FFN shapes of TinyLlama-1.1B and of the default model,
SmolLM2-135M; random), same inputs, side by side. As in a real decode step,
every call reads its weights from memory, not cache: before each timed call
the benchmark reads twice the size of the last-level cache in other data
(cycling through copies of the weights, as it did first, left the 4-bit
ones in a 300 MB L3). Every column is vLLM's linear layer, called as the
model calls it: 16-bit (its oneDNN-packed path where oneDNN has one, as the
engine runs it);
`o3_int4` as it runs here
(`Int4Linear`: our INT4 GEMM on AVX512-BF16, on AMX tiles from `AMX_MIN_ROWS`
rows where the CPU has them, or on AVX2); `o3_int4` where our kernel cannot
run (torch's packed INT4 matmul up to `packed_max_rows`, dequantize
+ GEMM above); and vLLM's own CPU W4A16 kernel (`CPUWNA16LinearKernel`)
for reference (with AMX it is vLLM's W4A8 path, which quantizes activations
to int8 and needs zero points: the symmetric weight is given explicit zeros
of 8). Medians of repeats.

    python -m benchmarks.int4_linear [--repeats 20]
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
    "1b gate_up": (11264, 2048),
    "1b down": (2048, 5632),
    "135m gate_up": (3072, 576),
    "135m down": (576, 1536),
}
# Plus both sides of the fallback's switch (`packed_max_rows`).
ROWS = (1, 2, 4, 8, 16, 32, 64, 256, 512, 2048)


def dense_linear(weight: torch.Tensor, packed):
    layer = vllm_linear(weight)
    return lambda x: layer(x)[0]


def o3_int4_layer(weight: torch.Tensor, packed, linear=None):
    """vLLM's linear layer with the `o3_int4` method on `packed`, called as the
    model calls its FFN projections (the layer, the method's `apply`, then
    `Int4Linear`), so that every column pays the same Python per call as the
    16-bit one; `linear` replaces the `Int4Linear` the method builds."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    from vllm_o3.quantization.o3_int4 import O3Int4Config

    out_features, in_features = weight.shape
    config = O3Int4Config(packed.group_size, packed.qzeros is None, serialized=True)
    layer = ReplicatedLinear(
        in_features, out_features, bias=False, quant_config=config,
        prefix="bench.mlp.down_proj",
    )  # fmt: skip
    for name in ("qweight", "scales", "qzeros"):
        if getattr(packed, name) is not None:
            getattr(layer, name).data.copy_(getattr(packed, name))
    layer.quant_method.process_weights_after_loading(layer)
    if linear is not None:
        layer.o3_int4 = linear
    return lambda x: layer(x)[0]


def int4_linear(weight: torch.Tensor, packed):
    return o3_int4_layer(weight, packed)


def vllm_wna16_linear(weight: torch.Tensor, packed):
    if not hasattr(torch.ops._C, "cpu_gemm_wna16"):
        return None  # vLLM's AVX2 build has no such kernel
    from vllm_o3.kernels.int4_linear import Int4Linear
    from vllm_o3.quantization.int4_format import SYMMETRIC_ZERO, Int4Weight, pack_int4

    if packed.qzeros is None and torch.cpu._is_amx_tile_supported():
        zeros = torch.full_like(packed.scales, SYMMETRIC_ZERO, dtype=torch.int32)
        packed = Int4Weight(packed.qweight, packed.scales, pack_int4(zeros, dim=1))
    vllm_kernel = Int4Linear(packed, torch.bfloat16, vllm_kernel=True)
    return o3_int4_layer(weight, packed, vllm_kernel)


def without_int4_kernel(weight: torch.Tensor, packed):
    from vllm_o3.kernels import cpu_int4_gemm

    available = cpu_int4_gemm.unavailable_reason
    if available() is not None:
        return None  # what the o3_int4 column runs here
    cpu_int4_gemm.unavailable_reason = lambda: "benchmarked without it"
    try:
        return o3_int4_layer(weight, packed)
    finally:
        cpu_int4_gemm.unavailable_reason = available


# The columns of the table, each built from (16-bit weight, INT4 weight);
# None: not run on this CPU.
VARIANTS = (dense_linear, int4_linear, without_int4_kernel, vllm_wna16_linear)


def main() -> None:
    from vllm_o3.kernels import cpu_int4_gemm, cpu_kernels
    from vllm_o3.kernels.int4_linear import gemm_dtype, packed_max_rows
    from vllm_o3.quantization.int4_format import largest_group_size, quantize

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_default_dtype(torch.bfloat16)
    rows = []
    evict = cache_evictor()
    switch = packed_max_rows(torch.bfloat16)
    with single_process_vllm():
        for name, (out_features, in_features) in SHAPES.items():
            torch.manual_seed(0)
            weight = torch.randn(out_features, in_features) * in_features**-0.5
            packed = quantize(weight, largest_group_size(name, in_features), sym=True)
            layers = [build(weight, packed) for build in VARIANTS]
            running = [f for f in layers if f is not None]
            for m in tqdm(sorted({*ROWS, switch, switch + 1}), desc=name):
                x = torch.randn(m, in_features)
                measured = iter(
                    interleaved_times(
                        [lambda f=f, x=x: f(x) for f in running],
                        args.repeats,
                        before=evict,
                    )
                )
                times = [None if f is None else next(measured) for f in layers]
                dense_ms = statistics.median(times[0]) * 1e3
                cells = [
                    "n/a | n/a"
                    if samples is None
                    else f"{statistics.median(samples) * 1e3:.3f} | "
                    f"{median_ratio(times[0], samples):.2f}x"
                    for samples in times[1:]
                ]
                rows.append(
                    f"| {name} {out_features}x{in_features} | {packed.group_size} "
                    f"| {m} | {dense_ms:.3f} | " + " | ".join(cells) + " |"
                )
    reason = cpu_int4_gemm.unavailable_reason()  # loads, sets AMX_MIN_ROWS
    amx = cpu_int4_gemm.AMX_MIN_ROWS > 0
    path = (
        f"below {cpu_int4_gemm.AMX_MIN_ROWS} rows, on AMX tiles from there "
        "(the 4-bit values on the tiles and the group scales on their products "
        "below 64 rows, the dequantized weight from 64, x of 2 MB or more in "
        "blocks of rows of 1 MB where it has 2048 inputs or fewer, y of 1 MB or "
        "more written past the caches), and from 1536 rows (640 over 2048 "
        "inputs; never for weights of 16 M values with 2048 inputs or fewer) "
        "dequantizes the weight and runs torch's 16-bit GEMM"
        if amx
        else "at every row count (no AMX)"
    )
    dequantized = str(gemm_dtype(torch.bfloat16)).removeprefix("torch.")
    fallback = (
        f"torch's packed INT4 matmul up to {switch} rows, above them the weight "
        f"dequantized to {dequantized} and torch's GEMM"
    )
    isa = torch.ops.o3_cpu.kernel_isa() if reason is None else None
    if isa == "avx512_bf16":
        runs = f"`Int4Linear` runs our AVX512-BF16 INT4 GEMM {path}"
    elif isa == "avx2":
        runs = (
            "`Int4Linear` runs our INT4 GEMM's AVX2 build: its tiles below 192 "
            "rows, from there the weight dequantized into float32 and torch's "
            "float32 GEMM"
        )
    else:
        runs = f"`Int4Linear` runs {fallback} ({reason})"
    runs += f"; without our kernel it runs {fallback}"
    if amx:
        vllm_kernel = "W4A8 (AMX)"
    elif hasattr(torch.ops._C, "cpu_gemm_wna16"):
        vllm_kernel = "CPUWNA16"
    else:
        vllm_kernel = "none in vLLM's build for this CPU"
    dense = (
        "oneDNN's"
        if cpu_kernels.has_fast_gemm(torch.bfloat16)
        else "torch's bfloat16 loop: oneDNN has no bfloat16 GEMM on this CPU"
    )
    body = (
        "bf16 activations; INT4 symmetric, group 128 (64 where 128 does not "
        f"divide the input); 16-bit: vLLM's linear ({dense}); {runs}. "
        f"vLLM's CPU kernel: {vllm_kernel}. Weights read from memory (the "
        "caches evicted before each call). "
        "Each repeat calls every column once, each repeat starting from the "
        "next column; times are medians, "
        "speed-ups the medians over the repeats of 16-bit time / variant time "
        "(the machine's speed drifts between minutes, and cancels in a repeat's "
        "ratio).\n\n"
        "| linear | group | rows | 16-bit ms | o3_int4 ms | speed-up "
        "| o3_int4 without our kernel ms | speed-up "
        "| vLLM's CPU kernel ms | speed-up |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
    )
    print(body)
    print(
        f"written to {write_report('bench_int4_linear', 'INT4 FFN linear vs 16-bit', body)}"
    )


if __name__ == "__main__":
    main()
