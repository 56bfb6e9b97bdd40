"""The tensors an O3 checkpoint must hold (O3_SPEC section 3), and a folder check.

One table, derived from the config, serves everyone: the vLLM model checks each
tensor it loads against it, the reference checks a folder before transformers
loads it, and the tools that write checkpoints are tested against it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from vllm_o3.model.config import O3Config
from vllm_o3.quantization.int4_format import Int4Weight, dequantize


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensor."""


# Names a checkpoint may carry that no implementation needs.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expected_tensor_shapes(config: O3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor name the checkpoint of `config` must hold, with its shape."""
    H, V = config.hidden_size, config.vocab_size
    head_dim = config.head_dim
    q_out = config.num_attention_heads * head_dim
    kv_out = config.num_key_value_heads * head_dim
    intermediate = config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (V, H),
        "model.norm.weight": (H,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes.update(
            {
                f"{p}.input_layernorm.weight": (H,),
                f"{p}.post_attention_layernorm.weight": (H,),
                f"{p}.self_attn.q_proj.weight": (q_out, H),
                f"{p}.self_attn.k_proj.weight": (kv_out, H),
                f"{p}.self_attn.v_proj.weight": (kv_out, H),
                f"{p}.self_attn.o_proj.weight": (H, q_out),
            }
        )
        if config.attention_bias:
            for name, size in (("q", q_out), ("k", kv_out), ("v", kv_out), ("o", H)):
                shapes[f"{p}.self_attn.{name}_proj.bias"] = (size,)
        for name, (out_features, in_features) in (
            ("mlp.gate_proj", (intermediate, H)),
            ("mlp.up_proj", (intermediate, H)),
            ("mlp.down_proj", (H, intermediate)),
        ):
            shapes.update(
                ffn_tensor_shapes(f"{p}.{name}", out_features, in_features, config)
            )
        if config.attn_output_gate:
            shapes[f"{p}.self_attn.gate_proj.weight"] = (config.num_attention_heads, H)
        if config.is_routed(i):
            R, r = config.router_hidden_size, config.light_rank
            shapes.update(
                {
                    f"{p}.router.fc1.weight": (R, H),
                    f"{p}.router.fc1.bias": (R,),
                    f"{p}.router.fc2.weight": (1, R),
                    f"{p}.router.fc2.bias": (1,),
                    f"{p}.light.down.weight": (r, H),
                    f"{p}.light.up.weight": (H, r),
                }
            )
    return shapes


def ffn_tensor_shapes(
    name: str, out_features: int, in_features: int, config: O3Config
) -> dict[str, tuple[int, ...]]:
    """An FFN projection's tensors: 16-bit, or o3_int4's (O3_SPEC section 4)."""
    if config.int4_format is None:
        return {f"{name}.weight": (out_features, in_features)}
    group_size, sym = config.int4_format
    shapes = {
        f"{name}.qweight": (in_features // 8, out_features),
        f"{name}.scales": (in_features // group_size, out_features),
    }
    if not sym:
        shapes[f"{name}.qzeros"] = (in_features // group_size, out_features // 8)
    return shapes


def is_ignored(name: str, config: O3Config) -> bool:
    """Tensors a checkpoint may hold beyond the spec, which loaders skip."""
    if name.endswith(IGNORED_SUFFIXES):
        return True
    return name == "lm_head.weight" and config.tie_word_embeddings


def check_tensor(
    name: str, shape: tuple[int, ...], expected: dict[str, tuple[int, ...]]
) -> None:
    """Refuse a tensor the spec does not name, or one of the wrong shape."""
    if name not in expected:
        raise CheckpointError(
            f"checkpoint tensor {name!r} is not part of this O3 config "
            "(check num_hidden_layers, router_layers, attn_output_gate and "
            "attention_bias)"
        )
    if tuple(shape) != expected[name]:
        raise CheckpointError(
            f"checkpoint tensor {name!r} has shape {tuple(shape)}, "
            f"expected {expected[name]} from config.json"
        )


def check_complete(seen: set[str], expected: dict[str, tuple[int, ...]]) -> None:
    """Refuse a checkpoint that lacks tensors its config requires."""
    missing = sorted(set(expected) - seen)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise CheckpointError(
            f"checkpoint is missing {len(missing)} tensor(s) its config requires: "
            f"{shown}"
        )


def safetensors_files(folder: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint folder, in the index's order."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors file in {folder}")
    return files


def pop_int4_weights(tensors: dict[str, torch.Tensor]) -> dict[str, Int4Weight]:
    """The `o3_int4` projections of a checkpoint's tensors, by name without
    `.qweight`, taken out of `tensors`."""
    return {
        name.removesuffix(".qweight"): Int4Weight(
            qweight=tensors.pop(name),
            scales=tensors.pop(name.replace(".qweight", ".scales")),
            qzeros=tensors.pop(name.replace(".qweight", ".qzeros"), None),
        )
        for name in [n for n in tensors if n.endswith(".qweight")]
    }


def dense_state_dict(
    folder: str | os.PathLike, config: O3Config, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of a checked checkpoint folder, INT4 FFN weights
    dequantized (what the format encodes, exactly), in `dtype` if given."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        tensors.update(load_file(path))
    if config.int4_format is not None:
        for base, packed in pop_int4_weights(tensors).items():
            tensors[f"{base}.weight"] = dequantize(packed, dtype)
    if dtype is not None:
        tensors = {
            k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()
        }
    return tensors


def check_checkpoint_folder(folder: str | os.PathLike) -> None:
    """Check every tensor's name and shape in `folder` against its config.json.

    Reads only the safetensors headers, so it costs milliseconds.
    """
    from safetensors import safe_open

    config = O3Config.from_pretrained(folder)
    expected = expected_tensor_shapes(config)
    seen: set[str] = set()
    for path in safetensors_files(folder):
        try:
            handle = safe_open(path, framework="pt")
        except Exception as e:
            raise CheckpointError(f"cannot read {path}: {e}") from e
        with handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is no dict)
                if is_ignored(name, config):
                    continue
                check_tensor(name, tuple(handle.get_slice(name).get_shape()), expected)
                seen.add(name)
    check_complete(seen, expected)
