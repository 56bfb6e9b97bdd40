"""The plain PyTorch O3 reference: the ground truth every other implementation meets.

It computes O3_SPEC section 1 literally (per-token routing with a gather and a
scatter, a float32 router, no scaling by the score) on transformers' Llama
building blocks, and loads the spec's checkpoints through
`AutoModelForCausalLM` once `vllm_o3` is imported. Speed is not its job.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from vllm_o3.model.checkpoint import (
    CheckpointError,
    check_checkpoint_folder,
    dense_state_dict,
)
from vllm_o3.model.config import O3Config


class O3Router(nn.Module):
    """The token router: score = sigmoid(fc2(silu(fc1(u)))), always in float32."""

    def __init__(self, config: O3Config):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.router_hidden_size)
        self.fc2 = nn.Linear(config.router_hidden_size, 1)

    def logits(self, u: torch.Tensor) -> torch.Tensor:
        """Pre-sigmoid scores, float32, shape `u.shape[:-1]` (also under autocast)."""
        with torch.autocast(u.device.type, enabled=False):
            return self._logits(u)

    def _logits(self, u: torch.Tensor) -> torch.Tensor:
        x = u.float()
        x = F.silu(F.linear(x, self.fc1.weight.float(), self.fc1.bias.float()))
        return F.linear(x, self.fc2.weight.float(), self.fc2.bias.float()).squeeze(-1)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(u))


class O3LightPath(nn.Module):
    """The cheap path for tokens the router does not send to the full FFN."""

    def __init__(self, config: O3Config):
        super().__init__()
        self.down = nn.Linear(config.hidden_size, config.light_rank, bias=False)
        self.up = nn.Linear(config.light_rank, config.hidden_size, bias=False)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(u))


class O3Attention(LlamaAttention):
    """Llama attention with O3's optional per-head sigmoid gate before `o_proj`."""

    def __init__(self, config: O3Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.gate_proj = (
            nn.Linear(config.hidden_size, config.num_attention_heads, bias=False)
            if config.attn_output_gate
            else None
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention(
            self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
        )
        # attn_output: [batch, seq, heads, head_dim]
        if self.gate_proj is not None:
            gate = torch.sigmoid(self.gate_proj(hidden_states))
            attn_output = attn_output * gate.unsqueeze(-1)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class O3DecoderLayer(GradientCheckpointingLayer):
    """One O3 layer: attention for every token, then the routed (or dense) FFN."""

    def __init__(self, config: O3Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.self_attn = O3Attention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(
            config.hidden_size, eps=config.rms_norm_eps
        )
        self.is_routed = config.is_routed(layer_idx)
        if self.is_routed:
            self.router = O3Router(config)
            self.light = O3LightPath(config)
        # Set (with model.train()) to distill routers and light paths.
        self.train_heavy_fraction: float | None = None

    def routed_ffn_straight_through(
        self, u: torch.Tensor, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Training: hard routing of the top `train_heavy_fraction` of the
        batch's tokens in the forward pass, the router's gradient through a
        sigmoid around the cut (straight-through). Not the serving rule: the
        converter recalibrates each router's bias to the spec's threshold."""
        logits = self.router.logits(u)
        cut = torch.quantile(logits.detach().flatten(), 1.0 - self.train_heavy_fraction)
        soft = torch.sigmoid((logits - cut) / temperature)
        gate = ((logits >= cut).to(soft.dtype) - soft.detach() + soft).unsqueeze(-1)
        y = gate * self.mlp(u) + (1 - gate) * self.light(u)
        return y.to(u.dtype), torch.sigmoid(logits)

    def routed_ffn(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The spec's routed FFN, literally: returns (output, router scores)."""
        if self.training and self.train_heavy_fraction is not None:
            return self.routed_ffn_straight_through(u)
        scores = self.router(u)
        heavy = scores >= self.config.router_threshold
        heavy_y, light_y = self.mlp(u[heavy]), self.light(u[~heavy])
        y = u.new_empty(
            u.shape, dtype=torch.promote_types(heavy_y.dtype, light_y.dtype)
        )
        y[heavy] = heavy_y
        y[~heavy] = light_y
        return y, scores

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        a = self.input_layernorm(hidden_states)
        attn, _ = self.self_attn(
            a, position_embeddings, attention_mask, past_key_values, **kwargs
        )
        h = hidden_states + attn
        u = self.post_attention_layernorm(h)
        if self.is_routed:
            y, scores = self.routed_ffn(u)
        else:
            y, scores = self.mlp(u), None
        return h + y, scores


class O3PreTrainedModel(PreTrainedModel):
    config_class = O3Config
    config: O3Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["O3DecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_attention_backend = True

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Load like transformers does, but refuse a checkpoint whose tensors do
        not match the spec (transformers would silently re-initialise them).
        An `o3_int4` checkpoint loads with its FFN dequantized: the reference
        computes with exactly the weights the INT4 format encodes."""
        folder = pretrained_model_name_or_path
        if not os.path.isdir(folder):
            return super().from_pretrained(folder, *args, **kwargs)
        check_checkpoint_folder(folder)
        config = O3Config.from_pretrained(folder)
        if config.int4_format is None:
            return super().from_pretrained(folder, *args, **kwargs)
        dtype = kwargs.get("dtype") or kwargs.get("torch_dtype") or config.dtype
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        state = dense_state_dict(folder, config, dtype)
        config.quantization_config = None
        model = cls(config).to(dtype)
        missing, _ = model.load_state_dict(state, strict=False)
        if set(missing) - ({"lm_head.weight"} if config.tie_word_embeddings else set()):
            raise CheckpointError(f"{folder}: tensors not loaded: {missing}")
        model.tie_weights()
        return model.eval()


@dataclass
class O3CausalLMOutput(CausalLMOutputWithPast):
    """Causal-LM output plus, on request, each routed layer's router scores.

    `router_scores[i]` has shape `[batch, seq]` and belongs to the i-th routed
    layer in layer order (`sorted(config.router_layers)[i]`); a token took the
    full FFN where
    `score >= config.router_threshold`.
    """

    router_scores: tuple[torch.Tensor, ...] | None = None


class O3Model(O3PreTrainedModel):
    """The O3 decoder stack without the LM head."""

    def __init__(self, config: O3Config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            O3DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, Cache | None, tuple[torch.Tensor, ...]]:
        """Returns (final hidden states, cache, router scores of routed layers)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if position_ids is None:
            past = past_key_values.get_seq_length() if past_key_values else 0
            position_ids = torch.arange(
                past, past + inputs_embeds.shape[1], device=inputs_embeds.device
            ).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        router_scores = []
        for layer in self.layers:
            hidden_states, scores = layer(
                hidden_states,
                position_embeddings,
                attention_mask=mask,
                past_key_values=past_key_values,
                position_ids=position_ids,
                **kwargs,
            )
            if scores is not None:
                router_scores.append(scores)
        hidden_states = self.norm(hidden_states)
        return hidden_states, past_key_values, tuple(router_scores)


class O3ForCausalLM(O3PreTrainedModel, GenerationMixin):
    """O3 with its LM head: logits, loss with `labels`, and `generate()`."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: O3Config):
        super().__init__(config)
        self.model = O3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_router_scores: bool = False,
        **kwargs,
    ) -> O3CausalLMOutput:
        hidden_states, past_key_values, router_scores = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        keep = (
            slice(-logits_to_keep, None)
            if isinstance(logits_to_keep, int)
            else logits_to_keep
        )
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size
            )
        return O3CausalLMOutput(
            loss=loss,
            logits=logits,
            past_key_values=past_key_values,
            router_scores=router_scores if output_router_scores else None,
        )
