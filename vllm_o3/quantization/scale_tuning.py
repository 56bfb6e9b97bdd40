"""End-to-end tuning of `o3_int4` group scales after GPTQ: every FFN
projection's 4-bit values and zero points stay as GPTQ chose them, and their
per-group scales train against the 16-bit model's next-token distribution
(the KL of `vllm_o3.tools.distill`) over the calibration text.

GPTQ fits each projection's outputs on its own; the errors it leaves add up
through 30 layers. On the default model, two passes over the 121 calibration
windows took the held-out perplexity increase through vLLM from +3.04 % to
+0.63 % (group 32 asymmetric), +4.63 % to +1.81 % (group 64 asymmetric),
+8.26 % to +4.18 % (group 64 symmetric): docs/bench_int4_quality.md. Same
tensors as GPTQ: only the scales move.
"""

from __future__ import annotations

import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn
from tqdm import tqdm

from vllm_o3.quantization.int4_format import Int4Weight, dequantize
from vllm_o3.tools.distill import TeacherCache, kl_step

# Adam on log scales moves each by about this share per step.
LEARNING_RATE = 1e-3


class GroupScales(nn.Module):
    """A projection's [out, in] weight as (q - zero) * scale of its group,
    the scales trained in log space so that they stay positive."""

    def __init__(self, packed: Int4Weight) -> None:
        super().__init__()
        self.group_size = packed.group_size
        # q - zero, [out, in]: the format's weight with every scale 1.
        unit = Int4Weight(packed.qweight, torch.ones_like(packed.scales), packed.qzeros)
        self.register_buffer("codes", dequantize(unit, torch.float32).contiguous())
        self.log_scales = nn.Parameter(packed.scales.float().log().t().contiguous())
        self.dtype = packed.scales.dtype

    def forward(self, _weight: torch.Tensor) -> torch.Tensor:
        scales = self.log_scales.exp().repeat_interleave(self.group_size, dim=1)
        return self.codes * scales

    def scales(self) -> torch.Tensor:
        """[groups, out] in the stored dtype."""
        return self.log_scales.detach().exp().t().contiguous().to(self.dtype)


def tune_scales(
    model: nn.Module,
    packed: dict[str, Int4Weight],
    windows: torch.Tensor,
    teacher: TeacherCache,
    steps: int,
    lr: float = LEARNING_RATE,
    seed: int = 0,
) -> dict[str, Int4Weight]:
    """`packed` (by projection name, as in the model's modules) with scales
    tuned over `steps` windows of `windows` [n, seq] drawn without
    replacement, pass after pass; `model` is the 16-bit model in float32,
    whose FFN weights this replaces for the duration."""
    modules = dict(model.named_modules())
    missing = sorted(set(packed) - set(modules))
    if missing:
        raise ValueError(f"no such projections in the model: {missing[:3]}")
    grids = {name: GroupScales(weight) for name, weight in packed.items()}
    for param in model.parameters():
        param.requires_grad_(False)
    for name, grid in grids.items():
        parametrize.register_parametrization(modules[name], "weight", grid, unsafe=True)
    optimizer = torch.optim.Adam([g.log_scales for g in grids.values()], lr=lr)
    generator = torch.Generator().manual_seed(seed)
    passes = -(-steps // len(windows))
    order = torch.cat(
        [torch.randperm(len(windows), generator=generator) for _ in range(passes)]
    )
    model.eval()
    try:
        progress = tqdm(order[:steps].tolist(), desc="tuning scales", unit="window")
        for i in progress:
            kl = kl_step(model, optimizer, windows, teacher, i)
            progress.set_postfix(kl=f"{kl:.4f}")
    finally:
        for name in grids:
            parametrize.remove_parametrizations(
                modules[name], "weight", leave_parametrized=False
            )
    return {
        name: Int4Weight(weight.qweight, grids[name].scales(), weight.qzeros)
        for name, weight in packed.items()
    }
