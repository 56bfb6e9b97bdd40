"""Reading the router's decisions and counts out of a running vLLM engine.

The model runs in a worker process; these functions are meant for
`LLM.apply_model` (which needs `VLLM_ALLOW_INSECURE_SERIALIZATION=1` to ship
them there):

    llm.apply_model(start_router_trace)
    llm.generate(...)
    scores = llm.apply_model(take_router_trace)[0]   # {layer index: scores}

Scores are float32, one per token row the layer computed, in the order the
engine ran them (a lone request: its prompt, then each decoded token).
`router_counts` needs no recording: every routed layer always counts its
tokens (see `router_metrics`).
"""

from __future__ import annotations

import torch
from torch import nn


def routed_layers(model: nn.Module):
    """(layer index, layer) of every routed layer of an O3 model."""
    for index, layer in enumerate(model.model.layers):
        if getattr(layer, "is_routed", False):
            yield index, layer


def start_router_trace(model: nn.Module) -> None:
    """Begin recording every routed layer's router scores."""
    for _, layer in routed_layers(model):
        layer.recorded_scores = []


def take_router_trace(model: nn.Module) -> dict[int, torch.Tensor]:
    """The scores recorded since the last call, per routed layer index."""
    trace = {}
    for index, layer in routed_layers(model):
        recorded = layer.recorded_scores or []
        trace[index] = torch.cat(recorded) if recorded else torch.empty(0)
        layer.recorded_scores = [] if layer.recorded_scores is not None else None
    return trace


def stop_router_trace(model: nn.Module) -> None:
    """Stop recording (recording copies scores to the CPU on every call)."""
    for _, layer in routed_layers(model):
        layer.recorded_scores = None


def router_counts(model: nn.Module) -> dict[int, tuple[int, int]]:
    """(heavy tokens, all tokens) each routed layer has seen since start-up."""
    return {
        index: tuple(layer.route_counts.tolist())
        for index, layer in routed_layers(model)
    }
