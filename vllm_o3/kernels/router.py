"""The token router on the GPU: scores and each row's route in one kernel.

Its plain PyTorch definition is `routing.router_scores_torch` followed by
`routing.routes_torch` (float32 throughout, as O3_SPEC section 1 prescribes);
the tests compare the two. Route codes are `routing.HEAVY/LIGHT/PADDING`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_o3.kernels.routing import HEAVY, LIGHT, PADDING


@triton.jit
def _router_kernel(
    u_ptr,
    w1_ptr,
    b1_ptr,
    w2_ptr,
    b2_ptr,
    padding_ptr,
    scores_ptr,
    route_ptr,
    T,
    H,
    R,
    stride_u,
    threshold,
    HAS_PADDING: tl.constexpr,
    HEAVY_CODE: tl.constexpr,
    LIGHT_CODE: tl.constexpr,
    PADDING_CODE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_H):
        k = k0 + tl.arange(0, BLOCK_H)
        k_ok = k < H
        x = tl.load(
            u_ptr + rows[:, None] * stride_u + k[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        w1t = tl.load(
            w1_ptr + r[None, :] * H + k[:, None],
            mask=r_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        acc += tl.dot(x, w1t, input_precision="ieee")
    acc += tl.load(b1_ptr + r, mask=r_ok, other=0.0)[None, :]
    hidden = acc * tl.sigmoid(acc)
    w2 = tl.load(w2_ptr + r, mask=r_ok, other=0.0)
    logit = tl.sum(hidden * w2[None, :], axis=1) + tl.load(b2_ptr)
    score = tl.sigmoid(logit)
    route = tl.where(score >= threshold, HEAVY_CODE, LIGHT_CODE)
    if HAS_PADDING:
        pad = tl.load(padding_ptr + rows, mask=row_ok, other=1)
        route = tl.where(pad != 0, PADDING_CODE, route)
    tl.store(scores_ptr + rows, score, mask=row_ok)
    tl.store(route_ptr + rows, route.to(tl.int8), mask=row_ok)


def router_scores(
    u: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor,
    threshold: float,
    is_padding: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 scores [T], int8 routes [T]) for `u` [T, H]; router weights are
    float32 and contiguous."""
    T, H = u.shape
    R = fc1_weight.shape[0]
    scores = torch.empty(T, dtype=torch.float32, device=u.device)
    route = torch.empty(T, dtype=torch.int8, device=u.device)
    if T == 0:
        return scores, route
    block_t = 16 if T <= 16 else 32
    _router_kernel[(triton.cdiv(T, block_t),)](
        u,
        fc1_weight,
        fc1_bias,
        fc2_weight,
        fc2_bias,
        is_padding if is_padding is not None else route,
        scores,
        route,
        T,
        H,
        R,
        u.stride(0),
        float(threshold),
        HAS_PADDING=is_padding is not None,
        HEAVY_CODE=HEAVY,
        LIGHT_CODE=LIGHT,
        PADDING_CODE=PADDING,
        BLOCK_T=block_t,
        BLOCK_H=64,
        BLOCK_R=max(16, triton.next_power_of_2(R)),
    )
    return scores, route
