"""The router's head and the row partition on the GPU, in one launch.

After the router's first layer (a float32 GEMM by the library), one program
walks the rows in blocks: silu, the second layer, sigmoid, the threshold and
vLLM's padding mask give each row's score and route, and a running prefix sum
lists the heavy rows in row order. All on the device: no host sync, so CUDA
graphs capture it. Its plain PyTorch definition is `routing.router_scores_torch`,
`routing.routes_torch` and `routing.partition_rows` (float32 throughout, as
O3_SPEC section 1 prescribes); the tests compare the two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vllm_o3.kernels.routing import HEAVY, LIGHT, PADDING

BLOCK_T = 64


@triton.jit
def _route_rows_kernel(
    hidden_ptr,
    w2_ptr,
    b2_ptr,
    padding_ptr,
    scores_ptr,
    route_ptr,
    order_ptr,
    marks_ptr,
    T,
    R,
    stride_h,
    threshold,
    HAS_PADDING: tl.constexpr,
    HEAVY_CODE: tl.constexpr,
    LIGHT_CODE: tl.constexpr,
    PADDING_CODE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    w2 = tl.load(w2_ptr + r, mask=r_ok, other=0.0)
    b2 = tl.load(b2_ptr)
    num_heavy = tl.zeros((), dtype=tl.int32)
    num_real = tl.zeros((), dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        ok = rows < T
        h = tl.load(
            hidden_ptr + rows[:, None] * stride_h + r[None, :],
            mask=ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        logit = tl.sum(h * tl.sigmoid(h) * w2[None, :], axis=1) + b2
        score = tl.sigmoid(logit)
        real = ok
        if HAS_PADDING:
            real = ok & (tl.load(padding_ptr + rows, mask=ok, other=1) == 0)
        heavy = real & (score >= threshold)
        route = tl.where(heavy, HEAVY_CODE, tl.where(real, LIGHT_CODE, PADDING_CODE))
        tl.store(scores_ptr + rows, score, mask=ok)
        tl.store(route_ptr + rows, route.to(tl.int8), mask=ok)
        is_heavy = heavy.to(tl.int32)
        position = num_heavy + tl.cumsum(is_heavy, axis=0) - is_heavy
        tl.store(order_ptr + position, rows.to(tl.int64), mask=heavy)
        num_heavy += tl.sum(is_heavy, axis=0)
        num_real += tl.sum(real.to(tl.int32), axis=0)
    tl.store(marks_ptr, 0)
    tl.store(marks_ptr + 1, num_heavy.to(tl.int64))
    tl.store(marks_ptr + 2, num_real.to(tl.int64))


def route_rows(
    u: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor,
    threshold: float,
    is_padding: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float32 scores [T], int8 routes [T], order [T], marks [3]) for `u`
    [T, H]: `order[:num_heavy]` lists the heavy rows in row order (the rest
    of `order` is unspecified) and `marks` is [0, num_heavy, num_real] on the
    device. Router weights are float32."""
    T = u.shape[0]
    R = fc1_weight.shape[0]
    hidden = F.linear(u.float(), fc1_weight, fc1_bias)
    scores = torch.empty(T, dtype=torch.float32, device=u.device)
    route = torch.empty(T, dtype=torch.int8, device=u.device)
    order = torch.empty(T, dtype=torch.int64, device=u.device)
    marks = torch.empty(3, dtype=torch.int64, device=u.device)
    _route_rows_kernel[(1,)](
        hidden, fc2_weight, fc2_bias,
        is_padding if is_padding is not None else route,
        scores, route, order, marks, T, R, hidden.stride(0), float(threshold),
        HAS_PADDING=is_padding is not None,
        HEAVY_CODE=HEAVY, LIGHT_CODE=LIGHT, PADDING_CODE=PADDING,
        BLOCK_T=BLOCK_T, BLOCK_R=max(16, triton.next_power_of_2(R)),
    )  # fmt: skip
    return scores, route, order, marks
