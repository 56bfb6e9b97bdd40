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

from vllm_o3.kernels.routed_gemm import gather_gemm, scatter_gemm, scatter_splits
from vllm_o3.kernels.routing import (
    HEAVY,
    PADDING,
    partition_rows,
    router_scores_torch,
    routes_torch,
)
from vllm_o3.quantization.int4_format import Int4Weight


@dataclass
class RoutedFFNWeights:
    """One routed layer's weights, as the kernels read them (this rank's shard
    of the FFN; router and light path are replicated)."""

    fc1_weight: torch.Tensor
    fc1_bias: torch.Tensor
    fc2_weight: torch.Tensor
    fc2_bias: torch.Tensor
    # 16-bit [2 * I_local, H] (gate rows, then up rows) and [H, I_local], or
    # both INT4 (o3_int4's layout: the heavy rows read 4 bits per weight).
    gate_up: torch.Tensor | Int4Weight
    down: torch.Tensor | Int4Weight
    light_down: torch.Tensor  # [light_rank, H]
    light_up: torch.Tensor  # [H, light_rank]


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
    row through the 16-bit GEMM (2-3 % of a heavy row's work at the shapes
    of docs/bench_gpu_kernels.md: two library GEMMs cost less than two more
    latency-bound gather/scatter launches); the route picks per row. `all_reduce`
    sums the heavy rows' partial outputs across tensor-parallel ranks; the
    light path is computed whole on every rank.
    """
    w = weights
    T, H = u.shape
    # The router in float32 through the library GEMMs: a Triton router kernel
    # (one program per 16-32 rows, H walked serially) cost 90-350 us on an
    # H200 at the shapes of docs/bench_gpu_kernels.md, more than the dense FFN.
    scores = router_scores_torch(u, w.fc1_weight, w.fc1_bias, w.fc2_weight, w.fc2_bias)
    route = routes_torch(scores, threshold, is_padding)
    order, bounds = partition_rows(route)
    zero = torch.zeros(1, dtype=bounds.dtype, device=u.device)
    num_heavy = bounds[0:1]
    act = gather_gemm(u, order, zero, num_heavy, w.gate_up, swiglu=True)
    splits = scatter_splits(T, w.down, u.device)
    parts = torch.zeros(splits, T, H, dtype=torch.float32, device=u.device)
    scatter_gemm(act, order, zero, num_heavy, w.down, parts)
    heavy = (parts[0] if splits == 1 else parts.sum(0)).to(u.dtype)
    if all_reduce is not None:
        heavy = all_reduce(heavy)
    light = F.linear(F.linear(u, w.light_down), w.light_up)
    y = torch.where((route == HEAVY).unsqueeze(-1), heavy, light)
    if is_padding is not None:
        y = y.masked_fill((route == PADDING).unsqueeze(-1), 0)
    return y, scores, bounds
