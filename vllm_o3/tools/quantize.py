"""`vllm-o3 quantize`: a 16-bit O3 checkpoint to `o3_int4` (O3_SPEC section 4).

Round-to-nearest per group (the default: no calibration text needed), or
calibrated: GPTQ against the Hessians of the FFN inputs over calibration
text, then the group scales tuned end to end against the 16-bit model over
the same text (`vllm_o3.quantization.scale_tuning`). On the default model the
calibrated method leaves a seventh or less of round-to-nearest's perplexity
increase (docs/bench_int4_quality.md). Every other tensor is copied
unchanged, as are the tokenizer and generation files.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from vllm_o3.model.checkpoint import check_checkpoint_folder, dense_state_dict
from vllm_o3.model.config import O3Config
from vllm_o3.quantization.gptq import gptq_quantize
from vllm_o3.quantization.int4_format import (
    FFN_PROJECTIONS,
    QUANT_METHOD,
    Int4Weight,
    largest_group_size,
    quantize,
)
from vllm_o3.quantization.scale_tuning import tune_scales
from vllm_o3.tools.distill import TeacherCache, cache_teacher
from vllm_o3.tools.output import atomic_output_dir

WEIGHT_FILES = ("config.json", "model.safetensors.index.json")
# Scale tuning over the calibration windows, on the default model (group 32
# asymmetric, float32 reference): one pass took the perplexity increase from
# +3.21 % (GPTQ) to +1.52 %, two to +0.79 %.
TUNE_PASSES = 2


def calibration_windows(model: Path, count: int) -> list[list[int]]:
    """Up to `count` windows of 512 tokens from the corpora's calibration
    split, shared evenly by the four domains (121 in all)."""
    from transformers import AutoTokenizer

    from vllm_o3.tools.corpora import load_corpora
    from vllm_o3.tools.evaluate import text_windows

    tokenizer = AutoTokenizer.from_pretrained(model)
    corpora = load_corpora()
    per_domain = -(-count // len(corpora))
    windows = [
        window
        for corpus in corpora.values()
        for window in text_windows(
            tokenizer, "\n\n".join(corpus.calibration), per_domain
        )
    ]
    return windows[:count]


@dataclass
class Calibration:
    """What the calibrated method needs from the 16-bit model, in one pass
    over the calibration windows."""

    windows: torch.Tensor  # [n, seq] token ids
    hessians: dict[str, torch.Tensor]  # X^T X per FFN projection
    teacher: TeacherCache  # the 16-bit model's top-k log-probabilities


def load_float32(src: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


@torch.no_grad()
def calibrate(src: Path, windows: list[list[int]]) -> Calibration:
    """One forward pass of the reference model in float32 per window: X^T X
    of the inputs of every FFN projection (by checkpoint name, without
    `.weight`) over the tokens each actually sees (heavy ones, in routed
    layers), and the model's top-k next-token log-probabilities. gate_proj
    and up_proj read the same input: one product serves both."""
    model = load_float32(src)
    hessians: dict[str, torch.Tensor] = {}

    def accumulate(name: str):
        def hook(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            hessians[name] = hessians.get(name, 0) + x.t() @ x

        return hook

    hooks = [
        module.register_forward_pre_hook(accumulate(name))
        for name, module in model.named_modules()
        if name.endswith(("mlp.gate_proj", "mlp.down_proj"))
    ]
    ids = torch.tensor(windows)
    try:
        teacher = cache_teacher(model, ids)
    finally:
        for hook in hooks:
            hook.remove()
    for name in [n for n in hessians if n.endswith("mlp.gate_proj")]:
        hessians[name.removesuffix("gate_proj") + "up_proj"] = hessians[name]
    return Calibration(ids, hessians, teacher)


def quantize_checkpoint(
    src: str | Path,
    out: str | Path,
    group_size: int | None = None,
    sym: bool = True,
    overwrite: bool = False,
    calibration: Calibration | None = None,
    tune_steps: int | None = None,
) -> Path:
    """Write `out`: `src` with its FFN projections in INT4; `group_size`
    None takes the largest that divides the FFN's input sizes. With
    `calibration` (`calibrate` of `src`), GPTQ, then `tune_steps` windows of
    scale tuning (None: TUNE_PASSES passes over the calibration windows; 0:
    none); without, round-to-nearest."""
    src = Path(src)
    check_checkpoint_folder(src)
    config = O3Config.from_pretrained(src)
    if config.int4_format is not None:
        raise ValueError(f"{src} is already quantized ({config.quantization_config})")
    if group_size is None:
        group_size = largest_group_size(
            str(src), config.hidden_size, config.intermediate_size
        )
    config.quantization_config = {
        "quant_method": QUANT_METHOD, "bits": 4, "group_size": group_size, "sym": sym,
    }  # fmt: skip
    config.validate()  # the group size must divide the FFN's input sizes
    tensors = dense_state_dict(src, O3Config.from_pretrained(src))
    ffn = [
        n for n in tensors if n.endswith(tuple(f"{p}.weight" for p in FFN_PROJECTIONS))
    ]
    packed: dict[str, Int4Weight] = {}
    for name in tqdm(ffn, desc="quantizing FFN projections"):
        base = name.removesuffix(".weight")
        weight = tensors.pop(name)
        if calibration is not None:
            if base not in calibration.hessians:
                raise ValueError(f"{src}: calibration never reached {base}")
            hessian = calibration.hessians[base]
            packed[base] = gptq_quantize(weight, hessian, group_size, sym)
        else:
            packed[base] = quantize(weight, group_size, sym)
    if calibration is not None:
        steps = tune_steps
        if steps is None:
            steps = TUNE_PASSES * len(calibration.windows)
        if steps > 0:
            packed = tune_scales(
                load_float32(src),
                packed,
                calibration.windows,
                calibration.teacher,
                steps,
            )
    for base, weight in packed.items():
        tensors[f"{base}.qweight"] = weight.qweight
        tensors[f"{base}.scales"] = weight.scales
        if weight.qzeros is not None:
            tensors[f"{base}.qzeros"] = weight.qzeros
    with atomic_output_dir(out, overwrite=overwrite) as folder:
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        config.save_pretrained(folder)
        for path in src.iterdir():
            if (
                path.is_file()
                and path.suffix != ".safetensors"
                and path.name not in WEIGHT_FILES
            ):
                shutil.copy2(path, folder / path.name)
    return Path(out)
