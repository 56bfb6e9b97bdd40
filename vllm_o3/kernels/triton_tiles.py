"""Pieces shared by the Triton GEMMs: the interpreter's dot, dot precision,
split-K sizing."""

from __future__ import annotations

import os

import torch

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
