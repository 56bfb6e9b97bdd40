"""GEMMs over a device-side slice of permuted rows, for the routed FFN on GPUs.

`order` lists row indices grouped by route and `start`/`end` are one-element
device tensors, so the number of rows a call computes is known only on the
device: the grid is sized for all T rows and blocks past `end` exit at once.
That keeps the whole routed FFN free of host syncs, so CUDA graphs capture it.

- `gather_gemm`: out[m - start] = act(x[order[m]] @ W^T) for m in [start, end)
  (act: none, or SwiGLU over a merged [gate; up] weight).
- `scatter_gemm`: y[order[m]] = a[m - start] @ W^T for m in [start, end).

Each has its plain PyTorch reference beside it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_N = 64
BLOCK_K = 64
# Triton's interpreter (3.9) computes 16-bit tl.dot wrongly; under it the
# operands are upcast first, which gives the products a GPU's 16-bit dot gives
# (exact in float32) with float32 accumulation as on the GPU.
UPCAST_DOT = os.environ.get("TRITON_INTERPRET") == "1"


def _block_m(rows: int) -> int:
    return 16 if rows <= 16 else 64


@triton.jit
def _gather_gemm_kernel(
    x_ptr,
    order_ptr,
    start_ptr,
    end_ptr,
    w_ptr,
    out_ptr,
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    SWIGLU: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    start = tl.load(start_ptr)
    end = tl.load(end_ptr)
    m0 = start + tl.program_id(0) * BLOCK_M
    if m0 >= end:
        return
    m = m0 + tl.arange(0, BLOCK_M)
    m_ok = m < end
    rows = tl.load(order_ptr + m, mask=m_ok, other=0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SWIGLU:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(
            x_ptr + rows[:, None] * stride_x + k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            a = a.to(tl.float32)
        w_mask = n_ok[None, :] & k_ok[:, None]
        w = tl.load(w_ptr + n[None, :] * stride_w + k[:, None], mask=w_mask, other=0.0)
        acc += tl.dot(a, w.to(tl.float32) if UPCAST else w)
        if SWIGLU:
            w_up = tl.load(
                w_ptr + (N + n)[None, :] * stride_w + k[:, None], mask=w_mask, other=0.0
            )
            acc_up += tl.dot(a, w_up.to(tl.float32) if UPCAST else w_up)
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    out = out_ptr + (m - start)[:, None] * stride_out + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gather_gemm(
    x: torch.Tensor,
    order: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    weight: torch.Tensor,
    swiglu: bool = False,
) -> torch.Tensor:
    """Rows `order[start:end]` of `x` times `weight`^T, compacted into the first
    rows of a [T, N] result (rows past `end - start` are left uninitialised).
    With `swiglu`, `weight` is [2N, K] (gate rows, then up rows)."""
    T, K = x.shape
    N = weight.shape[0] // 2 if swiglu else weight.shape[0]
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    block_m = _block_m(T)
    grid = (triton.cdiv(T, block_m), triton.cdiv(N, BLOCK_N))
    _gather_gemm_kernel[grid](
        x, order, start, end, weight, out, N, K,
        x.stride(0), weight.stride(0), out.stride(0),
        SWIGLU=swiglu, UPCAST=UPCAST_DOT,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out


def gather_gemm_reference(
    x: torch.Tensor,
    order: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    weight: torch.Tensor,
    swiglu: bool = False,
) -> torch.Tensor:
    rows = order[int(start) : int(end)]
    y = x[rows].float() @ weight.float().t()
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    out = torch.zeros(x.shape[0], y.shape[1], dtype=x.dtype, device=x.device)
    out[: rows.numel()] = y.to(x.dtype)
    return out


@triton.jit
def _scatter_gemm_kernel(
    a_ptr,
    order_ptr,
    start_ptr,
    end_ptr,
    w_ptr,
    y_ptr,
    N,
    K,
    stride_a,
    stride_w,
    stride_y,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    start = tl.load(start_ptr)
    end = tl.load(end_ptr)
    m0 = start + tl.program_id(0) * BLOCK_M
    if m0 >= end:
        return
    m = m0 + tl.arange(0, BLOCK_M)
    m_ok = m < end
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(
            a_ptr + (m - start)[:, None] * stride_a + k[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + n[None, :] * stride_w + k[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, w)
    rows = tl.load(order_ptr + m, mask=m_ok, other=0)
    out = y_ptr + rows[:, None] * stride_y + n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def scatter_gemm(
    a: torch.Tensor,
    order: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
) -> None:
    """y[order[m]] = a[m - start] @ weight^T for m in [start, end), in place;
    other rows of `y` are untouched."""
    T, K = a.shape
    N = weight.shape[0]
    if T == 0:
        return
    block_m = _block_m(T)
    grid = (triton.cdiv(T, block_m), triton.cdiv(N, BLOCK_N))
    _scatter_gemm_kernel[grid](
        a, order, start, end, weight, y, N, K,
        a.stride(0), weight.stride(0), y.stride(0), UPCAST=UPCAST_DOT,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip


def scatter_gemm_reference(
    a: torch.Tensor,
    order: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
) -> None:
    rows = order[int(start) : int(end)]
    y[rows] = (a[: rows.numel()].float() @ weight.float().t()).to(y.dtype)
