"""The seed's Python API, as a thin layer over vLLM's `LLM`:

    from vllm_o3 import O3Config, O3Model

    config = O3Config(
        model_path="./o3", device="cpu", dynamic_kv_cache=True, int4_ffn=True
    )
    model = O3Model.from_config(config)
    output = model.generate(prompt="Explain ...", max_new_tokens=128, temperature=0.7)
    print(output.text)

Each option maps to the vLLM setting it means:

| option | vLLM |
|---|---|
| `model_path` | the checkpoint folder (`LLM(model=...)`) |
| `device` | "auto", "cpu" or "cuda[:N]", checked against vLLM's platform |
| `dynamic_kv_cache` | prefix caching: hot KV blocks stay cached, evicted LRU |
| `cold_kv_cache_gib` | KV offloading (`kv_offloading_size`) to host RAM; GPU only |
| `int4_ffn` | `quantization="o3_int4"` (online; an o3_int4 checkpoint is already) |
| `router_threshold` | `hf_overrides={"router_threshold": ...}` |
| `max_model_len`, `tensor_parallel_size` | the same arguments |

(`O3Config` here is the serving configuration of the seed's example; the model
architecture's config is `vllm_o3.model.O3Config`.)
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(init=False)
class O3Config:
    """How to serve an O3 checkpoint; unknown options are refused by name."""

    model_path: str
    device: str = "auto"
    dynamic_kv_cache: bool = True
    cold_kv_cache_gib: float | None = None
    int4_ffn: bool = False
    router_threshold: float | None = None
    max_model_len: int | None = None
    tensor_parallel_size: int = 1

    def __init__(self, model_path: str, **options: Any):
        known = {f.name for f in dataclasses.fields(self)} - {"model_path"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"O3Config got unknown option(s) {unknown}; known: {sorted(known)}"
            )
        self.model_path = str(model_path)
        for field in dataclasses.fields(self):
            if field.name != "model_path":
                setattr(self, field.name, options.get(field.name, field.default))
        if not (
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
        ):
            raise ValueError(
                f"device must be auto, cpu or cuda[:N], got {self.device!r}"
            )

    def llm_arguments(self) -> dict[str, Any]:
        """The `LLM(...)` arguments this configuration means."""
        arguments: dict[str, Any] = {
            "model": self.model_path,
            "enable_prefix_caching": self.dynamic_kv_cache,
            "tensor_parallel_size": self.tensor_parallel_size,
        }
        if self.int4_ffn and not is_int4_checkpoint(self.model_path):
            arguments["quantization"] = "o3_int4"
        if self.router_threshold is not None:
            arguments["hf_overrides"] = {"router_threshold": self.router_threshold}
        if self.max_model_len is not None:
            arguments["max_model_len"] = self.max_model_len
        if self.cold_kv_cache_gib is not None:
            arguments["kv_offloading_size"] = self.cold_kv_cache_gib
        return arguments


def is_int4_checkpoint(path: str) -> bool:
    config = Path(path) / "config.json"
    if not config.exists():
        return False
    quantization = json.loads(config.read_text()).get("quantization_config") or {}
    return quantization.get("quant_method") == "o3_int4"


@dataclass
class O3Output:
    text: str
    token_ids: list[int]
    finish_reason: str | None


class O3Model:
    """An O3 checkpoint loaded in vLLM."""

    def __init__(self, llm, config: O3Config):
        self.llm = llm
        self.config = config

    @classmethod
    def from_config(cls, config: O3Config) -> O3Model:
        from vllm.platforms import current_platform

        if config.device == "cpu" and not current_platform.is_cpu():
            raise ValueError("device='cpu' but vLLM runs on a GPU platform here")
        if config.device.startswith("cuda"):
            if not current_platform.is_cuda_alike():
                raise ValueError(f"device={config.device!r} but vLLM has no GPU here")
            if ":" in config.device:
                os.environ["CUDA_VISIBLE_DEVICES"] = config.device.split(":", 1)[1]
        if config.cold_kv_cache_gib is not None and current_platform.is_cpu():
            raise ValueError(
                "cold_kv_cache_gib: vLLM's KV offloading needs a GPU (on a CPU the "
                "KV cache already lives in host RAM; size it with "
                "VLLM_CPU_KVCACHE_SPACE)"
            )
        if current_platform.is_cpu():
            # vLLM's default KV cache share of RAM (0.92) is too much here.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        from vllm import LLM

        return cls(LLM(**config.llm_arguments()), config)

    def generate(
        self,
        prompt: str,
        max_new_tokens: int = 128,
        temperature: float = 0.7,
        top_p: float = 1.0,
        tier: str | None = None,
    ) -> O3Output:
        """One completion of `prompt`; `tier` applies when the engine runs
        O3Scheduler."""
        from vllm import SamplingParams

        params = SamplingParams(
            max_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            extra_args={"tier": tier} if tier else None,
        )
        completion = self.llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        return O3Output(
            completion.text, list(completion.token_ids), completion.finish_reason
        )
