"""O3 for vLLM: Llama's layers plus the router, the light path and the head gate.

Attention, rotary embedding, norms, parallel linears, the paged KV cache and
the LM head are vLLM's own (`LlamaForCausalLM` with an O3 decoder layer; the
norms on vLLM's C++ CPU kernel in eager mode, `layernorm.py`). The
routed FFN runs as one opaque custom op (`torch.ops.vllm.o3_routed_ffn`), so
torch.compile sees a fixed-shape [T, H] -> [T, H] call whatever the routing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)
from vllm.model_executor.models.utils import (
    extract_layer_index,
    is_pp_missing_parameter,
)
from vllm.platforms import current_platform
from vllm.utils.torch_utils import direct_register_custom_op

from vllm_o3.kernels import cpu_bf16_linear, cpu_routed_ffn
from vllm_o3.kernels.cpu_routed_ffn import CpuRoutedWeights, routed_ffn_cpu
from vllm_o3.kernels.routed_ffn_triton import RoutedFFNWeights, routed_ffn_triton
from vllm_o3.kernels.routing import (
    HEAVY,
    PADDING,
    routed_ffn_torch,
    router_scores_torch,
    routes_torch,
)
from vllm_o3.model.checkpoint import (
    check_checkpoint_folder,
    check_complete,
    check_tensor,
    expected_tensor_shapes,
    is_ignored,
)
from vllm_o3.model.config import O3Config
from vllm_o3.model.cpu_allocator import keep_freed_memory
from vllm_o3.model.layernorm import RMSNormWithCpuKernel
from vllm_o3.model.router_metrics import ROUTER_COUNTS
from vllm_o3.model.router_trace import routed_layers

logger = init_logger(__name__)

# Checkpoint tensors that load into one fused vLLM parameter:
# (vLLM parameter name part, checkpoint name part, shard id).
STACKED_PARAMS = [
    (".self_attn.qkv_proj.", ".self_attn.q_proj.", "q"),
    (".self_attn.qkv_proj.", ".self_attn.k_proj.", "k"),
    (".self_attn.qkv_proj.", ".self_attn.v_proj.", "v"),
    (".mlp.gate_up_proj.", ".mlp.gate_proj.", 0),
    (".mlp.gate_up_proj.", ".mlp.up_proj.", 1),
]


class ReplicatedWeights(nn.Module):
    """A linear's weights as plain parameters, whole on every rank: the router
    and the light path are small, and their CPU kernel reads them into its
    own layout (vLLM's CPU linears hand theirs to oneDNN and drop them)."""

    def __init__(
        self, in_features: int, out_features: int, dtype: torch.dtype, bias: bool
    ):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = default_weight_loader  # copies with dtype cast
        self.bias = None
        if bias:
            self.bias = nn.Parameter(
                torch.empty(out_features, dtype=dtype), requires_grad=False
            )
            self.bias.weight_loader = default_weight_loader
        # The GEMM: F.linear, or on the CPU what vLLM's GEMM dispatch sets.
        self.cpu_linear = F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cpu_linear(x, self.weight, self.bias)


class O3Router(nn.Module):
    """Token scores sigmoid(fc2(silu(fc1(u)))) in float32, so that
    implementations agree on which side of the threshold a token falls."""

    def __init__(self, hidden_size: int, router_hidden_size: int):
        super().__init__()
        # Float32, so the CPU path computes exactly what the reference does.
        self.fc1 = ReplicatedWeights(
            hidden_size, router_hidden_size, torch.float32, bias=True
        )
        self.fc2 = ReplicatedWeights(router_hidden_size, 1, torch.float32, bias=True)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return router_scores_torch(
            u, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias
        )


class O3LightPath(nn.Module):
    """Rank-`light_rank` projection for tokens the router keeps off the full FFN.

    Replicated on every tensor-parallel rank: it is small, and each rank then
    holds the whole light output without a collective.
    """

    def __init__(self, hidden_size: int, light_rank: int):
        super().__init__()
        dtype = torch.get_default_dtype()  # the model's, while vLLM builds it
        self.down = ReplicatedWeights(hidden_size, light_rank, dtype, bias=False)
        self.up = ReplicatedWeights(light_rank, hidden_size, dtype, bias=False)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(u))

    def use_cpu_gemm(self) -> None:
        """vLLM's CPU GEMM for both linears, as its own linears get (AMX
        tiles where the CPU has them); the plain weights stay for the C++
        kernel's packing."""
        for linear in (self.down, self.up):
            dispatch_cpu_unquantized_gemm(linear, remove_weight=False)


