"""Router statistics: how many tokens each routed layer sent down the full FFN.

Each routed layer counts (heavy rows, real rows) in a small tensor on its own
device, updated in the forward pass without a host sync (CUDA graphs replay the
update too). A daemon thread in the worker copies the counts into Prometheus
counters once a second:

    o3_router_tokens_total{layer="3", path="heavy"|"light"}

so `sum by (layer) (rate(o3_router_tokens_total{path="heavy"}[1m])) /
sum by (layer) (rate(o3_router_tokens_total[1m]))` is the heavy fraction per
layer (drop `by (layer)` for all layers). The engine runs the model in another
process than the API server: `/metrics` shows them through Prometheus'
multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, which `register()` sets up for
`vllm serve`). Offline, `router_trace.router_counts` reads them directly.
"""

from __future__ import annotations

import threading
import time

import torch

EXPORT_INTERVAL_S = 1.0


class RouterCounts:
    """The exporter's view of every routed layer's count tensor in this process."""

    def __init__(self) -> None:
        self._layers: dict[int, torch.Tensor] = {}
        self._exported: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def track(self, layer_index: int, counts: torch.Tensor) -> None:
        """Export `counts` ([heavy, real] rows, int64) as layer `layer_index`."""
        with self._lock:
            self._layers[layer_index] = counts
            self._exported.setdefault(layer_index, (0, 0))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="o3-router-metrics", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        from prometheus_client import Counter

        tokens = Counter(
            "o3_router_tokens",
            "Tokens each routed O3 layer sent to the full FFN (heavy) or the "
            "light path (light)",
            ["layer", "path"],
        )
        while True:
            time.sleep(EXPORT_INTERVAL_S)
            self.export_once(tokens)

    def export_once(self, tokens) -> None:
        """Add what each layer counted since the last export to `tokens`.

        The forward pass updates the two counts while this thread reads them,
        so a read can see `heavy` advanced and `real` not yet (the light count
        then seems to shrink): such a layer waits for the next round, which
        sees both."""
        with self._lock:
            layers = dict(self._layers)
        for index, counts in layers.items():
            heavy, real = counts.tolist()
            old_heavy, old_real = self._exported[index]
            more_heavy = heavy - old_heavy
            more_light = (real - heavy) - (old_real - old_heavy)
            if more_heavy < 0 or more_light < 0:
                continue
            tokens.labels(str(index), "heavy").inc(more_heavy)
            tokens.labels(str(index), "light").inc(more_light)
            self._exported[index] = (heavy, real)


ROUTER_COUNTS = RouterCounts()
