"""GPTQ (Frantar et al., 2022) for `o3_int4`: round the input columns of a
weight one at a time and spread each column's rounding error over the
columns not yet rounded, weighted by the inverse Hessian of the layer's
inputs (H = X^T X over calibration tokens), so the layer's outputs on such
inputs move as little as the 4-bit grid allows. Same tensors as
round-to-nearest; only the chosen values differ.
"""

from __future__ import annotations

import torch

from vllm_o3.quantization.int4_format import (
    Int4Weight,
    check_shape,
    group_params,
    pack_quantized,
    round_to_grid,
)


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    group_size: int,
    sym: bool,
    damp: float = 0.01,
    block: int = 128,
) -> Int4Weight:
    """A [out, in] weight quantized against `hessian` [in, in]. A group's
    scale and zero are taken when its first column is reached, from the
    weights as updated by then; `damp` (a share of the mean diagonal) keeps
    the Hessian invertible."""
    out_features, in_features = weight.shape
    check_shape("weight", in_features, out_features, group_size, sym)
    w = weight.float().clone()
    h = hessian.float().clone()
    dead = torch.diag(h) == 0  # inputs never seen: their weights do not matter
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.diag(h).mean() * torch.eye(in_features)
    h_inv = torch.linalg.cholesky(
        torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True
    )
    groups = in_features // group_size
    q = torch.empty(out_features, in_features)
    scales = torch.empty(groups, out_features, dtype=weight.dtype)
    zeros = torch.empty(groups, out_features)
    for start in range(0, in_features, block):
        end = min(start + block, in_features)
        errors = torch.empty(out_features, end - start)
        for col in range(start, end):
            g = col // group_size
            if col % group_size == 0:
                scales[g], zeros[g] = group_params(
                    w[:, col : col + group_size].t(), sym, weight.dtype
                )
            column = w[:, col]
            q[:, col] = round_to_grid(column, scales[g], zeros[g])
            rounded = (q[:, col] - zeros[g]) * scales[g].float()
            error = (column - rounded) / h_inv[col, col]
            w[:, col:end] -= error.unsqueeze(1) * h_inv[col, col:end].unsqueeze(0)
            errors[:, col - start] = error
        w[:, end:] -= errors @ h_inv[start:end, end:]
    return pack_quantized(q.t().contiguous(), scales, zeros, sym)
