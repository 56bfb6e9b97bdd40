"""`o3_int4`: O3's INT4 FFN as a vLLM quantization method.

Only the FFN projections (`mlp.gate_up_proj`, `mlp.down_proj` in vLLM's fused
names) are INT4; every other linear layer of the model (attention, the light
path, the LM head) stays in the model dtype ("key layers keep 16-bit").

Two ways in:
- offline: `quantization_config: {"quant_method": "o3_int4", "bits": 4,
  "group_size": 32|64|128, "sym": true|false}` in config.json and the GPTQ-style
  tensors of `int4_format` in the checkpoint (`vllm-o3 quantize` writes them);
- online: `--quantization o3_int4` on a 16-bit checkpoint quantizes the FFN
  weights round-to-nearest at load, symmetric, each projection with the
  largest group size of 128, 64, 32 that divides its input (logged).

The matmul is `kernels.int4_linear.Int4Linear`, which picks per platform and
per batch size.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.parameter import (
    GroupQuantScaleParameter,
    ModelWeightParameter,
    PackedvLLMParameter,
)

from vllm_o3.kernels.int4_linear import Int4Linear
from vllm_o3.quantization.int4_format import (
    GROUP_SIZES,
    QUANT_METHOD,
    Int4Weight,
    check_shape,
    largest_group_size,
    parse_quantization_config,
    quantize,
)

FFN_LINEARS = (".mlp.gate_up_proj", ".mlp.down_proj")

logger = init_logger(__name__)


class O3Int4Config(QuantizationConfig):
    def __init__(
        self,
        group_size: int | None = None,
        sym: bool = True,
        serialized: bool = False,
    ):
        super().__init__()
        self.group_size = group_size  # None: online, per projection
        self.sym = sym
        self.serialized = serialized  # False: quantize 16-bit weights at load

    def __repr__(self) -> str:
        return (
            f"O3Int4Config(group_size={self.group_size}, sym={self.sym}, "
            f"serialized={self.serialized})"
        )

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return -1  # CPU and every GPU: the kernel is chosen at load

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # config.json's quantization_config, or online

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> O3Int4Config:
        group_size, sym = parse_quantization_config(config)
        return cls(group_size, sym, serialized=True)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if not isinstance(layer, LinearBase):
            return None
        if prefix.endswith(FFN_LINEARS):
            return O3Int4LinearMethod(self, prefix)
        return UnquantizedLinearMethod()


@register_weight_loader_v2_supported_method
class O3Int4LinearMethod(LinearMethodBase):
    """Parameters in the checkpoint's layout; after loading, one `Int4Linear`."""

    def __init__(self, config: O3Int4Config, prefix: str):
        self.config = config
        self.prefix = prefix

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        group = self.config.group_size
        if group is None:
            group = largest_group_size(self.prefix, input_size_per_partition)
            if group != max(GROUP_SIZES):
                logger.warning_once(
                    "o3_int4: FFN input size %d quantized in groups of %d",
                    input_size_per_partition, group,
                )  # fmt: skip
        layer.o3_int4_group_size = group
        out_features = sum(output_partition_sizes)
        check_shape(
            self.prefix, input_size_per_partition, out_features, group, self.config.sym
        )
        loader = extra_weight_attrs["weight_loader"]
        layer.o3_int4_dtype = params_dtype
        if not self.config.serialized:
            layer.register_parameter(
                "weight",
                ModelWeightParameter(
                    data=torch.empty(
                        out_features, input_size_per_partition, dtype=params_dtype
                    ),
                    input_dim=1,
                    output_dim=0,
                    weight_loader=loader,
                ),
            )
            return
        layer.register_parameter(
            "qweight",
            PackedvLLMParameter(
                data=torch.empty(
                    input_size_per_partition // 8, out_features, dtype=torch.int32
                ),
                input_dim=0,
                output_dim=1,
                packed_dim=0,
                packed_factor=8,
                weight_loader=loader,
            ),
        )
        layer.register_parameter(
            "scales",
            GroupQuantScaleParameter(
                data=torch.empty(
                    input_size_per_partition // group, out_features, dtype=params_dtype
                ),
                input_dim=0,
                output_dim=1,
                weight_loader=loader,
            ),
        )
        if not self.config.sym:
            layer.register_parameter(
                "qzeros",
                PackedvLLMParameter(
                    data=torch.empty(
                        input_size_per_partition // group,
                        out_features // 8,
                        dtype=torch.int32,
                    ),
                    input_dim=0,
                    output_dim=1,
                    packed_dim=1,
                    packed_factor=8,
                    weight_loader=loader,
                ),
            )

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.config.serialized:
            int4 = Int4Weight(
                qweight=layer.qweight.data,
                scales=layer.scales.data,
                qzeros=layer.qzeros.data if not self.config.sym else None,
            )
            names = ("qweight", "scales", "qzeros")
        else:
            int4 = quantize(
                layer.weight.data, layer.o3_int4_group_size, self.config.sym
            )
            names = ("weight",)
        for name in names:
            if hasattr(layer, name):
                delattr(layer, name)
        layer.o3_int4 = Int4Linear(int4, layer.o3_int4_dtype, name=self.prefix)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        y = layer.o3_int4(x)
        return y if bias is None else y + bias


def describe_weights(model: torch.nn.Module) -> dict[str, str]:
    """How each weight-holding module of a loaded model holds its weights:
    "o3_int4", or the weight's dtype (e.g. via `LLM.apply_model`)."""
    kinds = {}
    for name, module in model.named_modules():
        if isinstance(getattr(module, "quant_method", None), O3Int4LinearMethod):
            kinds[name] = QUANT_METHOD
        elif isinstance(getattr(module, "weight", None), torch.Tensor):
            kinds[name] = str(module.weight.dtype)
    return kinds
