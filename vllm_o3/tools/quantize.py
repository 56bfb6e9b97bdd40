"""`vllm-o3 quantize`: a 16-bit O3 checkpoint to `o3_int4` (O3_SPEC section 4).

Round-to-nearest per group: the default and, for now, the only method. Every
other tensor is copied unchanged, as are the tokenizer and generation files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import save_file
from tqdm import tqdm

from vllm_o3.model.checkpoint import check_checkpoint_folder, dense_state_dict
from vllm_o3.model.config import O3Config
from vllm_o3.quantization.int4_format import (
    FFN_PROJECTIONS,
    QUANT_METHOD,
    largest_group_size,
    quantize,
)
from vllm_o3.tools.output import atomic_output_dir

WEIGHT_FILES = ("config.json", "model.safetensors.index.json")


def quantize_checkpoint(
    src: str | Path,
    out: str | Path,
    group_size: int | None = None,
    sym: bool = True,
    overwrite: bool = False,
) -> Path:
    """Write `out`: `src` with its FFN projections in INT4; `group_size`
    None takes the largest that divides the FFN's input sizes."""
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
        packed = quantize(tensors.pop(name), group_size, sym)
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
