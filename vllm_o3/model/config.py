"""The O3 model configuration: one definition of its fields, defaults and rules.

Both implementations (the plain PyTorch reference and the vLLM model) read this
class, so a value refused here is refused everywhere. O3 is a Llama-layout
decoder, so the config extends transformers' `LlamaConfig` and adds the fields
of Hierarchical Gated Attention (O3_SPEC section 2). Of Llama's own fields it
takes `attention_bias` (biases on q, k, v and o, as Llama places them: what a
Qwen2 parent needs) and refuses `mlp_bias`.
"""

from __future__ import annotations

import math

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

from vllm_o3.quantization.int4_format import parse_quantization_config


@strict(accept_kwargs=True)
class O3Config(LlamaConfig):
    """Config of an O3 model (`model_type: "o3"`).

    `router_layers` defaults to every layer but the first and the last, and
    `light_rank` to `hidden_size // 8`; both are filled in at construction so
    that a saved config states them explicitly.
    """

    model_type = "o3"

    router_hidden_size: int = 64
    router_threshold: int | float = 0.85
    router_layers: list[int] | None = None
    light_rank: int | None = None
    attn_output_gate: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.router_layers is None:
            self.router_layers = list(range(1, self.num_hidden_layers - 1))
        if self.light_rank is None:
            self.light_rank = max(1, self.hidden_size // 8)

    def validate_o3(self) -> None:
        """Refuse values the O3 spec does not allow, naming the field.

        `@strict` runs every `validate_*` method after construction (and
        `config.validate()` runs them again, e.g. after `hf_overrides`).
        """
        threshold = self.router_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int | float):
            raise ValueError(f"router_threshold must be a number, got {threshold!r}")
        if math.isnan(threshold):
            raise ValueError("router_threshold must be a number, got NaN")
        if self.router_hidden_size < 1:
            raise ValueError(
                f"router_hidden_size must be >= 1, got {self.router_hidden_size}"
            )
        if not 1 <= self.light_rank <= self.hidden_size:
            raise ValueError(
                f"light_rank must be in [1, hidden_size={self.hidden_size}], "
                f"got {self.light_rank}"
            )
        layers = self.router_layers
        if not isinstance(layers, list):
            raise ValueError(
                f"router_layers must be a list of layer indices, got {layers!r}"
            )
        for index in layers:
            if not isinstance(index, int) or isinstance(index, bool):
                raise ValueError(f"router_layers: {index!r} is not a layer index")
            if not 0 <= index < self.num_hidden_layers:
                raise ValueError(
                    f"router_layers: layer index {index!r} is out of range "
                    f"[0, num_hidden_layers={self.num_hidden_layers})"
                )
        if len(set(layers)) != len(layers):
            raise ValueError(f"router_layers has duplicate entries: {layers}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.mlp_bias:
            raise ValueError(
                "mlp_bias must be false: O3's FFN projections (16-bit and "
                "o3_int4) take no bias"
            )
        if self.hidden_act != "silu":
            raise ValueError(
                f"hidden_act must be 'silu' (SwiGLU FFN), got {self.hidden_act!r}"
            )
        if self.int4_format is not None:
            group_size, _ = self.int4_format
            for name, size in (
                ("hidden_size", self.hidden_size),
                ("intermediate_size", self.intermediate_size),
            ):
                if size % group_size:
                    raise ValueError(
                        f"quantization_config.group_size {group_size} does not "
                        f"divide {name} {size}"
                    )

    @property
    def int4_format(self) -> tuple[int, bool] | None:
        """(group_size, sym) of an `o3_int4` checkpoint, None if 16-bit."""
        quantization = getattr(self, "quantization_config", None)
        if quantization is None:
            return None
        return parse_quantization_config(quantization)

    def is_routed(self, layer_index: int) -> bool:
        """Whether layer `layer_index` routes tokens between full FFN and light path."""
        return layer_index in self.router_layers
