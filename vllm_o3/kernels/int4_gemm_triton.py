"""W4A16 GEMM in Triton, on the checkpoint's own GPTQ-style layout: for GPUs
where vLLM's mixed-precision kernel selection has no kernel for a layer.

y = x @ W^T with W given as `qweight` [K/8, N] (eight 4-bit values per int32
along K), `scales` [K/G, N] and, asymmetric, `qzeros` [K/G, N/8]
(int4_format). Each program dequantizes a [BLOCK_K, BLOCK_N] tile of W^T in
registers (one group per tile: BLOCK_K divides G) and feeds it to `tl.dot`, so
the weight is read once in 4 bits. Few rows leave most of the GPU idle, so K is
split across programs (float32 partial sums, added after) until there are
about two programs per multiprocessor.

`int4_format.dequantize` followed by a 16-bit matmul is its reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_o3.kernels.triton_tiles import (
    UPCAST_DOT,
    dot_precision,
    multiprocessors,
    num_splits,
)


@triton.jit
def dequantized_tile(
    qweight_ptr,
    scales_ptr,
    qzeros_ptr,
    k0,
    n,
    n_ok,
    stride_q,
    stride_s,
    stride_z,
    GROUP_SIZE: tl.constexpr,
    SYM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Rows k0 .. k0 + BLOCK_K of W^T, columns `n`, in float32 ([BLOCK_K,
    BLOCK_N]), from `qweight` [K/8, N], `scales` [K/G, N] and (asymmetric)
    `qzeros` [K/G, N/8]; the rows lie in one quantization group."""
    kp = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    packed = tl.load(
        qweight_ptr + kp[:, None] * stride_q + n[None, :], mask=n_ok[None, :], other=0
    )
    shifts = tl.arange(0, 8) * 4
    q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [BK/8, 8, BN]
    q = tl.reshape(q, (BLOCK_K, BLOCK_N))  # row 8 i + j: nibble j of word i
    g = k0 // GROUP_SIZE
    scale = tl.load(scales_ptr + g * stride_s + n, mask=n_ok, other=0.0)
    if SYM:
        w = (q - 8).to(tl.float32)
    else:
        zp = tl.load(qzeros_ptr + g * stride_z + n // 8, mask=n_ok, other=0)
        zero = (zp >> ((n % 8) * 4)) & 0xF
        w = (q - zero[None, :]).to(tl.float32)
    return w * scale.to(tl.float32)[None, :]


@triton.jit
def _int4_gemm_kernel(
    x_ptr,
    qweight_ptr,
    scales_ptr,
    qzeros_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_x,
    stride_q,
    stride_s,
    stride_z,
    stride_split,
    stride_out,
    GROUP_SIZE: tl.constexpr,
    SYM: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_ok = m < M
    n_ok = n < N
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            x_ptr + m[:, None] * stride_x + k[None, :], mask=m_ok[:, None], other=0.0
        )
        w = dequantized_tile(
            qweight_ptr, scales_ptr, qzeros_ptr, k0, n, n_ok,
            stride_q, stride_s, stride_z, GROUP_SIZE, SYM, BLOCK_K, BLOCK_N,
        )  # fmt: skip
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), w.to(x_ptr.dtype.element_ty).to(tl.float32))
        else:
            acc += tl.dot(a, w.to(x_ptr.dtype.element_ty), input_precision=PRECISION)
    out = out_ptr + split * stride_split + m[:, None] * stride_out + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tile_config(rows: int) -> TileConfig:
    """Tiles by the number of rows: decode sizes read the weight once with
    narrow row tiles; prefill sizes take the tensor cores' large tiles."""
    if rows <= 16:
        return TileConfig(16, 64, 128, 4, 4)
    if rows <= 64:
        return TileConfig(64, 64, 64, 4, 4)
    return TileConfig(128, 128, 64, 8, 3)


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor | None,
    config: TileConfig | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """x [M, K] (16-bit) times the INT4 weight, [M, N] in x's dtype.
    `config` and `splits` override the choice by size (benchmarks, tests)."""
    M, K = x.shape
    N = qweight.shape[1]
    group_size = K // scales.shape[0]
    if qweight.shape[0] * 8 != K:
        raise ValueError(
            f"input has {K} features, the INT4 weight takes {qweight.shape[0] * 8}"
        )
    cfg = config or tile_config(M)
    block_k = min(cfg.block_k, group_size)
    grid_m, grid_n = triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n)
    k_blocks = K // block_k
    if splits is None:
        splits = num_splits(grid_m * grid_n, k_blocks, multiprocessors(x.device))
    k_per_split = triton.cdiv(k_blocks, splits) * block_k
    splits = triton.cdiv(K, k_per_split)
    if splits == 1:
        out = torch.empty(1, M, N, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    if M == 0:
        return out[0]
    _int4_gemm_kernel[(grid_m, grid_n, splits)](
        x, qweight, scales, qweight if qzeros is None else qzeros, out,
        M, N, K, k_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0),
        0 if qzeros is None else qzeros.stride(0), out.stride(0), out.stride(1),
        GROUP_SIZE=group_size, SYM=qzeros is None, UPCAST=UPCAST_DOT,
        PRECISION=dot_precision(x.dtype),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out[0] if splits == 1 else out.sum(0).to(x.dtype)


@torch.library.custom_op("o3::int4_gemm_triton", mutates_args=())
def int4_gemm_op(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    qzeros: torch.Tensor | None,
) -> torch.Tensor:
    """`int4_gemm` as one operation opaque to torch.compile: its tiles and
    splits are chosen per call from the number of rows."""
    return int4_gemm(x, qweight, scales, qzeros)


@int4_gemm_op.register_fake
def _(x, qweight, scales, qzeros):
    return x.new_empty(x.shape[0], qweight.shape[1])
