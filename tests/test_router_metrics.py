"""The router statistics exporter: counts read while the forward pass is
updating them (heavy advanced, real not yet) never make a counter go back,
and nothing is lost: the next export adds it."""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry, Counter

from vllm_o3.model.router_metrics import RouterCounts


def exported(registry: CollectorRegistry) -> dict[str, float]:
    return {
        path: registry.get_sample_value(
            "o3_router_tokens_total", {"layer": "3", "path": path}
        )
        for path in ("heavy", "light")
    }


def test_a_torn_read_waits_for_the_next_export():
    registry = CollectorRegistry()
    tokens = Counter("o3_router_tokens", "t", ["layer", "path"], registry=registry)
    counts = torch.tensor([0, 0])
    router = RouterCounts()
    router._layers[3], router._exported[3] = counts, (0, 0)  # no exporter thread

    counts += torch.tensor([4, 10])
    router.export_once(tokens)
    assert exported(registry) == {"heavy": 4, "light": 6}
    counts[0] += 3  # heavy updated, real not yet: light seems to shrink by 3
    router.export_once(tokens)
    assert exported(registry) == {"heavy": 4, "light": 6}
    counts[1] += 5  # the forward pass finishes its update
    router.export_once(tokens)
    assert exported(registry) == {"heavy": 7, "light": 8}