class O3Attention(LlamaAttention):
    """Llama attention with O3's optional per-head sigmoid gate before `o_proj`."""

    def __init__(self, config: O3Config, hidden_size: int, num_heads: int, **kwargs):
        super().__init__(
            config=config, hidden_size=hidden_size, num_heads=num_heads, **kwargs
        )
        self.gate_proj = None
        if config.attn_output_gate:
            # Column-parallel over heads, like the query heads it gates.
            self.gate_proj = ColumnParallelLinear(
                hidden_size,
                num_heads,
                bias=False,
                prefix=f"{kwargs.get('prefix', '')}.gate_proj",
            )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor
    ) -> torch.Tensor:
        if self.gate_proj is None:
            return super().forward(positions, hidden_states)
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)
        gate, _ = self.gate_proj(hidden_states)
        attn_output = attn_output.view(-1, self.num_heads, self.head_dim)
        attn_output = attn_output * torch.sigmoid(gate).unsqueeze(-1)
        output, _ = self.o_proj(attn_output.view(-1, self.q_size))
        return output


class O3DecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose FFN, in routed layers, is O3's routed FFN."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config=None):
        super().__init__(vllm_config, prefix, config, attn_layer_type=O3Attention)
        config = config or vllm_config.model_config.hf_config
        self.input_layernorm = RMSNormWithCpuKernel(
            config.hidden_size, eps=config.rms_norm_eps
        )
        self.post_attention_layernorm = RMSNormWithCpuKernel(
            config.hidden_size, eps=config.rms_norm_eps
        )
        self.is_routed = config.is_routed(extract_layer_index(prefix))
        if not self.is_routed:
            return
        self.router = O3Router(config.hidden_size, config.router_hidden_size)
        self.light = O3LightPath(config.hidden_size, config.light_rank)
        self.router_threshold = float(config.router_threshold)
        self.tp_size = get_tensor_model_parallel_world_size()
        self.dense_ffn = all(
            isinstance(linear.quant_method, UnquantizedLinearMethod)
            for linear in (self.mlp.gate_up_proj, self.mlp.down_proj)
        )
        if not self.dense_ffn and current_platform.is_cuda_alike():
            logger.warning_once(
                "O3 routed FFN with o3_int4 on a GPU: the INT4 FFN runs on every "
                "token and routing picks per token (exact, CUDA-graph safe, but "
                "no FFN compute saved); the 16-bit FFN takes the routed kernels."
            )
        self.kernel_weights: RoutedFFNWeights | None = None
        # Set by prepare_cpu_kernel where the C++ path takes this layer.
        self.cpu_weights: CpuRoutedWeights | None = None
        # Set to a list to record every call's router scores (router_trace).
        self.recorded_scores: list[torch.Tensor] | None = None
        # [heavy rows, real rows] so far, on the layer's device (router_metrics).
        self.register_buffer(
            "route_counts", torch.zeros(2, dtype=torch.int64), persistent=False
        )
        if get_tensor_model_parallel_rank() == 0:  # ranks route alike: count once
            ROUTER_COUNTS.track(extract_layer_index(prefix), self.route_counts)
        # The custom op finds this layer by name, as vLLM's attention op does.
        self.routed_ffn_name = f"{prefix}.routed_ffn"
        static_context = (
            get_current_vllm_config().compilation_config.static_forward_context
        )
        if self.routed_ffn_name in static_context:
            raise ValueError(f"duplicate layer name {self.routed_ffn_name}")
        static_context[self.routed_ffn_name] = self

    def routed_ffn(self, u: torch.Tensor) -> torch.Tensor:
        """Full FFN for tokens scoring >= threshold, light path for the rest.

        The decision depends on each token alone, so every tensor-parallel rank
        (same replicated router, same input) takes the same split. On CUDA the
        Triton path runs without a host sync (CUDA graphs capture it); on the
        CPU the C++ router and light path (`cpu_routed_ffn`, or PyTorch where
        it cannot run) compute each path on its own rows only.
        """
        context = get_forward_context()
        # Profiling and warm-up runs carry no attention metadata and no real
        # tokens: they are not counted.
        counting = context.attn_metadata is not None
        if u.is_cuda:
            padding = self._padding_mask(context.is_padding, u.shape[0])
            if self.dense_ffn:
                y, scores, bounds = routed_ffn_triton(
                    u,
                    self._kernel_weights(),
                    self.router_threshold,
                    padding,
                    tensor_model_parallel_all_reduce if self.tp_size > 1 else None,
                )
            else:
                y, scores, bounds = self._routed_ffn_every_row(u, padding)
            if counting:
                self.route_counts += bounds
        elif self.cpu_weights is not None:
            y, scores, _ = routed_ffn_cpu(
                u,
                self.cpu_weights,
                self.router_threshold,
                self.mlp,
                self.light,
                self.route_counts if counting else None,
            )
        else:
            scores = self.router(u)
            y, num_heavy = routed_ffn_torch(
                u, scores, self.router_threshold, self.mlp, self.light
            )
            if counting:
                self.route_counts[0] += num_heavy
                self.route_counts[1] += u.shape[0]
        if self.recorded_scores is not None:
            self.recorded_scores.append(scores.cpu())
        return y

    def _routed_ffn_every_row(
        self, u: torch.Tensor, padding: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """INT4 FFN on a GPU: vLLM's INT4 kernels take whole batches, so the
        full FFN runs on every row and the route picks per row. Sync-free and
        exact, but it saves no FFN compute (see the warning at start-up)."""
        scores = self.router(u)
        route = routes_torch(scores, self.router_threshold, padding)
        heavy = (route == HEAVY).unsqueeze(-1)
        y = torch.where(heavy, self.mlp(u), self.light(u))
        bounds = torch.stack([(route == HEAVY).sum(), (route != PADDING).sum()])
        return y, scores, bounds

    def prepare_cpu_kernel(self) -> None:
        """Hands the router, light path and full FFN's activation to the C++
        CPU kernels, once weights are final; where they cannot take them,
        PyTorch runs them (logged). The light path's linears get vLLM's CPU
        GEMMs either way."""
        self.light.use_cpu_gemm()
        reason = cpu_routed_ffn.unavailable_reason(
            self.light.down.weight.dtype, self.light.down.weight.shape[1]
        )
        if reason is not None:
            logger.warning_once(
                "O3 routed FFN on CPU: the C++ router, light path and "
                "activation are not used (%s); PyTorch runs them, slower at "
                "decode sizes (docs/bench_routed_ffn_layer.md)",
                reason,
            )
            return
        self.mlp.act_fn = cpu_routed_ffn.CpuSiluAndMul()
        self.cpu_weights = cpu_routed_ffn.pack_routed_weights(
            self.router.fc1.weight,
            self.router.fc1.bias,
            self.router.fc2.weight,
            self.router.fc2.bias,
            self.light.down.weight,
            self.light.up.weight,
        )

    def _kernel_weights(self) -> RoutedFFNWeights:
        """The tensors the Triton path reads, taken once weights are final."""
        if self.kernel_weights is None:
            gate_up, down = self.mlp.gate_up_proj, self.mlp.down_proj
            self.kernel_weights = RoutedFFNWeights(
                fc1_weight=self.router.fc1.weight,
                fc1_bias=self.router.fc1.bias,
                fc2_weight=self.router.fc2.weight,
                fc2_bias=self.router.fc2.bias,
                gate_up=gate_up.weight,
                down=down.weight,
                light_down=self.light.down.weight,
                light_up=self.light.up.weight,
            )
        return self.kernel_weights

    @staticmethod
    def _padding_mask(
        is_padding: torch.Tensor | None, num_rows: int
    ) -> torch.Tensor | None:
        """vLLM's mask of CUDA-graph padding rows, if it covers these rows."""
        if is_padding is None or is_padding.shape[0] != num_rows:
            return None
        return is_padding

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        if self.is_routed:
            hidden_states = torch.ops.vllm.o3_routed_ffn(
                hidden_states, self.routed_ffn_name
            )
        else:
            hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


def o3_routed_ffn(u: torch.Tensor, layer_name: str) -> torch.Tensor:
    layer = get_forward_context().no_compile_layers[layer_name]
    return layer.routed_ffn(u)


def o3_routed_ffn_fake(u: torch.Tensor, layer_name: str) -> torch.Tensor:
    return torch.empty_like(u)


direct_register_custom_op(
    op_name="o3_routed_ffn", op_func=o3_routed_ffn, fake_impl=o3_routed_ffn_fake
)


class O3ForCausalLM(LlamaForCausalLM):
    """vLLM's O3 model: `LlamaForCausalLM` with O3 decoder layers and a loader
    that checks every tensor against the spec."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        config = vllm_config.model_config.hf_config
        if not isinstance(config, O3Config):
            raise TypeError(
                f"O3ForCausalLM needs an O3Config, got {type(config).__name__}"
            )
        config.validate()  # again: --hf-overrides may have changed fields
        folder = vllm_config.model_config.model
        load_format = vllm_config.load_config.load_format
        if load_format in ("auto", "safetensors") and os.path.isdir(folder):
            # Before any weight is read: a truncated file or a missing or
            # misshapen tensor is refused naming it, not half-loaded.
            check_checkpoint_folder(folder)
        super().__init__(
            vllm_config=vllm_config, prefix=prefix, layer_type=O3DecoderLayer
        )
        if isinstance(self.model.norm, RMSNorm):  # not on earlier PP ranks
            self.model.norm = RMSNormWithCpuKernel(
                config.hidden_size, eps=config.rms_norm_eps
            )

    def process_weights_after_loading(self) -> None:
        """vLLM's model-level hook, after every layer's quantization: weights
        are final, so the CPU routed FFN kernel takes its copy, and 16-bit
        linears whose vLLM GEMM is torch's plain loop take O3's; and only now
        may freed memory be kept, or loading's and online quantization's
        temporaries would stay resident."""
        if current_platform.is_cpu():
            for _, layer in routed_layers(self):
                layer.prepare_cpu_kernel()
            cpu_bf16_linear.use_for_linears(self)
            keep_freed_memory()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        expected = expected_tensor_shapes(self.config)
        params = dict(self.named_parameters())
        seen: set[str] = set()
        loaded: set[str] = set()
        for name, tensor in weights:
            if is_ignored(name, self.config):
                continue
            check_tensor(name, tuple(tensor.shape), expected)
            seen.add(name)
            param_name, shard_id = self._param_name(name)
            if is_pp_missing_parameter(param_name, self):
                continue
            param = params[param_name]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            if shard_id is None:
                weight_loader(param, tensor)
            else:
                weight_loader(param, tensor, shard_id)
            loaded.add(param_name)
        check_complete(seen, expected)
        return loaded

    @staticmethod
    def _param_name(name: str) -> tuple[str, str | int | None]:
        """The vLLM parameter (and shard) a checkpoint tensor loads into."""
        for param_part, checkpoint_part, shard_id in STACKED_PARAMS:
            if checkpoint_part in name:
                return name.replace(checkpoint_part, param_part), shard_id
        return name, None
