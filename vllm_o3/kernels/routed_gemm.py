"""GEMMs over a device-side slice of permuted rows, for the routed FFN on GPUs.

`order` lists row indices grouped by route and `start`/`end` are one-element
device tensors, so the number of rows a call computes is known only on the
device: the grid is sized for all T rows and blocks past `end` exit at once.
That keeps the whole routed FFN free of host syncs, so CUDA graphs capture it.

- `gather_gemm`: out[m - start] = act(x[order[m]] @ W^T) for m in [start, end)
  (act: none, or SwiGLU over a merged [gate; up] weight).
- `scatter_gemm`: y[order[m]] = a[m - start] @ W^T for m in [start, end).

Each has its plain PyTorch reference beside it. (An INT4 variant, the weight
dequantized tile by tile as `int4_gemm_triton` does, was measured slower than
this 16-bit one at every row count on an H200: docs/bench_gpu_kernels.md.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from vllm_o3.kernels.triton_tiles import (
    UPCAST_DOT,
    dot_precision,
    multiprocessors,
    num_splits,
)

BLOCK_K = 64


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def tiles_for(rows: int, swiglu: bool = False) -> Tiles:
    """Narrow row tiles at decode sizes; at prefill sizes the large tiles the
    tensor cores need (SwiGLU keeps two accumulators: half as wide)."""
    if rows <= 16:
        return Tiles(16, 64, 4, 3)
    if rows <= 128:
        return Tiles(64, 64, 4, 3)
    return Tiles(128, 64 if swiglu else 128, 8, 3)


@triton.jit
def _weight_tile(w_ptr, k0, n, n_ok, K, stride_w, BLOCK_K: tl.constexpr):
    """[BLOCK_K, BLOCK_N] of W^T for a row-major [N, K] W, masked past K."""
    k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(
        w_ptr + n[None, :] * stride_w + k[:, None],
        mask=n_ok[None, :] & (k < K)[:, None],
        other=0.0,
    )


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
    PRECISION: tl.constexpr,
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
        a = tl.load(
            x_ptr + rows[:, None] * stride_x + k[None, :],
            mask=m_ok[:, None] & (k < K)[None, :],
            other=0.0,
        )
        w = _weight_tile(w_ptr, k0, n, n_ok, K, stride_w, BLOCK_K)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=PRECISION)
        if SWIGLU:
            w_up = _weight_tile(w_ptr, k0, N + n, n_ok, K, stride_w, BLOCK_K)
            if UPCAST:
                w_up = w_up.to(tl.float32)
            acc_up += tl.dot(a, w_up, input_precision=PRECISION)
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
    t = tiles_for(T, swiglu)
    grid = (triton.cdiv(T, t.block_m), triton.cdiv(N, t.block_n))
    _gather_gemm_kernel[grid](
        x, order, start, end, weight, out, N, K,
        x.stride(0), weight.stride(0), out.stride(0),
        SWIGLU=swiglu, UPCAST=UPCAST_DOT, PRECISION=dot_precision(x.dtype),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=BLOCK_K,
        num_warps=t.num_warps, num_stages=t.num_stages,
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
    k_per_split,
    stride_a,
    stride_w,
    stride_split,
    stride_y,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
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
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + (m - start)[:, None] * stride_a + k[None, :],
            mask=m_ok[:, None] & (k < K)[None, :],
            other=0.0,
        )
        w = _weight_tile(w_ptr, k0, n, n_ok, K, stride_w, BLOCK_K)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=PRECISION)
    rows = tl.load(order_ptr + m, mask=m_ok, other=0)
    out = (
        y_ptr + tl.program_id(2) * stride_split + rows[:, None] * stride_y + n[None, :]
    )
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def scatter_splits(rows: int, weight: torch.Tensor) -> int:
    """How many parts K is split into for `rows` rows: few rows make few
    programs, each running the whole of a long K (the FFN's down projection)
    one block after another."""
    N, K = weight.shape
    t = tiles_for(rows)
    tiles = triton.cdiv(rows, t.block_m) * triton.cdiv(N, t.block_n)
    return num_splits(tiles, triton.cdiv(K, BLOCK_K), multiprocessors(weight.device))


def scatter_gemm(
    a: torch.Tensor,
    order: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    weight: torch.Tensor,
    y: torch.Tensor,
) -> None:
    """y[order[m]] = a[m - start] @ weight^T for m in [start, end), in place;
    other rows of `y` are untouched. `y` is [T, N], or [S, T, N]: then K is
    split in S parts and y[s] gets part s's partial product (their sum is
    the product)."""
    T, K = a.shape
    N = weight.shape[0]
    if T == 0:
        return
    parts = y if y.dim() == 3 else y.unsqueeze(0)
    k_per_split = triton.cdiv(triton.cdiv(K, BLOCK_K), parts.shape[0]) * BLOCK_K
    t = tiles_for(T)
    grid = (triton.cdiv(T, t.block_m), triton.cdiv(N, t.block_n), parts.shape[0])
    _scatter_gemm_kernel[grid](
        a, order, start, end, weight, parts, N, K, k_per_split,
        a.stride(0), weight.stride(0), parts.stride(0), parts.stride(1),
        UPCAST=UPCAST_DOT, PRECISION=dot_precision(a.dtype),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=BLOCK_K,
        num_warps=t.num_warps, num_stages=t.num_stages,
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
