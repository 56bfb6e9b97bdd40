"""GEMMs over a device-side slice of permuted rows, for the routed FFN on GPUs.

`order` lists row indices grouped by route and `start`/`end` are one-element
device tensors, so the number of rows a call computes is known only on the
device: the grid is sized for all T rows and blocks past `end` exit at once.
That keeps the whole routed FFN free of host syncs, so CUDA graphs capture it.

- `gather_gemm`: out[m - start] = act(x[order[m]] @ W^T) for m in [start, end)
  (act: none, or SwiGLU over a merged [gate; up] weight).
- `scatter_gemm`: y[order[m]] = a[m - start] @ W^T for m in [start, end).

W is 16-bit [N, K], or an `Int4Weight` (o3_int4's layout, dequantized tile by
tile in registers): the heavy rows of an INT4 model read the 4-bit weight.
Each GEMM has its plain PyTorch reference beside it.
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
    weight_tile,
)
from vllm_o3.quantization.int4_format import Int4Weight, dequantize

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


class WeightArgs(NamedTuple):
    """A weight as the kernels take it (`weight_tile`'s arguments)."""

    w: torch.Tensor
    scales: torch.Tensor
    qzeros: torch.Tensor
    stride_w: int
    stride_s: int
    stride_z: int
    int4: bool
    group_size: int
    sym: bool
    block_k: int
    out_features: int
    in_features: int


def weight_args(weight: torch.Tensor | Int4Weight) -> WeightArgs:
    if isinstance(weight, Int4Weight):
        q, s, z = weight.qweight, weight.scales, weight.qzeros
        group_size = weight.group_size
        return WeightArgs(
            q, s, q if z is None else z, q.stride(0), s.stride(0),
            0 if z is None else z.stride(0), True, group_size, z is None,
            min(BLOCK_K, group_size), q.shape[1], q.shape[0] * 8,
        )  # fmt: skip
    return WeightArgs(
        weight, weight, weight, weight.stride(0), 0, 0, False, 1, True, BLOCK_K,
        weight.shape[0], weight.shape[1],
    )  # fmt: skip


def dense_weight(weight: torch.Tensor | Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight in `dtype`: what the references multiply by."""
    if isinstance(weight, Int4Weight):
        return dequantize(weight, dtype)
    return weight


@triton.jit
def _gather_gemm_kernel(
    x_ptr,
    order_ptr,
    start_ptr,
    end_ptr,
    w_ptr,
    scales_ptr,
    qzeros_ptr,
    out_ptr,
    N,
    K,
    stride_x,
    stride_w,
    stride_s,
    stride_z,
    stride_out,
    SWIGLU: tl.constexpr,
    INT4: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    SYM: tl.constexpr,
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
    dtype = x_ptr.dtype.element_ty
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
        w = weight_tile(
            w_ptr, scales_ptr, qzeros_ptr, k0, n, n_ok, K, stride_w, stride_s,
            stride_z, INT4, GROUP_SIZE, SYM, BLOCK_K, BLOCK_N,
        ).to(dtype)  # fmt: skip
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=PRECISION)
        if SWIGLU:
            w_up = weight_tile(
                w_ptr, scales_ptr, qzeros_ptr, k0, N + n, n_ok, K, stride_w,
                stride_s, stride_z, INT4, GROUP_SIZE, SYM, BLOCK_K, BLOCK_N,
            ).to(dtype)  # fmt: skip
            acc_up += tl.dot(
                a, w_up.to(tl.float32) if UPCAST else w_up, input_precision=PRECISION
            )
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    out = out_ptr + (m - start)[:, None] * stride_out + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gather_gemm(
    x: torch.Tensor,
    order: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    weight: torch.Tensor | Int4Weight,
    swiglu: bool = False,
) -> torch.Tensor:
    """Rows `order[start:end]` of `x` times `weight`^T, compacted into the first
    rows of a [T, N] result (rows past `end - start` are left uninitialised).
    With `swiglu`, `weight` has 2N outputs (gate rows, then up rows)."""
    w = weight_args(weight)
    T, K = x.shape
    N = w.out_features // 2 if swiglu else w.out_features
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    t = tiles_for(T, swiglu)
    grid = (triton.cdiv(T, t.block_m), triton.cdiv(N, t.block_n))
    _gather_gemm_kernel[grid](
        x, order, start, end, w.w, w.scales, w.qzeros, out, N, K,
        x.stride(0), w.stride_w, w.stride_s, w.stride_z, out.stride(0),
        SWIGLU=swiglu, INT4=w.int4, GROUP_SIZE=w.group_size, SYM=w.sym,
        UPCAST=UPCAST_DOT, PRECISION=dot_precision(x.dtype),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=w.block_k,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return out


def gather_gemm_reference(
    x: torch.Tensor,
    order: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    weight: torch.Tensor | Int4Weight,
    swiglu: bool = False,
) -> torch.Tensor:
    rows = order[int(start) : int(end)]
    y = x[rows].float() @ dense_weight(weight, x.dtype).float().t()
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
    scales_ptr,
    qzeros_ptr,
    y_ptr,
    N,
    K,
    k_per_split,
    stride_a,
    stride_w,
    stride_s,
    stride_z,
    stride_split,
    stride_y,
    INT4: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    SYM: tl.constexpr,
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
        w = weight_tile(
            w_ptr, scales_ptr, qzeros_ptr, k0, n, n_ok, K, stride_w, stride_s,
            stride_z, INT4, GROUP_SIZE, SYM, BLOCK_K, BLOCK_N,
        ).to(a_ptr.dtype.element_ty)  # fmt: skip
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=PRECISION)
    rows = tl.load(order_ptr + m, mask=m_ok, other=0)
    out = (
        y_ptr + tl.program_id(2) * stride_split + rows[:, None] * stride_y + n[None, :]
    )
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def scatter_splits(rows: int, weight: torch.Tensor | Int4Weight, device) -> int:
    """How many parts K is split into for `rows` rows: few rows make few
    programs, each running the whole of a long K (the FFN's down projection)
    one block after another."""
    w = weight_args(weight)
    t = tiles_for(rows)
    tiles = triton.cdiv(rows, t.block_m) * triton.cdiv(w.out_features, t.block_n)
    k_blocks = triton.cdiv(w.in_features, w.block_k)
    return num_splits(tiles, k_blocks, multiprocessors(device))


def scatter_gemm(
    a: torch.Tensor,
    order: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    weight: torch.Tensor | Int4Weight,
    y: torch.Tensor,
) -> None:
    """y[order[m]] = a[m - start] @ weight^T for m in [start, end), in place;
    other rows of `y` are untouched. `y` is [T, N], or [S, T, N]: then K is
    split in S parts and y[s] gets part s's partial product (their sum is
    the product)."""
    w = weight_args(weight)
    T, K = a.shape
    N = w.out_features
    if T == 0:
        return
    parts = y if y.dim() == 3 else y.unsqueeze(0)
    k_per_split = triton.cdiv(triton.cdiv(K, w.block_k), parts.shape[0]) * w.block_k
    t = tiles_for(T)
    grid = (triton.cdiv(T, t.block_m), triton.cdiv(N, t.block_n), parts.shape[0])
    _scatter_gemm_kernel[grid](
        a, order, start, end, w.w, w.scales, w.qzeros, parts, N, K, k_per_split,
        a.stride(0), w.stride_w, w.stride_s, w.stride_z, parts.stride(0),
        parts.stride(1), INT4=w.int4, GROUP_SIZE=w.group_size, SYM=w.sym,
        UPCAST=UPCAST_DOT, PRECISION=dot_precision(a.dtype),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=w.block_k,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip


def scatter_gemm_reference(
    a: torch.Tensor,
    order: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    weight: torch.Tensor | Int4Weight,
    y: torch.Tensor,
) -> None:
    rows = order[int(start) : int(end)]
    w = dense_weight(weight, a.dtype).float()
    y[rows] = (a[: rows.numel()].float() @ w.t()).to(y.dtype)
