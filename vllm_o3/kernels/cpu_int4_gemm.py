"""The AVX512-BF16 INT4 GEMM of `csrc/int4_gemm_cpu.cpp` and its weight layout.

It is the CPU kernel of `Int4Linear` wherever the CPU kernels run
(`cpu_kernels`) and activations are bfloat16. `int4_dequantize` gives the
weight as the reference dequantizes it (what `int4_gemm` runs the 16-bit GEMM
on from `DENSE_MIN_ROWS` rows).
"""

from __future__ import annotations

import functools

import torch

from vllm_o3.kernels import cpu_kernels
from vllm_o3.quantization.int4_format import SYMMETRIC_ZERO

# Output channels per VDPBF16PS, times the blocks one tile of the kernel runs
# (kBlock * kBlocksPerTile in the source): outputs are padded to it.
OUTPUT_TILE = 64
# Input channels per 64-byte word group.
INPUT_STEP = 8
# Rows from which `int4_gemm` dequantizes the weight (into a buffer it keeps)
# and runs torch's 16-bit GEMM instead: where the CPU has AMX (Intel from
# Sapphire Rapids), that GEMM runs on AMX tiles and overtakes the INT4 GEMM
# between 10 and 24 rows on the FFN shapes of both presets with the buffer in
# cache, around 32 for the largest weight (46 MB to write) with it in memory;
# without AMX never, the INT4 GEMM staying within 8 % of 16-bit at every row
# count (AMD Zen 4). docs/bench_int4_linear.md has both machines.
DENSE_MIN_ROWS = 32 if torch.cpu._is_amx_tile_supported() else 0


@functools.cache
def unavailable_reason() -> str | None:
    """None when `torch.ops.o3_cpu.int4_gemm` runs here, else why not."""
    reason = cpu_kernels.unavailable_reason()
    if reason is None:
        # What torch.compile traces: the operation stays opaque in the graph.
        torch.library.register_fake("o3_cpu::int4_gemm")(
            lambda x, weight, scales, offsets, n_out, dense_min_rows: x.new_empty(
                x.shape[0], n_out
            )
        )
    return reason


def pack_for_gemm(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's layout of a [N, K] weight of 4-bit values `q` with
    [K / group, N] `scales` and `zeros` (None: symmetric).

    Returns int16 words [N' / 16, K / 8, 32] (word w of a block holds, in
    nibble j, the value for output w // 2 and input 2 j + w % 2), and float32
    scales and offsets [N' / 16, groups, 16] with offset = (zero - 8) * scale
    (empty when symmetric); N' is N padded to `OUTPUT_TILE` with zeros.
    """
    n, k = q.shape
    groups = scales.shape[0]
    padded = -(-n // OUTPUT_TILE) * OUTPUT_TILE
    values = torch.zeros(padded, k, dtype=torch.int32)
    values[:n] = q
    # (block, channel in block, step, nibble j, pair member) ->
    # (block, step, channel in block, pair member, nibble j)
    values = values.view(padded // 16, 16, k // INPUT_STEP, 4, 2)
    values = values.permute(0, 2, 1, 4, 3)
    words = (values << torch.tensor([0, 4, 8, 12], dtype=torch.int32)).sum(-1)
    words = words.reshape(padded // 16, k // INPUT_STEP, 32)
    words = words.to(torch.uint16).view(torch.int16).contiguous()

    def by_block(per_group: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(groups, padded, dtype=torch.float32)
        full[:, :n] = per_group
        return full.t().reshape(padded // 16, 16, groups).transpose(1, 2).contiguous()

    scales = scales.float()
    offsets = (
        torch.empty(0)
        if zeros is None
        else by_block((zeros.float() - SYMMETRIC_ZERO) * scales)
    )
    return words, by_block(scales), offsets
