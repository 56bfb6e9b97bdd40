"""The routed FFN on CPUs: the router in C++ (`csrc/routed_light_cpu.cpp`),
the full FFN on the heavy rows only, its activation in C++ too
(`csrc/silu_and_mul_cpu.cpp`).

At decode sizes router, partition and light path run in one C++ call: in
PyTorch (`routing.routed_ffn_torch`, which defines it and runs where the C++
kernels cannot) they are a dozen operations per layer, whose dispatch alone
made a light token cost a third of a heavy one on a small model
(docs/bench_routed_ffn_layer.md). Where oneDNN has a bfloat16 GEMM (x86
with AVX-512), from FUSED_MAX_ROWS rows on, the light rows go through the
caller's light path instead, which is vLLM's own GEMM dispatch (oneDNN, on
AMX tiles where the CPU has them: at 7,680 rows 10 ms against the kernel's
92 ms for the 1b preset's light path). On AVX2 CPUs oneDNN has no bfloat16
GEMM and vLLM runs torch's loop, which the kernel outruns 4x at every batch
size (1b preset, 4 to 512 rows): there the kernel takes every batch.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vllm_o3.kernels import cpu_kernels
from vllm_o3.kernels.routing import routed_rows, with_heavy_rows

LANES = 16  # float32 lanes of AVX-512: output channels per block
ROUTER_CHUNK = 64  # router hidden units per pass of the kernel
# Rows from which the light path leaves the fused kernel for oneDNN's GEMM:
# at 4 rows both take the same time, at 16 the GEMM 4x less (1b preset, AMX).
FUSED_MAX_ROWS = 8


class CpuRoutedWeights(nn.Module):
    """One routed layer's router and light path in the kernel's layouts, as
    buffers: a layer holding them counts them among its weights; and from
    how many rows the light rows leave the kernel (`fused_rows_below`)."""

    def __init__(
        self,
        w1t: torch.Tensor,
        b1: torch.Tensor,
        w2: torch.Tensor,
        b2: torch.Tensor,
        down: torch.Tensor,
        up: torch.Tensor,
        rank: int,
    ):
        super().__init__()
        self.register_buffer("w1t", w1t, persistent=False)  # [H, R'] fc1^T
        self.register_buffer("b1", b1, persistent=False)  # [R']
        self.register_buffer("w2", w2, persistent=False)  # [R']
        self.register_buffer("b2", b2, persistent=False)  # [1]
        self.register_buffer("down", down, persistent=False)  # pair layout
        self.register_buffer("up", up, persistent=False)  # pair layout
        self.rank = rank
        self.fused_rows_below = fused_rows_below()


def fused_rows_below() -> int:
    """Batches of fewer rows run their light rows in the fused kernel: every
    batch where vLLM's GEMM for them would be torch's plain bfloat16 loop."""
    if cpu_kernels.has_fast_gemm(torch.bfloat16):
        return FUSED_MAX_ROWS
    return sys.maxsize


class CpuSiluAndMul(nn.Module):
    """silu(gate) * up of the full FFN in one C++ pass. vLLM's `SiluAndMul`,
    called inside an opaque op as the routed FFN is, runs as a
    torch.compile'd function: at one row 4 us here against 0.5-0.9 ms a call
    in the engine (docs/bench_e2e_routing.md), at 3,840 rows of the 1b
    preset 9.5 against 12.3 ms."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.o3_cpu.silu_and_mul(x)


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] 16-bit weight -> int16 [N' / 16, K' / 2, 32]: blocks of 16
    output channels, input channels in pairs, channel c of a block at 2c and
    2c + 1 (N' = N padded to 16, K' = K padded to even, with zeros)."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // LANES) * LANES, k + k % 2, dtype=weight.dtype)
    padded[:n, :k] = weight
    blocks = padded.view(padded.shape[0] // LANES, LANES, padded.shape[1] // 2, 2)
    return blocks.permute(0, 2, 1, 3).reshape(blocks.shape[0], -1, 2 * LANES)


def pack_routed_weights(
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor,
    light_down: torch.Tensor,
    light_up: torch.Tensor,
) -> CpuRoutedWeights:
    """The kernel's copy of a layer's router (float32, R padded to
    ROUTER_CHUNK units with zero weights, which add nothing) and light path
    (bfloat16). A copy: the plain weights stay for the PyTorch path."""
    r = fc1_weight.shape[0]
    r_pad = -(-r // ROUTER_CHUNK) * ROUTER_CHUNK

    def padded(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t.float().reshape(-1, r), (0, r_pad - r)).squeeze(0).contiguous()

    return CpuRoutedWeights(
        w1t=padded(fc1_weight.t()),
        b1=padded(fc1_bias),
        w2=padded(fc2_weight),
        b2=fc2_bias.float().reshape(1).contiguous(),
        down=pack_pairs(light_down.to(torch.bfloat16)).view(torch.int16).contiguous(),
        up=pack_pairs(light_up.to(torch.bfloat16)).view(torch.int16).contiguous(),
        rank=light_down.shape[0],
    )


def _route_fake(u, w1t, b1, w2, b2, threshold, counts):
    ctx = torch.library.get_ctx()
    return (
        u.new_empty(u.shape[0], dtype=torch.float32),
        u.new_empty(ctx.new_dynamic_size(), dtype=torch.int64),
        u.new_empty(ctx.new_dynamic_size(), dtype=torch.int64),
    )


def _silu_and_mul_fake(x):
    return x.new_empty(x.shape[0], x.shape[1] // 2)


def _routed_light_fake(u, w1t, b1, w2, b2, down, up, rank, threshold, counts):
    """Row counts of the light output (all or none) and of the heavy-row
    list depend on the scores."""
    ctx = torch.library.get_ctx()
    return (
        u.new_empty(ctx.new_dynamic_size(), u.shape[1]),
        u.new_empty(u.shape[0], dtype=torch.float32),
        u.new_empty(ctx.new_dynamic_size(), dtype=torch.int64),
    )


@functools.cache
def _kernels_reason() -> str | None:
    reason = cpu_kernels.unavailable_reason()
    if reason is None:
        # What torch.compile would trace; the routed FFN op that calls this
        # is opaque to it anyway.
        torch.library.register_fake("o3_cpu::routed_light")(_routed_light_fake)
        torch.library.register_fake("o3_cpu::route")(_route_fake)
        torch.library.register_fake("o3_cpu::silu_and_mul")(_silu_and_mul_fake)
    return reason


def unavailable_reason(dtype: torch.dtype, hidden_size: int) -> str | None:
    """None when the kernel runs this layer, else why not."""
    if dtype != torch.bfloat16:
        return f"activations are {dtype}, it takes bfloat16"
    if hidden_size % LANES:
        return f"hidden size {hidden_size} is not a multiple of {LANES}"
    return _kernels_reason()


def routed_ffn_cpu(
    u: torch.Tensor,
    weights: CpuRoutedWeights,
    threshold: float,
    heavy_ffn: Callable[[torch.Tensor], torch.Tensor],
    light_path: Callable[[torch.Tensor], torch.Tensor],
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(output, float32 router scores, number of heavy rows) for `u` [T, H];
    `counts` ([heavy, real] rows, int64), if given, gains this batch's.
    `light_path` (the layer's, on `weights`' light weights) runs the light
    rows of batches of `weights.fused_rows_below` rows or more."""
    u = u.contiguous()  # the kernels read rows in place
    if u.shape[0] < weights.fused_rows_below:
        y, scores, heavy_rows = torch.ops.o3_cpu.routed_light(
            u, weights.w1t, weights.b1, weights.w2, weights.b2,
            weights.down, weights.up, weights.rank, threshold, counts,
        )  # fmt: skip
        num_heavy = heavy_rows.shape[0]
        return with_heavy_rows(u, y, heavy_rows, heavy_ffn), scores, num_heavy
    scores, heavy_rows, light_rows = torch.ops.o3_cpu.route(
        u, weights.w1t, weights.b1, weights.w2, weights.b2, threshold, counts
    )
    y = routed_rows(u, heavy_rows, light_rows, heavy_ffn, light_path)
    return y, scores, heavy_rows.shape[0]
