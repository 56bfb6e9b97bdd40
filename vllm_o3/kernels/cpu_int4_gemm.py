"""The AVX512-BF16 INT4 GEMM of `csrc/int4_gemm_cpu.cpp`: built on first use
(torch's C++ extension builder, cached under ~/.cache/torch_extensions, about
10 s once) and its weight layout.

It is the CPU kernel of `Int4Linear` wherever it can run: an x86 CPU with
AVX512-BF16 (Intel Cooper Lake / Sapphire Rapids on, AMD Zen 4 on), bfloat16
activations, and a C++ compiler (which vLLM's compiled mode on CPU needs
anyway). Elsewhere `unavailable_reason` says why, and the caller logs it.
"""

from __future__ import annotations

import functools
import platform
import re
from pathlib import Path

import torch

from vllm_o3.quantization.int4_format import SYMMETRIC_ZERO

SOURCE = Path(__file__).parent / "csrc" / "int4_gemm_cpu.cpp"
# Output channels per VDPBF16PS, times the blocks one tile of the kernel runs
# (kBlock * kBlocksPerTile in the source): outputs are padded to it.
OUTPUT_TILE = 64
# Input channels per 64-byte word group.
INPUT_STEP = 8


@functools.cache
def unavailable_reason() -> str | None:
    """None when the kernel is built and this CPU runs it, else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"it is x86 code and this CPU is {platform.machine()}"
    try:
        from torch.utils.cpp_extension import load

        load(
            # One build per torch version: a build against another one's
            # headers would not load.
            name="vllm_o3_int4_gemm_cpu_torch_" + re.sub(r"\W", "_", torch.__version__),
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as e:  # a missing compiler or ninja, a failed build
        return f"building {SOURCE.name} failed: {e}"
    if not torch.ops.o3_cpu.int4_gemm_supported():
        return "this CPU has no AVX512-BF16"

    @torch.library.register_fake("o3_cpu::int4_gemm")
    def _(x, weight, scales, offsets, n_out):
        # What torch.compile traces: the operation stays opaque in the graph.
        return x.new_empty(x.shape[0], n_out)

    return None


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
