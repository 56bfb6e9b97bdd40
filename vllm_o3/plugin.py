"""Registration of O3 with transformers and vLLM; safe to call any number of times."""

from __future__ import annotations

VLLM_MODEL_CLASS = "vllm_o3.model.vllm_model:O3ForCausalLM"


def register_with_transformers() -> None:
    """Make `AutoConfig` / `AutoModelForCausalLM` know model_type "o3"."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from vllm_o3.model import O3Config, O3ForCausalLM

    AutoConfig.register(O3Config.model_type, O3Config, exist_ok=True)
    AutoModelForCausalLM.register(O3Config, O3ForCausalLM, exist_ok=True)


def register() -> None:
    """vLLM plugin entry point: O3's config, model class and extensions."""
    from vllm import ModelRegistry

    register_with_transformers()
    if "O3ForCausalLM" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("O3ForCausalLM", VLLM_MODEL_CLASS)
