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

from vllm_o3.kernels.routed_gemm import gather_gemm, scatter_gemm
from vllm_o3.kernels.router import router_scores
from vllm_o3.kernels.routing import partition_rows
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

    `all_reduce` sums the heavy rows' partial outputs across tensor-parallel
    ranks; the light rows, computed whole on every rank, are added after it.
    """
    w = weights
    scores, route = router_scores(
        u, w.fc1_weight, w.fc1_bias, w.fc2_weight, w.fc2_bias, threshold, is_padding
    )
    order, bounds = partition_rows(route)
    zero = torch.zeros(1, dtype=bounds.dtype, device=u.device)
    num_heavy, num_real = bounds[0:1], bounds[1:2]
    y = torch.zeros_like(u)
    act = gather_gemm(u, order, zero, num_heavy, w.gate_up, swiglu=True)
    scatter_gemm(act, order, zero, num_heavy, w.down, y)
    if all_reduce is not None:
        y = all_reduce(y)
    mid = gather_gemm(u, order, num_heavy, num_real, w.light_down)
    scatter_gemm(mid, order, num_heavy, num_real, w.light_up, y)
    return y, scores, bounds
