"""The seed's Python API over `LLM(...)`: its minimal example runs, each
option maps to its vLLM setting, unknown options are refused."""

from __future__ import annotations

import pytest

from vllm_o3 import O3Config, O3Model


def test_seed_example_runs(tiny_checkpoint):
    config = O3Config(
        model_path=str(tiny_checkpoint),
        device="cpu",
        dynamic_kv_cache=True,
        int4_ffn=True,
    )
    model = O3Model.from_config(config)
    try:
        output = model.generate(
            prompt="Explain quantum entanglement in simple terms.",
            max_new_tokens=8,
            temperature=0.7,
        )
        assert isinstance(output.text, str) and len(output.token_ids) >= 1
        assert output.finish_reason in ("length", "stop")
    finally:
        model.llm.llm_engine.engine_core.shutdown()


def test_options_map_to_vllm_settings(tiny_checkpoint):
    arguments = O3Config(
        model_path=str(tiny_checkpoint),
        dynamic_kv_cache=False,
        int4_ffn=True,
        router_threshold=0.5,
        max_model_len=256,
        cold_kv_cache_gib=8,
    ).llm_arguments()
    assert arguments == {
        "model": str(tiny_checkpoint),
        "enable_prefix_caching": False,
        "tensor_parallel_size": 1,
        "quantization": "o3_int4",
        "hf_overrides": {"router_threshold": 0.5},
        "max_model_len": 256,
        "kv_offloading_size": 8,
    }


def test_cold_kv_tier_is_refused_on_cpu(tiny_checkpoint):
    with pytest.raises(ValueError, match="cold_kv_cache_gib.*GPU"):
        O3Model.from_config(O3Config(str(tiny_checkpoint), cold_kv_cache_gib=4))


def test_unknown_options_are_refused_by_name():
    with pytest.raises(TypeError, match="speculative_boost"):
        O3Config(model_path="o3", speculative_boost=True)
    with pytest.raises(ValueError, match="device"):
        O3Config(model_path="o3", device="tpu")
