"""End-to-end training of an O3 model's routers and light paths against its
dense parent (knowledge distillation on the next-token distribution).

Every parent weight stays frozen; only `router.*` and `light.*` train. The
forward pass routes hard (each routed layer sends the top share of its batch's
tokens to the full FFN), the router learns through a straight-through sigmoid
(reference `routed_ffn_straight_through`). The parent's top-k log-probabilities
are computed once and cached; the loss is the KL divergence between teacher
and student over those k tokens plus one bucket for the rest of the vocabulary.
Matmuls run in bfloat16 autocast (the routers stay float32), on GPU if present.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

TOP_K = 64
# Adam moves every weight by about lr per step: on SmolLM2's fitted light
# paths 5e-4 raised the KL (0.30 -> 0.36 in 170 steps), 1e-4 lowered it
# (0.30 -> 0.18 in 125), 2e-5 was slower (0.27 after 93).
LEARNING_RATE = 1e-4


@dataclass
class TeacherCache:
    indices: torch.Tensor  # [windows, seq, k]
    logprobs: torch.Tensor  # [windows, seq, k], float32


@torch.no_grad()
def cache_teacher(parent, windows: torch.Tensor, top_k: int = TOP_K) -> TeacherCache:
    indices, logprobs = [], []
    for window in tqdm(windows, desc="teacher top-k", leave=False):
        logits = parent(window.unsqueeze(0)).logits[0].float().log_softmax(-1)
        top = logits.topk(top_k, dim=-1)
        indices.append(top.indices)
        logprobs.append(top.values)
    return TeacherCache(torch.stack(indices), torch.stack(logprobs))


def bucket_kl(
    student_logits: torch.Tensor, indices: torch.Tensor, teacher: torch.Tensor
) -> torch.Tensor:
    """KL(teacher || student) over the teacher's top-k tokens plus the rest."""
    student = student_logits.float().log_softmax(-1)
    student_top = student.gather(-1, indices)
    teacher_p = teacher.exp()
    rest_t = (1 - teacher_p.sum(-1)).clamp(min=1e-8)
    rest_s = (1 - student_top.exp().sum(-1)).clamp(min=1e-8)
    kl = (teacher_p * (teacher - student_top)).sum(-1) + rest_t * (
        rest_t.log() - rest_s.log()
    )
    return kl.mean()


def kl_step(
    model,
    optimizer: torch.optim.Optimizer,
    windows: torch.Tensor,
    teacher: TeacherCache,
    i: int,
) -> float:
    """One optimizer step on window `i` against the teacher; returns the KL."""
    with torch.autocast(windows.device.type, dtype=torch.bfloat16):
        logits = model(windows[i : i + 1], use_cache=False).logits[0]
    loss = bucket_kl(logits, teacher.indices[i], teacher.logprobs[i])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    params = []
    for name, param in model.named_parameters():
        train = ".router." in name or ".light." in name
        param.requires_grad_(train)
        if train:
            params.append(param)
    return params


def distill(
    model,
    windows: torch.Tensor,
    teacher: TeacherCache,
    heavy_fractions: dict[int, float],
    minutes: float,
    lr: float = LEARNING_RATE,
    seed: int = 0,
) -> list[float]:
    """Train until `minutes` have passed; returns the loss of each step."""
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    for index, layer in enumerate(model.model.layers):
        layer.train_heavy_fraction = (
            heavy_fractions.get(index) if layer.is_routed else None
        )
    model.train()
    generator = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    deadline = time.monotonic() + 60 * minutes
    progress = tqdm(desc="distillation", unit="step", leave=False)
    try:
        while time.monotonic() < deadline:
            i = int(torch.randint(0, windows.shape[0], (1,), generator=generator))
            losses.append(kl_step(model, optimizer, windows, teacher, i))
            progress.update()
            progress.set_postfix(kl=f"{losses[-1]:.4f}")
    finally:
        progress.close()
        model.eval()
        for layer in model.model.layers:
            layer.train_heavy_fraction = None
        for param in model.parameters():
            param.requires_grad_(False)
    return losses
