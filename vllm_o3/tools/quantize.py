"""`vllm-o3 quantize`: a 16-bit O3 checkpoint to `o3_int4` (O3_SPEC section 4).

Round-to-nearest per group (the default: no calibration text needed), or
GPTQ against the Hessians of the FFN inputs over calibration text (on the
default model it leaves a fifth to a third of round-to-nearest's
perplexity increase, docs/bench_int4_quality.md). Every other tensor is copied
unchanged, as are the tokenizer and generation files.
"""

from __future__ import annotations

import shutil
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
    largest_group_size,
    quantize,
)
from vllm_o3.tools.output import atomic_output_dir

WEIGHT_FILES = ("config.json", "model.safetensors.index.json")


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


@torch.no_grad()
def ffn_input_hessians(src: Path, windows: list[list[int]]) -> dict[str, torch.Tensor]:
    """X^T X of the inputs of every FFN projection (by checkpoint name, without
    `.weight`) over `windows` of token ids, through the reference model in
    float32: the tokens each projection actually sees (heavy ones, in routed
    layers). gate_proj and up_proj read the same input: one product serves
    both."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
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
    try:
        for window in tqdm(windows, desc="calibration windows"):
            model(torch.tensor([window]))
    finally:
        for hook in hooks:
            hook.remove()
    for name in [n for n in hessians if n.endswith("mlp.gate_proj")]:
        hessians[name.removesuffix("gate_proj") + "up_proj"] = hessians[name]
    return hessians


def quantize_checkpoint(
    src: str | Path,
    out: str | Path,
    group_size: int | None = None,
    sym: bool = True,
    overwrite: bool = False,
    hessians: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `out`: `src` with its FFN projections in INT4; `group_size`
    None takes the largest that divides the FFN's input sizes. With
    `hessians` (`ffn_input_hessians` of `src` over calibration text), GPTQ;
    without, round-to-nearest."""
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
    for name in tqdm(ffn, desc="quantizing FFN projections"):
        base = name.removesuffix(".weight")
        weight = tensors.pop(name)
        if hessians is not None:
            if base not in hessians:
                raise ValueError(f"{src}: calibration never reached {base}")
            packed = gptq_quantize(weight, hessians[base], group_size, sym)
        else:
            packed = quantize(weight, group_size, sym)
        tensors[f"{base}.qweight"] = packed.qweight
        tensors[f"{base}.scales"] = packed.scales
        if packed.qzeros is not None:
            tensors[f"{base}.qzeros"] = packed.qzeros
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
