"""Pieces shared by the Triton GEMMs: dot precision, split-K sizing, and the
INT4 weight tile dequantized in registers from o3_int4's layout."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's interpreter (3.9) computes 16-bit tl.dot wrongly; under it the
# operands are upcast first, which gives the products a GPU's 16-bit dot gives
# (exact in float32) with float32 accumulation as on the GPU.
UPCAST_DOT = os.environ.get("TRITON_INTERPRET") == "1"


def dot_precision(dtype: torch.dtype) -> str | None:
    """float32 operands multiply in IEEE float32, as torch's matmul does by
    default (Triton's default for them is TF32); 16-bit ones natively."""
    return "ieee" if dtype == torch.float32 else None


def multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # Triton's interpreter on the CPU: still exercise split-K


def num_splits(tiles: int, k_blocks: int, multiprocessors: int) -> int:
    """Splits of K that give about two programs per multiprocessor, each with
    at least four blocks of K."""
    want = -(-2 * multiprocessors // tiles)
    return max(1, min(want, k_blocks // 4))


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
