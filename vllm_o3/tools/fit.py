"""Fitting an O3 model's light paths and routers to its parent's FFNs.

Per layer, on the parent's own activations (u: the FFN input, y: its output):
1. tokens with massive FFN outputs (a few per sequence in some layers) would
   dominate any least-squares fit; they are flagged and always go heavy;
2. the light path is the reduced-rank least-squares map u -> y of rank
   `light_rank` over the ordinary tokens;
3. the router (the spec's float32 MLP) learns to predict, from u alone, how
   badly the light path does on that token (log squared error);
4. the light path is refitted on the tokens the router sends light at the
   target fraction (the heavy ones no longer pull on it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MASSIVE_FACTOR = 20.0  # an output norm this many times the median is massive
RIDGE = 1e-4  # relative ridge on u's second-moment matrix


@dataclass
class LayerFit:
    """A layer's fitted tensors and the measurements the converter decides on."""

    light_down: torch.Tensor  # [rank, H]
    light_up: torch.Tensor  # [H, rank]
    fc1_weight: torch.Tensor
    fc1_bias: torch.Tensor
    fc2_weight: torch.Tensor
    fc2_bias: torch.Tensor
    massive_fraction: float  # tokens with massive outputs
    light_error: float  # squared error / energy of y, on the tokens sent light


def reduced_rank_fit(
    u: torch.Tensor, y: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(down [rank, H], up [H, rank]) minimising ||y - u down^T up^T||."""
    u, y = u.double(), y.double()
    gram = u.T @ u
    gram += RIDGE * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype)
    w = torch.linalg.solve(gram, u.T @ y)  # least squares, [H, H]
    # The best rank-r approximation of the fitted values u @ w keeps the top
    # right singular vectors of u @ w (computed through its Gram matrix).
    fitted_gram = w.T @ (u.T @ u) @ w
    _, vectors = torch.linalg.eigh(fitted_gram)
    v = vectors[:, -rank:]  # [H, rank]
    down = (w @ v).T.float()  # u -> u @ w @ v
    up = v.float()  # -> (u @ w @ v) @ v^T
    return down, up


def light_errors(
    u: torch.Tensor, y: torch.Tensor, down: torch.Tensor, up: torch.Tensor
) -> torch.Tensor:
    return (y - (u @ down.T) @ up.T).pow(2).sum(-1)


def train_router(
    u: torch.Tensor, target: torch.Tensor, hidden: int, steps: int, seed: int
) -> tuple[torch.Tensor, ...]:
    """A float32 MLP u -> target (standardised), sigmoid(fc2(silu(fc1(u)))) shape."""
    generator = torch.Generator().manual_seed(seed)
    H = u.shape[1]
    fc1 = torch.nn.Linear(H, hidden)
    fc2 = torch.nn.Linear(hidden, 1)
    with torch.no_grad():
        fc1.weight.normal_(0, H**-0.5, generator=generator)
        fc1.bias.zero_()
        fc2.weight.normal_(0, hidden**-0.5, generator=generator)
        fc2.bias.zero_()
    target = (target - target.mean()) / target.std().clamp(min=1e-6)
    optimizer = torch.optim.Adam([*fc1.parameters(), *fc2.parameters()], lr=3e-3)
    batch = min(4096, u.shape[0])
    for _ in range(steps):
        rows = torch.randint(0, u.shape[0], (batch,), generator=generator)
        prediction = fc2(F.silu(fc1(u[rows]))).squeeze(-1)
        loss = F.mse_loss(prediction, target[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return tuple(
        p.detach().clone() for p in (fc1.weight, fc1.bias, fc2.weight, fc2.bias)
    )


def router_logits(u: torch.Tensor, w1, b1, w2, b2) -> torch.Tensor:
    return F.linear(F.silu(F.linear(u, w1, b1)), w2, b2).squeeze(-1)


def fit_layer(
    u: torch.Tensor,
    y: torch.Tensor,
    rank: int,
    router_hidden: int,
    heavy_fraction: float,
    router_steps: int = 300,
    seed: int = 0,
) -> LayerFit:
    """Fit one layer on float32 activations `u`, `y` [N, H] (see module doc)."""
    norms = y.norm(dim=-1)
    massive = norms > MASSIVE_FACTOR * norms.median()
    down, up = reduced_rank_fit(u[~massive], y[~massive], rank)
    errors = light_errors(u, y, down, up)
    router = train_router(
        u, errors.clamp(min=1e-12).log(), router_hidden, router_steps, seed
    )
    logits = router_logits(u, *router)
    # Massive tokens go heavy whatever the router learnt: give them the top.
    logits = torch.where(massive, logits.max() + 1.0, logits)
    cut = (
        torch.quantile(logits, 1.0 - heavy_fraction) if heavy_fraction > 0 else math.inf
    )
    light = (logits < cut) & ~massive
    if light.sum() > 4 * rank:
        down, up = reduced_rank_fit(u[light], y[light], rank)
    errors = light_errors(u[light], y[light], down, up)
    energy = y[light].pow(2).sum(-1)
    return LayerFit(
        light_down=down,
        light_up=up,
        fc1_weight=router[0],
        fc1_bias=router[1],
        fc2_weight=router[2],
        fc2_bias=router[3],
        massive_fraction=float(massive.float().mean()),
        light_error=float(errors.sum() / energy.sum().clamp(min=1e-12)),
    )


@torch.no_grad()
def calibrate_routers(
    model, input_ids: torch.Tensor, heavy_fraction: float | dict[int, float]
) -> None:
    """Set each router's output bias so that, at the configured threshold,
    `heavy_fraction` (one for all, or per layer index) of the sample tokens
    score heavy. One forward pass: each router is set as the pass reaches it,
    so later layers see the routing they will get."""
    threshold = model.config.router_threshold
    if not 0 < threshold < 1:
        return  # every token takes one path whatever the bias
    target_logit = math.log(threshold / (1 - threshold))

    def set_bias(fraction: float):
        def hook(router, args):
            logits = router.logits(args[0]).flatten()
            cut = torch.quantile(logits.float(), 1.0 - fraction)
            router.fc2.bias.add_(target_logit - cut)

        return hook

    hooks = []
    for index, layer in enumerate(model.model.layers):
        if layer.is_routed:
            fraction = (
                heavy_fraction[index]
                if isinstance(heavy_fraction, dict)
                else heavy_fraction
            )
            hooks.append(layer.router.register_forward_pre_hook(set_bias(fraction)))
    try:
        model(input_ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
