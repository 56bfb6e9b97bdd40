"""The `o3_int4` tensor format (O3_SPEC section 4) in plain PyTorch.

Per projection with a [out, in] weight W, groups of `group_size` along `in`:

- `qweight` int32 [in/8, out]: eight 4-bit values per int32 along `in`,
  lowest nibble first;
- `scales` [in/group_size, out] in the model dtype;
- `qzeros` int32 [in/group_size, out/8] (asymmetric only): the zero points,
  eight per int32 along `out`, lowest nibble first. They hold the zero point
  itself (as GPTQ v2 and AWQ do), not zero-1 as GPTQ v1 does.

W[o, i] = (q[i, o] - z[g, o]) * scales[g, o] with g = i // group_size and
z = 8 when symmetric. Quantization here is round-to-nearest per group; the
converter's calibrated method produces the same format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

QUANT_METHOD = "o3_int4"
GROUP_SIZES = (32, 64, 128)
SYMMETRIC_ZERO = 8
# The quantized projections, by checkpoint name.
FFN_PROJECTIONS = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def parse_quantization_config(config: Any) -> tuple[int, bool]:
    """(group_size, sym) from config.json's `quantization_config`, refusing
    bad values by field."""
    if not isinstance(config, dict):
        raise ValueError(f"quantization_config must be a JSON object, got {config!r}")
    if config.get("quant_method") != QUANT_METHOD:
        raise ValueError(
            f"quantization_config.quant_method must be {QUANT_METHOD!r}, "
            f"got {config.get('quant_method')!r}"
        )
    bits = config.get("bits", 4)
    if bits != 4 or isinstance(bits, bool):
        raise ValueError(f"quantization_config.bits must be 4, got {bits!r}")
    group_size = config.get("group_size", 128)
    if group_size not in GROUP_SIZES or isinstance(group_size, bool):
        raise ValueError(
            f"quantization_config.group_size must be one of {GROUP_SIZES}, "
            f"got {group_size!r}"
        )
    sym = config.get("sym", True)
    if not isinstance(sym, bool):
        raise ValueError(f"quantization_config.sym must be true or false, got {sym!r}")
    return group_size, sym


@dataclass
class Int4Weight:
    """One quantized projection in the on-disk layout."""

    qweight: torch.Tensor
    scales: torch.Tensor
    qzeros: torch.Tensor | None  # None when symmetric

    @property
    def group_size(self) -> int:
        return self.qweight.shape[0] * 8 // self.scales.shape[0]


def pack_int4(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Pack 4-bit values (0..15) eight to an int32 along `dim`, lowest first."""
    values = values.to(torch.int32).movedim(dim, 0)
    if values.shape[0] % 8:
        raise ValueError(f"cannot pack {values.shape[0]} values eight to an int32")
    values = values.reshape(values.shape[0] // 8, 8, *values.shape[1:])
    packed = torch.zeros_like(values[:, 0])
    for k in range(8):
        packed |= (values[:, k] & 0xF) << (4 * k)
    return packed.movedim(0, dim).contiguous()


def unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `pack_int4`: int32 -> uint8 values 0..15, 8x longer on `dim`."""
    packed = packed.to(torch.int32).movedim(dim, 0)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    values = (packed.unsqueeze(1) >> shifts.view(1, 8, *[1] * (packed.dim() - 1))) & 0xF
    values = values.reshape(packed.shape[0] * 8, *packed.shape[1:])
    return values.to(torch.uint8).movedim(0, dim).contiguous()


def check_shape(
    name: str, in_features: int, out_features: int, group_size: int, sym: bool
) -> None:
    """Refuse a layer the format cannot hold, naming it."""
    if group_size not in GROUP_SIZES:
        raise ValueError(
            f"{name}: group_size must be one of {GROUP_SIZES}, got {group_size}"
        )
    if in_features % group_size:
        raise ValueError(
            f"{name}: group_size {group_size} does not divide the input size "
            f"{in_features}"
        )
    if not sym and out_features % 8:
        raise ValueError(
            f"{name}: output size {out_features} is not a multiple of 8 (asymmetric "
            "zero points are packed eight to an int32 along the output)"
        )


def largest_group_size(name: str, *in_sizes: int) -> int:
    """The largest supported group size dividing every size in `in_sizes`:
    128 where it fits, else the next that does (SmolLM2's hidden size 576
    takes 64), so models whose sizes are multiples of 32 quantize at all."""
    for group_size in sorted(GROUP_SIZES, reverse=True):
        if not any(size % group_size for size in in_sizes):
            return group_size
    raise ValueError(
        f"{name}: no group size in {GROUP_SIZES} divides the input sizes {in_sizes}"
    )


def group_params(
    w: torch.Tensor, sym: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest scales (in `dtype`, as stored) and zero points
    (float, 0..15) of weight groups `w` [..., group_size, out]."""
    if sym:
        scales = (w.abs().amax(dim=-2) / 7).clamp(min=1e-10)
        zeros = torch.full_like(scales, SYMMETRIC_ZERO)
    else:
        low, high = w.amin(dim=-2).clamp(max=0), w.amax(dim=-2).clamp(min=0)
        scales = ((high - low) / 15).clamp(min=1e-10)
        zeros = (-low / scales).round().clamp(0, 15)
    return scales.to(dtype), zeros


def round_to_grid(
    w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    """4-bit values (float, 0..15) of `w` on the grid (q - zero) * scale."""
    return (w / scales.float() + zeros).round().clamp(0, 15)


def pack_quantized(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, sym: bool
) -> Int4Weight:
    """The format's tensors from 4-bit values `q` [in, out] and per-group
    `scales`, `zeros` [in / group_size, out]."""
    return Int4Weight(
        qweight=pack_int4(q, dim=0),
        scales=scales,
        qzeros=None if sym else pack_int4(zeros, dim=1),
    )


def quantize(weight: torch.Tensor, group_size: int, sym: bool) -> Int4Weight:
    """Round-to-nearest per group of a [out, in] weight."""
    out_features, in_features = weight.shape
    check_shape("weight", in_features, out_features, group_size, sym)
    w = weight.float().t().reshape(in_features // group_size, group_size, out_features)
    # Quantize against the scales actually stored.
    scales, zeros = group_params(w, sym, weight.dtype)
    q = round_to_grid(w, scales.unsqueeze(1), zeros.unsqueeze(1))
    return pack_quantized(q.reshape(in_features, out_features), scales, zeros, sym)


def dequantize(packed: Int4Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The [out, in] weight the format encodes."""
    q = unpack_int4(packed.qweight, dim=0).float()  # [in, out]
    in_features, out_features = q.shape
    group_size = packed.group_size
    if packed.qzeros is None:
        zeros = torch.full_like(packed.scales, SYMMETRIC_ZERO, dtype=torch.float32)
    else:
        zeros = unpack_int4(packed.qzeros, dim=1).float()
    q = q.reshape(in_features // group_size, group_size, out_features)
    w = (q - zeros.unsqueeze(1)) * packed.scales.float().unsqueeze(1)
    return w.reshape(in_features, out_features).t().to(dtype or packed.scales.dtype)
