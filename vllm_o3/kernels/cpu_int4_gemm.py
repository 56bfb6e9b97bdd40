"""The INT4 GEMM of `csrc/int4_gemm_cpu.cpp` and its weight layout.

It is the CPU kernel of `Int4Linear` wherever the CPU kernels run
(`cpu_kernels`: AVX512-BF16, or AVX2 with FMA, `csrc/int4_tile_avx2.h`) and
activations are bfloat16. On CPUs with AMX-BF16 (Intel from Sapphire Rapids)
the same operation runs calls of `AMX_MIN_ROWS` rows or more on AMX tiles.
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
# Rows from which `int4_gemm` runs on AMX tiles (0: never); set when the
# kernels load, where the CPU has AMX-BF16 and the OS lets us use it. The AMX
# path expands the whole weight per call (pairs of 16-channel blocks at a
# time, panels of them for large x), which costs more than the AVX512-BF16
# GEMM below about 4 rows and far less above (docs/bench_int4_linear.md).
AMX_MIN_ROWS = 0
AMX_CROSSOVER_ROWS = 4


@functools.cache
def unavailable_reason() -> str | None:
    """None when `torch.ops.o3_cpu.int4_gemm` runs here, else why not."""
    global AMX_MIN_ROWS
    reason = cpu_kernels.unavailable_reason()
    if reason is None:
        # What torch.compile traces: the operation stays opaque in the graph.
        torch.library.register_fake("o3_cpu::int4_gemm")(
            lambda x, weight, scales, offsets, n_out, amx_min_rows: x.new_empty(
                x.shape[0], n_out
            )
        )
        if torch.ops.o3_cpu.amx_ready():
            AMX_MIN_ROWS = AMX_CROSSOVER_ROWS
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
