"""The routed FFN in plain PyTorch: the CPU path, and the definitions the GPU
kernels are tested against.

Every token row gets a route: HEAVY (router score >= threshold: the full FFN),
LIGHT (the low-rank light path) or PADDING (a row a CUDA graph carries beyond
the real tokens: computed by neither path, counted by neither).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

HEAVY, LIGHT, PADDING = 0, 1, 2


def router_scores_torch(
    u: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor,
) -> torch.Tensor:
    """sigmoid(fc2(silu(fc1(u)))) in float32 (O3_SPEC section 1), shape [T]."""
    x = F.silu(F.linear(u.float(), fc1_weight.float(), fc1_bias.float()))
    return torch.sigmoid(F.linear(x, fc2_weight.float(), fc2_bias.float())).squeeze(-1)


def routes_torch(
    scores: torch.Tensor, threshold: float, is_padding: torch.Tensor | None = None
) -> torch.Tensor:
    """HEAVY / LIGHT / PADDING per row, int8."""
    route = torch.where(scores >= threshold, HEAVY, LIGHT).to(torch.int8)
    if is_padding is not None:
        route = torch.where(is_padding, PADDING, route).to(torch.int8)
    return route


def partition_rows(route: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices grouped as heavy, light, padding (each in row order), and
    the group bounds (number of heavy rows, number of real rows) as an int64
    tensor: the definition of `router.route_rows`' heavy-row list and counts."""
    order = torch.argsort(route, stable=True)
    bounds = torch.stack([(route == HEAVY).sum(), (route != PADDING).sum()])
    return order, bounds


def routed_ffn_torch(
    u: torch.Tensor,
    scores: torch.Tensor,
    threshold: float,
    heavy_ffn: Callable[[torch.Tensor], torch.Tensor],
    light_path: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, int]:
    """Heavy rows through `heavy_ffn`, the rest through `light_path`, each on
    only its own rows; returns (output, number of heavy rows)."""
    heavy = scores >= threshold
    num_heavy = int(heavy.sum())
    if num_heavy in (0, u.shape[0]):  # all one way: no partition to sort
        return (heavy_ffn(u) if num_heavy else light_path(u)), num_heavy
    order = torch.argsort(heavy.logical_not().to(torch.int8), stable=True)
    heavy_rows, light_rows = order[:num_heavy], order[num_heavy:]
    return routed_rows(u, heavy_rows, light_rows, heavy_ffn, light_path), num_heavy


def routed_rows(
    u: torch.Tensor,
    heavy_rows: torch.Tensor,
    light_rows: torch.Tensor,
    heavy_ffn: Callable[[torch.Tensor], torch.Tensor],
    light_path: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Each path on its own rows only. Reads the row counts on the host,
    which costs nothing on the CPU; a batch that goes all one way (every
    decode step of a lone request) needs no gather at all."""
    if light_rows.shape[0] == 0:
        return heavy_ffn(u)
    if heavy_rows.shape[0] == 0:
        return light_path(u)
    y = torch.empty_like(u)
    y.index_copy_(0, light_rows, on_rows(u, light_rows, light_path))
    return with_heavy_rows(u, y, heavy_rows, heavy_ffn)


def row_bucket(rows: int) -> int:
    """`rows` rounded up to one of few sizes: exact up to 16, then 16 sizes
    per doubling (at most 1/16 more rows)."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 5)
    return -(-rows // step) * step


def on_rows(
    u: torch.Tensor, rows: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """`fn` on the given rows of `u`, gathered to row_bucket rows (the first
    row repeated; those outputs are dropped). A path's row count changes with
    every batch, and on the CPU each new count costs oneDNN a new GEMM
    primitive and the allocator a block of a new size: fresh pages to fault
    in where no freed block fits (docs/bench_e2e_routing.md)."""
    n = rows.shape[0]
    padded = row_bucket(n)
    if padded > n:
        rows = torch.cat([rows, rows[:1].expand(padded - n)])
    return fn(u.index_select(0, rows))[:n]


def with_heavy_rows(
    u: torch.Tensor,
    light_out: torch.Tensor,
    heavy_rows: torch.Tensor,
    heavy_ffn: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The routed output from the light rows' (`light_out`, written in place)
    and the full FFN run on the heavy rows only; when every row is heavy, the
    full FFN on `u` as it is (no gather, no scatter, `light_out` unused)."""
    num_heavy = heavy_rows.shape[0]
    if num_heavy == u.shape[0]:
        return heavy_ffn(u)
    if num_heavy:
        light_out.index_copy_(0, heavy_rows, on_rows(u, heavy_rows, heavy_ffn))
    return light_out
