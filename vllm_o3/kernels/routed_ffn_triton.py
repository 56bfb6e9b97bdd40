"""The routed FFN on GPUs: router, partition and both paths without a host sync.

Fixed-shape from the outside ([T, H] in, [T, H] out) and sync-free inside, so
vLLM's CUDA graphs capture it; padded rows of a captured batch (vLLM's
`is_padding` mask) take neither path. Its definition in plain PyTorch is
`routing.routed_ffn_torch`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vllm_o3.kernels.routed_gemm import gather_gemm, scatter_gemm, scatter_splits
from vllm_o3.kernels.router import route_rows
from vllm_o3.kernels.routing import HEAVY, LIGHT


@dataclass
class RoutedFFNWeights:
    """One routed layer's weights, as the kernels read them (this rank's shard
    of the FFN; router and light path are replicated)."""

    fc1_weight: torch.Tensor
    fc1_bias: torch.Tensor
    fc2_weight: torch.Tensor
    fc2_bias: torch.Tensor
    gate_up: torch.Tensor  # [2 * I_local, H]: gate rows, then up rows
    down: torch.Tensor  # [H, I_local]
    light_down: torch.Tensor  # [light_rank, H]
    light_up: torch.Tensor  # [H, light_rank]


@triton.jit
def _combine_kernel(
    heavy_ptr,
    light_ptr,
    route_ptr,
    y_ptr,
    T,
    H,
    S,
    stride_split,
    stride_heavy,
    stride_light,
    stride_y,
    HEAVY_CODE: tl.constexpr,
    LIGHT_CODE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """y = the sum of the heavy parts on heavy rows, the light path on light
    rows, 0 on padding rows; parts of rows that are not heavy are never read."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = (rows < T)[:, None] & (cols < H)[None, :]
    route = tl.load(route_ptr + rows, mask=rows < T, other=-1)[:, None]
    heavy = ok & (route == HEAVY_CODE)
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for s in range(S):
        part = (
            heavy_ptr + s * stride_split + rows[:, None] * stride_heavy + cols[None, :]
        )
        acc += tl.load(part, mask=heavy, other=0.0).to(tl.float32)
    light = tl.load(
        light_ptr + rows[:, None] * stride_light + cols[None, :],
        mask=ok & (route == LIGHT_CODE),
        other=0.0,
    )
    y = tl.where(heavy, acc, light.to(tl.float32))
    tl.store(
        y_ptr + rows[:, None] * stride_y + cols[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=ok,
    )


def combine(
    heavy: torch.Tensor, light: torch.Tensor, route: torch.Tensor
) -> torch.Tensor:
    """`heavy` [S, T, H] (partial sums) and `light` [T, H] into y [T, H]."""
    S, T, H = heavy.shape
    y = torch.empty_like(light)
    if T == 0:
        return y
    block_t, block_h = 16, 128
    _combine_kernel[(triton.cdiv(T, block_t), triton.cdiv(H, block_h))](
        heavy, light, route, y, T, H, S,
        heavy.stride(0), heavy.stride(1), light.stride(0), y.stride(0),
        HEAVY_CODE=HEAVY, LIGHT_CODE=LIGHT, BLOCK_T=block_t, BLOCK_H=block_h,
    )  # fmt: skip
    return y


def routed_ffn_triton(
    u: torch.Tensor,
    weights: RoutedFFNWeights,
    threshold: float,
    is_padding: torch.Tensor | None = None,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y [T, H], float32 scores [T], bounds): `bounds` holds on the
    device the number of heavy rows and of real rows.

    The full FFN runs on the heavy rows only, through the gather/scatter
    GEMMs (K of the down projection split across programs when there are
    few rows). The light path, rank r against the FFN's 3 x I, runs on every
    row through the 16-bit library GEMM (2-3 % of a heavy row's work at the
    shapes of docs/bench_gpu_kernels.md, and cheaper than two more
    latency-bound gather/scatter launches); the route picks per row.
    `all_reduce` sums the heavy rows' partial outputs across tensor-parallel
    ranks; the light path is computed whole on every rank. Launches: the
    router's GEMM, one routing kernel, gather, scatter, two light GEMMs and
    the combine (each a fixed cost at decode sizes).
    """
    w = weights
    T, H = u.shape
    scores, route, order, marks = route_rows(
        u, w.fc1_weight, w.fc1_bias, w.fc2_weight, w.fc2_bias, threshold, is_padding
    )
    zero, num_heavy, bounds = marks[0:1], marks[1:2], marks[1:3]
    act = gather_gemm(u, order, zero, num_heavy, w.gate_up, swiglu=True)
    heavy = torch.empty(
        scatter_splits(T, w.down), T, H, dtype=torch.float32, device=u.device
    )
    scatter_gemm(act, order, zero, num_heavy, w.down, heavy)
    if all_reduce is not None:
        heavy = all_reduce(heavy.sum(0).to(u.dtype)).unsqueeze(0)
    light = F.linear(F.linear(u, w.light_down), w.light_up)
    return combine(heavy, light, route), scores, bounds
